// ATTND_HOST_DEVICE: marks the small inline functions that host code and CUDA kernels share (page
// arithmetic, the DCA rules, the rotary positions, the fp8 and int8 conversions), so that each
// exists once. Under nvcc they are __host__ __device__; elsewhere plain inline. In base/ because
// base/fp8.h and base/int8_kv.h use it and base depends on nothing else of ours;
// kernels/host_device.h forwards here.
#ifndef ATTND_BASE_HOST_DEVICE_H_
#define ATTND_BASE_HOST_DEVICE_H_

#if defined(__CUDACC__)
#define ATTND_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define ATTND_HOST_DEVICE inline
#endif

#endif  // ATTND_BASE_HOST_DEVICE_H_
