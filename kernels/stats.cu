// stats.cu: the per-rank statistics of ALQ / AMQ (hvdcomp/ops/level_stats.py), from one
// gradient.
//
// The specification is hvdcomp/ops/level_stats.py: histogram_stats (model "hist", the
// default) and bucket_stats (model "normal", the paper's).  Every per-element float
// operation below is the reference's, in float64, in the reference's order; only the SUMS
// are in the kernels' own fixed order (the reference sums with torch.bincount / torch.sum,
// whose order is PyTorch's and, on a GPU, not even deterministic), so the statistics agree
// with the reference to a few float64 ulps per sum and are bit-identical between the host
// build and the GPU, for any thread count (tests/kernels/test_stats.py says what is
// asserted).
//
// Kernels (geometry and checks: hvdcomp/ops/level_stats.py):
//   hvd_stats_norms          one block per bucket (grid-stride), blockDim = reduce_block(bucket)
//                            nrm[b] = ||bucket b||_2 or ||.||_inf, float64
//   hvd_stats_hist_partial   one thread per chunk of `chunk` elements (grid-stride), any
//                            geometry; partials[c][3 * 256]: the chunk's binned sums
//   hvd_stats_normal_buckets one block per bucket (grid-stride), blockDim = reduce_block(bucket)
//                            partials[b][3]: the bucket's three weighted sums
//   hvd_stats_reduce         one thread per (row group, 8 columns) (grid-stride), any geometry:
//                            out[g][c] = sum of in[r][c] over the rows r of group g
//   hvd_stats_hist_bins      one thread per value, any geometry: the bin of r (tests)
//
// Summation order (the definition of the kernels' result; none depends on the device, the
// grid or the thread count):
//   * L2 norm of a bucket: float64 squares, thread t of the block sums i = t, t + T, ...
//     (T = blockDim.x, fixed by bucket_size) in four interleaved partials joined as
//     (a0 + a1) + (a2 + a3), then the block_reduce tree;  nrm = sqrt of that.
//   * binned sums: within a chunk of `chunk` consecutive elements, element order; then the
//     chunks' sums in row groups of `group` rows in row order, repeatedly
//     (ops/level_stats.py), until one row is left.
//   * normal model: per bucket, sum v_i and sum v_i^2 in the L2 norm's order; then the
//     buckets' three products in row groups as above.
#include "hvdcomp.cuh"

