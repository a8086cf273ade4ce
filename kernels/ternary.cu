// ternary.cu: TernGrad (hvdcomp/compressors/terngrad.py) and EF-SignSGD
// (hvdcomp/compressors/signef.py): per-bucket scales, stochastic ternarization / scaled sign
// with error feedback, packing, and decode-accumulate.
//
// The specification is the references of hvdcomp/ops/ternary.py (with hvdcomp/philox.py and
// hvdcomp/ops/bitpack.py); every float operation that reaches a message or a residual is
// the reference's, in the reference's order, in float32.  Launch geometry and argument checks:
// the kernel implementations in hvdcomp/ops/ternary.py.
//
// Segments.  Per-bucket reductions run over SEGMENTS so that a single large bucket (the default
// bucket_size = 0 puts a whole tensor in one bucket) still spreads over many blocks: bucket b
// is cut into `spb` segments of `seg` coordinates (segment q = b * spb + j covers coordinates
// b*bs + j*seg .. min(b*bs + (j+1)*seg, (b+1)*bs, n) - 1; trailing segments of the last
// bucket may be empty).  One block per segment (grid-stride), blockDim = reduce_block(...)
// chosen by the launcher from the data alone; a second launch combines a bucket's segments
// in index order in one thread.
//
// Sums whose float64 order differs from torch.sum's (the clipping statistics of TernGrad, the
// L1 scale of EF-SignSGD) never reach a message by themselves: they come with a proof that
// every summation order gives the same float32 result (see hvd_signef_scales and
// certified_clip_threshold in hvdcomp/ops/ternary.py), and where that proof fails the caller
// recomputes the value with the reference.  Maxima are exact in any order.
//
// Kernels:
//   hvd_terngrad_segments    per segment: max |x| (NaN propagates), sum x, sum |x| (float64)
//   hvd_terngrad_sqdev       per segment: sum (x - mean)^2 (float64)
//   hvd_max_rows             max over the `cols` partials of each row, in order
//   hvd_sum_rows_f64         sum over the `cols` partials of each row, in order
//   hvd_terngrad_pack        clip, ternarize (Philox uniforms), pack 2 bits per coordinate
//   hvd_terngrad_decode_add  out += sign * s * b
//   hvd_signef_segments      per segment: sum |g + e| (float64)
//   hvd_signef_scales        per bucket: scale = float32(sum / len), and whether it is certain
//   hvd_signef_pack          sign bits of p = g + e, and the residual p - decoded
//   hvd_signef_decode_add    out += bit ? -s : s
#include "hvdcomp.cuh"

