// quantize.cu: the bucketed stochastic quantizer family (QSGD, QSGDinf, NUQSGD, ALQ, AMQ).
//
// One kernel set for the whole family, parameterized by the level table and the norm type.
// The specification is hvdcomp/ops/quantize.py (quantize_reference,
// dequantize_reference, bucket_norms) with hvdcomp/philox.py (Philox uniforms) and
// hvdcomp/ops/bitpack.py (LSB-first packing).  Every float operation below is the
// reference's, in the reference's order, in float32 (norms: float64, see below).
//
// Kernels (launch geometry and argument checks: hvdcomp/ops/quantize.py):
//   hvd_bucket_norms_l2    one block per bucket (grid-stride), blockDim = reduce_block(bucket)
//   hvd_bucket_norms_linf  same geometry
//   hvd_quantize_pack      one thread per group of 8 coordinates (grid-stride), any geometry
//   hvd_dequantize_add     one thread per group of 8 coordinates (grid-stride), any geometry
//   hvd_dequantize_add_many  several messages of one tensor, same geometry
//   hvd_quantize_pack_pieces, hvd_dequantize_add_pieces  several pieces (streams of their own)
//                          of one tensor in one launch (hvdcomp.cuh, section 4b): one thread
//                          per group of 8 coordinates of all the pieces, any geometry
//
// Sizes: n coordinates, nb = ceil(n / bucket_size) buckets (the last one may be partial;
// the reference pads it with zeros, which change neither norm), packed stream of
// ceil(n * bits / 8) bytes.  bits in 2..8: 1 sign bit + (bits - 1) index bits, so the level
// table holds 2^(bits-1) increasing float32 values (normally 0 .. 1).
#include "hvdcomp.cuh"

