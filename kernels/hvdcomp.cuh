// hvdcomp.cuh: device code shared by every hvdcomp kernel.
//
// Compiled three ways, from this one text:
//   * NVRTC (CuPy RawModule, hvdcomp/backends/cuda.py) and nvcc: CUDA C++17;
//   * g++ through kernels/host_shim.h (hvdcomp/backends/host.py): the same kernels run as a
//     grid of blocks on the CPU, blocks in parallel, the threads of a block one after another.
//
// Rules that keep the three bit-identical to each other and to the PyTorch reference
// (hvdcomp/compressors/quantizers.py, hvdcomp/philox.py):
//   * no FMA contraction: nvcc/NVRTC --fmad=false, g++ -ffp-contract=off (a*b+c must round
//     twice, as PyTorch's separate ops do);
//   * IEEE division and sqrt (nvcc/NVRTC default: -prec-div=true, -prec-sqrt=true, -ftz=false;
//     never -use_fast_math / -ffast-math);
//   * 64-bit index arithmetic (long long) for every element or byte index;
//   * threads of a block cooperate ONLY through the helpers in section 3 below.  The host
//     build runs a block's threads sequentially, so it cannot honour a bare __syncthreads();
//     host_shim.h deliberately does not define it, and a kernel that calls it fails to build
//     there.  Per-thread work lives in plain __device__ functions.
//   * no standard headers: NVRTC has none.
#ifndef HVDCOMP_CUH
#define HVDCOMP_CUH

