// dithered.cu: dithered (DQSG) and nested dithered (NDQSG) quantization, per-element work.
//
// Specification: hvdcomp/ops/dithered.py (dqsg_quantize, dqsg_reconstruct, bucket_checksums,
// nested_resolve, uniform_encode, uniform_decode_add; NDQSG.resolve / combine in
// hvdcomp/compressors/dithered.py) with
// hvdcomp/philox.py (Philox:
// the dither is the uniform of index i minus 1/2, the check weights the word of index
// 2**60 + i, or'ed with 1) and hvdcomp/ops/bitpack.py (LSB-first packing).  Every float
// operation is the reference's, in its order and precision.
//
// Sizes: n coordinates, nb = ceil(n / bucket_size) buckets (the last may be short).
// bits (2..8) is the fine code width, M = 2**(bits-1) - 1; nested_bits (1..bits-1) the residue
// width, k = 2**nested_bits.  delta: float32 (nb,) bucket steps (their max |x| comes from
// hvd_bucket_norms_linf in quantize.cu; the division by M is a torch op, see
// hvdcomp/ops/dithered.py).
//
// Kernels (grid-stride, 64-bit indices):
//   hvd_dqsg_quantize_pack    one thread per group of 8 coordinates: codes q + M (width bits)
//                             or residues q mod k (width nested_bits), packed
//   hvd_ndqsg_checks          one block per bucket (blockDim: power of two <= 256): S_b
//   hvd_dqsg_validate         one thread per group of 8 codes: flags of invalid codes
//   hvd_dqsg_decode_add       one thread per group of 8 codes: out += Delta q - u
//   hvd_ndqsg_resolve_add     one block per bucket: coset resolution against the side
//                             information, the check, out += the value (or the side
//                             information where the check fails), the failed flag
//   hvd_uniform_round_pack    one thread per group of 8 coordinates: uniformef's nearest
//                             rounding (no dither): codes q + M packed, residuals x - Delta q
//   hvd_uniform_decode_add    one thread per group of 8 codes: out += Delta q
//
// The per-bucket sums (checks) are sums of uint32 modulo 2**32: exact in any order, so any
// power-of-two block size gives the reference's value.
#include "hvdcomp.cuh"