namespace hvd {

// ---- per-thread work: bucket norms ----------------------------------------------------------

// sumsq_partial and absmax_partial (kernels/hvdcomp.cuh): the per-thread shares of the norms.

#if defined(HVD_HOST_BUILD)
// Host bulk path of the norm kernels: buckets b0, b0 + bstep, ... < nb, each as the kernel
// computes it (the partials of every thread, then block_reduce's tree), all by thread 0.
template <bool L2>
inline bool bucket_norms_bulk(const float* __restrict__ x, i64 n, i64 bucket_size,
                              float* __restrict__ norms) {
  const int level = hvd_host::simd_level();
  if (!level) return false;
  const int stride = (int)blockDim.x;
  const i64 nb = (n + bucket_size - 1) / bucket_size;
  simd_call(level, [&](auto) HVD_INLINE {
    for (i64 b = blockIdx.x; b < nb; b += gridDim.x) {
      const i64 base = b * bucket_size;
      const i64 len = min64(bucket_size, n - base);
      if (L2) {
        double v[HVD_MAX_BLOCK];
        sumsq_partials(x + base, len, stride, v);
        norms[b] = (float)sqrt(tree_reduce(SumOp(), v, (u32)stride));
      } else {
        float v[HVD_MAX_BLOCK];
        absmax_partials(x + base, len, stride, v);
        norms[b] = tree_reduce(MaxNanOp(), v, (u32)stride);
      }
    }
  });
  host_block_done();
  return true;
}
#endif

// ---- per-thread work: one coordinate ------------------------------------------------------
//
// The code width is a template parameter (the kernels dispatch on bits once), so that the
// level search, the shifts and the masks are compile-time constants.

// torch.searchsorted(levels, r, right=True) for a table of COUNT = 2^(BITS-1) entries: the
// number of k with !(levels[k] > r).  For an increasing table that predicate holds on a
// prefix (for every r, NaN included: then it holds everywhere, as in ATen's upper-bound
// loop, which also returns COUNT), so counting it, or a branch-free binary search over the
// power-of-two table, gives ATen's answer.  Small tables count (independent comparisons,
// short latency); larger ones search (log2(COUNT) + 1 dependent comparisons).  On the host
// "small" reaches 32 levels (6-bit codes: the reduce-scatter's second stage of 3- and 4-bit
// tables): a loop of independent comparisons vectorizes, where a search per coordinate does
// not (5-bit codes encoded 7x slower than 3-bit ones with the search).
#if defined(HVD_HOST_BUILD)
#define HVD_SMALL_TABLE 32
#else
#define HVD_SMALL_TABLE 8
#endif
template <int COUNT>
__device__ __forceinline__ int upper_bound_pow2(const float* __restrict__ levels, float r) {
  if (COUNT <= HVD_SMALL_TABLE) {
    int c = 0;
    for (int k = 0; k < COUNT; ++k) c += !(levels[k] > r) ? 1 : 0;
    return c;
  }
  int pos = 0;                                   // !(levels[k] > r) for every k < pos
  for (int step = COUNT >> 1; step > 0; step >>= 1) {
    pos += !(levels[pos + step - 1] > r) ? step : 0;
  }
  return pos + (!(levels[pos] > r) ? 1 : 0);     // pos <= COUNT - 1 here
}

// t[j] for 0 <= j < COUNT.  The GPU indexes.  The host selects over the whole table when it
// is small: the same value, and a loop over coordinates then vectorizes, where an indexed
// load would be a gather (emulated one element at a time on most x86 CPUs).
template <int COUNT>
__device__ __forceinline__ float table_at(const float* __restrict__ t, int j) {
#if defined(HVD_HOST_BUILD)
  if (COUNT <= HVD_SMALL_TABLE) {   // bit masks, not ?: (GCC turns a ?: chain on j into a many-way branch)
    u32 v = float_bits(t[0]);
    for (int k = 1; k < COUNT; ++k) {
      const u32 m = 0u - (u32)(j >= k);                     // all ones while k <= j
      v = (float_bits(t[k]) & m) | (v & ~m);
    }
    return bits_float(v);
  }
#endif
  return t[j];
}

// The code of one coordinate: sign << (BITS - 1) | level index (quantize_reference).
//   u: this coordinate's Philox uniform.
template <int BITS>
__device__ __forceinline__ u32 quantize_one(float x, float norm, const float* __restrict__ levels,
                                            float u) {
  constexpr int S = (1 << (BITS - 1)) - 1;        // intervals; the table has S + 1 levels
  const float safe = norm > 0.0f ? norm : 1.0f;  // torch.where(norms > 0, norms, 1)
  float r = fabsf(x) / safe;
  r = r > 1.0f ? 1.0f : r;                         // clamp_(max=1.0); NaN stays NaN
  int j = upper_bound_pow2<S + 1>(levels, r) - 1;
  j = j < 0 ? 0 : (j > S - 1 ? S - 1 : j);         // .clamp_(0, s - 1)
  const float lo = table_at<S>(levels, j);        // levels[j], levels[j + 1]: j < S
  const float hi = table_at<S>(levels + 1, j);
  const float p = (r - lo) / (hi - lo);
  const u32 idx = (u32)j + (u < p ? 1u : 0u);
  const u32 sign = x < 0.0f ? 1u : 0u;             // -0.0 and NaN: sign 0
  return (sign << (BITS - 1)) | idx;
}

// Quantize coordinates 8g .. 8g+7 (those < n) and assemble their codes into one word:
// code k at bits [k*BITS, (k+1)*BITS).  Uses Philox blocks 2g and 2g+1.
template <int BITS>
__device__ __forceinline__ u64 quantize_group(const float* __restrict__ x, i64 n,
                                              const float* __restrict__ norms, i64 bucket_size,
                                              const float* __restrict__ levels, u32 seed,
                                              u32 rank, u32 tensor_id, u32 step, i64 g) {
  const i64 i0 = 8 * g;
  const Philox4 ra = philox_block(2 * g, seed, rank, tensor_id, step);
  const Philox4 rb = philox_block(2 * g + 1, seed, rank, tensor_id, step);
  i64 b = i0 / bucket_size;           // bucket of coordinate i0
  i64 bucket_end = (b + 1) * bucket_size;
  u64 word = 0;
  if (i0 + 8 <= n && i0 + 8 <= bucket_end) {   // the common case: 8 coordinates, one bucket
    const float norm = norms[b];
    HVD_UNROLL8
    for (int k = 0; k < 8; ++k) {
      const u32 w = k < 4 ? ra.w[k] : rb.w[k - 4];
      word |= (u64)quantize_one<BITS>(x[i0 + k], norm, levels, uniform01(w)) << (k * BITS);
    }
    return word;
  }
  // the tail of the tensor, or a bucket boundary inside the group
  group_coords(g, n, bucket_size, [&](int k, i64 i, i64 bi) {
    const u32 w = k < 4 ? ra.w[k] : rb.w[k - 4];
    const u32 code = quantize_one<BITS>(x[i], norms[bi], levels, uniform01(w));
    word |= (u64)code << (k * BITS);
  });
  return word;
}

#if defined(HVD_HOST_BUILD)
// Host bulk path of quantize_pack: groups [g0, g1) of one stream of n codes.
template <int BITS, int SIMD>
__forceinline__ void quantize_pack_bulk(const float* __restrict__ x, i64 n,
                                        const float* __restrict__ norms, i64 bucket_size,
                                        const float* __restrict__ levels, u32 seed, u32 rank,
                                        u32 tensor_id, u32 step, unsigned char* __restrict__ out,
                                        i64 g0, i64 g1) {
  bulk_encode<BITS, SIMD, true>(
      n, bucket_size, seed, rank, tensor_id, step, out, g0, g1,
      [&](i64 s, int len, i64 b, const u32* __restrict__ ws, u32* __restrict__ cs) HVD_INLINE {
        const float* __restrict__ xs = x + s;
        const float* __restrict__ lv = levels;
        const float norm = norms[b];
        for (int i = 0; i < len; ++i) cs[i] = quantize_one<BITS>(xs[i], norm, lv, uniform01(ws[i]));
      });
}
#endif

template <int BITS>
__device__ inline void quantize_pack_loop(const float* __restrict__ x, i64 n,
                                          const float* __restrict__ norms, i64 bucket_size,
                                          const float* __restrict__ levels, u32 seed, u32 rank,
                                          u32 tensor_id, u32 step,
                                          unsigned char* __restrict__ out) {
  const i64 groups = (n + 7) / 8;
  const i64 nbytes = (n * BITS + 7) / 8;
#if defined(HVD_HOST_BUILD)
  // host bulk path (hvdcomp.cuh, section 5): quantize_one over runs of one bucket
  if (host_bulk_groups(groups, [&](auto L, i64 g0, i64 g1) HVD_INLINE {
        quantize_pack_bulk<BITS, decltype(L)::value>(x, n, norms, bucket_size, levels, seed,
                                                     rank, tensor_id, step, out, g0, g1);
      }))
    return;
#endif
  for (i64 g = global_thread(); g < groups; g += grid_threads()) {
    const u64 word = quantize_group<BITS>(x, n, norms, bucket_size, levels, seed, rank,
                                          tensor_id, step, g);
    store_group<BITS>(out, g, nbytes, word);
  }
}

// Decode coordinates 8g .. 8g+7 (those < n) from their word and add them into out:
// out[i] = out[i] + (neg ? -v : v), v = levels[idx] * norm  (out + dequantize_reference).
template <int BITS>
__device__ __forceinline__ void dequantize_add_group(u64 word, i64 n,
                                                     const float* __restrict__ norms,
                                                     i64 bucket_size,
                                                     const float* __restrict__ levels,
                                                     float* __restrict__ out, i64 g) {
  constexpr u32 CODE_MASK = (1u << BITS) - 1u;
  constexpr u32 INDEX_MASK = (1u << (BITS - 1)) - 1u;
  const i64 i0 = 8 * g;
  i64 b = i0 / bucket_size;
  i64 bucket_end = (b + 1) * bucket_size;
  if (i0 + 8 <= n && i0 + 8 <= bucket_end) {   // the common case: 8 coordinates, one bucket
    const float norm = norms[b];
    HVD_UNROLL8
    for (int k = 0; k < 8; ++k) {
      const u32 code = (u32)(word >> (k * BITS)) & CODE_MASK;
      const float v = levels[code & INDEX_MASK] * norm;
      out[i0 + k] = out[i0 + k] + negate_if(v, code >> (BITS - 1));   // where(neg, -v, v)
    }
    return;
  }
  group_coords(g, n, bucket_size, [&](int k, i64 i, i64 bi) {
    const u32 code = (u32)(word >> (k * BITS)) & CODE_MASK;
    const float v = levels[code & INDEX_MASK] * norms[bi];
    out[i] = out[i] + negate_if(v, code >> (BITS - 1));   // where(neg, -v, v)
  });
}

#if defined(HVD_HOST_BUILD)
// Host bulk path of dequantize_add(_many)_loop: groups [g0, g1) in chunks; per chunk every
// message's codes are unpacked and added into out (message order, as the device code), each
// coordinate as dequantize_add_group computes it, in loops that vectorize.
template <int BITS, int SIMD>
__forceinline__ void dequantize_add_bulk(const unsigned char* const* packed,
                                         const float* const* norms, int count, i64 n,
                                         i64 bucket_size, const float* __restrict__ levels,
                                         float* __restrict__ out, i64 g0, i64 g1) {
  constexpr int CG = HVD_BULK_GROUPS;
  constexpr u32 INDEX_MASK = (1u << (BITS - 1)) - 1u;
  constexpr int COUNT = 1 << (BITS - 1);
  const i64 nbytes = (n * BITS + 7) / 8;
  u32 codes[8 * CG];
  for (i64 g = g0; g < g1; g += CG) {
    const int cg = (int)min64(CG, g1 - g);
    const i64 e0 = 8 * g;
    for (int m = 0; m < count; ++m) {
      load_unpack<BITS>(packed[m], cg, g, nbytes, codes);
      const float* __restrict__ nm = norms[m];
      bucket_runs(e0, min64(8 * (g + cg), n), bucket_size, [&](i64 s, int len, i64 b) HVD_INLINE {
        const u32* __restrict__ cs = codes + (s - e0);
        float* __restrict__ os = out + s;
        const float norm = nm[b];
        for (int i = 0; i < len; ++i) {
          const u32 code = cs[i];
          const float v = table_at<COUNT>(levels, (int)(code & INDEX_MASK)) * norm;
          os[i] = os[i] + negate_if(v, code >> (BITS - 1));   // where(neg, -v, v)
        }
      });
    }
  }
}
#endif

template <int BITS>
__device__ inline void dequantize_add_loop(const unsigned char* __restrict__ packed, i64 n,
                                           const float* __restrict__ norms, i64 bucket_size,
                                           const float* __restrict__ levels,
                                           float* __restrict__ out) {
  const i64 groups = (n + 7) / 8;
  const i64 nbytes = (n * BITS + 7) / 8;
#if defined(HVD_HOST_BUILD)
  const unsigned char* pk[1] = {packed};
  const float* nm[1] = {norms};
  if (host_bulk_groups(groups, [&](auto L, i64 g0, i64 g1) HVD_INLINE {
        dequantize_add_bulk<BITS, decltype(L)::value>(pk, nm, 1, n, bucket_size, levels, out,
                                                      g0, g1);
      }))
    return;
#endif
  for (i64 g = global_thread(); g < groups; g += grid_threads()) {
    const u64 word = load_group<BITS>(packed, g, nbytes);
    dequantize_add_group<BITS>(word, n, norms, bucket_size, levels, out, g);
  }
}

// Several messages of one tensor (one per rank), added in message order: for each group the
// accumulator's 8 values stay in registers / L1 while every message's codes are added, so the
// accumulator crosses memory once instead of once per message.  Bit for bit the same as
// dequantize_add_loop applied to the messages one after another (same additions, same order).
template <int BITS>
__device__ inline void dequantize_add_many_loop(const unsigned long long* __restrict__ packed_ptrs,
                                                const unsigned long long* __restrict__ norms_ptrs,
                                                int count, i64 n, i64 bucket_size,
                                                const float* __restrict__ levels,
                                                float* __restrict__ out) {
  const i64 groups = (n + 7) / 8;
  const i64 nbytes = (n * BITS + 7) / 8;
#if defined(HVD_HOST_BUILD)
  if (host_bulk_groups(groups, [&](auto L, i64 g0, i64 g1) HVD_INLINE {
        dequantize_add_bulk<BITS, decltype(L)::value>(
            (const unsigned char* const*)packed_ptrs, (const float* const*)norms_ptrs, count, n,
            bucket_size, levels, out, g0, g1);
      }))
    return;
#endif
  for (i64 g = global_thread(); g < groups; g += grid_threads()) {
    for (int m = 0; m < count; ++m) {
      const unsigned char* packed = (const unsigned char*)packed_ptrs[m];
      const float* norms = (const float*)norms_ptrs[m];
      const u64 word = load_group<BITS>(packed, g, nbytes);
      dequantize_add_group<BITS>(word, n, norms, bucket_size, levels, out, g);
    }
  }
}

// quantize_pack_loop of every piece of a piece table (hvdcomp.cuh, section 4b): piece k's
// coordinates x[lo, lo + n) against norms[bucket ...], Philox with its own tensor id, packed
// into out[byte ...] as its own stream.
template <int BITS>
__device__ inline void quantize_pack_pieces_loop(const float* __restrict__ x,
                                                 const float* __restrict__ norms,
                                                 i64 bucket_size,
                                                 const float* __restrict__ levels, u32 seed,
                                                 u32 rank, u32 step,
                                                 const i64* __restrict__ table, int count,
                                                 i64 groups, unsigned char* __restrict__ out) {
#if defined(HVD_HOST_BUILD)
  if (host_bulk_pieces(table, count, groups, [&](auto L, const i64* p, i64 g0, i64 g1) HVD_INLINE {
        quantize_pack_bulk<BITS, decltype(L)::value>(
            x + p[PIECE_LO], p[PIECE_N], norms + p[PIECE_BUCKET], bucket_size, levels, seed,
            rank, (u32)p[PIECE_ID], step, out + p[PIECE_BYTE], g0, g1);
      }))
    return;
#endif
  for (i64 g = global_thread(); g < groups; g += grid_threads()) {
    const i64* p = piece_of(table, count, g);
    const i64 n = p[PIECE_N];
    const i64 lg = g - p[PIECE_GROUP];
    const u64 word = quantize_group<BITS>(x + p[PIECE_LO], n, norms + p[PIECE_BUCKET],
                                          bucket_size, levels, seed, rank, (u32)p[PIECE_ID],
                                          step, lg);
    store_group<BITS>(out + p[PIECE_BYTE], lg, (n * BITS + 7) / 8, word);
  }
}

// dequantize_add_loop of every piece of a piece table: piece k's stream at packed[byte ...]
// with norms[bucket ...] added into out[lo, lo + n).  The pieces' ranges of out must not
// overlap (the launcher checks).
template <int BITS>
__device__ inline void dequantize_add_pieces_loop(const unsigned char* __restrict__ packed,
                                                  const float* __restrict__ norms,
                                                  i64 bucket_size,
                                                  const float* __restrict__ levels,
                                                  const i64* __restrict__ table, int count,
                                                  i64 groups, float* __restrict__ out) {
#if defined(HVD_HOST_BUILD)
  if (host_bulk_pieces(table, count, groups, [&](auto L, const i64* p, i64 g0, i64 g1) HVD_INLINE {
        const unsigned char* pk[1] = {packed + p[PIECE_BYTE]};
        const float* nm[1] = {norms + p[PIECE_BUCKET]};
        dequantize_add_bulk<BITS, decltype(L)::value>(pk, nm, 1, p[PIECE_N], bucket_size,
                                                      levels, out + p[PIECE_LO], g0, g1);
      }))
    return;
#endif
  for (i64 g = global_thread(); g < groups; g += grid_threads()) {
    const i64* p = piece_of(table, count, g);
    const i64 n = p[PIECE_N];
    const i64 lg = g - p[PIECE_GROUP];
    const u64 word = load_group<BITS>(packed + p[PIECE_BYTE], lg, (n * BITS + 7) / 8);
    dequantize_add_group<BITS>(word, n, norms + p[PIECE_BUCKET], bucket_size, levels,
                               out + p[PIECE_LO], lg);
  }
}

}  // namespace hvd