namespace hvd {

typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

// ---------------------------------------------------------------------------------------------
// 1. Philox4x32-10 (Salmon et al., SC 2011), bit-identical to hvdcomp/philox.py.
//    key = (seed, rank); counter = (block lo, block hi, tensor_id, step), block = index / 4;
//    element `index` takes output word index % 4.
// ---------------------------------------------------------------------------------------------
#define HVD_PHILOX_M0 0xD2511F53u  // round multipliers
#define HVD_PHILOX_M1 0xCD9E8D57u
#define HVD_PHILOX_W0 0x9E3779B9u  // Weyl increments of the key
#define HVD_PHILOX_W1 0xBB67AE85u

struct Philox4 {
  u32 w[4];
};

__device__ __forceinline__ void mulhilo32(u32 a, u32 b, u32& hi, u32& lo) {
  const u64 p = (u64)a * (u64)b;  // exact 64-bit product; nvcc emits mul.wide.u32
  hi = (u32)(p >> 32);
  lo = (u32)p;
}

__device__ __forceinline__ Philox4 philox4x32_10(u32 c0, u32 c1, u32 c2, u32 c3, u32 k0,
                                                 u32 k1) {
  for (int r = 0; r < 10; ++r) {
    if (r) {
      k0 += HVD_PHILOX_W0;  // Weyl increments of the key between rounds
      k1 += HVD_PHILOX_W1;
    }
    u32 hi0, lo0, hi1, lo1;
    mulhilo32(HVD_PHILOX_M0, c0, hi0, lo0);
    mulhilo32(HVD_PHILOX_M1, c2, hi1, lo1);
    const u32 n0 = hi1 ^ c1 ^ k0;
    const u32 n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
  }
  Philox4 out;
  out.w[0] = c0;
  out.w[1] = c1;
  out.w[2] = c2;
  out.w[3] = c3;
  return out;
}

// The four words of Philox block `block` (elements 4*block .. 4*block+3).
__device__ __forceinline__ Philox4 philox_block(i64 block, u32 seed, u32 rank, u32 tensor_id,
                                                u32 step) {
  const u64 b = (u64)block;
  return philox4x32_10((u32)b, (u32)(b >> 32), tensor_id, step, seed, rank);
}

// Uniform float32 in [0, 1): the top 24 bits of the word times 2^-24 (exact in float32).
// (int): the value is below 2^24, so the signed conversion is the same number, and one
// instruction wide on the CPU (unsigned int -> float has no SSE2/AVX2 instruction).
__device__ __forceinline__ float uniform01(u32 word) {
  return (float)(int)(word >> 8) * 5.9604644775390625e-08f;
}

#if defined(HVD_HOST_BUILD)
// ---------------------------------------------------------------------------------------------
// 1b. Host only: many Philox blocks at once, the same bits as philox_block.
//
//    philox_words<SIMD>(first, count, seed, rank, tensor_id, step, out):
//        out[4*j + w] = philox_block(first + j, ...).w[w]  for j < count
//    (so out[k] is the word of element 4*first + k, hvdcomp/philox.py's order).
//
//    The scalar round costs two 32x32->64 multiplies and a dependent chain of ten rounds; the
//    vector versions run 2 (SSE2), 4 (AVX2) or 8 (AVX-512) blocks per register, each word in
//    the low half of a 64-bit lane, which is what the unsigned 32x32->64 multiply
//    (pmuludq) reads and writes: lo = the lane (its high half is never read), hi = lane >> 32.
//    Several registers in flight hide the multiply latency.  SIMD is the level of
//    hvd_host::simd_level (host_shim.h); each level's version is compiled for its target.
// ---------------------------------------------------------------------------------------------
__forceinline__ void philox_words_scalar(u64 first, int count, u32 seed, u32 rank,
                                         u32 tensor_id, u32 step, u32* __restrict__ out) {
  for (int j = 0; j < count; ++j) {
    const Philox4 r = philox_block((i64)(first + (u64)j), seed, rank, tensor_id, step);
    out[4 * j] = r.w[0];
    out[4 * j + 1] = r.w[1];
    out[4 * j + 2] = r.w[2];
    out[4 * j + 3] = r.w[3];
  }
}

#if defined(HVD_HOST_X86)
// One round on V registers: c0 = hi(M1*c2) ^ c1 ^ k0, c1 = lo(M1*c2), c2 = hi(M0*c0) ^ c3 ^ k1,
// c3 = lo(M0*c0) (philox4x32_10).  MUL: 32x32->64 of the low halves; SRL: 64-bit shift.
#define HVD_PHILOX_ROUNDS(V, T, SET1, MUL, SRL, XOR)                                   \
  {                                                                                 \
    const T m0 = SET1((long long)HVD_PHILOX_M0), m1 = SET1((long long)HVD_PHILOX_M1); \
    for (int r = 0; r < 10; ++r) {                                                  \
      if (r) {                                                                      \
        k0 += HVD_PHILOX_W0;                                                        \
        k1 += HVD_PHILOX_W1;                                                        \
      }                                                                             \
      const T K0 = SET1((long long)k0), K1 = SET1((long long)k1);                   \
      for (int v = 0; v < V; ++v) {                                                 \
        const T p0 = MUL(c0[v], m0), p1 = MUL(c2[v], m1);                           \
        c0[v] = XOR(XOR(SRL(p1, 32), c1[v]), K0);                                   \
        c1[v] = p1;                                                                 \
        c2[v] = XOR(XOR(SRL(p0, 32), c3[v]), K1);                                   \
        c3[v] = p0;                                                                 \
      }                                                                             \
    }                                                                               \
  }

// SSE2: 2 blocks per register, 8 registers (16 blocks) per pass.  (The pass sizes of the three
// versions were the fastest in a sweep on a Zen 5 core: AVX-512's 8 x 4 registers spill.)
inline void philox_words_sse2(u64 first, int count, u32 seed, u32 rank, u32 tensor_id,
                              u32 step, u32* __restrict__ out) {
  constexpr int V = 8;
  int j = 0;
  for (; j + 2 * V <= count; j += 2 * V) {
    __m128i c0[V], c1[V], c2[V], c3[V];
    for (int v = 0; v < V; ++v) {
      const u64 b0 = first + (u64)(j + 2 * v), b1 = b0 + 1;
      c0[v] = _mm_set_epi64x((long long)(b1 & 0xFFFFFFFFu), (long long)(b0 & 0xFFFFFFFFu));
      c1[v] = _mm_set_epi64x((long long)(b1 >> 32), (long long)(b0 >> 32));
      c2[v] = _mm_set1_epi64x((long long)tensor_id);
      c3[v] = _mm_set1_epi64x((long long)step);
    }
    u32 k0 = seed, k1 = rank;
    HVD_PHILOX_ROUNDS(V, __m128i, _mm_set1_epi64x, _mm_mul_epu32, _mm_srli_epi64,
                      _mm_xor_si128)
    const __m128i lo = _mm_set1_epi64x(0xFFFFFFFFll);
    for (int v = 0; v < V; ++v) {
      // (a0 . b0 .), (a1 . b1 .) -> (a0 a1 b0 b1); same for words 2, 3; then per block
      const __m128i t01 = _mm_or_si128(_mm_and_si128(c0[v], lo), _mm_slli_epi64(c1[v], 32));
      const __m128i t23 = _mm_or_si128(_mm_and_si128(c2[v], lo), _mm_slli_epi64(c3[v], 32));
      _mm_storeu_si128((__m128i*)(out + 4 * (j + 2 * v)), _mm_unpacklo_epi64(t01, t23));
      _mm_storeu_si128((__m128i*)(out + 4 * (j + 2 * v) + 4), _mm_unpackhi_epi64(t01, t23));
    }
  }
  philox_words_scalar(first + (u64)j, count - j, seed, rank, tensor_id, step, out + 4 * j);
}

// AVX2: 4 blocks per register, 8 registers (32 blocks) per pass.
HVD_TARGET_AVX2 inline void philox_words_avx2(u64 first, int count, u32 seed, u32 rank,
                                              u32 tensor_id, u32 step, u32* __restrict__ out) {
  constexpr int V = 8;
  int j = 0;
  const __m256i iota = _mm256_set_epi64x(3, 2, 1, 0);
  for (; j + 4 * V <= count; j += 4 * V) {
    __m256i c0[V], c1[V], c2[V], c3[V];
    for (int v = 0; v < V; ++v) {
      const __m256i b = _mm256_add_epi64(_mm256_set1_epi64x((long long)(first + (u64)(j + 4 * v))), iota);
      c0[v] = b;                         // the high halves are never read by the multiply
      c1[v] = _mm256_srli_epi64(b, 32);
      c2[v] = _mm256_set1_epi64x((long long)tensor_id);
      c3[v] = _mm256_set1_epi64x((long long)step);
    }
    u32 k0 = seed, k1 = rank;
    HVD_PHILOX_ROUNDS(V, __m256i, _mm256_set1_epi64x, _mm256_mul_epu32, _mm256_srli_epi64,
                      _mm256_xor_si256)
    for (int v = 0; v < V; ++v) {
      // per 128-bit half: (a0 a1 b0 b1), (a2 a3 b2 b3) -> blocks a | c and b | d
      const __m256i t01 = _mm256_blend_epi32(c0[v], _mm256_slli_epi64(c1[v], 32), 0xAA);
      const __m256i t23 = _mm256_blend_epi32(c2[v], _mm256_slli_epi64(c3[v], 32), 0xAA);
      const __m256i ac = _mm256_unpacklo_epi64(t01, t23), bd = _mm256_unpackhi_epi64(t01, t23);
      u32* o = out + 4 * (j + 4 * v);
      _mm256_storeu_si256((__m256i*)o, _mm256_permute2x128_si256(ac, bd, 0x20));
      _mm256_storeu_si256((__m256i*)(o + 8), _mm256_permute2x128_si256(ac, bd, 0x31));
    }
  }
  philox_words_scalar(first + (u64)j, count - j, seed, rank, tensor_id, step, out + 4 * j);
}

// AVX-512: 8 blocks per register, 4 registers (32 blocks) per pass.  (GCC 12's AVX-512
// intrinsics start from _mm512_undefined_epi32(), which -Wmaybe-uninitialized flags: GCC bug
// 105593, fixed in 12.3.)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
HVD_TARGET_AVX512 inline void philox_words_avx512(u64 first, int count, u32 seed, u32 rank,
                                                  u32 tensor_id, u32 step,
                                                  u32* __restrict__ out) {
  constexpr int V = 4;
  int j = 0;
  const __m512i iota = _mm512_set_epi64(7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i pick0 = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0);
  const __m512i pick1 = _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4);
  for (; j + 8 * V <= count; j += 8 * V) {
    __m512i c0[V], c1[V], c2[V], c3[V];
    for (int v = 0; v < V; ++v) {
      const __m512i b = _mm512_add_epi64(_mm512_set1_epi64((long long)(first + (u64)(j + 8 * v))), iota);
      c0[v] = b;
      c1[v] = _mm512_srli_epi64(b, 32);
      c2[v] = _mm512_set1_epi64((long long)tensor_id);
      c3[v] = _mm512_set1_epi64((long long)step);
    }
    u32 k0 = seed, k1 = rank;
    HVD_PHILOX_ROUNDS(V, __m512i, _mm512_set1_epi64, _mm512_mul_epu32, _mm512_srli_epi64,
                      _mm512_xor_si512)
    for (int v = 0; v < V; ++v) {
      const __m512i t01 = _mm512_mask_blend_epi32(0xAAAA, c0[v], _mm512_slli_epi64(c1[v], 32));
      const __m512i t23 = _mm512_mask_blend_epi32(0xAAAA, c2[v], _mm512_slli_epi64(c3[v], 32));
      // 128-bit lanes: even = blocks 0 2 4 6, odd = blocks 1 3 5 7
      const __m512i even = _mm512_unpacklo_epi64(t01, t23), odd = _mm512_unpackhi_epi64(t01, t23);
      u32* o = out + 4 * (j + 8 * v);
      _mm512_storeu_si512((void*)o, _mm512_permutex2var_epi64(even, pick0, odd));
      _mm512_storeu_si512((void*)(o + 16), _mm512_permutex2var_epi64(even, pick1, odd));
    }
  }
  philox_words_scalar(first + (u64)j, count - j, seed, rank, tensor_id, step, out + 4 * j);
}
#pragma GCC diagnostic pop
#undef HVD_PHILOX_ROUNDS
#endif  // HVD_HOST_X86

