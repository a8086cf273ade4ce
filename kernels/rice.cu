// rice.cu: the Golomb-Rice index section of the sparsifiers' messages (hvdcomp/ops/rice.py:
// the ops encode / decode, whose references are the specification; the layout is described
// in hvdcomp/codecs/sparse_vectors.py, whose encode_indices / decode_indices call them).
//
// Indices i_0 < ... < i_{m-1} are sent as gaps d_0 = i_0, d_j = i_j - i_{j-1} - 1, each as a
// unary quotient q_j = d_j >> k (q_j one-bits, then a zero-bit, one LSB-first stream) and a
// k-bit remainder (packed LSB-first).  Every output word is owned by one thread, which
// gathers the codes that overlap it (positions from a prefix sum computed between launches).
//
// Kernels (geometry, checks, the prefix sums between launches: hvdcomp/ops/rice.py):
//   hvd_sparse_gaps        one thread per group of `group` indices: the gaps, and bad[g] = 1
//                          where an index is not above its predecessor.
//   hvd_sparse_rice_sums   one thread per group: sum of d >> k over the group, for the three
//                          candidate parameters k0 - 1, k0, k0 + 1 (0 outside 0..62).
//   hvd_sparse_unary_len   one thread per group: q_j + 1 (the unary code's length).
//   hvd_sparse_unary       one thread per 64-bit word of the unary stream: ones up to the
//                          stream's end, minus the terminators ends[j] - 1 that fall in it
//                          (ends: inclusive prefix sum of the lengths, found by binary search).
//   hvd_sparse_remainders  one thread per 64-bit word of the remainder stream.
//   hvd_sparse_zero_count  decoder: one thread per 64-bit word of the unary stream: its zero
//                          bits (the terminators and the padding).
//   hvd_sparse_zero_pos    decoder: one thread per word: the positions of its zero bits, at
//                          their ranks (exclusive prefix sum of the counts) below m.
//   hvd_sparse_decode_gaps decoder: one thread per group: q_j from the terminator positions,
//                          r_j from the remainders; gaps + 1 (mod 2^64), bad[g] = 1 where a
//                          quotient exceeds qmax = (numel - 1) >> k.
// Streams are written and read byte by byte (they start at odd offsets of the section).
#include "hvdcomp.cuh"

