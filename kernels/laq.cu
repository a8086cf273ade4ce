// laq.cu: LAQ's (and SLAQ's) innovation quantizer (hvdcomp/compressors/laq.py).
//
// The specification is hvdcomp/ops/laq.py: quantize_innovation, dequantize_innovation,
// fixed_sum and encode_innovation (LAQ.encode's arithmetic: v = x - Qprev, R, the codes,
// delta, Qnew and the two squared norms ||Qnew - x||^2 and ||delta||^2).  Every float
// operation below is the reference's, in its order and precision; the squared norms are
// float64 sums in the fixed order that fixed_sum defines (and the reference uses), so
// codes, Qnew and both sums are bit-identical to the reference, on the host and on the GPU,
// for any thread count.
//
// Kernels (geometry and checks: hvdcomp/ops/laq.py):
//   hvd_laq_absmax        blocks of any power-of-two size <= 256, one thread per group of 8
//                         coordinates, one block per chunk of 8 * blockDim coordinates
//                         (grid-stride): partial[chunk] = max |x - q| over the chunk
//   hvd_laq_quantize      blockDim = 256 (checked: it fixes the summation order), one thread
//                         per group of 8, one block per chunk of 2048 coordinates
//                         (grid-stride): codes packed, Qnew, and the chunk's two sums
//   hvd_laq_sum_stage     blockDim = 256 (checked), the same chunking of a float64 array:
//                         one stage of fixed_sum
//   hvd_laq_dequantize_add  one thread per group of 8 (grid-stride), any geometry
//
// The summation order (laq.fixed_sum): terms padded with zeros to a multiple of 2048; per
// chunk of 2048, each group of 8 (t0..t7) as ((t0 + t1) + (t2 + t3)) + ((t4 + t5) + (t6 + t7)),
// then the 256 group sums folded as hvd::block_reduce does (s[t] = s[t] + s[t + w] for
// w = 128, 64, ..., 1); the chunk sums are summed the same way again, until one is left.
#include "hvdcomp.cuh"