namespace hvd {
namespace dith {

// Philox index offset of the check weights (dithered.CHECK_OFFSET = 2**60), in Philox blocks.
#define HVD_DITH_CHECK_BLOCK (1LL << 58)

// s = uniform - 1/2 (exact in float32).
__device__ __forceinline__ float dither_of(u32 word) { return uniform01(word) - 0.5f; }

// q = clamp(floor(float32(float32(x / D) + s) + 0.5), -M, M), D = delta or 1 where delta == 0.
__device__ __forceinline__ int quantize_q(float x, float delta, float s, int M) {
  const float safe = delta > 0.0f ? delta : 1.0f;
  const float y = x / safe + s;
  float q = floor_f32(y + 0.5f);
  const float fm = (float)M;
  q = q < -fm ? -fm : q;
  q = q > fm ? fm : q;
  return (int)q;
}

// float32(float64(delta) * q - float64(float32(s * delta))) (dqsg_reconstruct).
__device__ __forceinline__ float reconstruct(float delta, int q, float s) {
  const float u = s * delta;
  return (float)((double)delta * (double)q - (double)u);
}

// nested_resolve for one coordinate: the member of the coset c (mod k) in [-M, M] nearest z.
__device__ __forceinline__ int resolve_q(int c, float z, int M, int k) {
  const double lim = (double)(M + k);
  double zz = (double)z;
  zz = zz != zz ? 0.0 : zz;                   // nan_to_num: NaN -> 0, +-inf -> +-(M + k)
  zz = zz < -lim ? -lim : (zz > lim ? lim : zz);
  const i64 t = (i64)floor((zz - (double)c) / (double)k + 0.5);
  i64 qh = (i64)c + (i64)k * t;
  const i64 lo = (i64)((c + M) % k) - M;      // c + M >= 0
  const i64 hi = lo + (i64)k * ((M - lo) / k);  // M - lo > 0
  qh = qh < lo ? lo : qh;
  qh = qh > hi ? hi : qh;
  return (int)qh;
}

// Codes of coordinates 8g .. 8g+7: q + M (nested == 0) or q & (k - 1) (nested: k = 2**WIDTH).
template <int WIDTH>
__device__ __forceinline__ u64 quantize_group(const float* __restrict__ x, i64 n,
                                              const float* __restrict__ delta, i64 bucket_size,
                                              int M, int nested, u32 seed, u32 rank,
                                              u32 tensor_id, u32 step, i64 g) {
  constexpr u32 MASK = (1u << WIDTH) - 1u;
  const i64 i0 = 8 * g;
  const Philox4 ra = philox_block(2 * g, seed, rank, tensor_id, step);
  const Philox4 rb = philox_block(2 * g + 1, seed, rank, tensor_id, step);
  const int offset = nested ? 0 : M;
  i64 b = i0 / bucket_size;
  i64 bucket_end = (b + 1) * bucket_size;
  u64 word = 0;
  if (i0 + 8 <= n && i0 + 8 <= bucket_end) {
    const float d = delta[b];
    HVD_UNROLL8
    for (int k = 0; k < 8; ++k) {
      const u32 w = k < 4 ? ra.w[k] : rb.w[k - 4];
      const int q = quantize_q(x[i0 + k], d, dither_of(w), M);
      word |= (u64)((u32)(q + offset) & MASK) << (k * WIDTH);
    }
    return word;
  }
  group_coords(g, n, bucket_size, [&](int k, i64 i, i64 bi) {
    const u32 w = k < 4 ? ra.w[k] : rb.w[k - 4];
    const int q = quantize_q(x[i], delta[bi], dither_of(w), M);
    word |= (u64)((u32)(q + offset) & MASK) << (k * WIDTH);
  });
  return word;
}

template <int WIDTH>
__device__ inline void quantize_pack_loop(const float* __restrict__ x, i64 n,
                                          const float* __restrict__ delta, i64 bucket_size,
                                          int M, int nested, u32 seed, u32 rank, u32 tensor_id,
                                          u32 step, unsigned char* __restrict__ out) {
  const i64 groups = (n + 7) / 8;
  const i64 nbytes = (n * WIDTH + 7) / 8;
#if defined(HVD_HOST_BUILD)
  // host bulk path (hvdcomp.cuh, section 5): quantize_q over runs of one bucket
  if (host_bulk_groups(groups, [&](auto L, i64 g0, i64 g1) HVD_INLINE {
        bulk_encode<WIDTH, decltype(L)::value, true>(
            n, bucket_size, seed, rank, tensor_id, step, out, g0, g1,
            [&](i64 s, int len, i64 b, const u32* __restrict__ ws, u32* __restrict__ cs)
                HVD_INLINE {
                  constexpr u32 MASK = (1u << WIDTH) - 1u;
                  const float* __restrict__ xs = x + s;
                  const float d = delta[b];
                  const int m = M;
                  const int offset = nested ? 0 : M;
                  for (int i = 0; i < len; ++i)
                    cs[i] = (u32)(quantize_q(xs[i], d, dither_of(ws[i]), m) + offset) & MASK;
                });
      }))
    return;
#endif
  for (i64 g = global_thread(); g < groups; g += grid_threads()) {
    store_group<WIDTH>(out, g, nbytes,
                       quantize_group<WIDTH>(x, n, delta, bucket_size, M, nested, seed, rank,
                                             tensor_id, step, g));
  }
}

// The groups of 8 coordinates that meet bucket [base, end): first .. last (inclusive).
__device__ __forceinline__ i64 first_group(i64 base) { return base / 8; }
__device__ __forceinline__ i64 last_group(i64 end) { return (end - 1) / 8; }

// Thread t's share of bucket [base, end)'s check: sum of q_i * w_i (mod 2**32) over the
// coordinates of groups first + t, first + t + stride, ... that lie in the bucket.
__device__ inline u32 check_partial(const float* __restrict__ x, float d, i64 base, i64 end,
                                    int M, u32 seed, u32 rank, u32 tensor_id, u32 step, i64 t,
                                    i64 stride) {
  u32 sum = 0;
  const i64 g1 = last_group(end);
  for (i64 g = first_group(base) + t; g <= g1; g += stride) {
    const Philox4 ra = philox_block(2 * g, seed, rank, tensor_id, step);
    const Philox4 rb = philox_block(2 * g + 1, seed, rank, tensor_id, step);
    const Philox4 wa = philox_block(HVD_DITH_CHECK_BLOCK + 2 * g, seed, rank, tensor_id, step);
    const Philox4 wb =
        philox_block(HVD_DITH_CHECK_BLOCK + 2 * g + 1, seed, rank, tensor_id, step);
    HVD_UNROLL8
    for (int k = 0; k < 8; ++k) {
      const i64 i = 8 * g + k;
      if (i < base || i >= end) continue;
      const u32 s = k < 4 ? ra.w[k] : rb.w[k - 4];
      const u32 w = (k < 4 ? wa.w[k] : wb.w[k - 4]) | 1u;
      sum += (u32)quantize_q(x[i], d, dither_of(s), M) * w;
    }
  }
  return sum;
}

// The receiver's side of a nested coordinate i of a bucket with step d.
struct Nested {
  int q;      // resolved q_hat (0 in a zero bucket)
  float y;    // the side information y_i = side_sum_i / G
};

template <int WIDTH>
__device__ __forceinline__ Nested nested_one(const unsigned char* __restrict__ packed,
                                             i64 nbytes, const float* __restrict__ side_sum,
                                             float groupf, i64 i, float d, float s, int M) {
  const u64 word = load_group<WIDTH>(packed, i / 8, nbytes);
  const int c = (int)((u32)(word >> ((i % 8) * WIDTH)) & ((1u << WIDTH) - 1u));
  Nested r;
  r.y = side_sum[i] / groupf;
  const float safe = d > 0.0f ? d : 1.0f;
  const float z = r.y / safe + s;
  r.q = d > 0.0f ? resolve_q(c, z, M, 1 << WIDTH) : 0;
  return r;
}

// Thread t's share of the check of the resolved q_hat (as check_partial) in bucket [base, end).
template <int WIDTH>
__device__ inline u32 resolved_check_partial(const unsigned char* __restrict__ packed,
                                             i64 nbytes, const float* __restrict__ side_sum,
                                             float groupf, float d, i64 base, i64 end, int M,
                                             u32 seed, u32 rank, u32 tensor_id, u32 step, i64 t,
                                             i64 stride) {
  u32 sum = 0;
  const i64 g1 = last_group(end);
  for (i64 g = first_group(base) + t; g <= g1; g += stride) {
    const Philox4 ra = philox_block(2 * g, seed, rank, tensor_id, step);
    const Philox4 rb = philox_block(2 * g + 1, seed, rank, tensor_id, step);
    const Philox4 wa = philox_block(HVD_DITH_CHECK_BLOCK + 2 * g, seed, rank, tensor_id, step);
    const Philox4 wb =
        philox_block(HVD_DITH_CHECK_BLOCK + 2 * g + 1, seed, rank, tensor_id, step);
    HVD_UNROLL8
    for (int k = 0; k < 8; ++k) {
      const i64 i = 8 * g + k;
      if (i < base || i >= end) continue;
      const u32 s = k < 4 ? ra.w[k] : rb.w[k - 4];
      const u32 w = (k < 4 ? wa.w[k] : wb.w[k - 4]) | 1u;
      const Nested r = nested_one<WIDTH>(packed, nbytes, side_sum, groupf, i, d, dither_of(s), M);
      sum += (u32)r.q * w;
    }
  }
  return sum;
}

template <int WIDTH>
__device__ inline void resolve_add_loop(const unsigned char* __restrict__ packed, i64 n,
                                        const float* __restrict__ delta,
                                        const unsigned int* __restrict__ checks,
                                        const float* __restrict__ side_sum, int group,
                                        i64 bucket_size, int M, u32 seed, u32 rank,
                                        u32 tensor_id, u32 step, float* __restrict__ out,
                                        unsigned char* __restrict__ failed) {
  const i64 nb = (n + bucket_size - 1) / bucket_size;
  const i64 nbytes = (n * WIDTH + 7) / 8;
  const float groupf = (float)group;
  const i64 stride = blockDim.x;
  for (i64 b = blockIdx.x; b < nb; b += gridDim.x) {
    const i64 base = b * bucket_size;
    const i64 end = min64(base + bucket_size, n);
    const float d = delta[b];
    const u32 sum = block_reduce<u32>(SumOp(), [&](unsigned t) {
      return resolved_check_partial<WIDTH>(packed, nbytes, side_sum, groupf, d, base, end, M,
                                           seed, rank, tensor_id, step, (i64)t, stride);
    });
    const bool bad = sum != checks[b];
    if (threadIdx.x == 0) failed[b] = bad ? 1 : 0;
    const i64 g1 = last_group(end);
    for (i64 g = first_group(base) + threadIdx.x; g <= g1; g += stride) {
      const Philox4 ra = philox_block(2 * g, seed, rank, tensor_id, step);
      const Philox4 rb = philox_block(2 * g + 1, seed, rank, tensor_id, step);
      HVD_UNROLL8
      for (int k = 0; k < 8; ++k) {
        const i64 i = 8 * g + k;
        if (i < base || i >= end) continue;
        const float s = dither_of(k < 4 ? ra.w[k] : rb.w[k - 4]);
        const Nested r = nested_one<WIDTH>(packed, nbytes, side_sum, groupf, i, d, s, M);
        const float v = bad ? r.y : reconstruct(d, r.q, s);
        out[i] = out[i] + v;
      }
    }
  }
}

template <int WIDTH>
__device__ inline void validate_loop(const unsigned char* __restrict__ packed, i64 n,
                                     const float* __restrict__ delta, i64 bucket_size,
                                     u32 zero_code, u32 max_code,
                                     unsigned char* __restrict__ flags) {
  constexpr u32 MASK = (1u << WIDTH) - 1u;
  const i64 groups = (n + 7) / 8;
  const i64 nbytes = (n * WIDTH + 7) / 8;
#if defined(HVD_HOST_BUILD)
  // host bulk path (hvdcomp.cuh, section 5): the block's groups, their flags or'ed per run
  // of one bucket (the block owns its groups' flags)
  if (host_bulk_groups(groups, [&](auto L, i64 g0, i64 g1) HVD_INLINE {
        for (i64 g = g0; g < g1; ++g) flags[g] = 0;
        bulk_decode<WIDTH, decltype(L)::value, false>(
            packed, n, bucket_size, 0, 0, 0, 0, g0, g1,
            [&](i64 s, int len, i64 b, const u32* __restrict__ cs, const u32* __restrict__)
                HVD_INLINE {
                  const bool zero_step = !(delta[b] > 0.0f);
                  for (int i = 0; i < len; ++i) {
                    const u32 c = cs[i];
                    const u32 f = (c > max_code ? 1u : 0u) |
                                  ((zero_step && c != zero_code) ? 2u : 0u);
                    flags[(s + i) >> 3] |= (unsigned char)f;
                  }
                });
      }))
    return;
#endif
  for (i64 g = global_thread(); g < groups; g += grid_threads()) {
    const u64 word = load_group<WIDTH>(packed, g, nbytes);
    u32 f = 0;
    group_coords(g, n, bucket_size, [&](int k, i64, i64 b) {
      const u32 c = (u32)(word >> (k * WIDTH)) & MASK;
      f |= c > max_code ? 1u : 0u;
      f |= (c != zero_code && !(delta[b] > 0.0f)) ? 2u : 0u;
    });
    flags[g] = (unsigned char)f;
  }
}

template <int BITS>
__device__ inline void decode_add_loop(const unsigned char* __restrict__ packed, i64 n,
                                       const float* __restrict__ delta, i64 bucket_size,
                                       u32 seed, u32 rank, u32 tensor_id, u32 step,
                                       float* __restrict__ out) {
  constexpr u32 MASK = (1u << BITS) - 1u;
  constexpr int M = (1 << (BITS - 1)) - 1;
  const i64 groups = (n + 7) / 8;
  const i64 nbytes = (n * BITS + 7) / 8;
#if defined(HVD_HOST_BUILD)
  if (host_bulk_groups(groups, [&](auto L, i64 g0, i64 g1) HVD_INLINE {
        bulk_decode<BITS, decltype(L)::value, true>(
            packed, n, bucket_size, seed, rank, tensor_id, step, g0, g1,
            [&](i64 s, int len, i64 b, const u32* __restrict__ cs, const u32* __restrict__ ws)
                HVD_INLINE {
                  float* __restrict__ os = out + s;
                  const float d = delta[b];
                  for (int i = 0; i < len; ++i)
                    os[i] = os[i] + reconstruct(d, (int)cs[i] - M, dither_of(ws[i]));
                });
      }))
    return;
#endif
  for (i64 g = global_thread(); g < groups; g += grid_threads()) {
    const u64 word = load_group<BITS>(packed, g, nbytes);
    const Philox4 ra = philox_block(2 * g, seed, rank, tensor_id, step);
    const Philox4 rb = philox_block(2 * g + 1, seed, rank, tensor_id, step);
    const i64 i0 = 8 * g;
    i64 b = i0 / bucket_size;
    i64 bucket_end = (b + 1) * bucket_size;
    if (i0 + 8 <= n && i0 + 8 <= bucket_end) {
      const float d = delta[b];
      HVD_UNROLL8
      for (int k = 0; k < 8; ++k) {
        const int q = (int)((u32)(word >> (k * BITS)) & MASK) - M;
        const float s = dither_of(k < 4 ? ra.w[k] : rb.w[k - 4]);
        out[i0 + k] = out[i0 + k] + reconstruct(d, q, s);
      }
      continue;
    }
    group_coords(g, n, bucket_size, [&](int k, i64 i, i64 bi) {
      const int q = (int)((u32)(word >> (k * BITS)) & MASK) - M;
      const float s = dither_of(k < 4 ? ra.w[k] : rb.w[k - 4]);
      out[i] = out[i] + reconstruct(delta[bi], q, s);
    });
  }
}

// uniformef (hvdcomp/ops/dithered.py uniform_encode): q = quantize_q(x, Delta, 0, M), i.e.
// clamp(floor(float32(x / D) + 0.5), -M, M), the code q + M packed at BITS, and the residual
// float32(x - float32(float32(q) * Delta)).  One thread per group of 8 coordinates.
template <int BITS>
__device__ inline void round_pack_loop(const float* __restrict__ x, i64 n,
                                       const float* __restrict__ delta, i64 bucket_size, int M,
                                       float* __restrict__ residual,
                                       unsigned char* __restrict__ out) {
  constexpr u32 MASK = (1u << BITS) - 1u;
  const i64 groups = (n + 7) / 8;
  const i64 nbytes = (n * BITS + 7) / 8;
#if defined(HVD_HOST_BUILD)
  // host bulk path (hvdcomp.cuh, section 5): the same operations over runs of one bucket
  if (host_bulk_groups(groups, [&](auto L, i64 g0, i64 g1) HVD_INLINE {
        bulk_encode<BITS, decltype(L)::value, false>(
            n, bucket_size, 0, 0, 0, 0, out, g0, g1,
            [&](i64 s, int len, i64 b, const u32* __restrict__, u32* __restrict__ cs)
                HVD_INLINE {
                  const float* __restrict__ xs = x + s;
                  float* __restrict__ rs = residual + s;
                  const float d = delta[b];
                  const int m = M;
                  for (int i = 0; i < len; ++i) {
                    const int q = quantize_q(xs[i], d, 0.0f, m);
                    rs[i] = xs[i] - (float)q * d;
                    cs[i] = (u32)(q + m) & MASK;
                  }
                });
      }))
    return;
#endif
  for (i64 g = global_thread(); g < groups; g += grid_threads()) {
    u64 word = 0;
    group_coords(g, n, bucket_size, [&](int k, i64 i, i64 b) {
      const float d = delta[b];
      const float v = x[i];
      const int q = quantize_q(v, d, 0.0f, M);
      const float x_hat = (float)q * d;
      residual[i] = v - x_hat;
      word |= (u64)((u32)(q + M) & MASK) << (k * BITS);
    });
    store_group<BITS>(out, g, nbytes, word);
  }
}

// out[i] = float32(out[i] + float32(float32(q_i) * Delta_b)), q = code - M (uniform_decode_add).
template <int BITS>
__device__ inline void round_decode_add_loop(const unsigned char* __restrict__ packed, i64 n,
                                             const float* __restrict__ delta, i64 bucket_size,
                                             float* __restrict__ out) {
  constexpr u32 MASK = (1u << BITS) - 1u;
  constexpr int M = (1 << (BITS - 1)) - 1;
  const i64 groups = (n + 7) / 8;
  const i64 nbytes = (n * BITS + 7) / 8;
#if defined(HVD_HOST_BUILD)
  if (host_bulk_groups(groups, [&](auto L, i64 g0, i64 g1) HVD_INLINE {
        bulk_decode<BITS, decltype(L)::value, false>(
            packed, n, bucket_size, 0, 0, 0, 0, g0, g1,
            [&](i64 s, int len, i64 b, const u32* __restrict__ cs, const u32* __restrict__)
                HVD_INLINE {
                  float* __restrict__ os = out + s;
                  const float d = delta[b];
                  for (int i = 0; i < len; ++i) {
                    const float v = (float)((int)cs[i] - M) * d;
                    os[i] = os[i] + v;
                  }
                });
      }))
    return;
#endif
  for (i64 g = global_thread(); g < groups; g += grid_threads()) {
    const u64 word = load_group<BITS>(packed, g, nbytes);
    group_coords(g, n, bucket_size, [&](int k, i64 i, i64 b) {
      const int q = (int)((u32)(word >> (k * BITS)) & MASK) - M;
      const float v = (float)q * delta[b];
      out[i] = out[i] + v;
    });
  }
}

}  // namespace dith
}  // namespace hvd