namespace hvd {

// ---- segment geometry ---------------------------------------------------------------------

struct Segment {
  i64 start;  // first coordinate
  i64 len;    // coordinates (0 for a trailing segment past the tensor's end)
};

__device__ __forceinline__ Segment segment_of(i64 q, i64 n, i64 bs, i64 seg, i64 spb) {
  const i64 b = q / spb;
  const i64 j = q - b * spb;
  const i64 start = b * bs + j * seg;
  i64 end = min64(min64(start + seg, (b + 1) * bs), n);
  Segment s;
  s.start = start;
  s.len = end > start ? end - start : 0;
  return s;
}

// ---- TernGrad: statistics of one segment ----------------------------------------------------

struct TernStats {
  float mx;     // max |x| (NaN propagates, as torch.amax)
  double sum;   // sum of x
  double asum;  // sum of |x|
};

struct TernStatsOp {
  __device__ __forceinline__ TernStats operator()(TernStats a, TernStats b) const {
    TernStats r;
    r.mx = MaxNanOp()(a.mx, b.mx);
    r.sum = a.sum + b.sum;
    r.asum = a.asum + b.asum;
    return r;
  }
};

// Thread t of `stride` threads: coordinates t, t + stride, ... < len of segment xs; the sums
// in two interleaved partials each (their order does not matter: see the top of the file).
// The maximum is a plain max (no branch on NaN in the loop); NaN is restored at the end
// from the sum of |x|, which is NaN exactly when some |x| is (the other terms are >= 0).
__device__ inline TernStats tern_stats_partial(const float* __restrict__ xs, i64 len, i64 t,
                                               i64 stride) {
  float m0 = 0.0f, m1 = 0.0f;
  double s0 = 0.0, s1 = 0.0, a0 = 0.0, a1 = 0.0;
  i64 i = t;
  for (; i + stride < len; i += 2 * stride) {
    const float v0 = fabsf(xs[i]);
    const float v1 = fabsf(xs[i + stride]);
    m0 = v0 > m0 ? v0 : m0;
    m1 = v1 > m1 ? v1 : m1;
    s0 = s0 + (double)xs[i];
    s1 = s1 + (double)xs[i + stride];
    a0 = a0 + (double)v0;
    a1 = a1 + (double)v1;
  }
  for (; i < len; i += stride) {
    const float v = fabsf(xs[i]);
    m0 = v > m0 ? v : m0;
    s0 = s0 + (double)xs[i];
    a0 = a0 + (double)v;
  }
  TernStats r;
  r.sum = s0 + s1;
  r.asum = a0 + a1;
  r.mx = r.asum != r.asum ? (float)r.asum : (m1 > m0 ? m1 : m0);
  return r;
}

__device__ inline double sqdev_partial(const float* __restrict__ xs, i64 len, i64 t, i64 stride,
                                       double mean) {
  double a0 = 0.0, a1 = 0.0;
  i64 i = t;
  for (; i + stride < len; i += 2 * stride) {
    const double d0 = (double)xs[i] - mean;
    const double d1 = (double)xs[i + stride] - mean;
    a0 = a0 + d0 * d0;
    a1 = a1 + d1 * d1;
  }
  for (; i < len; i += stride) {
    const double d = (double)xs[i] - mean;
    a0 = a0 + d * d;
  }
  return a0 + a1;
}

// ---- TernGrad: one group of 8 coordinates -------------------------------------------------
//
// The reference (terngrad.py: clip_gradient, then quantizers.quantize_reference with the
// level table {0, 1}, the L-inf norm and bits = 2), for one coordinate x with bucket scale s
// and clipping threshold T (+inf: no clipping):
//   c   = clamp(x, -T, T)                  torch.clamp; x is finite here (encode checks first)
//   r   = min(|c| / (s > 0 ? s : 1), 1)
//   j   = clamp(searchsorted({0,1}, r, right) - 1, 0, 0) = 0, so lo = 0, hi = 1 and
//   p   = (r - 0) / (1 - 0) = r            exact: r - 0 == r and r / 1 == r for every float r
//   idx = u < p                            u: the coordinate's Philox uniform
//   code = (c < 0) << 1 | idx              -0.0: sign 0
__device__ __forceinline__ u32 terngrad_code(float x, float s, float T, float u) {
  const float c = x < -T ? -T : (x > T ? T : x);
  const float safe = s > 0.0f ? s : 1.0f;
  float r = fabsf(c) / safe;
  r = r > 1.0f ? 1.0f : r;
  const u32 idx = u < r ? 1u : 0u;
  const u32 sign = c < 0.0f ? 1u : 0u;
  return (sign << 1) | idx;
}

__device__ __forceinline__ u32 terngrad_group(const float* __restrict__ x, i64 n,
                                              const float* __restrict__ scales, i64 bs, float T,
                                              u32 seed, u32 rank, u32 tensor_id, u32 step,
                                              i64 g) {
  const i64 i0 = 8 * g;
  const Philox4 ra = philox_block(2 * g, seed, rank, tensor_id, step);
  const Philox4 rb = philox_block(2 * g + 1, seed, rank, tensor_id, step);
  i64 b = i0 / bs;
  i64 bucket_end = (b + 1) * bs;
  u32 word = 0;
  if (i0 + 8 <= n && i0 + 8 <= bucket_end) {  // the common case: 8 coordinates, one bucket
    const float s = scales[b];
    HVD_UNROLL8
    for (int k = 0; k < 8; ++k) {
      const u32 w = k < 4 ? ra.w[k] : rb.w[k - 4];
      word |= terngrad_code(x[i0 + k], s, T, uniform01(w)) << (2 * k);
    }
    return word;
  }
  HVD_UNROLL8
  for (int k = 0; k < 8; ++k) {
    const i64 i = i0 + k;
    if (i >= n) break;
    while (i >= bucket_end) {  // buckets smaller than 8 coordinates step more than once
      ++b;
      bucket_end += bs;
    }
    const u32 w = k < 4 ? ra.w[k] : rb.w[k - 4];
    word |= terngrad_code(x[i], scales[b], T, uniform01(w)) << (2 * k);
  }
  return word;
}

// out[i] + where(neg, -v, v), v = levels[idx] * s with levels = {0, 1}
// (quantizers.dequantize_reference, then out.add_).
__device__ __forceinline__ float terngrad_add_one(float o, u32 code, float s) {
  const float v = (float)(code & 1u) * s;  // levels[idx]: 0.0f or 1.0f, without a branch
  return o + negate_if(v, code >> 1);
}

__device__ __forceinline__ void terngrad_decode_group(u32 word, i64 n,
                                                      const float* __restrict__ scales, i64 bs,
                                                      float* __restrict__ out, i64 g) {
  const i64 i0 = 8 * g;
  i64 b = i0 / bs;
  i64 bucket_end = (b + 1) * bs;
  if (i0 + 8 <= n && i0 + 8 <= bucket_end) {
    const float s = scales[b];
    HVD_UNROLL8
    for (int k = 0; k < 8; ++k) {
      out[i0 + k] = terngrad_add_one(out[i0 + k], (word >> (2 * k)) & 3u, s);
    }
    return;
  }
  HVD_UNROLL8
  for (int k = 0; k < 8; ++k) {
    const i64 i = i0 + k;
    if (i >= n) break;
    while (i >= bucket_end) {
      ++b;
      bucket_end += bs;
    }
    out[i] = terngrad_add_one(out[i], (word >> (2 * k)) & 3u, scales[b]);
  }
}

// ---- EF-SignSGD -----------------------------------------------------------------------------

// p = g + e (float32, as torch's g + e), or g on the first step (no residual yet: the
// reference clones g; adding +0.0 would turn -0.0 into +0.0).
__device__ __forceinline__ float signef_p(const float* __restrict__ g, const float* e,
                                          int has_e, i64 i) {
  return has_e ? g[i] + e[i] : g[i];
}

// The bits of a float32, and +inf (the host build has no __float_as_uint / __int_as_float).
__device__ __forceinline__ u32 bits32(float v) {
#if defined(HVD_HOST_BUILD)
  u32 b;
  __builtin_memcpy(&b, &v, sizeof b);
  return b;
#else
  return __float_as_uint(v);
#endif
}

__device__ __forceinline__ float inf32() {
#if defined(HVD_HOST_BUILD)
  return __builtin_inff();
#else
  return __int_as_float(0x7f800000);
#endif
}

// 2^k as a double, for -1022 <= k <= 1023.
__device__ __forceinline__ double pow2(int k) {
  const u64 bits = (u64)(k + 1023) << 52;
#if defined(HVD_HOST_BUILD)
  double r;
  __builtin_memcpy(&r, &bits, sizeof r);
  return r;
#else
  return __longlong_as_double((long long)bits);
#endif
}

// The spacing of float32 numbers at a finite v > 0 (its ulp): every float32 value >= v in
// magnitude is a multiple of it.
__device__ __forceinline__ double ulp32(float v) {
  const int biased = (int)((bits32(v) >> 23) & 0xffu);
  return pow2(biased == 0 ? -149 : biased - 150);
}

// Sum of |p| (float64) and the smallest non-zero |p| (+inf if none) of some coordinates.
struct L1Stats {
  double sum;
  float minnz;
};

struct L1StatsOp {
  __device__ __forceinline__ L1Stats operator()(L1Stats a, L1Stats b) const {
    L1Stats r;
    r.sum = a.sum + b.sum;
    r.minnz = b.minnz < a.minnz ? b.minnz : a.minnz;
    return r;
  }
};

__device__ __forceinline__ float min_nonzero(float m, float a) {
  return (a < m && a != 0.0f) ? a : m;
}

// Thread t: over t, t + stride, ... < len of the segment at `start`: the sum of |p| in
// float64, in four interleaved partial sums joined as (a0 + a1) + (a2 + a3), and min |p| != 0.
__device__ inline L1Stats signef_l1_partial(const float* __restrict__ g, const float* e,
                                            int has_e, i64 start, i64 len, i64 t, i64 stride) {
  double a0 = 0.0, a1 = 0.0, a2 = 0.0, a3 = 0.0;
  const float inf = inf32();
  float m0 = inf, m1 = inf;
  i64 i = t;
  for (; i + 3 * stride < len; i += 4 * stride) {
    const float v0 = fabsf(signef_p(g, e, has_e, start + i));
    const float v1 = fabsf(signef_p(g, e, has_e, start + i + stride));
    const float v2 = fabsf(signef_p(g, e, has_e, start + i + 2 * stride));
    const float v3 = fabsf(signef_p(g, e, has_e, start + i + 3 * stride));
    a0 = a0 + (double)v0;
    a1 = a1 + (double)v1;
    a2 = a2 + (double)v2;
    a3 = a3 + (double)v3;
    m0 = min_nonzero(min_nonzero(m0, v0), v1);
    m1 = min_nonzero(min_nonzero(m1, v2), v3);
  }
  for (; i < len; i += stride) {
    const float v = fabsf(signef_p(g, e, has_e, start + i));
    a0 = a0 + (double)v;
    m0 = min_nonzero(m0, v);
  }
  L1Stats r;
  r.sum = (a0 + a1) + (a2 + a3);
  r.minnz = m1 < m0 ? m1 : m0;
  return r;
}


// One coordinate (signef.py _encode): bit = p < 0 (zero, also -0.0, is sent as +),
// decoded = bit ? -s : s, new residual p - decoded.
__device__ __forceinline__ u32 signef_one(const float* __restrict__ g, const float* e,
                                          int has_e, float* e_out, float s, i64 i) {
  const float p = signef_p(g, e, has_e, i);
  const u32 bit = p < 0.0f ? 1u : 0u;
  e_out[i] = p - negate_if(s, bit);
  return bit;
}

__device__ __forceinline__ u32 signef_group(const float* __restrict__ g, const float* e,
                                            int has_e, i64 n, const float* __restrict__ scales,
                                            i64 bs, float* e_out, i64 grp) {
  const i64 i0 = 8 * grp;
  i64 b = i0 / bs;
  i64 bucket_end = (b + 1) * bs;
  u32 byte = 0;
  if (i0 + 8 <= n && i0 + 8 <= bucket_end) {
    const float s = scales[b];
    HVD_UNROLL8
    for (int k = 0; k < 8; ++k) byte |= signef_one(g, e, has_e, e_out, s, i0 + k) << k;
    return byte;
  }
  HVD_UNROLL8
  for (int k = 0; k < 8; ++k) {
    const i64 i = i0 + k;
    if (i >= n) break;
    while (i >= bucket_end) {
      ++b;
      bucket_end += bs;
    }
    byte |= signef_one(g, e, has_e, e_out, scales[b], i) << k;
  }
  return byte;
}

__device__ __forceinline__ void signef_decode_group(u32 byte, i64 n,
                                                    const float* __restrict__ scales, i64 bs,
                                                    float* __restrict__ out, i64 grp) {
  const i64 i0 = 8 * grp;
  i64 b = i0 / bs;
  i64 bucket_end = (b + 1) * bs;
  if (i0 + 8 <= n && i0 + 8 <= bucket_end) {
    const float s = scales[b];
    HVD_UNROLL8
    for (int k = 0; k < 8; ++k) out[i0 + k] = out[i0 + k] + negate_if(s, (byte >> k) & 1u);
    return;
  }
  HVD_UNROLL8
  for (int k = 0; k < 8; ++k) {
    const i64 i = i0 + k;
    if (i >= n) break;
    while (i >= bucket_end) {
      ++b;
      bucket_end += bs;
    }
    out[i] = out[i] + negate_if(scales[b], (byte >> k) & 1u);
  }
}

}  // namespace hvd

