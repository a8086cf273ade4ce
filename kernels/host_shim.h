// host_shim.h: the CUDA built-ins that hvdcomp's .cu sources use, for g++.
//
// With this header included first, kernels/*.cu compile unchanged as C++17 and a grid runs
// on the CPU (kernels/host_launch.cpp, loaded by hvdcomp/backends/host.py):
//   * blocks run in parallel (OpenMP, when built with -fopenmp), each on one OS thread;
//   * the threads of a block run one after another, in threadIdx order, on that OS thread;
//   * threadIdx / blockIdx / blockDim / gridDim are per-OS-thread variables set by the
//     launcher before each (block, thread) call;
//   * __shared__ is per OS thread (static thread_local): it persists from one thread of a
//     block to the next, like shared memory, and is not initialized, like shared memory;
//   * a thread may declare that it has done the work of its whole block (block_done, set by
//     kernels/hvdcomp.cuh's host_bulk_groups): the block's later threads are then not run.
//     The host's bulk paths use this to process a block's elements in one loop that the
//     compiler vectorizes, with Philox in SIMD registers (hvdcomp.cuh, section 1b).
//
// Not provided, on purpose: __syncthreads(), warp shuffles and votes, atomics.  Sequentially
// run threads cannot wait for each other; block cooperation goes through hvd::block_reduce
// (kernels/hvdcomp.cuh), which implements it for both sides.  A kernel that uses one of
// these directly does not compile here, instead of silently computing something else.
//
// Floating point: build with -ffp-contract=off and without -ffast-math, so that each float
// operation rounds once, in IEEE binary32/binary64, as on the GPU with --fmad=false.
#ifndef HVDCOMP_HOST_SHIM_H
#define HVDCOMP_HOST_SHIM_H

#define HVD_HOST_BUILD 1

#include <math.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstddef>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>

#if defined(__FAST_MATH__)
#error "hvdcomp kernels must not be built with -ffast-math (results must be IEEE, bit for bit)"
#endif

// x86-64 with GCC or Clang: the bulk paths have SSE2 (the x86-64 baseline), AVX2 and AVX-512
// versions, compiled here with function target attributes (no -m flags) and chosen at run
// time from the CPU (hvd_host::simd_level).  Elsewhere: one portable version.
#if (defined(__x86_64__) || defined(_M_X64)) && defined(__GNUC__)
#define HVD_HOST_X86 1
#include <immintrin.h>
#define HVD_TARGET_AVX2 __attribute__((target("avx2")))
#define HVD_TARGET_AVX512 __attribute__((target("avx2,avx512f,avx512bw,avx512vl,avx512dq")))
#endif

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the hvdcomp host build assumes a little-endian CPU"
#endif

struct uint3 {
  unsigned int x, y, z;
};
struct dim3 {
  unsigned int x, y, z;
};

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __shared__ static thread_local
#define __launch_bounds__(...)