namespace hvd_sparse {

using hvd::i64;
using hvd::u64;

__device__ __forceinline__ int popcount64(u64 v) {
#if defined(HVD_HOST_BUILD)
  return __builtin_popcountll(v);
#else
  return __popcll(v);
#endif
}

__device__ __forceinline__ int lowest_bit(u64 v) {   // v != 0
#if defined(HVD_HOST_BUILD)
  return __builtin_ctzll(v);
#else
  return __ffsll((long long)v) - 1;
#endif
}

// Bytes [8w, 8w + 8) of a stream of nbytes, as a little-endian word (missing bytes: 0).
__device__ inline u64 load_word(const unsigned char* __restrict__ p, i64 nbytes, i64 w) {
  u64 v = 0;
  const i64 o = w * 8;
  for (int b = 0; b < 8 && o + b < nbytes; ++b) v |= (u64)p[o + b] << (8 * b);
  return v;
}

__device__ inline void store_word(unsigned char* __restrict__ p, i64 nbytes, i64 w, u64 v) {
  const i64 o = w * 8;
  for (int b = 0; b < 8 && o + b < nbytes; ++b) p[o + b] = (unsigned char)(v >> (8 * b));
}

__device__ inline void gaps_group(const i64* __restrict__ idx, i64 m, i64 group, i64 g,
                                  i64* __restrict__ gaps, int* __restrict__ bad) {
  const i64 lo = g * group;
  const i64 hi = hvd::min64(m, lo + group);
  int b = 0;
  for (i64 j = lo; j < hi; ++j) {
    if (j == 0) {
      gaps[0] = idx[0];
    } else {
      const i64 a = idx[j - 1], c = idx[j];
      b |= (c <= a);
      gaps[j] = (i64)((u64)c - (u64)a - 1u);   // modulo 2^64: only used when increasing
    }
  }
  bad[g] = b;
}

__device__ inline void rice_sums_group(const i64* __restrict__ gaps, i64 m, i64 group, i64 g,
                                       int k0, i64* __restrict__ sums) {
  const i64 lo = g * group;
  const i64 hi = hvd::min64(m, lo + group);
  for (int c = 0; c < 3; ++c) {
    const int k = k0 - 1 + c;
    i64 s = 0;
    if (k >= 0 && k <= 62) {
      for (i64 j = lo; j < hi; ++j) s += gaps[j] >> k;
    }
    sums[3 * g + c] = s;
  }
}

__device__ inline void unary_word(const i64* __restrict__ ends, i64 m, i64 total,
                                  unsigned char* __restrict__ out, i64 nbytes, i64 w) {
  const i64 b0 = w * 64;
  u64 v;
  if (total - b0 >= 64) v = ~0ULL; else v = (1ULL << (total - b0)) - 1ULL;
  // the first j with ends[j] - 1 >= b0, i.e. ends[j] > b0
  i64 a = 0, b = m;
  while (a < b) {
    const i64 mid = (a + b) >> 1;
    if (ends[mid] > b0) b = mid; else a = mid + 1;
  }
  for (i64 j = a; j < m && ends[j] - 1 < b0 + 64; ++j) v &= ~(1ULL << (ends[j] - 1 - b0));
  store_word(out, nbytes, w, v);
}

__device__ inline void remainder_word(const i64* __restrict__ gaps, i64 m, int k,
                                      unsigned char* __restrict__ out, i64 nbytes, i64 w) {
  const i64 b0 = w * 64;
  const u64 mask = (1ULL << k) - 1ULL;
  u64 v = 0;
  for (i64 j = b0 / k; j < m && j * k < b0 + 64; ++j) {
    const u64 r = (u64)gaps[j] & mask;
    const i64 pos = j * k - b0;                     // > -k, < 64
    v |= pos >= 0 ? (r << pos) : (r >> (-pos));
  }
  store_word(out, nbytes, w, v);
}

__device__ inline void zero_positions(const unsigned char* __restrict__ u, i64 ubytes,
                                      const i64* __restrict__ rank0, i64 m,
                                      i64* __restrict__ z, i64 w) {
  i64 r = rank0[w];
  if (r >= m) return;
  const i64 valid = hvd::min64(64, ubytes * 8 - w * 64);
  u64 zeros = ~load_word(u, ubytes, w);
  if (valid < 64) zeros &= (1ULL << valid) - 1ULL;
  while (zeros != 0 && r < m) {
    z[r++] = w * 64 + lowest_bit(zeros);
    zeros &= zeros - 1ULL;
  }
}

__device__ inline void decode_gaps_group(const i64* __restrict__ z, i64 m,
                                         const unsigned char* __restrict__ rem, i64 rbytes,
                                         int k, i64 qmax, i64 group, i64 g,
                                         i64* __restrict__ gp1, int* __restrict__ bad) {
  const i64 lo = g * group;
  const i64 hi = hvd::min64(m, lo + group);
  const u64 mask = k ? ((1ULL << k) - 1ULL) : 0ULL;
  int b = 0;
  for (i64 j = lo; j < hi; ++j) {
    const i64 q = j == 0 ? z[0] : z[j] - z[j - 1] - 1;
    b |= (q > qmax);
    u64 r = 0;
    if (k) {
      const i64 bit = j * k;
      const i64 byte = bit >> 3;
      const int sh = (int)(bit & 7);
      // the code's bits lie in bytes byte .. byte + (sh + k - 1) / 8 (at most 9 bytes)
      const int nb = (sh + k + 7) >> 3;
      u64 lo64 = 0, hi8 = 0;
      for (int t = 0; t < nb && t < 8; ++t) lo64 |= (u64)rem[byte + t] << (8 * t);
      if (nb > 8) hi8 = rem[byte + 8];
      r = (lo64 >> sh) | (sh ? (hi8 << (64 - sh)) : 0ULL);
      r &= mask;
    }
    gp1[j] = (i64)((((u64)q << k) | r) + 1u);
  }
  (void)rbytes;
  bad[g] = b;
}

}  // namespace hvd_sparse

// idx: i64 (m,); gaps: i64 (m,); bad: i32 (ceil(m / group),).
extern "C" __global__ void hvd_sparse_gaps(const long long* __restrict__ idx, long long m,
                                           long long group, long long* __restrict__ gaps,
                                           int* __restrict__ bad) {
  const long long ng = (m + group - 1) / group;
  for (long long g = hvd::global_thread(); g < ng; g += hvd::grid_threads())
    hvd_sparse::gaps_group(idx, m, group, g, gaps, bad);
}