// ---- kernels ------------------------------------------------------------------------------

// out = pack_bits(codes, width) with (delta, q) = dqsg_quantize(x, bits, bucket_size, s) for
// the given delta (float32 (nb,)) and s = dither(n, key): codes = q + M when nested_bits == 0
// (width = bits; DQSG and NDQSG's DQSG group), else q & (2**nested_bits - 1) (width =
// nested_bits; NDQSG's nested group).  bits in 2..8, nested_bits in 0..bits-1.
extern "C" __global__ void hvd_dqsg_quantize_pack(const float* __restrict__ x, long long n,
                                                  const float* __restrict__ delta,
                                                  long long bucket_size, int bits,
                                                  int nested_bits, unsigned int seed,
                                                  unsigned int rank, unsigned int tensor_id,
                                                  unsigned int step,
                                                  unsigned char* __restrict__ out) {
  if (bits < 2 || bits > 8 || nested_bits < 0 || nested_bits >= bits) {
    hvd::bad_launch("hvd_dqsg_quantize_pack: bits in 2..8, nested_bits in 0..bits-1");
    return;
  }
  const int M = (1 << (bits - 1)) - 1;
  const int width = nested_bits ? nested_bits : bits;
  const int nested = nested_bits ? 1 : 0;
#define HVD_CASE(W)                                                                        \
  case W:                                                                                  \
    hvd::dith::quantize_pack_loop<W>(x, n, delta, bucket_size, M, nested, seed, rank,     \
                                     tensor_id, step, out);                                \
    break;
  switch (width) {
    HVD_CASE(1) HVD_CASE(2) HVD_CASE(3) HVD_CASE(4) HVD_CASE(5) HVD_CASE(6) HVD_CASE(7)
    HVD_CASE(8)
    default:
      break;
  }
#undef HVD_CASE
}

