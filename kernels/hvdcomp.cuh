// hvdcomp.cuh: device code shared by every hvdcomp kernel.
//
// Compiled three ways, from this one text:
//   * NVRTC (CuPy RawModule, hvdcomp/backends/cuda.py) and nvcc: CUDA C++17;
//   * g++ through kernels/host_shim.h (hvdcomp/backends/host.py): the same kernels run as a
//     grid of blocks on the CPU, blocks in parallel, the threads of a block one after another.
//
// Rules that keep the three bit-identical to each other and to the PyTorch reference
// (hvdcomp/compressors/quantizers.py, hvdcomp/random.py):
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
// 1. Philox4x32-10 (Salmon et al., SC 2011), bit-identical to hvdcomp/random.py.
//    key = (seed, rank); counter = (block lo, block hi, tensor_id, step), block = index / 4;
//    element `index` takes output word index % 4.
// ---------------------------------------------------------------------------------------------
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
      k0 += 0x9E3779B9u;  // Weyl increments of the key between rounds
      k1 += 0xBB67AE85u;
    }
    u32 hi0, lo0, hi1, lo1;
    mulhilo32(0xD2511F53u, c0, hi0, lo0);
    mulhilo32(0xCD9E8D57u, c2, hi1, lo1);
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
__device__ __forceinline__ float uniform01(u32 word) {
  return (float)(word >> 8) * 5.9604644775390625e-08f;
}

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

// -v when neg is 1, v when 0: IEEE negation is a flip of the sign bit, done here on the bits
// so that no data-dependent branch is taken (random signs mispredict half the time).
__device__ __forceinline__ float negate_if(float v, u32 neg) {
#if defined(HVD_HOST_BUILD)
  u32 b;
  __builtin_memcpy(&b, &v, sizeof b);
  b ^= neg << 31;
  float r;
  __builtin_memcpy(&r, &b, sizeof r);
  return r;
#else
  return __uint_as_float(__float_as_uint(v) ^ (neg << 31));
#endif
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

// Host: blockDim.x calls of the kernel per block, in thread order, on one OS thread.
template <class T, class Op, class F>
__device__ inline T block_reduce(Op op, F f) {
  static thread_local T result;  // per OS thread = per running block
  if (threadIdx.x == 0) {
    T v[HVD_MAX_BLOCK];
    const u32 n = blockDim.x;
    for (u32 t = 0; t < n; ++t) v[t] = f(t);
    for (u32 w = n >> 1; w > 0; w >>= 1) {
      for (u32 t = 0; t < w; ++t) v[t] = op(v[t], v[t + w]);
    }
    result = v[0];
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

// ---------------------------------------------------------------------------------------------
// 4. Grid-stride loops with 64-bit indices.
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ i64 global_thread() {
  return (i64)blockIdx.x * (i64)blockDim.x + (i64)threadIdx.x;
}
__device__ __forceinline__ i64 grid_threads() { return (i64)gridDim.x * (i64)blockDim.x; }

}  // namespace hvd

#endif  // HVDCOMP_CUH