namespace hvd_host {

// The outcome of one launch: the first error a kernel reported during it (a launcher bug:
// kernels only report violated launch preconditions).  One per calling thread, so that
// launches from several threads (the exchange's encoder and decoder) run concurrently.
struct LaunchStatus {
  std::atomic<int> flag{0};
  char message[256] = {0};
};

struct Context {
  uint3 thread_idx;
  uint3 block_idx;
  dim3 block_dim;
  dim3 grid_dim;
  LaunchStatus* status;  // the launch this OS thread is running blocks for
  bool block_done;       // the current thread did its whole block's work: skip the rest
};

// initial-exec: one %fs-relative load per access instead of a __tls_get_addr call (the
// library is dlopen'ed, which glibc's static TLS surplus allows for a few dozen bytes).
inline thread_local Context ctx __attribute__((tls_model("initial-exec")));

// The calling thread's last launch (read back by hvd_host_last_error on the same thread).
inline thread_local LaunchStatus caller_status;

inline void report_error(const char* msg) {
  LaunchStatus* s = ctx.status ? ctx.status : &caller_status;
  int expected = 0;
  if (s->flag.compare_exchange_strong(expected, 1)) {
    std::strncpy(s->message, msg, sizeof(s->message) - 1);
    s->message[sizeof(s->message) - 1] = '\0';
  }
}

// ---- SIMD level of the bulk paths ------------------------------------------------------------
//
// 0: none: every kernel runs its device code, thread by thread (what the GPU runs);
// 1: bulk paths, baseline instruction set (x86-64: SSE2; elsewhere: portable C++);
// 2: bulk paths with AVX2;  3: bulk paths with AVX-512 (F, BW, VL, DQ).
// All levels give the same bits (integer Philox; the same IEEE float operations in the same
// order, one rounding each).  Default: the best the CPU (and OS) supports, detected once;
// hvd_host_set_simd (host_launch.cpp) lowers it, for tests and measurements.
inline int detect_simd() {
#if defined(HVD_HOST_X86)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    return 3;
  if (__builtin_cpu_supports("avx2")) return 2;
#endif
  return 1;
}

inline int max_simd() {
  static const int level = detect_simd();
  return level;
}

inline std::atomic<int> simd_setting{-1};  // -1: max_simd()

inline int simd_level() {
  const int s = simd_setting.load(std::memory_order_relaxed);
  return s < 0 ? max_simd() : s;
}

// ---- launching a grid -----------------------------------------------------------------------

template <class... A, std::size_t... I>
std::tuple<A...> unpack_args(void** args, std::index_sequence<I...>) {
  return std::tuple<A...>(*static_cast<A*>(args[I])...);
}

// Runs kernel<<<grid, block>>>(*args[0], *args[1], ...), args as for cuLaunchKernel: one
// pointer per kernel parameter, pointing to a value of exactly that parameter's type.
// Returns 0, or 1 if a kernel reported an error (message: caller_status.message).
template <class... A>
int launch(void (*kernel)(A...), unsigned grid, unsigned block, int nthreads, void** args) {
  const std::tuple<A...> a = unpack_args<A...>(args, std::index_sequence_for<A...>{});
  LaunchStatus* status = &caller_status;
  status->flag.store(0);
  status->message[0] = '\0';
  const long long nblocks = grid;
  // Blocks are handed out in chunks of about 1/16 of a thread's share: on a shared machine
  // a descheduled thread then delays only its current chunk, not a fixed half of the grid.
  const long long chunk = nblocks / (16LL * (nthreads > 0 ? nthreads : 1)) + 1;
  (void)nthreads;
  (void)chunk;
#if defined(_OPENMP)
#pragma omp parallel for schedule(dynamic, chunk) num_threads(nthreads) \
    if (nthreads > 1 && nblocks > 1)
#endif
  for (long long b = 0; b < nblocks; ++b) {
    Context& c = ctx;
    c.grid_dim = dim3{grid, 1, 1};
    c.block_dim = dim3{block, 1, 1};
    c.block_idx = uint3{(unsigned)b, 0, 0};
    c.status = status;
    c.block_done = false;
    for (unsigned t = 0; t < block; ++t) {
      c.thread_idx = uint3{t, 0, 0};
      std::apply(kernel, a);
      if (c.block_done) break;
    }
  }
  ctx.status = nullptr;
  return status->flag.load() ? 1 : 0;
}

// ---- kernel signatures, checked by the Python launcher before the first launch ---------------
// P pointer, q long long, i int, I unsigned int, f float, d double.

template <class T>
struct type_code;
template <class T>
struct type_code<T*> {
  static constexpr char value = 'P';
};
template <>
struct type_code<long long> {
  static constexpr char value = 'q';
};
template <>
struct type_code<int> {
  static constexpr char value = 'i';
};
template <>
struct type_code<unsigned int> {
  static constexpr char value = 'I';
};
template <>
struct type_code<float> {
  static constexpr char value = 'f';
};
template <>
struct type_code<double> {
  static constexpr char value = 'd';
};

template <class... A>
const char* signature(void (*)(A...)) {
  static const char s[] = {type_code<A>::value..., '\0'};
  return s;
}

struct Entry {
  const char* name;
  const char* signature;
  int (*launch)(unsigned grid, unsigned block, int nthreads, void** args);
};

template <auto K>
int trampoline(unsigned grid, unsigned block, int nthreads, void** args) {
  return launch(K, grid, block, nthreads, args);
}

}  // namespace hvd_host

#define threadIdx (::hvd_host::ctx.thread_idx)
#define blockIdx (::hvd_host::ctx.block_idx)
#define blockDim (::hvd_host::ctx.block_dim)
#define gridDim (::hvd_host::ctx.grid_dim)

// One registry entry per kernel: name, signature and launcher (kernels/host_launch.cpp).
#define HVD_HOST_KERNEL(k) \
  ::hvd_host::Entry { #k, ::hvd_host::signature(&k), &::hvd_host::trampoline<&k> }

#endif  // HVDCOMP_HOST_SHIM_H
