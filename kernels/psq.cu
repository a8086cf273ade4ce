// psq.cu: the per-sample (PSQ) and block Householder (BHQ) quantizers, per-element work.
//
// Specification: hvdcomp/ops/psq.py (quantize_rows, dequantize_rows, row_variance,
// householder_blocks, bhq_plan) with hvdcomp/philox.py (Philox uniforms) and
// hvdcomp/ops/bitpack.py (LSB-first packing).  Every float operation below is the
// reference's, in the reference's order and precision (float64 where it computes in float64).
//
// The gradient is a row-major float32 matrix of R rows and D columns, n = R * D coordinates;
// codes are packed row-major (flat index i = row * D + column), `bits` (1..8) per code.
// What stays in PyTorch (glue in the kernel implementations of hvdcomp/ops/psq.py): the
// per-row min and max (torch.amin / torch.amax: their choice between -0.0 and +0.0 is PyTorch's), the per-row step
// (hi - lo) / L (a division by a scalar, which PyTorch rounds differently on CPU and CUDA), the
// row sums of the variance terms (torch.sum's order) and BHQ's grouping (sort, scales, choice).
//
// Kernels (any geometry unless stated; grid-stride, 64-bit indices):
//   hvd_psq_quantize_pack     one thread per group of 8 coordinates: codes, packed
//   hvd_psq_dequantize_add    one thread per group of 8 coordinates: out += decoded
//   hvd_psq_row_terms         one thread per group of 8 coordinates: p (1 - p), float64
//   hvd_bhq_forward           one thread per (block, column): y = H diag(s) x[perm]
//   hvd_bhq_dequantize_add    one thread per (block, column): out[perm] += diag(1/s) H yhat
#include "hvdcomp.cuh"