template <int SIMD>
__forceinline__ void philox_words(u64 first, int count, u32 seed, u32 rank, u32 tensor_id,
                                  u32 step, u32* __restrict__ out) {
#if defined(HVD_HOST_X86)
  if (SIMD >= 3) return philox_words_avx512(first, count, seed, rank, tensor_id, step, out);
  if (SIMD == 2) return philox_words_avx2(first, count, seed, rank, tensor_id, step, out);
  return philox_words_sse2(first, count, seed, rank, tensor_id, step, out);
#else
  philox_words_scalar(first, count, seed, rank, tensor_id, step, out);
#endif
}
#endif  // HVD_HOST_BUILD

// ---------------------------------------------------------------------------------------------
// 2. Small per-thread helpers.
// ---------------------------------------------------------------------------------------------
// Full unrolling of the 8-coordinate loops keeps the Philox words in registers on the GPU
// (a dynamically indexed array would go to local memory).
#if defined(HVD_HOST_BUILD)
#define HVD_UNROLL8 _Pragma("GCC unroll 8")
#else
#define HVD_UNROLL8 _Pragma("unroll")
#endif

__device__ __forceinline__ i64 min64(i64 a, i64 b) { return a < b ? a : b; }

// The bits of a float32 and back.
__device__ __forceinline__ u32 float_bits(float v) {
#if defined(HVD_HOST_BUILD)
  u32 b;
  __builtin_memcpy(&b, &v, sizeof b);
  return b;
#else
  return __float_as_uint(v);
#endif
}

