// host_launch.cpp: the host build of hvdcomp's kernels (g++, see kernels/host_shim.h).
//
// The .cu sources are included verbatim; this file only adds the C entry points through
// which hvdcomp/backends/host.py (ctypes) finds and launches them.  Kernel logic lives in the
// .cu files alone.  Which .cu files and kernels there are comes from hvd_host_kernels.h,
// which host.py writes next to each build from the `extern "C" __global__` declarations it
// finds in kernels/*.cu (one #include per file, then HVD_HOST_KERNEL_TABLE: one
// HVD_HOST_KERNEL(name) per kernel).
//
//   int         hvd_host_abi_version(void)
//   int         hvd_host_kernel_count(void)
//   const char* hvd_host_kernel_name(int k)
//   const char* hvd_host_kernel_signature(int k)      e.g. "PqqP" (see host_shim.h)
//   int         hvd_host_launch(int k, unsigned grid, unsigned block, int nthreads,
//                               void** args)          0 ok, 1 kernel error, 2 bad k / geometry
//   const char* hvd_host_last_error(void)
//   int         hvd_host_openmp(void)                  OpenMP version macro, 0 without OpenMP
//   int         hvd_host_simd(void)                    SIMD level in use (host_shim.h)
//   int         hvd_host_max_simd(void)                the best level this CPU supports
//   int         hvd_host_set_simd(int level)           use min(level, max) (-1: the best);
//                                                      returns the level now in use
#include "host_shim.h"

#include "hvd_host_kernels.h"

namespace {

const hvd_host::Entry kKernels[] = {HVD_HOST_KERNEL_TABLE};
constexpr int kCount = (int)(sizeof(kKernels) / sizeof(kKernels[0]));

}  // namespace

#define HVD_EXPORT extern "C" __attribute__((visibility("default")))

HVD_EXPORT int hvd_host_abi_version(void) { return 1; }

HVD_EXPORT int hvd_host_kernel_count(void) { return kCount; }

HVD_EXPORT const char* hvd_host_kernel_name(int k) {
  return (k >= 0 && k < kCount) ? kKernels[k].name : nullptr;
}

HVD_EXPORT const char* hvd_host_kernel_signature(int k) {
  return (k >= 0 && k < kCount) ? kKernels[k].signature : nullptr;
}

HVD_EXPORT int hvd_host_launch(int k, unsigned grid, unsigned block, int nthreads,
                               void** args) {
  hvd_host::ctx.status = nullptr;  // errors found here go to this thread's caller_status
  hvd_host::caller_status.flag.store(0);
  if (k < 0 || k >= kCount) {
    hvd_host::report_error("hvd_host_launch: no such kernel");
    return 2;
  }
  if (grid == 0 || block == 0 || block > 1024 || nthreads < 1) {
    hvd_host::report_error("hvd_host_launch: invalid geometry or thread count");
    return 2;
  }
  return kKernels[k].launch(grid, block, nthreads, args);
}

HVD_EXPORT const char* hvd_host_last_error(void) { return hvd_host::caller_status.message; }

HVD_EXPORT int hvd_host_openmp(void) {
#if defined(_OPENMP)
  return _OPENMP;
#else
  return 0;
#endif
}

HVD_EXPORT int hvd_host_simd(void) { return hvd_host::simd_level(); }

HVD_EXPORT int hvd_host_max_simd(void) { return hvd_host::max_simd(); }

HVD_EXPORT int hvd_host_set_simd(int level) {
  const int m = hvd_host::max_simd();
  hvd_host::simd_setting.store(level < 0 ? -1 : (level < m ? level : m));
  return hvd_host::simd_level();
}
