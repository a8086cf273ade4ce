// dgc.cu: the sparsifiers (DGC, top-k, random-k): element-wise state update, threshold
// sampling, deterministic selection, masking, and the decoder's scatter-add.
//
// Specification: the references of hvdcomp/ops/sparsify.py (update, select, mask,
// scatter_add, sample_positions, topk_indices) with hvdcomp/philox.py (Philox words).
// Every float operation below is the reference's, in the reference's order, in float32
// (the clipping norm: float64, in the fixed order defined here).  Orchestration (which
// kernel when, the choice of the threshold, the exact top-k among candidates): the kernel
// implementations of those ops, in the same module.
//
// Per coordinate i of a tensor of n (the reference sparsify.update, flags below):
//   g  = grad[i]                       (float32)
//   g  = g * scale                     if CLIP   (scale = float32(T / ||g||))
//   u  = u_old[i] * m + g   (HAS_U)    if MOM    (two roundings: no FMA)
//      = g              (no u_old)
//   a  = u if MOM else g
//   v  = v_old[i] + a   if HAS_V, else a
// top-k and random-k are the same map with MOM and CLIP off: p = g + e (e = "v_old").
//
// Kernels (geometry and argument checks: hvdcomp/ops/sparsify.py):
//   hvd_dgc_sumsq        float64 sum of squares of 65536-element chunks, one chunk per block
//                        (grid-stride), blockDim = 256 exactly (fixes the summation order)
//   hvd_dgc_sum_f64      the sum of those partials: one block of 256 threads
//   hvd_dgc_sample       |v| at the reference's Philox sample positions (one thread per
//                        16 draws: 8 Philox blocks)
//   hvd_dgc_accumulate   the map above over chunks of `chunk` coordinates (one thread per
//                        chunk, grid-stride): writes u and/or v, and per chunk the counts of
//                        |v| passing two thresholds and of non-finite v
//   hvd_dgc_select       the passing coordinates of each chunk, written at the chunk's offset
//                        from an inclusive prefix sum of the counts: indices and values in
//                        ascending index order, optionally masking v and u there
//   hvd_dgc_mask         v[idx[j]] -= dec[j] and/or u[idx[j]] = 0 (one thread per index)
//   hvd_dgc_scatter_add  out[idx[j]] += vals[j] * scale (indices unique: no race)
//
// "Passes threshold t" means |v| >= t and |v| > 0 (for t <= 0: every nonzero), which is the
// reference's candidate set `mag >= t if t > 0 else mag > 0`.
//
// Determinism: no atomics; each thread writes only its own chunk's counts and output slots
// (selection), or distinct coordinates (mask, scatter-add: the indices of one call are
// distinct); the float64 norm is summed in an order fixed by n alone.
#include "hvdcomp.cuh"