__device__ __forceinline__ float bits_float(u32 b) {
#if defined(HVD_HOST_BUILD)
  float v;
  __builtin_memcpy(&v, &b, sizeof v);
  return v;
#else
  return __uint_as_float(b);
#endif
}

// floorf / floor, bit for bit for every input (signed zeros, infinities and NaN included).
// The GPU calls them.  The host rounds to an integer by adding and subtracting 2^23 (2^52):
// one rounding, exact, to an integer next to y whatever the rounding mode, corrected to the
// one below; the sign of a zero result is y's.  This form vectorizes (GCC vectorizes the
// library floor only without -ftrapping-math).  |y| >= 2^23 (2^52), inf, NaN: y itself.
__device__ __forceinline__ float floor_f32(float y) {
#if defined(HVD_HOST_BUILD)
  const float big = 8388608.0f;
  const float r = y < 0.0f ? (y - big) + big : (y + big) - big;
  const float f = r > y ? r - 1.0f : r;
  return fabsf(y) < big ? copysignf(f, y) : y;
#else
  return floorf(y);
#endif
}

__device__ __forceinline__ double floor_f64(double y) {
#if defined(HVD_HOST_BUILD)
  const double big = 4503599627370496.0;
  const double r = y < 0.0 ? (y - big) + big : (y + big) - big;
  const double f = r > y ? r - 1.0 : r;
  return fabs(y) < big ? copysign(f, y) : y;
#else
  return floor(y);
#endif
}

// -v when neg is 1, v when 0: IEEE negation is a flip of the sign bit, done here on the bits
// so that no data-dependent branch is taken (random signs mispredict half the time).
__device__ __forceinline__ float negate_if(float v, u32 neg) {
  return bits_float(float_bits(v) ^ (neg << 31));
}

// Packed streams (hvdcomp/ops/bitpack.py): code i occupies bits [i*BITS, (i+1)*BITS) of
// the little-endian bit stream, so the 8 codes of group g are exactly the BITS bytes
// [g*BITS, (g+1)*BITS), held here as one 64-bit word (code k at bits [k*BITS, ...)).  Bytes
// at or past `nbytes` (the tail of the last group) are neither written nor read.
template <int BITS>
__device__ __forceinline__ void store_group(unsigned char* __restrict__ out, i64 g, i64 nbytes,
                                            u64 word) {
  const i64 o = g * BITS;
  if (o + BITS <= nbytes) {
    for (int k = 0; k < BITS; ++k) out[o + k] = (unsigned char)(word >> (8 * k));
  } else {
    for (int k = 0; k < BITS; ++k) {
      if (o + k < nbytes) out[o + k] = (unsigned char)(word >> (8 * k));
    }
  }
}

template <int BITS>
__device__ __forceinline__ u64 load_group(const unsigned char* __restrict__ in, i64 g,
                                          i64 nbytes) {
  const i64 o = g * BITS;
  u64 word = 0;
  if (o + BITS <= nbytes) {
    for (int k = 0; k < BITS; ++k) word |= (u64)in[o + k] << (8 * k);
  } else {
    for (int k = 0; k < BITS; ++k) {
      if (o + k < nbytes) word |= (u64)in[o + k] << (8 * k);
    }
  }
  return word;
}

// Calls f(k, i, b) for the coordinates i = 8g + k (k < 8, i < n) of group g in increasing
// k, b the bucket (of bucket_size coordinates) of i: the group-at-a-time loop of the
// element-wise kernels where a group may end the tensor or cross a bucket boundary.
template <class F>
__device__ __forceinline__ void group_coords(i64 g, i64 n, i64 bucket_size, F&& f) {
  const i64 i0 = 8 * g;
  i64 b = i0 / bucket_size;
  i64 bucket_end = (b + 1) * bucket_size;
  HVD_UNROLL8
  for (int k = 0; k < 8; ++k) {
    const i64 i = i0 + k;
    if (i >= n) break;
    while (i >= bucket_end) {          // buckets smaller than 8 coordinates step more than once
      ++b;
      bucket_end += bucket_size;
    }
    f(k, i, b);
  }
}

// A kernel argument that the launchers never pass (they check first): stop the GPU kernel
// with an error; on the host, report it to the launcher.
__device__ inline void bad_launch(const char* what) {
#if defined(HVD_HOST_BUILD)
  hvd_host::report_error(what);
#else
  (void)what;
  __trap();
#endif
}

// ---------------------------------------------------------------------------------------------
// 3. Block cooperation: the only place where the threads of a block talk to each other.
//
//    block_reduce<T>(op, f): every thread t of the block contributes f(t); the result is
//    combined by a fixed binary tree (level w = n/2, n/4, ..., 1: v[t] = op(v[t], v[t + w])
//    for t < w) and returned to every thread.  The tree, hence the rounding, depends only on
//    blockDim.x, which must be a power of two <= HVD_MAX_BLOCK (check_reduce_block()).
//
//    The per-thread contribution is passed as a callable (a lambda calling a plain __device__
//    function) rather than as a value, so that the host build, which runs the threads of a
//    block one after another, can evaluate all contributions in the first thread and run the
//    same tree; later threads read the broadcast result.  On the GPU each thread evaluates
//    only its own f(threadIdx.x).
// ---------------------------------------------------------------------------------------------
#define HVD_MAX_BLOCK 256