// checks[b] = bucket_checksums(q, check_weights(n, key), bucket_size)[b] (uint32), q the DQSG
// indices of x for the given delta.  One block per bucket, blockDim a power of two <= 256.
extern "C" __global__ void hvd_ndqsg_checks(const float* __restrict__ x, long long n,
                                            const float* __restrict__ delta,
                                            long long bucket_size, int bits,
                                            unsigned int seed, unsigned int rank,
                                            unsigned int tensor_id, unsigned int step,
                                            unsigned int* __restrict__ checks) {
  if (!hvd::check_reduce_block()) return;
  if (bits < 2 || bits > 8) {
    hvd::bad_launch("hvd_ndqsg_checks: bits must be in 2..8");
    return;
  }
  const int M = (1 << (bits - 1)) - 1;
  const long long nb = (n + bucket_size - 1) / bucket_size;
  const long long stride = blockDim.x;
  for (long long b = blockIdx.x; b < nb; b += gridDim.x) {
    const long long base = b * bucket_size;
    const long long end = hvd::min64(base + bucket_size, n);
    const float d = delta[b];
    const unsigned int sum = hvd::block_reduce<unsigned int>(hvd::SumOp(), [&](unsigned t) {
      return hvd::dith::check_partial(x, d, base, end, M, seed, rank, tensor_id, step,
                                      (long long)t, stride);
    });
    if (threadIdx.x == 0) checks[b] = sum;
  }
}