namespace hvd {
namespace dgc {

enum : int {
  CLIP = 1,      // g = g * scale
  MOM = 2,       // momentum correction: u = u_old * m + g (or g), written to uout
  HAS_U = 4,     // u_old given (with MOM)
  HAS_V = 8,     // v = v_old + a (accumulation / error feedback)
  WRITE_V = 16,  // write v to vout
};

#define HVD_DGC_NORM_CHUNK 65536LL   // coordinates per partial sum of hvd_dgc_sumsq
#define HVD_DGC_NORM_BLOCK 256u      // threads per block of the norm kernels (fixed)

// The reference's map for coordinate i (see the top of this file); u receives the new
// momentum when MOM is set.
template <int F>
__device__ __forceinline__ float value_at(const float* __restrict__ g,
                                          const float* __restrict__ uo,
                                          const float* __restrict__ vo, i64 i, float scale,
                                          float m, float& u) {
  float gi = g[i];
  if (F & CLIP) gi = gi * scale;
  float a = gi;
  if (F & MOM) {
    if (F & HAS_U) {
      const float um = uo[i] * m;   // torch: u_old * m, then + g (two roundings)
      u = um + gi;
    } else {
      u = gi;
    }
    a = u;
  }
  if (F & HAS_V) return vo[i] + a;
  return a;
}

// The candidate predicate: |v| >= t and |v| > 0 (NaN passes neither).  Written without
// control flow (0/1 arithmetic) so that the host compiler vectorizes the loops.
__device__ __forceinline__ u32 passes(float mag, float t) {
  return (u32)(mag >= t) & (u32)(mag > 0.0f);
}

// Not finite: NaN or +-Inf (|v| <= FLT_MAX fails for both).
__device__ __forceinline__ u32 nonfinite(float mag) {
  return 1u - (u32)(mag <= 3.40282346638528859812e+38f);
}

#define HVD_DGC_MAX_CHUNK (1LL << 30)   // per-chunk counts are 32-bit in the loops

template <int F>
__device__ inline void accumulate_loop(const float* __restrict__ g,
                                       const float* __restrict__ uo,
                                       const float* __restrict__ vo, i64 n, float scale,
                                       float m, float t1, float t2, i64 chunk,
                                       float* __restrict__ uout, float* __restrict__ vout,
                                       i64* __restrict__ counts) {
  const i64 nchunks = (n + chunk - 1) / chunk;
  for (i64 j = global_thread(); j < nchunks; j += grid_threads()) {
    const i64 lo = j * chunk;
    const i64 hi = min64(n, lo + chunk);
    u32 c1 = 0, c2 = 0, bad = 0;
    for (i64 i = lo; i < hi; ++i) {
      float u = 0.0f;
      const float v = value_at<F>(g, uo, vo, i, scale, m, u);
      if (F & MOM) uout[i] = u;
      if (F & WRITE_V) vout[i] = v;
      const float mag = fabsf(v);
      c1 += passes(mag, t1);
      c2 += passes(mag, t2);
      bad += nonfinite(mag);
    }
    counts[j] = (i64)c1;
    counts[nchunks + j] = (i64)c2;
    counts[2 * nchunks + j] = (i64)bad;
  }
}

#define HVD_DGC_SAMPLE_GROUP 16   // draws per thread of hvd_dgc_sample (even)

template <int F>
__device__ inline void sample_loop(const float* __restrict__ g, const float* __restrict__ uo,
                                   const float* __restrict__ vo, i64 n, float scale, float m,
                                   i64 s, u32 seed, u32 rank, u32 tensor_id, u32 step,
                                   float* __restrict__ out) {
  // Draw j uses Philox words 2j and 2j+1, i.e. words 2(j%2), 2(j%2)+1 of block j/2.  One
  // thread per group of HVD_DGC_SAMPLE_GROUP draws: all positions first, then the (independent,
  // random) loads, so that their cache misses overlap.
  const i64 ngroups = (s + HVD_DGC_SAMPLE_GROUP - 1) / HVD_DGC_SAMPLE_GROUP;
  for (i64 q = global_thread(); q < ngroups; q += grid_threads()) {
    const i64 j0 = q * HVD_DGC_SAMPLE_GROUP;
    i64 pos[HVD_DGC_SAMPLE_GROUP];
    for (int h = 0; h < HVD_DGC_SAMPLE_GROUP / 2; ++h) {
      const Philox4 r = philox_block(j0 / 2 + h, seed, rank, tensor_id, step);
      pos[2 * h] = (i64)(((((u64)r.w[0] >> 1) << 32) | (u64)r.w[1]) % (u64)n);
      pos[2 * h + 1] = (i64)(((((u64)r.w[2] >> 1) << 32) | (u64)r.w[3]) % (u64)n);
    }
    const int cnt = (int)min64(HVD_DGC_SAMPLE_GROUP, s - j0);
    for (int h = 0; h < cnt; ++h) {
      float u = 0.0f;
      out[j0 + h] = fabsf(value_at<F>(g, uo, vo, pos[h], scale, m, u));
    }
  }
}

// Thread t of a block of `nt` threads: sum of x[i]^2 in float64 over its contiguous segment
// [t * seg, (t + 1) * seg) ∩ [0, len), seg = len / nt rounded up to a multiple of 4, in four
// interleaved partial sums (i mod 4) joined as (a0 + a1) + (a2 + a3).  (Contiguous so that
// the host build, which runs a block's threads one after another, streams and vectorizes.)
__device__ inline double sumsq_part(const float* __restrict__ x, i64 len, i64 t, i64 nt) {
  const i64 seg = ((len + nt - 1) / nt + 3) / 4 * 4;
  const i64 lo = min64(len, t * seg);
  const i64 hi = min64(len, lo + seg);
  double a0 = 0.0, a1 = 0.0, a2 = 0.0, a3 = 0.0;
  i64 i = lo;
  for (; i + 4 <= hi; i += 4) {
    const double v0 = (double)x[i];
    const double v1 = (double)x[i + 1];
    const double v2 = (double)x[i + 2];
    const double v3 = (double)x[i + 3];
    a0 = a0 + v0 * v0;
    a1 = a1 + v1 * v1;
    a2 = a2 + v2 * v2;
    a3 = a3 + v3 * v3;
  }
  for (; i < hi; ++i) {
    const double v = (double)x[i];
    a0 = a0 + v * v;
  }
  return (a0 + a1) + (a2 + a3);
}

__device__ inline double sum_part(const double* __restrict__ p, i64 count, i64 t, i64 stride) {
  double a = 0.0;
  for (i64 i = t; i < count; i += stride) a = a + p[i];
  return a;
}

// The bits of |f| as a non-negative int (the sign bit cleared).
__device__ __forceinline__ int abs_bits(float f) {
#if defined(HVD_HOST_BUILD)
  int b;
  __builtin_memcpy(&b, &f, sizeof b);
  return b & 0x7fffffff;
#else
  return __float_as_int(f) & 0x7fffffff;
#endif
}

// The passing coordinates of [lo, hi), written from output position o on; returns the next.
__device__ __forceinline__ i64 select_run(float* __restrict__ x, i64 lo, i64 hi, float t, i64 o,
                                          i64* __restrict__ idx, float* __restrict__ vals,
                                          int mask, float* __restrict__ u) {
  for (i64 i = lo; i < hi; ++i) {
    const float xi = x[i];
    if (passes(fabsf(xi), t)) {
      idx[o] = i;
      vals[o] = xi;
      if (mask & 1) x[i] = 0.0f;
      if (mask & 2) u[i] = 0.0f;
      ++o;
    }
  }
  return o;
}

__device__ inline bool check_norm_block() {
  if (blockDim.x != HVD_DGC_NORM_BLOCK || blockDim.y != 1 || blockDim.z != 1) {
    bad_launch("hvd_dgc_sumsq / hvd_dgc_sum_f64: blockDim must be (256, 1, 1)");
    return false;
  }
  return true;
}

}  // namespace dgc
}  // namespace hvd