struct SumOp {
  template <class T>
  __device__ __forceinline__ T operator()(T a, T b) const {
    return a + b;
  }
};

// max that propagates NaN (as torch.amax does): once NaN, always NaN.
struct MaxNanOp {
  __device__ __forceinline__ float operator()(float a, float b) const {
    return (b > a || b != b) ? b : a;
  }
};

__device__ __forceinline__ bool is_pow2_block(u32 n) {
  return n >= 1 && n <= HVD_MAX_BLOCK && (n & (n - 1)) == 0;
}

// The reduction order is defined for these geometries only; anything else is a launcher bug
// (never silently produce a different order).
__device__ inline bool check_reduce_block() {
  if (!is_pow2_block(blockDim.x) || blockDim.y != 1 || blockDim.z != 1) {
    bad_launch("block_reduce: blockDim must be (2^k <= 256, 1, 1)");
    return false;
  }
  return true;
}

#if defined(HVD_HOST_BUILD)

// The tree of block_reduce over v[0 .. n), n a power of two; v is overwritten.
template <class T, class Op>
__forceinline__ T tree_reduce(Op op, T* __restrict__ v, u32 n) {
  for (u32 w = n >> 1; w > 0; w >>= 1) {
    for (u32 t = 0; t < w; ++t) v[t] = op(v[t], v[t + w]);
  }
  return v[0];
}

// Host: blockDim.x calls of the kernel per block, in thread order, on one OS thread.
template <class T, class Op, class F>
__device__ inline T block_reduce(Op op, F f) {
  static thread_local T result;  // per OS thread = per running block
  if (threadIdx.x == 0) {
    T v[HVD_MAX_BLOCK];
    const u32 n = blockDim.x;
    for (u32 t = 0; t < n; ++t) v[t] = f(t);
    result = tree_reduce(op, v, n);
  }
  return result;
}

#else  // CUDA (nvcc device and host passes, NVRTC)

template <class T, class Op, class F>
__device__ inline T block_reduce(Op op, F f) {
  __shared__ T v[HVD_MAX_BLOCK];
  const u32 t = threadIdx.x;
  v[t] = f(t);
  __syncthreads();
  for (u32 w = blockDim.x >> 1; w > 0; w >>= 1) {
    if (t < w) v[t] = op(v[t], v[t + w]);
    __syncthreads();
  }
  const T r = v[0];
  __syncthreads();  // v may be reused by the next call
  return r;
}

#endif

// Per-thread shares of a bucket's norms, combined by block_reduce (quantize.cu, stats.cu):
// Thread t of a block of `stride` threads: sum of x[i]^2 over i = t, t + stride, ... < len,
// in float64, in four interleaved partial sums (k mod 4) joined as (a0 + a1) + (a2 + a3).
// Squares of float32 are exact in float64; only the additions round.  This fixed order is
// the kernel's definition of the L2 norm; it differs from torch.sum's order, which is
// itself an implementation detail of PyTorch (vector width, threads): see
// tests/kernels/test_host.py for the bound (the float32 results agree to 1 ulp at most).
__device__ inline double sumsq_partial(const float* __restrict__ xb, i64 len, i64 t,
                                       i64 stride) {
  double a0 = 0.0, a1 = 0.0, a2 = 0.0, a3 = 0.0;
  i64 i = t;
  for (; i + 3 * stride < len; i += 4 * stride) {
    const double v0 = (double)xb[i];
    const double v1 = (double)xb[i + stride];
    const double v2 = (double)xb[i + 2 * stride];
    const double v3 = (double)xb[i + 3 * stride];
    a0 = a0 + v0 * v0;
    a1 = a1 + v1 * v1;
    a2 = a2 + v2 * v2;
    a3 = a3 + v3 * v3;
  }
  for (; i < len; i += stride) {
    const double v = (double)xb[i];
    a0 = a0 + v * v;
  }
  return (a0 + a1) + (a2 + a3);
}

// max |x[i]| over the same index set; NaN propagates (torch.amax).  Order-free (exact).
__device__ inline float absmax_partial(const float* __restrict__ xb, i64 len, i64 t,
                                       i64 stride) {
  const MaxNanOp op;
  float m = 0.0f;
  for (i64 i = t; i < len; i += stride) m = op(m, fabsf(xb[i]));
  return m;
}