namespace hvd {
namespace psq {

// Row constants of quantize_rows / row_variance: lo (float64), safe span (float64).
struct Row {
  double lo;
  double safe;
};

__device__ __forceinline__ Row row_of(const float* __restrict__ lohi, i64 row) {
  Row r;
  r.lo = (double)lohi[2 * row];
  const double span = (double)lohi[2 * row + 1] - r.lo;
  r.safe = span > 0.0 ? span : 1.0;  // torch.where(span > 0, span, 1)
  return r;
}

// r = ((x - lo) / safe * L).clamp_(0, L), float64.
__device__ __forceinline__ double grid_pos(float x, const Row& row, double L) {
  double r = ((double)x - row.lo) / row.safe * L;
  r = r < 0.0 ? 0.0 : r;
  r = r > L ? L : r;
  return r;
}

// index = floor(r) + (u < r - floor(r)).
__device__ __forceinline__ u32 code_of(float x, const Row& row, double L, float u) {
  const double r = grid_pos(x, row, L);
  const double f = floor_f64(r);
  return (u32)(int)f + ((double)u < r - f ? 1u : 0u);   // 0 <= f <= L < 2^31
}

// Codes of coordinates 8g .. 8g+7 (those < n), code k at bits [k*BITS, (k+1)*BITS).
template <int BITS>
__device__ __forceinline__ u64 quantize_group(const float* __restrict__ x, i64 n, i64 D,
                                              const float* __restrict__ lohi, u32 seed,
                                              u32 rank, u32 tensor_id, u32 step, i64 g) {
  const double L = (double)((1 << BITS) - 1);
  const i64 i0 = 8 * g;
  const Philox4 ra = philox_block(2 * g, seed, rank, tensor_id, step);
  const Philox4 rb = philox_block(2 * g + 1, seed, rank, tensor_id, step);
  i64 row = i0 / D;
  i64 row_end = (row + 1) * D;
  u64 word = 0;
  if (i0 + 8 <= n && i0 + 8 <= row_end) {   // the common case: one row
    const Row rw = row_of(lohi, row);
    HVD_UNROLL8
    for (int k = 0; k < 8; ++k) {
      const u32 w = k < 4 ? ra.w[k] : rb.w[k - 4];
      word |= (u64)code_of(x[i0 + k], rw, L, uniform01(w)) << (k * BITS);
    }
    return word;
  }
  HVD_UNROLL8
  for (int k = 0; k < 8; ++k) {
    const i64 i = i0 + k;
    if (i >= n) break;
    while (i >= row_end) {   // rows shorter than 8 coordinates step more than once
      ++row;
      row_end += D;
    }
    const u32 w = k < 4 ? ra.w[k] : rb.w[k - 4];
    word |= (u64)code_of(x[i], row_of(lohi, row), L, uniform01(w)) << (k * BITS);
  }
  return word;
}

template <int BITS>
__device__ inline void quantize_pack_loop(const float* __restrict__ x, i64 n, i64 D,
                                          const float* __restrict__ lohi, u32 seed, u32 rank,
                                          u32 tensor_id, u32 step,
                                          unsigned char* __restrict__ out) {
  const i64 groups = (n + 7) / 8;
  const i64 nbytes = (n * BITS + 7) / 8;
#if defined(HVD_HOST_BUILD)
  // host bulk path (hvdcomp.cuh, section 5): code_of over runs of one row
  if (host_bulk_groups(groups, [&](auto L, i64 g0, i64 g1) HVD_INLINE {
        bulk_encode<BITS, decltype(L)::value, true>(
            n, D, seed, rank, tensor_id, step, out, g0, g1,
            [&](i64 s, int len, i64 row, const u32* __restrict__ ws, u32* __restrict__ cs)
                HVD_INLINE {
                  const double Lv = (double)((1 << BITS) - 1);
                  const float* __restrict__ xs = x + s;
                  const Row rw = row_of(lohi, row);
                  for (int i = 0; i < len; ++i)
                    cs[i] = code_of(xs[i], rw, Lv, uniform01(ws[i]));
                });
      }))
    return;
#endif
  for (i64 g = global_thread(); g < groups; g += grid_threads()) {
    store_group<BITS>(out, g, nbytes,
                      quantize_group<BITS>(x, n, D, lohi, seed, rank, tensor_id, step, g));
  }
}

// out[i] = out[i] + float32(lo + code * step[row]) for coordinates 8g .. 8g+7 (< n).
template <int BITS>
__device__ inline void dequantize_add_loop(const unsigned char* __restrict__ packed, i64 n,
                                           i64 D, const float* __restrict__ lohi,
                                           const double* __restrict__ steps,
                                           float* __restrict__ out) {
  constexpr u32 MASK = (1u << BITS) - 1u;
  const i64 groups = (n + 7) / 8;
  const i64 nbytes = (n * BITS + 7) / 8;
#if defined(HVD_HOST_BUILD)
  if (host_bulk_groups(groups, [&](auto L, i64 g0, i64 g1) HVD_INLINE {
        bulk_decode<BITS, decltype(L)::value, false>(
            packed, n, D, 0u, 0u, 0u, 0u, g0, g1,
            [&](i64 s, int len, i64 row, const u32* __restrict__ cs, const u32*) HVD_INLINE {
              float* __restrict__ os = out + s;
              const double lo = (double)lohi[2 * row];
              const double st = steps[row];
              for (int i = 0; i < len; ++i) os[i] = os[i] + (float)(lo + (double)cs[i] * st);
            });
      }))
    return;
#endif
  for (i64 g = global_thread(); g < groups; g += grid_threads()) {
    const u64 word = load_group<BITS>(packed, g, nbytes);
    const i64 i0 = 8 * g;
    i64 row = i0 / D;
    i64 row_end = (row + 1) * D;
    if (i0 + 8 <= n && i0 + 8 <= row_end) {
      const double lo = (double)lohi[2 * row];
      const double st = steps[row];
      HVD_UNROLL8
      for (int k = 0; k < 8; ++k) {
        const u32 c = (u32)(word >> (k * BITS)) & MASK;
        out[i0 + k] = out[i0 + k] + (float)(lo + (double)c * st);
      }
      continue;
    }
    for (int k = 0; k < 8; ++k) {
      const i64 i = i0 + k;
      if (i >= n) break;
      while (i >= row_end) {
        ++row;
        row_end += D;
      }
      const u32 c = (u32)(word >> (k * BITS)) & MASK;
      out[i] = out[i] + (float)((double)lohi[2 * row] + (double)c * steps[row]);
    }
  }
}

// One code of a packed stream (any BITS <= 8): it spans at most two bytes.
__device__ __forceinline__ u32 load_code(const unsigned char* __restrict__ packed, i64 nbytes,
                                         i64 i, int bits) {
  const i64 bit = i * (i64)bits;
  const i64 byte = bit >> 3;
  u32 v = packed[byte];
  if (byte + 1 < nbytes) v |= (u32)packed[byte + 1] << 8;
  return (v >> (u32)(bit & 7)) & ((1u << bits) - 1u);
}

// Householder coefficients of a block of k >= 2 rows (psq._reflect): t = 1/sqrt(k),
// c = 2 / (2 - 2t), coef0 = c (1 - t) for the leading row, coef1 = c * -t for the others.
struct Reflector {
  double t, coef0, coef1;
};

__device__ __forceinline__ Reflector reflector(i64 k) {
  Reflector h;
  h.t = 1.0 / sqrt((double)k);
  const double c = 2.0 / (2.0 - 2.0 * h.t);
  h.coef0 = c * (1.0 - h.t);
  h.coef1 = c * -h.t;
  return h;
}

}  // namespace psq
}  // namespace hvd