// ---- kernels: reductions ----------------------------------------------------------------------

// For every segment q < nb * spb (see the top of the file): segmax[q] = max |x| (0 for an
// empty segment, NaN if any x is NaN), sums[q] = sum of x, sums[nseg + q] = sum of |x|
// (float64, nseg = nb * spb).
extern "C" __global__ void hvd_terngrad_segments(const float* __restrict__ x, long long n,
                                                 long long bs, long long seg, long long spb,
                                                 float* __restrict__ segmax,
                                                 double* __restrict__ sums) {
  if (!hvd::check_reduce_block()) return;
  const long long nb = (n + bs - 1) / bs;
  const long long nseg = nb * spb;
  for (long long q = blockIdx.x; q < nseg; q += gridDim.x) {
    const hvd::Segment s = hvd::segment_of(q, n, bs, seg, spb);
    const float* xs = x + s.start;
    const long long stride = blockDim.x;
    const hvd::TernStats r = hvd::block_reduce<hvd::TernStats>(
        hvd::TernStatsOp(),
        [&](unsigned t) { return hvd::tern_stats_partial(xs, s.len, t, stride); });
    if (threadIdx.x == 0) {
      segmax[q] = r.mx;
      sums[q] = r.sum;
      sums[nseg + q] = r.asum;
    }
  }
}