// ---- kernels ------------------------------------------------------------------------------

// norms[b] = float32(sqrt(sum of x[i]^2 over bucket b)), the sum in float64 in the order of
// hvd::sumsq_partial + hvd::block_reduce (fixed by blockDim.x, which the launchers derive
// from bucket_size alone: see hvdcomp/backends/_common.py:reduce_block).
extern "C" __global__ void hvd_bucket_norms_l2(const float* __restrict__ x, long long n,
                                               long long bucket_size,
                                               float* __restrict__ norms) {
  if (!hvd::check_reduce_block()) return;
  const long long nb = (n + bucket_size - 1) / bucket_size;
#if defined(HVD_HOST_BUILD)
  if (hvd::bucket_norms_bulk<true>(x, n, bucket_size, norms)) return;
#endif
  for (long long b = blockIdx.x; b < nb; b += gridDim.x) {
    const long long base = b * bucket_size;
    const long long len = hvd::min64(bucket_size, n - base);
    const float* xb = x + base;
    const long long stride = blockDim.x;
    const double ss = hvd::block_reduce<double>(
        hvd::SumOp(), [&](unsigned t) { return hvd::sumsq_partial(xb, len, t, stride); });
    if (threadIdx.x == 0) norms[b] = (float)sqrt(ss);
  }
}