// ---- kernels ------------------------------------------------------------------------------

// out[0 .. ceil(n*bits/8)) = pack_bits(quantize_rows(x.view(n/D, D), bits, u)[1], bits) with
// u = hvdcomp.philox.uniform(n, seed, step, rank, tensor_id) and lohi (float32 (R, 2)) the
// per-row (min, max) that quantize_rows computes.  bits in 1..8, D >= 1.
extern "C" __global__ void hvd_psq_quantize_pack(const float* __restrict__ x, long long n,
                                                 long long D, const float* __restrict__ lohi,
                                                 int bits, unsigned int seed,
                                                 unsigned int rank, unsigned int tensor_id,
                                                 unsigned int step,
                                                 unsigned char* __restrict__ out) {
#define HVD_CASE(B)                                                                       \
  case B:                                                                                 \
    hvd::psq::quantize_pack_loop<B>(x, n, D, lohi, seed, rank, tensor_id, step, out);   \
    break;
  switch (bits) {
    HVD_CASE(1) HVD_CASE(2) HVD_CASE(3) HVD_CASE(4) HVD_CASE(5) HVD_CASE(6) HVD_CASE(7)
    HVD_CASE(8)
    default:
      hvd::bad_launch("hvd_psq_quantize_pack: bits must be in 1..8");
  }
#undef HVD_CASE
}

// out[i] += float32(dequantize_rows(lohi, unpack_bits(packed, n, bits), bits))[i], with
// steps (float64 (R,)) = (hi - lo) / (2**bits - 1) as dequantize_rows computes it.
extern "C" __global__ void hvd_psq_dequantize_add(const unsigned char* __restrict__ packed,
                                                  long long n, long long D,
                                                  const float* __restrict__ lohi,
                                                  const double* __restrict__ steps, int bits,
                                                  float* __restrict__ out) {
#define HVD_CASE(B)                                                              \
  case B:                                                                        \
    hvd::psq::dequantize_add_loop<B>(packed, n, D, lohi, steps, out);           \
    break;
  switch (bits) {
    HVD_CASE(1) HVD_CASE(2) HVD_CASE(3) HVD_CASE(4) HVD_CASE(5) HVD_CASE(6) HVD_CASE(7)
    HVD_CASE(8)
    default:
      hvd::bad_launch("hvd_psq_dequantize_add: bits must be in 1..8");
  }
#undef HVD_CASE
}

// The per-coordinate terms of row_variance: out[p*D + j] = q (1 - q), q = r - floor(r), for
// the coordinate x[rows[p]*D + j] of row p of the (R, D) matrix x[rows], lohi (float32 (R, 2))
// that matrix's per-row (min, max).  float64 (R*D,); row_variance = out.view(R, D).sum(1) *
// ((hi - lo) / L) ** 2, the sum left to torch.
extern "C" __global__ void hvd_psq_row_terms(const float* __restrict__ x,
                                             const long long* __restrict__ rows, long long R,
                                             long long D, const float* __restrict__ lohi,
                                             int bits, double* __restrict__ out) {
  if (bits < 1 || bits > 8) {
    hvd::bad_launch("hvd_psq_row_terms: bits must be in 1..8");
    return;
  }
  const double L = (double)((1 << bits) - 1);
  const long long n = R * D;
  const long long groups = (n + 7) / 8;
  for (long long g = hvd::global_thread(); g < groups; g += hvd::grid_threads()) {
    const long long i0 = 8 * g;
    long long p = i0 / D;
    long long j = i0 - p * D;
    hvd::psq::Row rw = hvd::psq::row_of(lohi, p);
    const float* xr = x + rows[p] * D;
    for (int k = 0; k < 8; ++k) {
      if (i0 + k >= n) break;
      if (j == D) {
        ++p;
        j = 0;
        rw = hvd::psq::row_of(lohi, p);
        xr = x + rows[p] * D;
      }
      const double r = hvd::psq::grid_pos(xr[j], rw, L);
      const double q = r - floor(r);
      out[i0 + k] = q * (1.0 - q);
      ++j;
    }
  }
}