// out[q] = sum over the coordinates of segment q (geometry as above, one bucket of n: pass
// bs = n) of (x - mean)^2, float64.
extern "C" __global__ void hvd_terngrad_sqdev(const float* __restrict__ x, long long n,
                                              long long bs, long long seg, long long spb,
                                              double mean, double* __restrict__ out) {
  if (!hvd::check_reduce_block()) return;
  const long long nb = (n + bs - 1) / bs;
  const long long nseg = nb * spb;
  for (long long q = blockIdx.x; q < nseg; q += gridDim.x) {
    const hvd::Segment s = hvd::segment_of(q, n, bs, seg, spb);
    const float* xs = x + s.start;
    const long long stride = blockDim.x;
    const double v = hvd::block_reduce<double>(
        hvd::SumOp(), [&](unsigned t) { return hvd::sqdev_partial(xs, s.len, t, stride, mean); });
    if (threadIdx.x == 0) out[q] = v;
  }
}

// out[r] = max(0, in[r*cols], in[r*cols + 1], ...) for r < rows (NaN propagates).
// One thread per row, grid-stride, any geometry.
extern "C" __global__ void hvd_max_rows(const float* __restrict__ in, long long rows,
                                        long long cols, float* __restrict__ out) {
  const hvd::MaxNanOp op;
  for (long long r = hvd::global_thread(); r < rows; r += hvd::grid_threads()) {
    float m = 0.0f;
    for (long long j = 0; j < cols; ++j) m = op(m, in[r * cols + j]);
    out[r] = m;
  }
}