// sums: i64 (3 * ceil(m / group),).
extern "C" __global__ void hvd_sparse_rice_sums(const long long* __restrict__ gaps, long long m,
                                                long long group, int k0,
                                                long long* __restrict__ sums) {
  const long long ng = (m + group - 1) / group;
  for (long long g = hvd::global_thread(); g < ng; g += hvd::grid_threads())
    hvd_sparse::rice_sums_group(gaps, m, group, g, k0, sums);
}

// len: i64 (m,) = (gaps >> k) + 1.
extern "C" __global__ void hvd_sparse_unary_len(const long long* __restrict__ gaps, long long m,
                                                int k, long long* __restrict__ len) {
  for (long long j = hvd::global_thread(); j < m; j += hvd::grid_threads())
    len[j] = (gaps[j] >> k) + 1;
}

// ends: i64 (m,) inclusive prefix sum of the lengths; total = ends[m - 1];
// out: the nbytes = ceil(total / 8) bytes of the unary stream.
extern "C" __global__ void hvd_sparse_unary(const long long* __restrict__ ends, long long m,
                                            long long total, unsigned char* __restrict__ out,
                                            long long nbytes) {
  const long long nw = (nbytes + 7) / 8;
  for (long long w = hvd::global_thread(); w < nw; w += hvd::grid_threads())
    hvd_sparse::unary_word(ends, m, total, out, nbytes, w);
}

// k in 1..62; out: the nbytes = ceil(m * k / 8) bytes of the remainder stream.
extern "C" __global__ void hvd_sparse_remainders(const long long* __restrict__ gaps,
                                                 long long m, int k,
                                                 unsigned char* __restrict__ out,
                                                 long long nbytes) {
  if (k < 1 || k > 62) {
    hvd::bad_launch("hvd_sparse_remainders: k must be in 1..62");
    return;
  }
  const long long nw = (nbytes + 7) / 8;
  for (long long w = hvd::global_thread(); w < nw; w += hvd::grid_threads())
    hvd_sparse::remainder_word(gaps, m, k, out, nbytes, w);
}

// u: the ubytes bytes of the unary stream; counts: i64 (ceil(ubytes / 8),).
extern "C" __global__ void hvd_sparse_zero_count(const unsigned char* __restrict__ u,
                                                 long long ubytes,
                                                 long long* __restrict__ counts) {
  const long long nw = (ubytes + 7) / 8;
  for (long long w = hvd::global_thread(); w < nw; w += hvd::grid_threads()) {
    const long long valid = hvd::min64(64, ubytes * 8 - w * 64);
    const unsigned long long word = hvd_sparse::load_word(u, ubytes, w);
    counts[w] = valid - hvd_sparse::popcount64(word);   // missing bytes load as 0: excluded
  }
}

// rank0: i64 (ceil(ubytes / 8),) exclusive prefix sum of the counts; z: i64 (m,).
extern "C" __global__ void hvd_sparse_zero_pos(const unsigned char* __restrict__ u,
                                               long long ubytes,
                                               const long long* __restrict__ rank0,
                                               long long m, long long* __restrict__ z) {
  const long long nw = (ubytes + 7) / 8;
  for (long long w = hvd::global_thread(); w < nw; w += hvd::grid_threads())
    hvd_sparse::zero_positions(u, ubytes, rank0, m, z, w);
}

// rem: the rbytes = ceil(m * k / 8) bytes of the remainder stream (unused when k = 0);
// gp1: i64 (m,) gaps + 1; bad: i32 (ceil(m / group),).
extern "C" __global__ void hvd_sparse_decode_gaps(const long long* __restrict__ z, long long m,
                                                  const unsigned char* __restrict__ rem,
                                                  long long rbytes, int k, long long qmax,
                                                  long long group,
                                                  long long* __restrict__ gp1,
                                                  int* __restrict__ bad) {
  const long long ng = (m + group - 1) / group;
  for (long long g = hvd::global_thread(); g < ng; g += hvd::grid_threads())
    hvd_sparse::decode_gaps_group(z, m, rem, rbytes, k, qmax, group, g, gp1, bad);
}