#if defined(HVD_HOST_BUILD)
// Host: v[t] = sumsq_partial(xb, len, t, stride) for every t < stride (<= HVD_MAX_BLOCK), and
// v[t] = absmax_partial(...): each t's operations exactly as there, in the same order, but the
// threads in lockstep (a loop over t with contiguous loads, which vectorizes): first the
// rounds that every t completes, then each t's remaining steps as sumsq_partial takes them.
__forceinline__ void sumsq_partials(const float* __restrict__ xb, i64 len, int stride,
                                    double* __restrict__ v) {
  double a0[HVD_MAX_BLOCK], a1[HVD_MAX_BLOCK], a2[HVD_MAX_BLOCK], a3[HVD_MAX_BLOCK];
  for (int t = 0; t < stride; ++t) a0[t] = a1[t] = a2[t] = a3[t] = 0.0;
  i64 base = 0;
  for (; base + 4 * (i64)stride <= len; base += 4 * (i64)stride) {  // i + 3 stride < len, all t
    const float* __restrict__ p = xb + base;
    for (int t = 0; t < stride; ++t) {
      const double v0 = (double)p[t];
      const double v1 = (double)p[t + stride];
      const double v2 = (double)p[t + 2 * stride];
      const double v3 = (double)p[t + 3 * stride];
      a0[t] = a0[t] + v0 * v0;
      a1[t] = a1[t] + v1 * v1;
      a2[t] = a2[t] + v2 * v2;
      a3[t] = a3[t] + v3 * v3;
    }
  }
  for (int t = 0; t < stride; ++t) {
    double b0 = a0[t], b1 = a1[t], b2 = a2[t], b3 = a3[t];
    i64 i = base + t;
    for (; i + 3 * (i64)stride < len; i += 4 * (i64)stride) {
      const double v0 = (double)xb[i];
      const double v1 = (double)xb[i + stride];
      const double v2 = (double)xb[i + 2 * stride];
      const double v3 = (double)xb[i + 3 * stride];
      b0 = b0 + v0 * v0;
      b1 = b1 + v1 * v1;
      b2 = b2 + v2 * v2;
      b3 = b3 + v3 * v3;
    }
    for (; i < len; i += stride) {
      const double v0 = (double)xb[i];
      b0 = b0 + v0 * v0;
    }
    v[t] = (b0 + b1) + (b2 + b3);
  }
}

__forceinline__ void absmax_partials(const float* __restrict__ xb, i64 len, int stride,
                                     float* __restrict__ v) {
  const MaxNanOp op;
  for (int t = 0; t < stride; ++t) v[t] = 0.0f;
  i64 base = 0;
  for (; base + stride <= len; base += stride) {
    const float* __restrict__ p = xb + base;
    for (int t = 0; t < stride; ++t) v[t] = op(v[t], fabsf(p[t]));
  }
  for (int t = 0; base + t < len; ++t) v[t] = op(v[t], fabsf(xb[base + t]));
}
#endif

// ---------------------------------------------------------------------------------------------
// 4. Grid-stride loops with 64-bit indices.
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ i64 global_thread() {
  return (i64)blockIdx.x * (i64)blockDim.x + (i64)threadIdx.x;
}
__device__ __forceinline__ i64 grid_threads() { return (i64)gridDim.x * (i64)blockDim.x; }

// ---------------------------------------------------------------------------------------------
// 4b. Pieces: several streams of one tensor (the reduce-scatter's pieces, one per destination
//     rank) in one launch.  A piece table holds PIECE_FIELDS long longs per piece k:
//       PIECE_LO     its first coordinate in the launch's flat float32 vector (x or out);
//       PIECE_N      its number of coordinates;
//       PIECE_BYTE   the offset of its packed stream in the launch's byte buffer;
//       PIECE_BUCKET the index of its first bucket norm in the launch's norms;
//       PIECE_ID     its tensor id (the Philox counter word; encoders only);
//       PIECE_GROUP  its first group (of 8 coordinates) in the launch's numbering: the sum of
//                    ceil(n / 8) over the pieces before it.
//     Each piece is computed exactly as a launch of its own would compute it (its groups are
//     numbered from 0 within it); the launchers (hvdcomp/ops) check the table.
// ---------------------------------------------------------------------------------------------
constexpr int PIECE_FIELDS = 6;
constexpr int PIECE_LO = 0, PIECE_N = 1, PIECE_BYTE = 2, PIECE_BUCKET = 3, PIECE_ID = 4,
              PIECE_GROUP = 5;

// The piece of launch group g (0 <= g < the total): the last k with PIECE_GROUP <= g (an empty
// piece starts where the next one does, so the last such piece holds g).
__device__ __forceinline__ const i64* piece_of(const i64* __restrict__ table, int count, i64 g) {
  int lo = 0, hi = count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (table[(i64)mid * PIECE_FIELDS + PIECE_GROUP] <= g) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return table + (i64)lo * PIECE_FIELDS;
}

#if defined(HVD_HOST_BUILD)
// ---------------------------------------------------------------------------------------------
// 5. Host only: bulk paths.
//
//    An element-wise kernel whose thread t handles groups g = global_thread() + k *
//    grid_threads() (8 coordinates each) may, on the host, do the work of its whole block in
//    thread 0 instead: host_bulk_groups hands it the block's groups as contiguous runs (their
//    union is exactly the set its threads would handle) and marks the block done (host_shim.h),
//    so the other threads are not run.  A run is processed in chunks of HVD_BULK_GROUPS groups
//    whose Philox words come from philox_words (section 1b) in one call and whose
//    per-coordinate arithmetic, the very __device__ functions the GPU runs (same operations,
//    same order), sits in plain loops over the coordinates that the compiler vectorizes.  The
//    output bits are the device code's; at hvd_host::simd_level() 0 every kernel runs its
//    device code instead (tests/kernels/test_host_simd.py runs every level against the
//    PyTorch references).
//
//    The code inside is compiled once per SIMD level: simd_call(level, f) calls
//    f(SimdLevel<level>()) from a function compiled for that level's instruction set, and f
//    (a lambda marked HVD_INLINE, as are the lambdas it calls) is inlined there.
// ---------------------------------------------------------------------------------------------
#define HVD_INLINE __attribute__((always_inline))
#define HVD_BULK_GROUPS 32   // groups per chunk: 256 coordinates, 64 Philox blocks, 1 KiB of words