// out[r] = (((0 + in[r*cols]) + in[r*cols + 1]) + ...) for r < rows, float64, in index order.
// One thread per row, grid-stride, any geometry.
extern "C" __global__ void hvd_sum_rows_f64(const double* __restrict__ in, long long rows,
                                            long long cols, double* __restrict__ out) {
  for (long long r = hvd::global_thread(); r < rows; r += hvd::grid_threads()) {
    double acc = 0.0;
    for (long long j = 0; j < cols; ++j) acc = acc + in[r * cols + j];
    out[r] = acc;
  }
}

// ---- kernels: TernGrad --------------------------------------------------------------------

// out[0 .. ceil(n/4)) = pack_bits(codes, 2), codes = quantize_reference(clamp(x, -T, T),
// {0, 1}, bs, "linf", uniform(n, seed, step, rank, tensor_id)) given the bucket scales
// `scales` (= the reference's L-inf norms of the clipped buckets) and T (+inf: no clipping).
// One thread per group of 8 coordinates (2 bytes), grid-stride, any geometry.
extern "C" __global__ void hvd_terngrad_pack(const float* __restrict__ x, long long n,
                                             const float* __restrict__ scales, long long bs,
                                             float T, unsigned int seed, unsigned int rank,
                                             unsigned int tensor_id, unsigned int step,
                                             unsigned char* __restrict__ out) {
  const long long groups = (n + 7) / 8;
  const long long nbytes = (n * 2 + 7) / 8;
#if defined(HVD_HOST_BUILD)
  // host bulk path (hvdcomp.cuh, section 5): terngrad_code over runs of one bucket
  if (hvd::host_bulk_groups(groups, [&](auto L, long long g0, long long g1) HVD_INLINE {
        hvd::bulk_encode<2, decltype(L)::value, true>(
            n, bs, seed, rank, tensor_id, step, out, g0, g1,
            [&](long long s, int len, long long b, const hvd::u32* __restrict__ ws,
                hvd::u32* __restrict__ cs) HVD_INLINE {
              const float* __restrict__ xs = x + s;
              const float sc = scales[b];
              const float t = T;
              for (int i = 0; i < len; ++i)
                cs[i] = hvd::terngrad_code(xs[i], sc, t, hvd::uniform01(ws[i]));
            });
      }))
    return;
#endif
  for (long long g = hvd::global_thread(); g < groups; g += hvd::grid_threads()) {
    const hvd::u32 word = hvd::terngrad_group(x, n, scales, bs, T, seed, rank, tensor_id, step, g);
    hvd::store_group<2>(out, g, nbytes, (hvd::u64)word);
  }
}