// flags[g] (uint8, one per group of 8 codes of `width` bits) for the codes 8g .. 8g+7 (< n):
// bit 0: a code > max_code; bit 1: a code != zero_code in a bucket whose delta is not > 0.
// (DQSG: zero_code M, max_code 2M; nested residues: zero_code 0, max_code k - 1.)
extern "C" __global__ void hvd_dqsg_validate(const unsigned char* __restrict__ packed,
                                             long long n, const float* __restrict__ delta,
                                             long long bucket_size, int width,
                                             unsigned int zero_code, unsigned int max_code,
                                             unsigned char* __restrict__ flags) {
#define HVD_CASE(W)                                                                        \
  case W:                                                                                  \
    hvd::dith::validate_loop<W>(packed, n, delta, bucket_size, zero_code, max_code, flags); \
    break;
  switch (width) {
    HVD_CASE(1) HVD_CASE(2) HVD_CASE(3) HVD_CASE(4) HVD_CASE(5) HVD_CASE(6) HVD_CASE(7)
    HVD_CASE(8)
    default:
      hvd::bad_launch("hvd_dqsg_validate: width must be in 1..8");
  }
#undef HVD_CASE
}

// out[i] += dqsg_reconstruct(delta, unpack_bits(packed, n, bits) - M, dither(n, key),
// bucket_size)[i], bit for bit (one DQSG message added into a float32 accumulator).
extern "C" __global__ void hvd_dqsg_decode_add(const unsigned char* __restrict__ packed,
                                               long long n, const float* __restrict__ delta,
                                               long long bucket_size, int bits,
                                               unsigned int seed, unsigned int rank,
                                               unsigned int tensor_id, unsigned int step,
                                               float* __restrict__ out) {
#define HVD_CASE(B)                                                                        \
  case B:                                                                                  \
    hvd::dith::decode_add_loop<B>(packed, n, delta, bucket_size, seed, rank, tensor_id,   \
                                  step, out);                                              \
    break;
  switch (bits) {
    HVD_CASE(2) HVD_CASE(3) HVD_CASE(4) HVD_CASE(5) HVD_CASE(6) HVD_CASE(7) HVD_CASE(8)
    default:
      hvd::bad_launch("hvd_dqsg_decode_add: bits must be in 2..8");
  }
#undef HVD_CASE
}