// norms[b] = max |x[i]| over bucket b (NaN if any x[i] is NaN).
extern "C" __global__ void hvd_bucket_norms_linf(const float* __restrict__ x, long long n,
                                                 long long bucket_size,
                                                 float* __restrict__ norms) {
  if (!hvd::check_reduce_block()) return;
  const long long nb = (n + bucket_size - 1) / bucket_size;
#if defined(HVD_HOST_BUILD)
  if (hvd::bucket_norms_bulk<false>(x, n, bucket_size, norms)) return;
#endif
  for (long long b = blockIdx.x; b < nb; b += gridDim.x) {
    const long long base = b * bucket_size;
    const long long len = hvd::min64(bucket_size, n - base);
    const float* xb = x + base;
    const long long stride = blockDim.x;
    const float m = hvd::block_reduce<float>(
        hvd::MaxNanOp(), [&](unsigned t) { return hvd::absmax_partial(xb, len, t, stride); });
    if (threadIdx.x == 0) norms[b] = m;
  }
}

// out[0 .. ceil(n*bits/8)) = pack_bits(codes, bits), codes as quantize_reference(x, levels,
// bucket_size, norm, uniform(n, seed, step, rank, tensor_id)) computes them from `norms`.
// Each thread writes whole groups of `bits` bytes: no atomics, deterministic.
extern "C" __global__ void hvd_quantize_pack(const float* __restrict__ x, long long n,
                                             const float* __restrict__ norms,
                                             long long bucket_size,
                                             const float* __restrict__ levels, int bits,
                                             unsigned int seed, unsigned int rank,
                                             unsigned int tensor_id, unsigned int step,
                                             unsigned char* __restrict__ out) {
#define HVD_CASE(B)                                                                      \
  case B:                                                                                \
    hvd::quantize_pack_loop<B>(x, n, norms, bucket_size, levels, seed, rank, tensor_id, \
                               step, out);                                               \
    break;
  switch (bits) {
    HVD_CASE(2) HVD_CASE(3) HVD_CASE(4) HVD_CASE(5) HVD_CASE(6) HVD_CASE(7) HVD_CASE(8)
    default:
      hvd::bad_launch("hvd_quantize_pack: bits must be in 2..8");
  }
#undef HVD_CASE
}