// y (float32, wire order, (sum sizes) x D) = householder_blocks(x[perm].double(), sizes,
// scales, inverse=False).float(): block g holds wire rows starts[g] .. starts[g]+sizes[g]-1,
// wire row p is row perm[p] of x; its leading row is scaled by scales[g], then a block of
// k >= 2 rows is reflected (psq._reflect), all in float64, rounded once to float32.
extern "C" __global__ void hvd_bhq_forward(const float* __restrict__ x, long long D,
                                           const long long* __restrict__ perm,
                                           const long long* __restrict__ starts,
                                           const long long* __restrict__ sizes,
                                           const float* __restrict__ scales, long long G,
                                           float* __restrict__ y) {
  const long long items = G * D;
  for (long long it = hvd::global_thread(); it < items; it += hvd::grid_threads()) {
    const long long g = it / D;
    const long long c = it - g * D;
    const long long s0 = starts[g];
    const long long k = sizes[g];
    const double y0 = (double)x[perm[s0] * D + c] * (double)scales[g];
    if (k < 2) {
      y[s0 * D + c] = (float)y0;
      continue;
    }
    const hvd::psq::Reflector h = hvd::psq::reflector(k);
    double acc = y0;
    for (long long j = 1; j < k; ++j) acc = acc + (double)x[perm[s0 + j] * D + c];
    const double w = y0 - h.t * acc;
    y[s0 * D + c] = (float)(y0 - h.coef0 * w);
    for (long long j = 1; j < k; ++j) {
      y[(s0 + j) * D + c] = (float)((double)x[perm[s0 + j] * D + c] - h.coef1 * w);
    }
  }
}

// out[perm[p]*D + c] += float32(householder_blocks(dequantize_rows(lohi, codes, bits), sizes,
// scales, inverse=True))[p, c]: the BHQ receiver (psq.BHQ._decode) without materializing the
// codes or the dense values.  steps: float64 (R,) = (hi - lo) / (2**bits - 1) per wire row;
// n = R * D; perm a permutation of 0..R-1 (each out element is written by one thread).
extern "C" __global__ void hvd_bhq_dequantize_add(const unsigned char* __restrict__ packed,
                                                  long long n, long long D,
                                                  const float* __restrict__ lohi,
                                                  const double* __restrict__ steps,
                                                  const long long* __restrict__ perm,
                                                  const long long* __restrict__ starts,
                                                  const long long* __restrict__ sizes,
                                                  const float* __restrict__ scales,
                                                  long long G, int bits,
                                                  float* __restrict__ out) {
  if (bits < 1 || bits > 8) {
    hvd::bad_launch("hvd_bhq_dequantize_add: bits must be in 1..8");
    return;
  }
  const long long nbytes = (n * bits + 7) / 8;
  const long long items = G * D;
  for (long long it = hvd::global_thread(); it < items; it += hvd::grid_threads()) {
    const long long g = it / D;
    const long long c = it - g * D;
    const long long s0 = starts[g];
    const long long k = sizes[g];
    const double sc = (double)scales[g];
    // yhat of wire row p at column c: lo + code * step (dequantize_rows)
    const double y0 = (double)lohi[2 * s0] +
                      (double)hvd::psq::load_code(packed, nbytes, s0 * D + c, bits) * steps[s0];
    if (k < 2) {
      out[perm[s0] * D + c] = out[perm[s0] * D + c] + (float)(y0 / sc);
      continue;
    }
    const hvd::psq::Reflector h = hvd::psq::reflector(k);
    double acc = y0;
    for (long long j = 1; j < k; ++j) {
      const long long p = s0 + j;
      acc = acc + ((double)lohi[2 * p] +
                   (double)hvd::psq::load_code(packed, nbytes, p * D + c, bits) * steps[p]);
    }
    const double w = y0 - h.t * acc;
    const long long o0 = perm[s0] * D + c;
    out[o0] = out[o0] + (float)((y0 - h.coef0 * w) / sc);
    for (long long j = 1; j < k; ++j) {
      const long long p = s0 + j;
      const double yp = (double)lohi[2 * p] +
                        (double)hvd::psq::load_code(packed, nbytes, p * D + c, bits) * steps[p];
      const long long o = perm[p] * D + c;
      out[o] = out[o] + (float)(yp - h.coef1 * w);
    }
  }
}