// out[i] += dequantize_reference(scales, unpack_bits(packed, n, 2), {0, 1}, bs, 1)[i].
extern "C" __global__ void hvd_terngrad_decode_add(const unsigned char* __restrict__ packed,
                                                   long long n, const float* __restrict__ scales,
                                                   long long bs, float* __restrict__ out) {
  const long long groups = (n + 7) / 8;
  const long long nbytes = (n * 2 + 7) / 8;
#if defined(HVD_HOST_BUILD)
  if (hvd::host_bulk_groups(groups, [&](auto L, long long g0, long long g1) HVD_INLINE {
        hvd::bulk_decode<2, decltype(L)::value, false>(
            packed, n, bs, 0u, 0u, 0u, 0u, g0, g1,
            [&](long long s, int len, long long b, const hvd::u32* __restrict__ cs,
                const hvd::u32*) HVD_INLINE {
              float* __restrict__ os = out + s;
              const float sc = scales[b];
              for (int i = 0; i < len; ++i) os[i] = hvd::terngrad_add_one(os[i], cs[i], sc);
            });
      }))
    return;
#endif
  for (long long g = hvd::global_thread(); g < groups; g += hvd::grid_threads()) {
    const hvd::u32 word = (hvd::u32)hvd::load_group<2>(packed, g, nbytes);
    hvd::terngrad_decode_group(word, n, scales, bs, out, g);
  }
}

// ---- kernels: EF-SignSGD ------------------------------------------------------------------

// partial[q] = sum of |p| over segment q, p = g + e (has_e != 0) or g, float64;
// minnz[q] = the smallest non-zero |p| there (+inf if none).
// e may be any pointer when has_e == 0 (it is not read).
extern "C" __global__ void hvd_signef_segments(const float* __restrict__ g, const float* e,
                                               int has_e, long long n, long long bs,
                                               long long seg, long long spb,
                                               double* __restrict__ partial,
                                               float* __restrict__ minnz) {
  if (!hvd::check_reduce_block()) return;
  const long long nb = (n + bs - 1) / bs;
  const long long nseg = nb * spb;
  for (long long q = blockIdx.x; q < nseg; q += gridDim.x) {
    const hvd::Segment s = hvd::segment_of(q, n, bs, seg, spb);
    const long long stride = blockDim.x;
    const hvd::L1Stats v = hvd::block_reduce<hvd::L1Stats>(hvd::L1StatsOp(), [&](unsigned t) {
      return hvd::signef_l1_partial(g, e, has_e, s.start, s.len, t, stride);
    });
    if (threadIdx.x == 0) {
      partial[q] = v.sum;
      minnz[q] = v.minnz;
    }
  }
}