// out[i] += dequantize_reference(norms, unpack_bits(packed, n, bits), levels, bucket_size,
// bits - 1)[i] for i < n: one rank's contribution added into a float32 accumulator.
extern "C" __global__ void hvd_dequantize_add(const unsigned char* __restrict__ packed,
                                              long long n, const float* __restrict__ norms,
                                              long long bucket_size,
                                              const float* __restrict__ levels, int bits,
                                              float* __restrict__ out) {
#define HVD_CASE(B)                                                                  \
  case B:                                                                            \
    hvd::dequantize_add_loop<B>(packed, n, norms, bucket_size, levels, out);        \
    break;
  switch (bits) {
    HVD_CASE(2) HVD_CASE(3) HVD_CASE(4) HVD_CASE(5) HVD_CASE(6) HVD_CASE(7) HVD_CASE(8)
    default:
      hvd::bad_launch("hvd_dequantize_add: bits must be in 2..8");
  }
#undef HVD_CASE
}

// hvd_dequantize_add applied to `count` messages in order (message m: packed codes at
// packed_ptrs[m], norms at norms_ptrs[m], device addresses), in one pass over out.
extern "C" __global__ void hvd_dequantize_add_many(const unsigned long long* __restrict__ packed_ptrs,
                                                   const unsigned long long* __restrict__ norms_ptrs,
                                                   int count, long long n, long long bucket_size,
                                                   const float* __restrict__ levels, int bits,
                                                   float* __restrict__ out) {
#define HVD_CASE(B)                                                                          \
  case B:                                                                                    \
    hvd::dequantize_add_many_loop<B>(packed_ptrs, norms_ptrs, count, n, bucket_size, levels, \
                                     out);                                                   \
    break;
  switch (bits) {
    HVD_CASE(2) HVD_CASE(3) HVD_CASE(4) HVD_CASE(5) HVD_CASE(6) HVD_CASE(7) HVD_CASE(8)
    default:
      hvd::bad_launch("hvd_dequantize_add_many: bits must be in 2..8");
  }
#undef HVD_CASE
}