namespace hvd {
namespace lq {

constexpr int GROUPS = 256;             // threads per block of the summing kernels
constexpr i64 CHUNK = 8 * GROUPS;       // coordinates per chunk (2048)

struct Pair {
  double e, d;   // ||eps||^2, ||delta||^2 partial sums
};
struct PairOp {
  __device__ __forceinline__ Pair operator()(Pair p, Pair q) const {
    Pair r;
    r.e = p.e + q.e;
    r.d = p.d + q.d;
    return r;
  }
};

__device__ __forceinline__ double tree8(const double t[8]) {
  return ((t[0] + t[1]) + (t[2] + t[3])) + ((t[4] + t[5]) + (t[6] + t[7]));
}

// The code of one innovation coordinate v (quantize_innovation):
//   c = clamp(floor((v + R) * L / (2R) + 1/2), 0, L) in float64;  R = 0: c = 0.
template <int BITS>
__device__ __forceinline__ u32 code_of(float v, double r) {
  constexpr int L = (1 << BITS) - 1;
  if (r == 0.0) return 0u;
  const double u = (((double)v + r) * (double)L) / (2.0 * r);
  // floor(u + 0.5) clamped to [0, L]: clamping first to [-1, L + 1] keeps the integer
  // conversion in range, and an exact floor by truncation (no libm call on the host)
  double f = u + 0.5;
  f = f < -1.0 ? -1.0 : (f > (double)(L + 1) ? (double)(L + 1) : f);
  int c = (int)f;                       // truncation toward zero
  c -= (double)c > f ? 1 : 0;           // floor
  c = c < 0 ? 0 : (c > L ? L : c);
  return (u32)c;
}

// The grid point of a code (dequantize_innovation): float32(R * (2c - L) / L), float64 ops.
template <int BITS>
__device__ __forceinline__ float delta_of(u32 c, double r) {
  constexpr int L = (1 << BITS) - 1;
  return (float)((r * (double)(2 * (int)c - L)) / (double)L);
}

// Group g (coordinates 8g .. 8g+7, those < n): codes packed into out, Qnew written, and the
// group's two tree8 sums returned (coordinates >= n contribute 0).
template <int BITS>
__device__ inline Pair quantize_group(const float* __restrict__ x, const float* __restrict__ q,
                                      int has_q, i64 n, double r, float* __restrict__ qnew,
                                      unsigned char* __restrict__ out, i64 nbytes, i64 g) {
  const i64 i0 = 8 * g;
  double te[8], td[8];
  u64 word = 0;
  HVD_UNROLL8
  for (int k = 0; k < 8; ++k) {
    te[k] = 0.0;
    td[k] = 0.0;
    const i64 i = i0 + k;
    if (i < n) {
      const float xi = x[i];
      const float qi = has_q ? q[i] : 0.0f;   // the reference's zeros_like(x) before an upload
      const float v = xi - qi;
      const u32 c = code_of<BITS>(v, r);
      const float d = delta_of<BITS>(c, r);
      const float qn = qi + d;                  // qnew = q + delta
      const float e = qn - xi;                  // eps = qnew - x
      qnew[i] = qn;
      word |= (u64)c << (k * BITS);
      te[k] = (double)e * (double)e;
      td[k] = (double)d * (double)d;
    }
  }
  if (i0 < n) store_group<BITS>(out, g, nbytes, word);
  Pair p;
  p.e = tree8(te);
  p.d = tree8(td);
  return p;
}

template <int BITS>
__device__ inline void quantize_loop(const float* __restrict__ x, const float* __restrict__ q,
                                     int has_q, i64 n, double r, float* __restrict__ qnew,
                                     unsigned char* __restrict__ out,
                                     double* __restrict__ sums) {
  const i64 nchunks = (n + CHUNK - 1) / CHUNK;
  const i64 nbytes = (n * BITS + 7) / 8;
  for (i64 c = blockIdx.x; c < nchunks; c += gridDim.x) {
    const Pair s = block_reduce<Pair>(PairOp(), [&](unsigned t) {
      return quantize_group<BITS>(x, q, has_q, n, r, qnew, out, nbytes, c * GROUPS + t);
    });
    if (threadIdx.x == 0) {
      sums[c] = s.e;
      sums[nchunks + c] = s.d;
    }
  }
}

template <int BITS>
__device__ inline void dequantize_add_loop(const unsigned char* __restrict__ packed, i64 n,
                                           double r, float* __restrict__ out) {
  constexpr u32 MASK = (1u << BITS) - 1u;
  const i64 groups = (n + 7) / 8;
  const i64 nbytes = (n * BITS + 7) / 8;
  for (i64 g = global_thread(); g < groups; g += grid_threads()) {
    const u64 word = load_group<BITS>(packed, g, nbytes);
    const i64 i0 = 8 * g;
    if (i0 + 8 <= n) {
      HVD_UNROLL8
      for (int k = 0; k < 8; ++k) {
        out[i0 + k] = out[i0 + k] + delta_of<BITS>((u32)(word >> (k * BITS)) & MASK, r);
      }
    } else {
      for (int k = 0; k < 8 && i0 + k < n; ++k) {
        out[i0 + k] = out[i0 + k] + delta_of<BITS>((u32)(word >> (k * BITS)) & MASK, r);
      }
    }
  }
}

__device__ inline float absmax_group(const float* __restrict__ x, const float* __restrict__ q,
                                     int has_q, i64 n, i64 g) {
  const MaxNanOp op;
  float m = 0.0f;
  const i64 i1 = min64(8 * g + 8, n);
  for (i64 i = 8 * g; i < i1; ++i) m = op(m, fabsf(x[i] - (has_q ? q[i] : 0.0f)));
  return m;
}

__device__ inline double sum_group(const double* __restrict__ in, i64 n, i64 g) {
  double t[8];
  for (int k = 0; k < 8; ++k) t[k] = 8 * g + k < n ? in[8 * g + k] : 0.0;
  return tree8(t);
}

}  // namespace lq
}  // namespace hvd

// ---- kernels ------------------------------------------------------------------------------

// partial[c] = max |x[i] - q[i]| (q = 0 when has_q == 0) over the chunk c of 8 * blockDim.x
// coordinates, NaN propagating (torch.max): R = the max of the partials; R is finite iff
// every x - q is (encode_innovation's finiteness check).
extern "C" __global__ void hvd_laq_absmax(const float* __restrict__ x,
                                          const float* __restrict__ q, int has_q, long long n,
                                          float* __restrict__ partial) {
  if (!hvd::check_reduce_block()) return;
  const long long per = 8LL * blockDim.x;
  const long long nchunks = (n + per - 1) / per;
  for (long long c = blockIdx.x; c < nchunks; c += gridDim.x) {
    const float m = hvd::block_reduce<float>(hvd::MaxNanOp(), [&](unsigned t) {
      return hvd::lq::absmax_group(x, q, has_q, n, c * blockDim.x + t);
    });
    if (threadIdx.x == 0) partial[c] = m;
  }
}