template <int L>
struct SimdLevel {
  static constexpr int value = L;
};

template <class F>
__attribute__((noinline)) void simd_call1(F& f) {
  f(SimdLevel<1>());
}
#if defined(HVD_HOST_X86)
template <class F>
HVD_TARGET_AVX2 __attribute__((noinline)) void simd_call2(F& f) {
  f(SimdLevel<2>());
}
template <class F>
HVD_TARGET_AVX512 __attribute__((noinline)) void simd_call3(F& f) {
  f(SimdLevel<3>());
}
#endif

template <class F>
inline void simd_call(int level, F&& f) {
#if defined(HVD_HOST_X86)
  if (level >= 3) return simd_call3(f);
  if (level == 2) return simd_call2(f);
#endif
  (void)level;
  simd_call1(f);
}

// The calling thread has done its whole block's work: the block's later threads are skipped.
__forceinline__ void host_block_done() { hvd_host::ctx.block_done = true; }

// At SIMD level 0: false, nothing run.  Else f(SimdLevel<L>(), g0, g1) for the block's runs
// of groups [g0, g1) (of 0 .. groups - 1), compiled for L = the level; the block is done.
template <class F>
inline bool host_bulk_groups(i64 groups, F&& f) {
  const int level = hvd_host::simd_level();
  if (!level) return false;
  const i64 bd = (i64)blockDim.x;
  const i64 stride = grid_threads();
  for (i64 g0 = (i64)blockIdx.x * bd; g0 < groups; g0 += stride) {
    const i64 g1 = min64(g0 + bd, groups);
    simd_call(level, [&](auto L) HVD_INLINE { f(L, g0, g1); });
  }
  host_block_done();
  return true;
}

// host_bulk_groups over the groups of a piece table (section 4b): f(SimdLevel<L>(), piece,
// lg0, lg1) for the runs [lg0, lg1) of one piece's own groups.
template <class F>
inline bool host_bulk_pieces(const i64* __restrict__ table, int count, i64 groups, F&& f) {
  return host_bulk_groups(groups, [&](auto L, i64 g0, i64 g1) HVD_INLINE {
    for (const i64* p = piece_of(table, count, g0); g0 < g1; p += PIECE_FIELDS) {
      const i64 first = p[PIECE_GROUP];
      const i64 end = min64(first + (p[PIECE_N] + 7) / 8, g1);
      if (end > g0) f(L, p, g0 - first, end - first);
      g0 = end > g0 ? end : g0;
    }
  });
}

// The words of groups g .. g + cg - 1 from their codes (codes[8k + c]: code c of group g + k),
// stored as store_group stores them.  Up to 4 bits a group's word fits 32 bits: the words are
// built in a loop that vectorizes, then stored 4 bytes at a time in increasing order (the
// bytes past a group's own are rewritten by the next group), the chunk's last group exactly
// (its successor may belong to another block, written by another thread).
template <int BITS>
__forceinline__ void pack_store(const u32* __restrict__ codes, int cg, i64 g, i64 nbytes,
                                unsigned char* __restrict__ out) {
  if (BITS <= 4) {
    u32 words[HVD_BULK_GROUPS];
    for (int k = 0; k < cg; ++k) {
      u32 w = 0;
      for (int c = 0; c < 8; ++c) w |= codes[8 * k + c] << (c * BITS);
      words[k] = w;
    }
    // Group k's 4-byte store covers bytes [(g+k)*BITS, (g+k)*BITS + 4): whole stores only
    // while those lie in this chunk's own bytes and in the stream (1, 2, 3 bits: the last
    // 4, 2, 2 groups are stored exactly; 4 bits: none but past the stream's end).
    const i64 limit = min64((g + cg) * BITS, nbytes);
    int k = 0;
    for (; k < cg && (g + k) * BITS + 4 <= limit; ++k)
      __builtin_memcpy(out + (g + k) * BITS, &words[k], 4);
    for (; k < cg; ++k) store_group<BITS>(out, g + k, nbytes, words[k]);
  } else {
    for (int k = 0; k < cg; ++k) {
      u64 word = 0;
      HVD_UNROLL8
      for (int c = 0; c < 8; ++c) word |= (u64)codes[8 * k + c] << (c * BITS);
      store_group<BITS>(out, g + k, nbytes, word);
    }
  }
}

// The codes of groups g .. g + cg - 1 (codes[8k + c]: code c of group g + k), read as
// load_group reads them (up to 4 bits: whole 4-byte words, except where one would run past
// the stream's end).
template <int BITS>
__forceinline__ void load_unpack(const unsigned char* __restrict__ packed, int cg, i64 g,
                                 i64 nbytes, u32* __restrict__ codes) {
  constexpr u32 CODE_MASK = (1u << BITS) - 1u;
  if (BITS <= 4) {
    u32 words[HVD_BULK_GROUPS];
    int k = 0;
    for (; k < cg && (g + k) * BITS + 4 <= nbytes; ++k)
      __builtin_memcpy(&words[k], packed + (g + k) * BITS, 4);
    for (; k < cg; ++k) words[k] = (u32)load_group<BITS>(packed, g + k, nbytes);
    for (int e = 0; e < 8 * cg; ++e) codes[e] = (words[e >> 3] >> ((e & 7) * BITS)) & CODE_MASK;
  } else {
    for (int k = 0; k < cg; ++k) {
      const u64 word = load_group<BITS>(packed, g + k, nbytes);
      HVD_UNROLL8
      for (int c = 0; c < 8; ++c) codes[8 * k + c] = (u32)(word >> (c * BITS)) & CODE_MASK;
    }
  }
}

