// ATTND_HOST_DEVICE: marks the small inline functions that host code and CUDA kernels share (page
// arithmetic, the DCA rules, the rotary positions), so that each exists once. Under nvcc they are
// __host__ __device__; elsewhere plain inline.
#ifndef ATTND_KERNELS_HOST_DEVICE_H_
#define ATTND_KERNELS_HOST_DEVICE_H_

#if defined(__CUDACC__)
#define ATTND_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define ATTND_HOST_DEVICE inline
#endif

#endif  // ATTND_KERNELS_HOST_DEVICE_H_