// One nested rank of NDQSG.resolve, added into out: with y = side_sum / group (float32),
// z = y / D + s, q_hat = nested_resolve(residue, z) (0 where delta == 0), the bucket fails
// when bucket_checksums(q_hat) != checks[b]; out[i] += y_i in failed buckets, else
// dqsg_reconstruct(delta, q_hat, s)[i]; failed[b] = 1 / 0.  Residues: nested_bits each,
// packed.  One block per bucket, blockDim a power of two <= 256.
extern "C" __global__ void hvd_ndqsg_resolve_add(const unsigned char* __restrict__ packed,
                                                 long long n, const float* __restrict__ delta,
                                                 const unsigned int* __restrict__ checks,
                                                 const float* __restrict__ side_sum,
                                                 int group, long long bucket_size, int bits,
                                                 int nested_bits, unsigned int seed,
                                                 unsigned int rank, unsigned int tensor_id,
                                                 unsigned int step, float* __restrict__ out,
                                                 unsigned char* __restrict__ failed) {
  if (!hvd::check_reduce_block()) return;
  if (bits < 2 || bits > 8 || nested_bits < 1 || nested_bits >= bits || group < 1) {
    hvd::bad_launch("hvd_ndqsg_resolve_add: bits in 2..8, nested_bits in 1..bits-1, group >= 1");
    return;
  }
  const int M = (1 << (bits - 1)) - 1;
#define HVD_CASE(W)                                                                        \
  case W:                                                                                  \
    hvd::dith::resolve_add_loop<W>(packed, n, delta, checks, side_sum, group, bucket_size, \
                                   M, seed, rank, tensor_id, step, out, failed);           \
    break;
  switch (nested_bits) {
    HVD_CASE(1) HVD_CASE(2) HVD_CASE(3) HVD_CASE(4) HVD_CASE(5) HVD_CASE(6) HVD_CASE(7)
    default:
      break;
  }
#undef HVD_CASE
}