// Bucket b < nb: M = the sum of its spb partials in index order, len = min(bs, n - b*bs),
// scales[b] = float32(M / len) (signef.py SignEF.scales: float64 L1 sum, float64 division,
// one rounding to float32), and uncertain[b] = 1 unless that float32 is the same for EVERY
// float64 summation order of the bucket's terms (the reference's torch.sum included):
//   a sum of non-negative float64 terms computed by any tree of additions of height h has
//   relative error at most gamma_h = h u / (1 - h u), u = 2^-53 (Higham, Accuracy and
//   Stability of Numerical Algorithms, 2nd ed., Sec. 4.2; no underflow: the terms are
//   float32 magnitudes, multiples of 2^-149, and no overflow in float64).  The reference
//   sums bs terms (its padding zeros included): height < bs.  This M's tree (4 interleaved
//   chains of at most ceil(min(bs, seg) / seg_block) terms, joined in 2 levels, the block
//   tree of log2(seg_block) <= 8 levels, then spb partials in sequence) has height
//   D <= ceil(min(bs, seg) / seg_block) + spb + 12.  So the reference's sum R lies in
//   [M (1 - d), M (1 + d)] with d = 1.01 (gamma_bs + gamma_D) + 2^-51 (the margin covers
//   (1 + gamma) / (1 - gamma) and the roundings of the two products below).  Division by
//   len and the float64 -> float32 conversion are monotone: if both ends of the interval
//   give the same float32, R gives it too.
// Also certain: a sum that is EXACT in every order (then R = M; this settles the float32
// ties that small buckets of few-bit values hit): every term is a multiple of
// q = ulp32(min |p| != 0), so if the exact sum S <= M (1 + d) is below 2^53 q, every
// partial sum of every order is a multiple of q below 2^53 q, hence a float64 value.
// A non-finite M (a NaN or Inf in p) gives a non-finite scale; the caller checks.
// seg_block: blockDim.x of the hvd_signef_segments launch that produced `partial`.
extern "C" __global__ void hvd_signef_scales(const double* __restrict__ partial, long long nb,
                                             long long spb, long long n, long long bs,
                                             long long seg, int seg_block,
                                             const float* __restrict__ minnz,
                                             float* __restrict__ scales,
                                             int* __restrict__ uncertain) {
  const double u = 1.1102230246251565e-16;  // 2^-53
  const long long chain = (hvd::min64(bs, seg) + seg_block - 1) / seg_block;
  const double kr = (double)bs * u;              // exact: scaling by a power of two
  const double kd = (double)(chain + spb + 12) * u;
  const bool small = kr < 0.001 && kd < 0.001;
  const double d = small ? 1.01 * (kr / (1.0 - kr) + kd / (1.0 - kd)) + 4.0 * u : 1.0;
  for (long long b = hvd::global_thread(); b < nb; b += hvd::grid_threads()) {
    double m = 0.0;
    float mn = hvd::inf32();
    for (long long j = 0; j < spb; ++j) {
      m = m + partial[b * spb + j];
      mn = minnz[b * spb + j] < mn ? minnz[b * spb + j] : mn;
    }
    const long long len = hvd::min64(bs, n - b * bs);
    const double cnt = (double)len;
    scales[b] = (float)(m / cnt);
    const float lo = (float)((m * (1.0 - d)) / cnt);
    const float hi = (float)((m * (1.0 + d)) / cnt);
    const bool exact = small && mn < hvd::inf32() &&
                       m * (1.0 + d) < 9007199254740992.0 * hvd::ulp32(mn);   // 2^53 q
    uncertain[b] = (small && (lo == hi || exact)) ? 0 : 1;
  }
}

// bits[0 .. ceil(n/8)) = pack_bits(p < 0, 1) and e_out[i] = p - (p < 0 ? -s : s) for
// p = g + e (has_e) or g, s the scale of i's bucket (signef.py _encode).  e_out may be e
// itself (each coordinate is read before it is written, by the same thread).
// One thread per group of 8 coordinates (1 byte), grid-stride, any geometry.
extern "C" __global__ void hvd_signef_pack(const float* __restrict__ g, const float* e,
                                           int has_e, long long n,
                                           const float* __restrict__ scales, long long bs,
                                           unsigned char* __restrict__ bits, float* e_out) {
  const long long groups = (n + 7) / 8;
#if defined(HVD_HOST_BUILD)
  // host bulk path: signef_one over runs of one bucket (e_out may be e: each coordinate is
  // read, then written, in the same iteration)
  if (hvd::host_bulk_groups(groups, [&](auto L, long long g0, long long g1) HVD_INLINE {
        hvd::bulk_encode<1, decltype(L)::value, false>(
            n, bs, 0u, 0u, 0u, 0u, bits, g0, g1,
            [&](long long s, int len, long long b, const hvd::u32*, hvd::u32* __restrict__ cs)
                HVD_INLINE {
                  const float sc = scales[b];
                  for (int i = 0; i < len; ++i)
                    cs[i] = hvd::signef_one(g, e, has_e, e_out, sc, s + i);
                });
      }))
    return;
#endif
  for (long long grp = hvd::global_thread(); grp < groups; grp += hvd::grid_threads()) {
    bits[grp] = (unsigned char)hvd::signef_group(g, e, has_e, n, scales, bs, e_out, grp);
  }
}

// out[i] += bit_i ? -s : s (signef.py _decode), bits packed LSB-first.
extern "C" __global__ void hvd_signef_decode_add(const unsigned char* __restrict__ bits,
                                                 long long n, const float* __restrict__ scales,
                                                 long long bs, float* __restrict__ out) {
  const long long groups = (n + 7) / 8;
  // (no host bulk path: one byte per group already, and a bulk version measured no faster,
  // bench/results/host_kernels_cpu.md)
  for (long long grp = hvd::global_thread(); grp < groups; grp += hvd::grid_threads()) {
    hvd::signef_decode_group((hvd::u32)bits[grp], n, scales, bs, out, grp);
  }
}