namespace hvd {
namespace st {

constexpr int HIST_BINS = 256;
constexpr int HIST_COLS = 3 * HIST_BINS;

__device__ __forceinline__ u64 double_bits(double v) {
#if defined(HVD_HOST_BUILD)
  u64 b;
  __builtin_memcpy(&b, &v, sizeof b);
  return b;
#else
  return (u64)__double_as_longlong(v);
#endif
}

// The same order as sumsq_partial, for the signed normalized coordinates v = x / safe:
// .x = sum v, .y = sum v * v.
struct Sum2 {
  double a, b;
};
struct Sum2Op {
  __device__ __forceinline__ Sum2 operator()(Sum2 p, Sum2 q) const {
    Sum2 r;
    r.a = p.a + q.a;
    r.b = p.b + q.b;
    return r;
  }
};

__device__ inline Sum2 vsums64(const float* __restrict__ xb, i64 len, double safe, i64 t,
                               i64 stride) {
  double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0;
  double q0 = 0.0, q1 = 0.0, q2 = 0.0, q3 = 0.0;
  i64 i = t;
  for (; i + 3 * stride < len; i += 4 * stride) {
    const double v0 = (double)xb[i] / safe;
    const double v1 = (double)xb[i + stride] / safe;
    const double v2 = (double)xb[i + 2 * stride] / safe;
    const double v3 = (double)xb[i + 3 * stride] / safe;
    s0 = s0 + v0;
    s1 = s1 + v1;
    s2 = s2 + v2;
    s3 = s3 + v3;
    q0 = q0 + v0 * v0;
    q1 = q1 + v1 * v1;
    q2 = q2 + v2 * v2;
    q3 = q3 + v3 * v3;
  }
  for (; i < len; i += stride) {
    const double v = (double)xb[i] / safe;
    s0 = s0 + v;
    q0 = q0 + v * v;
  }
  Sum2 r;
  r.a = (s0 + s1) + (s2 + s3);
  r.b = (q0 + q1) + (q2 + q3);
  return r;
}

// The float64 norm of one bucket, every thread of the block gets it (block_reduce).
//   l2: sqrt(sum x^2)  (ops/level_stats.py: b.norm(dim=1) in float64);
//   linf: max |x| (b.abs().amax).
__device__ inline double bucket_norm64(const float* __restrict__ xb, i64 len, int linf) {
  const i64 stride = blockDim.x;
  if (linf) {
    const float m = block_reduce<float>(MaxNanOp(),
                                        [&](unsigned t) { return absmax_partial(xb, len, t, stride); });
    return (double)m;
  }
  const double ss = block_reduce<double>(
      SumOp(), [&](unsigned t) { return sumsq_partial(xb, len, t, stride); });
  return sqrt(ss);
}

// torch.searchsorted(edges, r, right=True) - 1 clamped to [0, 255], for the 257 increasing
// edges of levels.HIST_EDGES (edges[0] = 0, edges[1] = 1e-8, ..., edges[256] = 1) and r in
// [0, 1] or NaN (NaN: searchsorted gives 257, so bin 255).  The guess from the binary exponent
// and the linear mantissa (a lower bound of log2 r, within 0.09 of it: within one bin) is only
// a starting point: the two loops make the answer exact against the edges themselves.
__device__ __forceinline__ int hist_bin(double r, const double* __restrict__ edges) {
  if (!(r >= edges[1])) return r != r ? HIST_BINS - 1 : 0;
  if (r >= edges[HIST_BINS]) return HIST_BINS - 1;
  const u64 b = double_bits(r);
  const double e = (double)((int)((b >> 52) & 0x7ffu) - 1023);
  const double m = (double)(b & 0xfffffffffffffULL) * 2.220446049250313e-16;  // 2^-52
  // bin j holds log10 r in [-8 + 8 (j-1)/255, ...): j = 256 + log2(r) * 255 / (8 log2 10)
  int g = (int)(256.0 + (e + m) * 9.5953311117894);
  g = g < 1 ? 1 : (g > HIST_BINS - 1 ? HIST_BINS - 1 : g);
  while (edges[g] > r) --g;           // stops at 1: edges[1] <= r
  while (edges[g + 1] <= r) ++g;      // stops at 255: r < edges[256]
  return g;
}

// One chunk's binned sums h[3k + p] = sum w r^p over its elements in bin k, element order.
__device__ inline void hist_chunk(const float* __restrict__ x, i64 n,
                                  const double* __restrict__ nrm, i64 bucket_size,
                                  const double* __restrict__ edges, i64 chunk, i64 c,
                                  double* __restrict__ out) {
  double h[HIST_COLS];
  for (int k = 0; k < HIST_COLS; ++k) h[k] = 0.0;
  const i64 i0 = c * chunk;
  const i64 i1 = min64(i0 + chunk, n);
  i64 b = i0 / bucket_size;
  i64 bucket_end = (b + 1) * bucket_size;
  double w = nrm[b] * nrm[b];
  double safe = nrm[b] > 0.0 ? nrm[b] : 1.0;
  for (i64 i = i0; i < i1; ++i) {
    if (i >= bucket_end) {
      b = i / bucket_size;
      bucket_end = (b + 1) * bucket_size;
      w = nrm[b] * nrm[b];                    // w = nrm * nrm
      safe = nrm[b] > 0.0 ? nrm[b] : 1.0;     // where(nrm > 0, nrm, 1)
    }
    double r = fabs((double)x[i]) / safe;
    r = r < 0.0 ? 0.0 : r;                    // clamp(0, 1); NaN stays NaN
    r = r > 1.0 ? 1.0 : r;
    const int k = hist_bin(r, edges);
    h[3 * k] = h[3 * k] + w;                  // w * r**0
    h[3 * k + 1] = h[3 * k + 1] + w * r;      // w * r**1
    h[3 * k + 2] = h[3 * k + 2] + w * (r * r);  // w * r**2
  }
  double* o = out + c * HIST_COLS;
  for (int k = 0; k < HIST_COLS; ++k) o[k] = h[k];
}

}  // namespace st
}  // namespace hvd

// ---- kernels ------------------------------------------------------------------------------

// nrm[b] = float64 norm of bucket b of x (n floats, buckets of bucket_size, the last partial):
// linf = 0: sqrt(sum x^2) in the order described at the top; linf = 1: max |x| (NaN
// propagates).  blockDim.x = reduce_block(bucket_size) (ops/level_stats.py).
extern "C" __global__ void hvd_stats_norms(const float* __restrict__ x, long long n,
                                           long long bucket_size, int linf,
                                           double* __restrict__ nrm) {
  if (!hvd::check_reduce_block()) return;
  const long long nb = (n + bucket_size - 1) / bucket_size;
  for (long long b = blockIdx.x; b < nb; b += gridDim.x) {
    const long long base = b * bucket_size;
    const long long len = hvd::min64(bucket_size, n - base);
    const double v = hvd::st::bucket_norm64(x + base, len, linf);
    if (threadIdx.x == 0) nrm[b] = v;
  }
}