// (packed, residual) = uniform_encode(x, delta, bits, bucket_size): the codes q + M packed at
// bits (uint8, ceil(n bits / 8)) and the residuals x - Delta q (float32 (n,); not x itself).
extern "C" __global__ void hvd_uniform_round_pack(const float* __restrict__ x, long long n,
                                                  const float* __restrict__ delta,
                                                  long long bucket_size, int bits,
                                                  float* __restrict__ residual,
                                                  unsigned char* __restrict__ out) {
  const int M = (1 << (bits - 1)) - 1;
#define HVD_CASE(B)                                                                        \
  case B:                                                                                  \
    hvd::dith::round_pack_loop<B>(x, n, delta, bucket_size, M, residual, out);             \
    break;
  switch (bits) {
    HVD_CASE(2) HVD_CASE(3) HVD_CASE(4) HVD_CASE(5) HVD_CASE(6) HVD_CASE(7) HVD_CASE(8)
    default:
      hvd::bad_launch("hvd_uniform_round_pack: bits must be in 2..8");
  }
#undef HVD_CASE
}

// out[i] += uniform_decode_add's value: float32(q) * delta[b], q = the code - M (codes
// validated before, as for hvd_dqsg_decode_add).
extern "C" __global__ void hvd_uniform_decode_add(const unsigned char* __restrict__ packed,
                                                  long long n, const float* __restrict__ delta,
                                                  long long bucket_size, int bits,
                                                  float* __restrict__ out) {
#define HVD_CASE(B)                                                                        \
  case B:                                                                                  \
    hvd::dith::round_decode_add_loop<B>(packed, n, delta, bucket_size, out);               \
    break;
  switch (bits) {
    HVD_CASE(2) HVD_CASE(3) HVD_CASE(4) HVD_CASE(5) HVD_CASE(6) HVD_CASE(7) HVD_CASE(8)
    default:
      hvd::bad_launch("hvd_uniform_decode_add: bits must be in 2..8");
  }
#undef HVD_CASE
}