// The flag combinations, as compile-time constants (the loops then carry no tests).
#define HVD_DGC_FLAG_CASES(X)                                                        \
  X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13) X(14)   \
  X(15) X(16) X(17) X(18) X(19) X(20) X(21) X(22) X(23) X(24) X(25) X(26) X(27)     \
  X(28) X(29) X(30) X(31)

// ---- kernels ------------------------------------------------------------------------------

// partials[b] = sum of x[i]^2 (float64) over chunk b = [b * 65536, (b + 1) * 65536) ∩ [0, n),
// in the order of dgc::sumsq_part (256 contiguous segments) + block_reduce over 256 threads.
extern "C" __global__ void hvd_dgc_sumsq(const float* __restrict__ x, long long n,
                                         double* __restrict__ partials) {
  if (!hvd::dgc::check_norm_block()) return;
  const long long nb = (n + HVD_DGC_NORM_CHUNK - 1) / HVD_DGC_NORM_CHUNK;
  for (long long b = blockIdx.x; b < nb; b += gridDim.x) {
    const long long base = b * HVD_DGC_NORM_CHUNK;
    const long long len = hvd::min64(HVD_DGC_NORM_CHUNK, n - base);
    const float* xb = x + base;
    const long long nt = blockDim.x;
    const double ss = hvd::block_reduce<double>(
        hvd::SumOp(), [&](unsigned t) { return hvd::dgc::sumsq_part(xb, len, t, nt); });
    if (threadIdx.x == 0) partials[b] = ss;
  }
}

// out[0] = the sum of p[0 .. count): thread t sums p[t], p[t + 256], ... in order, then the
// block's fixed tree.  One block of 256 threads.
extern "C" __global__ void hvd_dgc_sum_f64(const double* __restrict__ p, long long count,
                                           double* __restrict__ out) {
  if (!hvd::dgc::check_norm_block()) return;
  if (blockIdx.x != 0) return;
  const long long stride = blockDim.x;
  const double s = hvd::block_reduce<double>(
      hvd::SumOp(), [&](unsigned t) { return hvd::dgc::sum_part(p, count, t, stride); });
  if (threadIdx.x == 0) out[0] = s;
}

// out[j] = |v(pos_j)| for j < s, pos_j = u63_j mod n with u63_j = ((w_2j >> 1) << 32) | w_2j+1
// (hvdcomp.ops.sparsify.sample_positions), v as at the top of this file.  n >= 1.
extern "C" __global__ void hvd_dgc_sample(const float* __restrict__ g,
                                          const float* __restrict__ u_old,
                                          const float* __restrict__ v_old, long long n,
                                          float scale, float m, int flags, long long s,
                                          unsigned int seed, unsigned int rank,
                                          unsigned int tensor_id, unsigned int step,
                                          float* __restrict__ out) {
#define HVD_CASE(F)                                                                    \
  case F:                                                                              \
    hvd::dgc::sample_loop<F>(g, u_old, v_old, n, scale, m, s, seed, rank, tensor_id,   \
                             step, out);                                               \
    break;
  switch (flags) {
    HVD_DGC_FLAG_CASES(HVD_CASE)
    default:
      hvd::bad_launch("hvd_dgc_sample: flags must be in 0..31");
  }
#undef HVD_CASE
}

