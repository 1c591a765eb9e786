// Device helpers shared by the CUDA kernel families (dca_cuda_kernels.cuh, prefill_wgmma.cuh,
// sparse_cuda_kernels.cuh): dtype loads and stores, the paged-KV offset, and thin wrappers of the
// PTX instructions they use (cp.async, ldmatrix, mma.sync m16n8k16 bf16). Device code only:
// included by .cu files through those headers.
#ifndef ATTND_KERNELS_CUDA_DEVICE_COMMON_CUH_
#define ATTND_KERNELS_CUDA_DEVICE_COMMON_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "base/dtype.h"
#include "kernels/cuda/dca_cuda.h"
#include "kernels/paged_kv.h"

namespace attnd {
namespace cuda_common {

__device__ __forceinline__ float LoadAsFloat(const void* p, int dtype, int64_t i) {
  switch (dtype) {
    case static_cast<int>(DType::kBf16):
      return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    case static_cast<int>(DType::kFp16):
      return __half2float(static_cast<const __half*>(p)[i]);
    default:
      return static_cast<const float*>(p)[i];
  }
}

// Stores two adjacent outputs (index i even) as out_dtype.
__device__ __forceinline__ void StorePair(void* out, int dtype, int64_t i, float x, float y) {
  switch (dtype) {
    case static_cast<int>(DType::kBf16):
      *reinterpret_cast<__nv_bfloat162*>(static_cast<__nv_bfloat16*>(out) + i) =
          __floats2bfloat162_rn(x, y);
      break;
    case static_cast<int>(DType::kFp16):
      *reinterpret_cast<__half2*>(static_cast<__half*>(out) + i) = __floats2half2_rn(x, y);
      break;
    default:
      *reinterpret_cast<float2*>(static_cast<float*>(out) + i) = make_float2(x, y);
  }
}

__device__ __forceinline__ void StoreOne(void* out, int dtype, int64_t i, float x) {
  switch (dtype) {
    case static_cast<int>(DType::kBf16):
      static_cast<__nv_bfloat16*>(out)[i] = __float2bfloat16_rn(x);
      break;
    case static_cast<int>(DType::kFp16):
      static_cast<__half*>(out)[i] = __float2half_rn(x);
      break;
    default:
      static_cast<float*>(out)[i] = x;
  }
}

// Stores four adjacent outputs as out_dtype: one vector store when out + i is aligned to it, else
// four element stores.
__device__ __forceinline__ void StoreQuad(void* out, int dtype, int64_t i, float4 x) {
  const bool wide =
      dtype != static_cast<int>(DType::kBf16) && dtype != static_cast<int>(DType::kFp16);
  char* at = static_cast<char*>(out) + i * (wide ? 4 : 2);
  if (reinterpret_cast<uintptr_t>(at) % (wide ? 16 : 8) != 0) {
    StoreOne(out, dtype, i, x.x);
    StoreOne(out, dtype, i + 1, x.y);
    StoreOne(out, dtype, i + 2, x.z);
    StoreOne(out, dtype, i + 3, x.w);
    return;
  }
  switch (dtype) {
    case static_cast<int>(DType::kBf16): {
      const __nv_bfloat162 lo = __floats2bfloat162_rn(x.x, x.y);
      const __nv_bfloat162 hi = __floats2bfloat162_rn(x.z, x.w);
      *reinterpret_cast<uint2*>(at) = make_uint2(*reinterpret_cast<const uint32_t*>(&lo),
                                                 *reinterpret_cast<const uint32_t*>(&hi));
      break;
    }
    case static_cast<int>(DType::kFp16): {
      const __half2 lo = __floats2half2_rn(x.x, x.y), hi = __floats2half2_rn(x.z, x.w);
      *reinterpret_cast<uint2*>(at) = make_uint2(*reinterpret_cast<const uint32_t*>(&lo),
                                                 *reinterpret_cast<const uint32_t*>(&hi));
      break;
    }
    default:
      *reinterpret_cast<float4*>(at) = x;
  }
}

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte global->shared copy; when !valid the 16 bytes are zero-filled and nothing is read.
__device__ __forceinline__ void CpAsync16(void* smem, const void* gmem, bool valid) {
  const int src_size = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(SmemAddr(smem)), "l"(gmem),
               "r"(src_size));
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void LdMatrixX4(uint32_t (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SmemAddr(smem)));
}
__device__ __forceinline__ void LdMatrixX4Trans(uint32_t (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SmemAddr(smem)));
}

__device__ __forceinline__ void Mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// As Mma16816 with fp16 operands (the int8 decode's exact codes and its fp16 query and weights).
__device__ __forceinline__ void Mma16816F16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                            uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t PackF16(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

__device__ __forceinline__ uint32_t PackBf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// Element offset of (pos, kv_head) in one layer's K or V region: PagedKv::Offset32 (paged_kv.h).
__device__ __forceinline__ int64_t PagedOffset(const PagedKv<Bf16>& kv, int32_t pos,
                                               int32_t kv_head) {
  return kv.Offset32(pos, kv_head);
}

// mbarriers in shared memory, by their shared-space address (SmemAddr): init with the arrival
// count, a plain arrival, and a spin on the phase parity.
__device__ __forceinline__ void MbarInit(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void MbarArrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void MbarWait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}

// The kernels of one decode step, launched with programmatic dependent launch
// (LaunchAfterPrevious in dca_cuda_launch.cuh), call this first: it lets the step's next kernel be
// dispatched as soon as every block of this one has started, so that blocks of a lower-priority
// stream (a prefill) never take the multiprocessors between two kernels of the step, then waits
// until the kernel before this one has finished and its writes are visible. Both are no-ops for
// a kernel not launched that way, and before sm_90.
__device__ __forceinline__ void StepKernelEntry() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

}  // namespace cuda_common
}  // namespace attnd

#endif  // ATTND_KERNELS_CUDA_DEVICE_COMMON_CUH_