// partials[c * 768 + 3k + p] = sum over the elements i of chunk c (i in [c*chunk, (c+1)*chunk)
// and i < n) whose normalized magnitude r_i = clamp(|x_i| / safe_b, 0, 1) falls in bin k of
// `edges` (257 float64 values, levels.HIST_EDGES), of w_b * r_i^p, p = 0, 1, 2, with
// w_b = nrm_b^2 and safe_b = nrm_b if nrm_b > 0 else 1 for the bucket b of i.  Element order.
extern "C" __global__ void hvd_stats_hist_partial(const float* __restrict__ x, long long n,
                                                  const double* __restrict__ nrm,
                                                  long long bucket_size,
                                                  const double* __restrict__ edges,
                                                  long long chunk,
                                                  double* __restrict__ partials) {
  if (chunk < 1 || bucket_size < 1) {
    hvd::bad_launch("hvd_stats_hist_partial: chunk and bucket_size must be >= 1");
    return;
  }
  const long long nc = (n + chunk - 1) / chunk;
  for (long long c = hvd::global_thread(); c < nc; c += hvd::grid_threads()) {
    hvd::st::hist_chunk(x, n, nrm, bucket_size, edges, chunk, c, partials);
  }
}

// partials[3b + 0..2] = w * count, w * sum v, w * sum v^2 for bucket b (levels.bucket_stats):
// nrm the bucket's float64 norm (as hvd_stats_norms), w = nrm * nrm, v = x / safe with
// safe = nrm if nrm > 0 else 1, count = the bucket's length (the reference's zero padding adds
// nothing to either sum).  blockDim.x = reduce_block(bucket_size).
extern "C" __global__ void hvd_stats_normal_buckets(const float* __restrict__ x, long long n,
                                                    long long bucket_size, int linf,
                                                    double* __restrict__ partials) {
  if (!hvd::check_reduce_block()) return;
  const long long nb = (n + bucket_size - 1) / bucket_size;
  for (long long b = blockIdx.x; b < nb; b += gridDim.x) {
    const long long base = b * bucket_size;
    const long long len = hvd::min64(bucket_size, n - base);
    const float* xb = x + base;
    const double nrm = hvd::st::bucket_norm64(xb, len, linf);
    const double w = nrm * nrm;
    const double safe = nrm > 0.0 ? nrm : 1.0;
    const long long stride = blockDim.x;
    const hvd::st::Sum2 s = hvd::block_reduce<hvd::st::Sum2>(
        hvd::st::Sum2Op(),
        [&](unsigned t) { return hvd::st::vsums64(xb, len, safe, t, stride); });
    if (threadIdx.x == 0) {
      partials[3 * b] = w * (double)len;
      partials[3 * b + 1] = w * s.a;
      partials[3 * b + 2] = w * s.b;
    }
  }
}

// out[g * ncols + c] = sum of in[r * ncols + c] over r in [g*group, min((g+1)*group, nrows)),
// in row order, for g < ceil(nrows / group) and c < ncols.  One work item = one row group and
// 8 consecutive columns (a 64-byte line of the row), so each row is read once per item.
extern "C" __global__ void hvd_stats_reduce(const double* __restrict__ in, long long nrows,
                                            long long ncols, long long group,
                                            double* __restrict__ out) {
  if (group < 1) {
    hvd::bad_launch("hvd_stats_reduce: group must be >= 1");
    return;
  }
  const long long ng = (nrows + group - 1) / group;
  const long long cg = (ncols + 7) / 8;
  for (long long item = hvd::global_thread(); item < ng * cg; item += hvd::grid_threads()) {
    const long long g = item / cg;
    const long long c0 = (item % cg) * 8;
    const int w = (int)hvd::min64(8, ncols - c0);
    const long long r1 = hvd::min64((g + 1) * group, nrows);
    double acc[8];
    for (int k = 0; k < 8; ++k) acc[k] = 0.0;
    for (long long r = g * group; r < r1; ++r) {
      const double* row = in + r * ncols + c0;
      for (int k = 0; k < w; ++k) acc[k] = acc[k] + row[k];
    }
    for (int k = 0; k < w; ++k) out[g * ncols + c0 + k] = acc[k];
  }
}

// bins[i] = the histogram bin of r[i] (torch.searchsorted(edges, r, right=True) - 1, clamped
// to 0..255), for r[i] in [0, 1] or NaN: what hvd_stats_hist_partial uses.
extern "C" __global__ void hvd_stats_hist_bins(const double* __restrict__ r, long long n,
                                               const double* __restrict__ edges,
                                               int* __restrict__ bins) {
  for (long long i = hvd::global_thread(); i < n; i += hvd::grid_threads()) {
    bins[i] = hvd::st::hist_bin(r[i], edges);
  }
}