// hvd_quantize_pack of `count` pieces in one launch (the reduce-scatter's pieces of one
// tensor, one per destination rank): piece k (table row k, hvdcomp.cuh section 4b) is
// quantized and packed exactly as hvd_quantize_pack(x + lo, n, norms + bucket, ...,
// tensor_id = its id, ..., out + byte) would.  groups: the table's total number of groups.
extern "C" __global__ void hvd_quantize_pack_pieces(const float* __restrict__ x,
                                                    const float* __restrict__ norms,
                                                    long long bucket_size,
                                                    const float* __restrict__ levels, int bits,
                                                    unsigned int seed, unsigned int rank,
                                                    unsigned int step,
                                                    const long long* __restrict__ table,
                                                    int count, long long groups,
                                                    unsigned char* __restrict__ out) {
#define HVD_CASE(B)                                                                        \
  case B:                                                                                  \
    hvd::quantize_pack_pieces_loop<B>(x, norms, bucket_size, levels, seed, rank, step,    \
                                      table, count, groups, out);                          \
    break;
  switch (bits) {
    HVD_CASE(2) HVD_CASE(3) HVD_CASE(4) HVD_CASE(5) HVD_CASE(6) HVD_CASE(7) HVD_CASE(8)
    default:
      hvd::bad_launch("hvd_quantize_pack_pieces: bits must be in 2..8");
  }
#undef HVD_CASE
}

// hvd_dequantize_add of `count` pieces in one launch (every owner's averaged piece of one
// tensor): piece k's stream at packed + byte with norms + bucket added into out + lo, as
// hvd_dequantize_add would.
extern "C" __global__ void hvd_dequantize_add_pieces(const unsigned char* __restrict__ packed,
                                                     const float* __restrict__ norms,
                                                     long long bucket_size,
                                                     const float* __restrict__ levels,
                                                     int bits,
                                                     const long long* __restrict__ table,
                                                     int count, long long groups,
                                                     float* __restrict__ out) {
#define HVD_CASE(B)                                                                         \
  case B:                                                                                   \
    hvd::dequantize_add_pieces_loop<B>(packed, norms, bucket_size, levels, table, count,   \
                                       groups, out);                                        \
    break;
  switch (bits) {
    HVD_CASE(2) HVD_CASE(3) HVD_CASE(4) HVD_CASE(5) HVD_CASE(6) HVD_CASE(7) HVD_CASE(8)
    default:
      hvd::bad_launch("hvd_dequantize_add_pieces: bits must be in 2..8");
  }
#undef HVD_CASE
}