// With v = x - q (q = 0 when has_q == 0) and R = max |v| (finite, >= 0):
//   packed[0 .. ceil(n*bits/8)) = pack_bits(codes, bits), codes = quantize_innovation(v, bits)
//   qnew[i] = q[i] + dequantize_innovation(R, codes, bits)[i]
//   sums[c], sums[C + c] (C = ceil(n / 2048)) = chunk c's sums of (qnew - x)^2 and delta^2
//     in float64, in fixed_sum's order (hvd_laq_sum_stage finishes them).
// blockDim.x must be 256.  bits in 1..8.
extern "C" __global__ void hvd_laq_quantize(const float* __restrict__ x,
                                            const float* __restrict__ q, int has_q,
                                            long long n, float R, int bits,
                                            float* __restrict__ qnew,
                                            unsigned char* __restrict__ packed,
                                            double* __restrict__ sums) {
  if (blockDim.x != hvd::lq::GROUPS || blockDim.y != 1 || blockDim.z != 1) {
    hvd::bad_launch("hvd_laq_quantize: blockDim must be (256, 1, 1)");
    return;
  }
  const double r = (double)R;
#define HVD_CASE(B)                                                        \
  case B:                                                                  \
    hvd::lq::quantize_loop<B>(x, q, has_q, n, r, qnew, packed, sums);      \
    break;
  switch (bits) {
    HVD_CASE(1) HVD_CASE(2) HVD_CASE(3) HVD_CASE(4) HVD_CASE(5) HVD_CASE(6) HVD_CASE(7)
    HVD_CASE(8)
    default:
      hvd::bad_launch("hvd_laq_quantize: bits must be in 1..8");
  }
#undef HVD_CASE
}

// One stage of fixed_sum on `narrays` float64 arrays of n values each (array a at in + a*n):
// out[a * C + c] = the fixed-order sum of chunk c (2048 values, zero padded) of array a,
// C = ceil(n / 2048).  blockDim.x must be 256.
extern "C" __global__ void hvd_laq_sum_stage(const double* __restrict__ in, long long n,
                                             int narrays, double* __restrict__ out) {
  if (blockDim.x != hvd::lq::GROUPS || blockDim.y != 1 || blockDim.z != 1) {
    hvd::bad_launch("hvd_laq_sum_stage: blockDim must be (256, 1, 1)");
    return;
  }
  const long long nchunks = (n + hvd::lq::CHUNK - 1) / hvd::lq::CHUNK;
  for (long long item = blockIdx.x; item < nchunks * narrays; item += gridDim.x) {
    const long long a = item / nchunks;
    const long long c = item % nchunks;
    const double* ia = in + a * n;
    const double s = hvd::block_reduce<double>(hvd::SumOp(), [&](unsigned t) {
      return hvd::lq::sum_group(ia, n, c * hvd::lq::GROUPS + t);
    });
    if (threadIdx.x == 0) out[a * nchunks + c] = s;
  }
}

// out[i] += dequantize_innovation(R, unpack_bits(packed, n, bits), bits)[i], i < n (one
// rank's innovation added into a float32 accumulator).  bits in 1..8.
extern "C" __global__ void hvd_laq_dequantize_add(const unsigned char* __restrict__ packed,
                                                  long long n, float R, int bits,
                                                  float* __restrict__ out) {
  const double r = (double)R;
#define HVD_CASE(B)                                                 \
  case B:                                                           \
    hvd::lq::dequantize_add_loop<B>(packed, n, r, out);             \
    break;
  switch (bits) {
    HVD_CASE(1) HVD_CASE(2) HVD_CASE(3) HVD_CASE(4) HVD_CASE(5) HVD_CASE(6) HVD_CASE(7)
    HVD_CASE(8)
    default:
      hvd::bad_launch("hvd_laq_dequantize_add: bits must be in 1..8");
  }
#undef HVD_CASE
}