// The map at the top of this file for every coordinate: u_out (MOM) and v_out (WRITE_V)
// written; counts (int64, 3 rows of nchunks = ceil(n / chunk)): row 0 / row 1 the number of
// coordinates of chunk j whose |v| passes t1 / t2, row 2 the number of non-finite v.
extern "C" __global__ void hvd_dgc_accumulate(const float* __restrict__ g,
                                              const float* __restrict__ u_old,
                                              const float* __restrict__ v_old, long long n,
                                              float scale, float m, int flags, float t1,
                                              float t2, long long chunk,
                                              float* __restrict__ u_out,
                                              float* __restrict__ v_out,
                                              long long* __restrict__ counts) {
#define HVD_CASE(F)                                                                      \
  case F:                                                                                \
    hvd::dgc::accumulate_loop<F>(g, u_old, v_old, n, scale, m, t1, t2, chunk, u_out,     \
                                 v_out, counts);                                         \
    break;
  if (chunk < 1 || chunk > HVD_DGC_MAX_CHUNK) {
    hvd::bad_launch("hvd_dgc_accumulate: chunk must be in 1..2^30");
    return;
  }
  switch (flags) {
    HVD_DGC_FLAG_CASES(HVD_CASE)
    default:
      hvd::bad_launch("hvd_dgc_accumulate: flags must be in 0..31");
  }
#undef HVD_CASE
}

// For every chunk j (as hvd_dgc_accumulate's), the coordinates i whose |x[i]| passes t, in
// ascending order, at out positions ends[j-1] (0 for j = 0) onwards: idx[o] = i,
// vals[o] = x[i].  ends: the inclusive prefix sum of that threshold's counts row.
// mask & 1: x[i] = 0 (after reading it); mask & 2: u[i] = 0.
extern "C" __global__ void hvd_dgc_select(float* __restrict__ x, long long n, float t,
                                          long long chunk, const long long* __restrict__ ends,
                                          long long* __restrict__ idx,
                                          float* __restrict__ vals, int mask,
                                          float* __restrict__ u) {
  if (chunk < 1 || chunk > HVD_DGC_MAX_CHUNK) {
    hvd::bad_launch("hvd_dgc_select: chunk must be in 1..2^30");
    return;
  }
  const long long nchunks = (n + chunk - 1) / chunk;
  for (long long j = hvd::global_thread(); j < nchunks; j += hvd::grid_threads()) {
    const long long lo = j * chunk;
    const long long hi = hvd::min64(n, lo + chunk);
    long long o = j ? ends[j - 1] : 0;
    long long i = lo;
    // Runs of 32 are screened first, branch-free (vectorized on the host), on the bits of
    // |x|: for non-negative floats the integer order is the float order, so a run with no
    // |x| >= t, |x| > 0 by the integers has none by the floats (NaN, larger as an integer,
    // only lets a run through to the exact test below).  Few runs hold a candidate.
    const int tb = hvd::dgc::abs_bits(t);
    for (; i + 32 <= hi; i += 32) {
      int any = 0;
      for (int q = 0; q < 32; ++q) {
        const int b = hvd::dgc::abs_bits(x[i + q]);
        any |= (b >= tb) & (b != 0);
      }
      if (any) o = hvd::dgc::select_run(x, i, i + 32, t, o, idx, vals, mask, u);
    }
    hvd::dgc::select_run(x, i, hi, t, o, idx, vals, mask, u);
  }
}

// For j < m, i = idx[j] (distinct, in [0, n)): flags & 1: v[i] = v[i] - dec[j];
// flags & 2: u[i] = 0.
extern "C" __global__ void hvd_dgc_mask(const long long* __restrict__ idx, long long m,
                                        long long n, const float* __restrict__ dec,
                                        float* __restrict__ v, float* __restrict__ u,
                                        int flags) {
  for (long long j = hvd::global_thread(); j < m; j += hvd::grid_threads()) {
    const long long i = idx[j];
    if (i < 0 || i >= n) {
      hvd::bad_launch("hvd_dgc_mask: index out of range");
      return;
    }
    if (flags & 1) v[i] = v[i] - dec[j];
    if (flags & 2) u[i] = 0.0f;
  }
}

// out[i] = out[i] + vals[j] * scale for i = idx[j], j < m; the indices distinct and in
// [0, n) (one message's: decode_indices guarantees both).
extern "C" __global__ void hvd_dgc_scatter_add(const long long* __restrict__ idx,
                                               long long m, const float* __restrict__ vals,
                                               float scale, long long n,
                                               float* __restrict__ out) {
  for (long long j = hvd::global_thread(); j < m; j += hvd::grid_threads()) {
    const long long i = idx[j];
    if (i < 0 || i >= n) {
      hvd::bad_launch("hvd_dgc_scatter_add: index out of range");
      return;
    }
    out[i] = out[i] + vals[j] * scale;
  }
}