// out[k] = conv(word of Philox stream index first + k) for k < count (random.cu's kernels).
template <int SIMD, class T, class Conv>
__forceinline__ void bulk_stream(i64 first, i64 count, u32 seed, u32 rank, u32 tensor_id,
                                 u32 step, T* __restrict__ out, Conv&& conv) {
  constexpr int NB = 2 * HVD_BULK_GROUPS;
  u32 words[4 * NB];
  for (i64 k = 0; k < count;) {
    const i64 index = first + k;
    const int skip = (int)(index % 4);
    const int take = (int)min64(4 * NB - skip, count - k);
    philox_words<SIMD>((u64)(index / 4), (skip + take + 3) / 4, seed, rank, tensor_id, step,
                       words);
    T* __restrict__ o = out + k;
    const u32* __restrict__ w = words + skip;
    for (int j = 0; j < take; ++j) o[j] = conv(w[j]);
    k += take;
  }
}

// Calls run(s, len, b) for the runs [s, s + len) of coordinates e0 <= s < e1 that lie in one
// bucket b (of bucket_size coordinates).
template <class Run>
__forceinline__ void bucket_runs(i64 e0, i64 e1, i64 bucket_size, Run&& run) {
  for (i64 s = e0; s < e1;) {
    const i64 b = s / bucket_size;
    const i64 t = min64(e1, (b + 1) * bucket_size);
    run(s, (int)(t - s), b);
    s = t;
  }
}

// The encoders: groups [g0, g1) of a BITS-bit packed stream of n codes.
// code_run(s, len, b, ws, cs) fills cs[k] with the code of coordinate s + k (k < len, all in
// bucket b); if WORDS, ws[k] is its Philox word (coordinate i takes word i: blocks 2g, 2g + 1
// for group g), else ws is null.
template <int BITS, int SIMD, bool WORDS, class CodeRun>
__forceinline__ void bulk_encode(i64 n, i64 bucket_size, u32 seed, u32 rank, u32 tensor_id,
                                 u32 step, unsigned char* __restrict__ out, i64 g0, i64 g1,
                                 CodeRun&& code_run) {
  constexpr int CG = HVD_BULK_GROUPS;
  const i64 nbytes = (n * BITS + 7) / 8;
  u32 words[WORDS ? 8 * CG : 1];
  u32 codes[8 * CG];
  for (i64 g = g0; g < g1; g += CG) {
    const int cg = (int)min64(CG, g1 - g);
    if (WORDS) philox_words<SIMD>(2 * (u64)g, 2 * cg, seed, rank, tensor_id, step, words);
    const i64 e0 = 8 * g;
    const i64 e1 = min64(8 * (g + cg), n);
    bucket_runs(e0, e1, bucket_size, [&](i64 s, int len, i64 b) HVD_INLINE {
      code_run(s, len, b, WORDS ? (const u32*)words + (s - e0) : (const u32*)nullptr,
               codes + (s - e0));
    });
    for (i64 e = e1; e < 8 * (g + cg); ++e) codes[e - e0] = 0;   // past the end: no code
    pack_store<BITS>(codes, cg, g, nbytes, out);
  }
}

// The decoders: groups [g0, g1) of a BITS-bit packed stream of n codes.
// value_run(s, len, b, cs, ws) gets the codes cs[k] of coordinates s + k (k < len, all in
// bucket b) and, if WORDS, their Philox words ws[k] (else ws is null).
template <int BITS, int SIMD, bool WORDS, class ValueRun>
__forceinline__ void bulk_decode(const unsigned char* __restrict__ packed, i64 n,
                                 i64 bucket_size, u32 seed, u32 rank, u32 tensor_id, u32 step,
                                 i64 g0, i64 g1, ValueRun&& value_run) {
  constexpr int CG = HVD_BULK_GROUPS;
  const i64 nbytes = (n * BITS + 7) / 8;
  u32 words[WORDS ? 8 * CG : 1];
  u32 codes[8 * CG];
  for (i64 g = g0; g < g1; g += CG) {
    const int cg = (int)min64(CG, g1 - g);
    if (WORDS) philox_words<SIMD>(2 * (u64)g, 2 * cg, seed, rank, tensor_id, step, words);
    load_unpack<BITS>(packed, cg, g, nbytes, codes);
    const i64 e0 = 8 * g;
    bucket_runs(e0, min64(8 * (g + cg), n), bucket_size, [&](i64 s, int len, i64 b) HVD_INLINE {
      value_run(s, len, b, (const u32*)codes + (s - e0),
                WORDS ? (const u32*)words + (s - e0) : (const u32*)nullptr);
    });
  }
}
#endif  // HVD_HOST_BUILD

}  // namespace hvd

#endif  // HVDCOMP_CUH
