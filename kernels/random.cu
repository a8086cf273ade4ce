// random.cu: the Philox streams of hvdcomp/philox.py as kernels.
//
// hvd_philox_words(out, n, offset, ...): out[i] = word of index offset + i (uint32), as
//   hvdcomp.philox.random_words(n, offset=offset, ...).
// hvd_uniform(out, n, offset, ...): out[i] = the float32 uniform of index offset + i, as
//   hvdcomp.philox.uniform(n, offset=offset, ...).
// Used to pin the device Philox against the reference (tests/kernels) and wherever a kernel
// needs the uniforms themselves.  One thread per element, grid-stride, any geometry.
#include "hvdcomp.cuh"

extern "C" __global__ void hvd_philox_words(unsigned int* __restrict__ out, long long n,
                                            long long offset, unsigned int seed,
                                            unsigned int rank, unsigned int tensor_id,
                                            unsigned int step) {
#if defined(HVD_HOST_BUILD)
  // host bulk path (hvdcomp.cuh, section 5): the block's elements, Philox in SIMD registers
  if (hvd::host_bulk_groups(n, [&](auto L, long long i0, long long i1) HVD_INLINE {
        hvd::bulk_stream<decltype(L)::value>(offset + i0, i1 - i0, seed, rank, tensor_id, step,
                                             out + i0, [](hvd::u32 w) HVD_INLINE { return w; });
      }))
    return;
#endif
  for (long long i = hvd::global_thread(); i < n; i += hvd::grid_threads()) {
    const long long index = offset + i;
    const hvd::Philox4 r = hvd::philox_block(index / 4, seed, rank, tensor_id, step);
    out[i] = r.w[index % 4];
  }
}

extern "C" __global__ void hvd_uniform(float* __restrict__ out, long long n, long long offset,
                                       unsigned int seed, unsigned int rank,
                                       unsigned int tensor_id, unsigned int step) {
#if defined(HVD_HOST_BUILD)
  if (hvd::host_bulk_groups(n, [&](auto L, long long i0, long long i1) HVD_INLINE {
        hvd::bulk_stream<decltype(L)::value>(
            offset + i0, i1 - i0, seed, rank, tensor_id, step, out + i0,
            [](hvd::u32 w) HVD_INLINE { return hvd::uniform01(w); });
      }))
    return;
#endif
  for (long long i = hvd::global_thread(); i < n; i += hvd::grid_threads()) {
    const long long index = offset + i;
    const hvd::Philox4 r = hvd::philox_block(index / 4, seed, rank, tensor_id, step);
    out[i] = hvd::uniform01(r.w[index % 4]);
  }
}
