// random.cu: the Philox streams of hvdcomp/random.py as kernels.
//
// hvd_philox_words(out, n, offset, ...): out[i] = word of index offset + i (uint32), as
//   hvdcomp.random.random_words(n, offset=offset, ...).
// hvd_uniform(out, n, offset, ...): out[i] = the float32 uniform of index offset + i, as
//   hvdcomp.random.uniform(n, offset=offset, ...).
// Used to pin the device Philox against the reference (tests/kernels) and wherever a kernel
// needs the uniforms themselves.  One thread per element, grid-stride, any geometry.
#include "hvdcomp.cuh"

extern "C" __global__ void hvd_philox_words(unsigned int* __restrict__ out, long long n,
                                            long long offset, unsigned int seed,
                                            unsigned int rank, unsigned int tensor_id,
                                            unsigned int step) {
  for (long long i = hvd::global_thread(); i < n; i += hvd::grid_threads()) {
    const long long index = offset + i;
    const hvd::Philox4 r = hvd::philox_block(index / 4, seed, rank, tensor_id, step);
    out[i] = r.w[index % 4];
  }
}

extern "C" __global__ void hvd_uniform(float* __restrict__ out, long long n, long long offset,
                                       unsigned int seed, unsigned int rank,
                                       unsigned int tensor_id, unsigned int step) {
  for (long long i = hvd::global_thread(); i < n; i += hvd::grid_threads()) {
    const long long index = offset + i;
    const hvd::Philox4 r = hvd::philox_block(index / 4, seed, rank, tensor_id, step);
    out[i] = hvd::uniform01(r.w[index % 4]);
  }
}
