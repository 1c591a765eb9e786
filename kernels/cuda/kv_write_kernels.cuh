// Device code of the KV writes and conversions in dca_cuda.h (prefill append, decode append, the
// decode staging kernel, bf16 conversion). Included by kv_write.cu only (its kernels are not
// templates: a second includer would define them twice).
#ifndef ATTND_KERNELS_CUDA_KV_WRITE_KERNELS_CUH_
#define ATTND_KERNELS_CUDA_KV_WRITE_KERNELS_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

#include "kernels/cuda/dca_cuda_kernels.cuh"
#include "kernels/cuda/rotary_device.cuh"

namespace attnd {
namespace cuda_kernels {

// ---- append and conversion
// -----------------------------------------------------------------------

// grid-stride over num_tokens * Hkv * D elements of one sequence.
__global__ void AppendKvKernel(PagedKv<Bf16> kv, const void* k, const void* v, int in_dtype,
                               int32_t start, int64_t n, float key_scale) {
  const int64_t per_token = static_cast<int64_t>(kv.num_kv_heads) * kv.head_dim;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int32_t t = static_cast<int32_t>(i / per_token);
    const int32_t h = static_cast<int32_t>((i % per_token) / kv.head_dim);
    const int32_t d = static_cast<int32_t>(i % kv.head_dim);
    const int64_t off = PagedOffset(kv, start + t, h) + d;
    kv.k[off] = __float2bfloat16_rn(LoadAsFloat(k, in_dtype, i) * key_scale);
    kv.v[off] = __float2bfloat16_rn(LoadAsFloat(v, in_dtype, i));
  }
}

// ---- rows of scaled codes (int8, fp8)
// ---------------------------------------------------------------------
//
// How each code type quantises a row, as its base/ header's QuantizeRow does: the largest code
// magnitude, one value's code, a code's value, and whether a NaN in the row becomes its max (int8:
// yes, so the row's scale is NaN; fp8: no, the NaN keeps its own code).
template <typename CodeT>
struct ScaledCode;
template <>
struct ScaledCode<Int8Kv> {
  static constexpr float kMax = kInt8KvMax;
  static constexpr bool kNanSticks = true;
  __device__ static uint8_t Encode(float q) { return static_cast<uint8_t>(FloatToInt8Kv(q)); }
  __device__ static float Decode(uint32_t c) {
    return static_cast<float>(static_cast<int8_t>(c & 0xffu));
  }
};
template <>
struct ScaledCode<Fp8E4m3> {
  static constexpr float kMax = kFp8E4m3Max;
  static constexpr bool kNanSticks = false;
  __device__ static uint8_t Encode(float q) { return FloatToFp8E4m3(q); }
  __device__ static float Decode(uint32_t c) { return Fp8E4m3ToFloat(c & 0xffu); }
};

// One warp quantises one row of D values (one token, one kv head), lane l holding the D / 32
// values [l * D / 32, (l + 1) * D / 32): Int8QuantizeRow (base/int8_kv.h) or Fp8QuantizeRow
// (base/fp8.h) step for step. The largest |x| is exact whatever the order it is taken in, and NaN
// takes part in it as it does there (a comparison with NaN is false), so the scale, one IEEE
// division (nvcc's default -prec-div=true), and every code are the CPU's bit for bit.
template <int D, typename CodeT>
__device__ __forceinline__ void StoreCodeRow(const float (&x)[D / 32], CodeT* codes, float* scale,
                                             int lane) {
  using Code = ScaledCode<CodeT>;
  constexpr int kPer = D / 32;
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const float a = fabsf(x[i]);
    if (a > amax || (Code::kNanSticks && a != a)) amax = a;
  }
#pragma unroll
  for (int off = 16; off > 0; off /= 2) {
    const float o = __shfl_xor_sync(0xffffffffu, amax, off);
    if (o > amax || (Code::kNanSticks && o != o)) amax = o;
  }
  const float sc = amax / Code::kMax;
  uint32_t packed = 0;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const uint8_t c = sc == 0.f ? uint8_t{0} : Code::Encode(x[i] / sc);
    packed |= static_cast<uint32_t>(c) << (8 * i);
  }
  if constexpr (kPer == 4) {
    *reinterpret_cast<uint32_t*>(codes + lane * kPer) = packed;
  } else {
    static_assert(kPer == 2, "head_dim 64 or 128");
    *reinterpret_cast<uint16_t*>(codes + lane * kPer) = static_cast<uint16_t>(packed);
  }
  if (lane == 0) *scale = sc;
}

// grid-stride, one warp per (token, kv head) row of one sequence's num_tokens new tokens.
template <int D, typename CodeT>
__global__ void AppendKvCodesKernel(PagedKv<CodeT> kv, const void* k, const void* v, int in_dtype,
                                    int32_t start, int64_t rows, float key_scale) {
  constexpr int kPer = D / 32;
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  for (int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x / 32) + threadIdx.x / 32; r < rows;
       r += warps) {
    const int32_t t = static_cast<int32_t>(r / kv.num_kv_heads);
    const int32_t h = static_cast<int32_t>(r % kv.num_kv_heads);
    float xk[kPer], xv[kPer];
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int64_t src = r * D + lane * kPer + i;
      xk[i] = LoadAsFloat(k, in_dtype, src) * key_scale;
      xv[i] = LoadAsFloat(v, in_dtype, src);
    }
    const int64_t off = kv.Offset32(start + t, h);
    StoreCodeRow<D>(xk, kv.k + off, kv.k_scale + off / D, lane);
    StoreCodeRow<D>(xv, kv.v + off, kv.v_scale + off / D, lane);
  }
}

// grid (batch), block 128: sequence b's new token at lengths[b] - 1, one warp per kv head (K and
// V); rows with length 0 are skipped.
template <int D, typename CodeT>
__global__ void DecodeAppendKvCodesKernel(PagedKvBatchScaled<CodeT> kvb, const int32_t* lengths,
                                          const void* k, const void* v, int in_dtype,
                                          int64_t orig) {
  constexpr int kPer = D / 32;
  const int32_t b = blockIdx.x;
  const int32_t len = lengths[b];
  if (len < 1) return;
  const float key_scale = LengthScale(len, orig);
  const PagedKv<CodeT> kv = kvb.Seq(b);
  const int lane = threadIdx.x % 32;
  for (int h = threadIdx.x / 32; h < kv.num_kv_heads; h += blockDim.x / 32) {
    float xk[kPer], xv[kPer];
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int64_t src = (static_cast<int64_t>(b) * kv.num_kv_heads + h) * D + lane * kPer + i;
      xk[i] = LoadAsFloat(k, in_dtype, src) * key_scale;
      xv[i] = LoadAsFloat(v, in_dtype, src);
    }
    const int64_t off = kv.Offset32(len - 1, h);
    StoreCodeRow<D>(xk, kv.k + off, kv.k_scale + off / D, lane);
    StoreCodeRow<D>(xv, kv.v + off, kv.v_scale + off / D, lane);
  }
}

// grid (batch), block 128: the append of a decode step over scaled codes
// (CudaDecodeQuantizeRowsParamsOf), after the stage kernel left the rows (already length-scaled)
// in kv_rows; one warp per (K or V, kv head) row.
template <int D, typename CodeT>
__global__ void DecodeQuantizeRowsKernel(PagedKvBatchScaled<CodeT> kvb, const int32_t* lengths,
                                         const float* kv_rows) {
  cuda_common::StepKernelEntry();
  constexpr int kPer = D / 32;
  const int32_t b = blockIdx.x;
  const int32_t len = lengths[b];
  if (len < 1) return;  // a padding row of a captured batch size
  const PagedKv<CodeT> kv = kvb.Seq(b);
  const int lane = threadIdx.x % 32;
  const int64_t head0 = kv.Offset32(len - 1, 0);  // the token's first kv head
  for (int row = threadIdx.x / 32; row < 2 * kv.num_kv_heads; row += blockDim.x / 32) {
    const bool is_k = row < kv.num_kv_heads;
    const int h = is_k ? row : row - kv.num_kv_heads;
    const float* src = kv_rows +
                       ((static_cast<int64_t>(b) * 2 + (is_k ? 0 : 1)) * kv.num_kv_heads + h) * D +
                       lane * kPer;
    float x[kPer];
#pragma unroll
    for (int i = 0; i < kPer; ++i) x[i] = src[i];
    const int64_t off = head0 + int64_t{h} * D;
    StoreCodeRow<D>(x, (is_k ? kv.k : kv.v) + off, (is_k ? kv.k_scale : kv.v_scale) + off / D,
                    lane);
  }
}

// grid-stride over 8-element pieces of positions [0, num_tokens) x kv heads: bf16(code * scale)
// into dense [num_tokens, Hkv, D] rows (CudaDequantizeKvParamsOf).
template <typename CodeT>
__global__ void DequantizeKvKernel(PagedKv<CodeT> kv, Bf16* k_out, Bf16* v_out, int64_t pieces) {
  const int per_row = kv.head_dim / 8;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < pieces;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = i / per_row;  // token * Hkv + head
    const int c = static_cast<int>(i % per_row);
    const int32_t t = static_cast<int32_t>(row / kv.num_kv_heads);
    const int32_t h = static_cast<int32_t>(row % kv.num_kv_heads);
    const int64_t off = kv.Offset32(t, h);
    const int64_t so = off / kv.head_dim;
#pragma unroll
    for (int part = 0; part < 2; ++part) {
      const CodeT* codes = (part == 0 ? kv.k : kv.v) + off + c * 8;
      const float sc = (part == 0 ? kv.k_scale : kv.v_scale)[so];
      const uint2 w = *reinterpret_cast<const uint2*>(codes);
      float x[8];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        x[e] = ScaledCode<CodeT>::Decode(w.x >> (8 * e)) * sc;
        x[4 + e] = ScaledCode<CodeT>::Decode(w.y >> (8 * e)) * sc;
      }
      *reinterpret_cast<uint4*>((part == 0 ? k_out : v_out) + row * kv.head_dim + c * 8) =
          make_uint4(PackBf16(x[0], x[1]), PackBf16(x[2], x[3]), PackBf16(x[4], x[5]),
                     PackBf16(x[6], x[7]));
    }
  }
}

// ---- bf16 decode append
// ----------------------------------------------------------------------------

// grid (batch), block 128: sequence b's new token at lengths[b] - 1; rows with length 0 are
// skipped.
__global__ void DecodeAppendKvKernel(PagedKvBatch kvb, const int32_t* lengths, const void* k,
                                     const void* v, int in_dtype, int64_t orig) {
  const int32_t b = blockIdx.x;
  const int32_t len = lengths[b];
  if (len < 1) return;  // a padding row of a captured batch size: nothing to append
  const float key_scale = LengthScale(len, orig);
  const PagedKv<Bf16> kv = kvb.Seq(b);
  const int per_token = kv.num_kv_heads * kv.head_dim;
  for (int i = threadIdx.x; i < per_token; i += blockDim.x) {
    const int64_t src = static_cast<int64_t>(b) * per_token + i;
    const int64_t off = PagedOffset(kv, len - 1, i / kv.head_dim) + i % kv.head_dim;
    kv.k[off] = __float2bfloat16_rn(LoadAsFloat(k, in_dtype, src) * key_scale);
    kv.v[off] = __float2bfloat16_rn(LoadAsFloat(v, in_dtype, src));
  }
}

// grid (DecodeStageBlocksPerRow(batch), batch), block kDecodeStageThreads: CudaDecodeStageParams.
// Host memory is read over the bus, where every read is a round trip of microseconds, so a row at
// small batches takes two: its header, then every 16-byte piece of the row (q, page table, k, v,
// and the page id of the new token) loaded by its own thread before any of them is stored; a
// pre-rotary row's rotary loads (its q and k, the new page id) go out with the first pieces. A
// row's pieces, in order: q (3 * Hq * D elements of its dtype), its page table (4 ids a piece;
// tables are 16-byte aligned, so the last piece may carry up to 3 ids past num_pages, which nobody
// reads), k, v.
constexpr int kDecodeStageBlocks = 16;  // per row, at most
constexpr int kDecodeStageThreads = 256;
constexpr int kDecodeStageUnroll = 4;  // pieces in flight per thread: 16 * 256 * 4 * 16 B = 256 KB
// Blocks per row for a batch: kDecodeStageBlocks at small batches, fewer as the batch grows (a
// thread then takes more of its row, in more rounds) so that the grid stays within about one wave
// of resident blocks (two per multiprocessor at this kernel's registers, 132 multiprocessors on
// an H100 or H200): every further wave would pay the round trips again, for all its rows.
constexpr int kDecodeStageGridBlocks = 256;
inline int DecodeStageBlocksPerRow(int batch) {
  return batch >= kDecodeStageGridBlocks
             ? 1
             : std::min(kDecodeStageBlocks, kDecodeStageGridBlocks / std::max(batch, 1));
}

// The `n` (16 / element size) values of one 16-byte piece of `dtype` elements, as floats.
__device__ __forceinline__ int PieceToFloats(const uint4& piece, int dtype, float (&x)[8]) {
  const uint32_t w[4] = {piece.x, piece.y, piece.z, piece.w};
  if (dtype == static_cast<int>(DType::kFp32)) {
#pragma unroll
    for (int i = 0; i < 4; ++i) x[i] = __uint_as_float(w[i]);
    return 4;
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const uint16_t h = static_cast<uint16_t>(w[i / 2] >> (16 * (i % 2)));
    x[i] = dtype == static_cast<int>(DType::kBf16) ? __bfloat162float(__ushort_as_bfloat16(h))
                                                   : __half2float(__ushort_as_half(h));
  }
  return 8;
}

// Stores n (4 or 8) floats as bf16 at dst (8- or 16-byte aligned).
__device__ __forceinline__ void StoreBf16Piece(Bf16* dst, const float (&x)[8], int n, float scale) {
  const uint32_t p0 = PackBf16(x[0] * scale, x[1] * scale);
  const uint32_t p1 = PackBf16(x[2] * scale, x[3] * scale);
  if (n == 4) {
    *reinterpret_cast<uint2*>(dst) = make_uint2(p0, p1);
  } else {
    *reinterpret_cast<uint4*>(dst) = make_uint4(p0, p1, PackBf16(x[4] * scale, x[5] * scale),
                                                PackBf16(x[6] * scale, x[7] * scale));
  }
}

__device__ __forceinline__ int32_t DTypeBytes(int dtype) {
  return dtype == static_cast<int>(DType::kFp32) ? 4 : 2;
}

// One 16-byte piece at `src`, which is at least 2-byte aligned (pinned slots are 16-byte aligned;
// a device row's tensors have their dtype's alignment): one load when it can be, else narrower
// ones (device memory, so a few more loads cost nothing like a bus round trip).
__device__ __forceinline__ uint4 LoadPiece(const char* src) {
  const uintptr_t at = reinterpret_cast<uintptr_t>(src);
  if (at % 16 == 0) return *reinterpret_cast<const uint4*>(src);
  uint32_t w[4];
  if (at % 4 == 0) {
#pragma unroll
    for (int i = 0; i < 4; ++i) w[i] = reinterpret_cast<const uint32_t*>(src)[i];
  } else {
    const uint16_t* h = reinterpret_cast<const uint16_t*>(src);
#pragma unroll
    for (int i = 0; i < 4; ++i) w[i] = uint32_t{h[2 * i]} | (uint32_t{h[2 * i + 1]} << 16);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// The dual-chunk rotary of one pre-rotary row at position pos, spread over the row's stage
// blocks: q [Hq, D] (q_dtype at q_src) becomes its three bf16 decode variants at qv ([3, Hq, D]),
// each variant by its own position, and the key [Hkv, D] (k_dtype at k_src) is rotated by the
// intra position and handed to store_key(element, value). One unit per thread per pass: a q dim
// pair (its three variants), a key dim pair, then the dims past rotary_dim (copied). Each thread
// computes the cos and sin it needs (RotaryCosSin, fp64): no shared table, so no barrier between
// a row's loads and its stores.
template <typename StoreKey>
__device__ __forceinline__ void DecodeStageRotary(const CudaDecodeStageParams::Rotary& rot,
                                                  int64_t pos, const char* q_src, int q_dtype,
                                                  const char* k_src, int k_dtype, int hq, int hkv,
                                                  int D, Bf16* qv, StoreKey&& store_key) {
  const int half = rot.half, rd = 2 * half, rest = D - rd;
  const int64_t n_qp = int64_t{hq} * half, n_kp = int64_t{hkv} * half;
  const int64_t n_qr = int64_t{hq} * rest, n_kr = int64_t{hkv} * rest;
  const int64_t variant_elems = int64_t{hq} * D;
  const int64_t step = int64_t{gridDim.x} * blockDim.x;
  for (int64_t u = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; u < n_qp + n_kp + n_qr + n_kr;
       u += step) {
    if (u < n_qp) {
      const int h = static_cast<int>(u / half), i = static_cast<int>(u % half);
      const int64_t e = int64_t{h} * D + i;
      const float x1 = LoadAsFloat(q_src, q_dtype, e), x2 = LoadAsFloat(q_src, q_dtype, e + half);
#pragma unroll
      for (int v = 0; v < kNumDecodeVariants; ++v) {
        float c, s;
        cuda_common::RotaryCosSin(v, pos, i, rot.chunk_size, rot.chunk_len, rot.inv_freq, &c, &s);
        qv[v * variant_elems + e] = __float2bfloat16_rn(x1 * c - x2 * s);
        qv[v * variant_elems + e + half] = __float2bfloat16_rn(x2 * c + x1 * s);
      }
    } else if (u < n_qp + n_kp) {
      const int64_t k = u - n_qp;
      const int h = static_cast<int>(k / half), i = static_cast<int>(k % half);
      const int64_t e = int64_t{h} * D + i;
      const float x1 = LoadAsFloat(k_src, k_dtype, e), x2 = LoadAsFloat(k_src, k_dtype, e + half);
      float c, s;
      cuda_common::RotaryCosSin(kIntra, pos, i, rot.chunk_size, rot.chunk_len, rot.inv_freq, &c,
                                &s);
      store_key(e, x1 * c - x2 * s);
      store_key(e + half, x2 * c + x1 * s);
    } else if (u < n_qp + n_kp + n_qr) {
      const int64_t k = u - n_qp - n_kp;
      const int64_t e = (k / rest) * D + rd + k % rest;
      const Bf16 x = __float2bfloat16_rn(LoadAsFloat(q_src, q_dtype, e));
#pragma unroll
      for (int v = 0; v < kNumDecodeVariants; ++v) qv[v * variant_elems + e] = x;
    } else {
      const int64_t k = u - n_qp - n_kp - n_qr;
      const int64_t e = (k / rest) * D + rd + k % rest;
      store_key(e, LoadAsFloat(k_src, k_dtype, e));
    }
  }
}

// Whether this thread has a key unit (a rotated pair or a copied dim) in DecodeStageRotary's walk.
__device__ __forceinline__ bool DecodeStageRotaryStoresKey(const CudaDecodeStageParams::Rotary& rot,
                                                           int hq, int hkv, int D) {
  const int half = rot.half, rest = D - 2 * half;
  const int64_t n_qp = int64_t{hq} * half, n_kp = int64_t{hkv} * half;
  const int64_t n_qr = int64_t{hq} * rest, n_kr = int64_t{hkv} * rest;
  const int64_t step = int64_t{gridDim.x} * blockDim.x;
  for (int64_t u = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; u < n_qp + n_kp + n_qr + n_kr;
       u += step) {
    if ((u >= n_qp && u < n_qp + n_kp) || u >= n_qp + n_kp + n_qr) return true;
  }
  return false;
}

// kFloatRows: the stage of a pool of scaled codes (CudaDecodeStageParams::kv_rows): the new token's
// K/V rows go to kv_rows as fp32 (the key length-scaled), not into the pool, and the new token's
// page id is not read.
template <bool kFloatRows>
__device__ __forceinline__ void DecodeStage(PagedKvBatch kvb, const DecodeStageRow* rows,
                                            const int32_t* host_tables, const char* host_q,
                                            const char* host_k, const char* host_v,
                                            int64_t q_row_bytes, int64_t kv_row_bytes,
                                            int32_t* lengths, Bf16* q, DecodeRowOut* row_outs,
                                            int32_t num_q_heads, int64_t orig, float* kv_rows,
                                            CudaDecodeStageParams::Rotary rot) {
  cuda_common::StepKernelEntry();
  const int32_t r = blockIdx.y;
  __shared__ DecodeStageRow row;
  if (threadIdx.x == 0) row = rows[r];
  __syncthreads();
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    lengths[r] = max(row.length, 0);
    if (row_outs != nullptr) {
      DecodeRowOut o;
      if (row.length >= 1) {
        o.out = row.out;
        o.dtype = row.out_dtype;
      }
      row_outs[r] = o;
    }
  }
  if (row.length < 1) return;  // padding of a captured batch size: nothing else

  const int64_t stride = kvb.page_table_stride;
  const int32_t* host_table = host_tables + r * stride;
  const int D = kvb.head_dim;
  const int64_t q_elems = int64_t{3} * num_q_heads * D, kv_elems = int64_t{kvb.num_kv_heads} * D;
  // A pre-rotary row's q and k go through DecodeStageRotary below, not as pieces.
  const bool rotary = row.rotary != 0;
  const int k_dtype = row.k_dtype;
  const int64_t n_q = rotary ? 0 : q_elems * DTypeBytes(row.q_dtype) / 16;
  const int64_t n_t = (row.num_pages + 3) / 4;
  const int64_t n_k = rotary ? 0 : kv_elems * DTypeBytes(k_dtype) / 16;
  const int64_t n_v = kv_elems * DTypeBytes(row.v_dtype) / 16;
  const int64_t total = n_q + n_t + n_k + n_v;
  const int64_t step = int64_t{gridDim.x} * blockDim.x;
  const int32_t pos = row.length - 1;  // the new token
  const uint32_t ps = static_cast<uint32_t>(kvb.page_size);
  const PageIndexer pages(kvb.page_size);
  const float key_scale = LengthScale(row.length, orig);
  // Where the row's pieces come from: its pinned slots, or its device tensors. q's variant rows
  // may be apart (a device q's pitch); a slot's are dense.
  const int64_t q_variant_bytes = int64_t{num_q_heads} * D * DTypeBytes(row.q_dtype);
  const char* q_src = row.q != nullptr ? static_cast<const char*>(row.q) : host_q + r * q_row_bytes;
  const int64_t q_pitch = row.q != nullptr ? row.q_pitch : q_variant_bytes;
  const char* k_src =
      row.k != nullptr ? static_cast<const char*>(row.k) : host_k + r * kv_row_bytes;
  const char* v_src =
      row.v != nullptr ? static_cast<const char*>(row.v) : host_v + r * kv_row_bytes;
  const int64_t new_slot_in_page = pages.Slot(static_cast<uint32_t>(pos));
  const int32_t* new_page_id = host_table + pages.Page(static_cast<uint32_t>(pos));
  // Pieces [base, base + kDecodeStageUnroll * step) of this thread, and the new token's page id
  // when one of them is k or v: loads only (stores come in store_pieces), so that a caller can
  // have them in flight beside other loads.
  auto load_pieces = [&](int64_t base, uint4(&piece)[kDecodeStageUnroll], int32_t& page) {
    bool appends = false;
#pragma unroll
    for (int u = 0; u < kDecodeStageUnroll; ++u) {
      const int64_t i = base + u * step;
      if (i >= total) continue;
      const char* src;
      if (i < n_q) {
        // A variant row is a whole number of pieces (head_dim is a multiple of 8).
        const int64_t variant = i * 16 / q_variant_bytes;
        src = q_src + variant * q_pitch + (i * 16 - variant * q_variant_bytes);
      } else if (i < n_q + n_t) {
        src = reinterpret_cast<const char*>(host_table) + (i - n_q) * 16;
      } else if (i < n_q + n_t + n_k) {
        src = k_src + (i - n_q - n_t) * 16;
        appends = true;
      } else {
        src = v_src + (i - n_q - n_t - n_k) * 16;
        appends = true;
      }
      piece[u] = LoadPiece(src);
    }
    if (!kFloatRows && appends) page = *new_page_id;
  };
  auto store_pieces = [&](int64_t base, const uint4(&piece)[kDecodeStageUnroll], int32_t page) {
#pragma unroll
    for (int u = 0; u < kDecodeStageUnroll; ++u) {
      const int64_t i = base + u * step;
      if (i >= total) continue;
      float x[8];
      if (i < n_q) {
        const int n = PieceToFloats(piece[u], row.q_dtype, x);
        StoreBf16Piece(q + r * q_elems + i * n, x, n, 1.f);
      } else if (i < n_q + n_t) {
        int32_t* table = const_cast<int32_t*>(kvb.page_tables) + r * stride;
        *reinterpret_cast<uint4*>(table + (i - n_q) * 4) = piece[u];
      } else {
        const bool is_k = i < n_q + n_t + n_k;
        const int n = PieceToFloats(piece[u], is_k ? k_dtype : row.v_dtype, x);
        const int64_t e = (is_k ? i - n_q - n_t : i - n_q - n_t - n_k) * n;  // first element
        if constexpr (kFloatRows) {
          float* dst = kv_rows + (int64_t{r} * 2 + (is_k ? 0 : 1)) * kv_elems + e;
          const float sc = is_k ? key_scale : 1.f;
          *reinterpret_cast<float4*>(dst) = make_float4(x[0] * sc, x[1] * sc, x[2] * sc, x[3] * sc);
          if (n == 8) {
            *reinterpret_cast<float4*>(dst + 4) =
                make_float4(x[4] * sc, x[5] * sc, x[6] * sc, x[7] * sc);
          }
          continue;
        }
        const int64_t off =
            (PagedTokenIndex(page, new_slot_in_page, ps) * kvb.num_kv_heads + e / D) * D + e % D;
        StoreBf16Piece((is_k ? kvb.k : kvb.v) + off, x, n, is_k ? key_scale : 1.f);
      }
    }
  };

  int64_t base = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  uint4 piece[kDecodeStageUnroll];
  int32_t page = 0;
  // The first round of pieces is loaded before a pre-rotary row's rotary, whose loads (q, k, the
  // new page id) then travel with them: one bus round trip after the row's header, not two.
  if (base < total) load_pieces(base, piece, page);
  if (rotary) {
    // Where the new key's element e (head e / D) goes: the pool (bf16, length-scaled) or, for a
    // pool of scaled codes, kv_rows as fp32. Only the threads that store a key element read the
    // page id (over the bus, beside the rotary's own loads).
    const int32_t new_page =
        !kFloatRows && DecodeStageRotaryStoresKey(rot, num_q_heads, kvb.num_kv_heads, D)
            ? *new_page_id
            : 0;
    const int64_t new_slot = PagedTokenIndex(new_page, new_slot_in_page, ps) * kvb.num_kv_heads * D;
    auto store_key = [&](int64_t e, float x) {
      if constexpr (kFloatRows) {
        kv_rows[int64_t{r} * 2 * kv_elems + e] = x * key_scale;
      } else {
        kvb.k[new_slot + e] = __float2bfloat16_rn(x * key_scale);
      }
    };
    DecodeStageRotary(rot, pos, q_src, row.q_dtype, k_src, k_dtype, num_q_heads, kvb.num_kv_heads,
                      D, q + r * q_elems, store_key);
  }
  for (; base < total; base += step * kDecodeStageUnroll) {
    if (base != int64_t{blockIdx.x} * blockDim.x + threadIdx.x) load_pieces(base, piece, page);
    store_pieces(base, piece, page);
  }
}

__global__ void __launch_bounds__(kDecodeStageThreads)
    DecodeStageKernel(PagedKvBatch kvb, const DecodeStageRow* rows, const int32_t* host_tables,
                      const char* host_q, const char* host_k, const char* host_v,
                      int64_t q_row_bytes, int64_t kv_row_bytes, int32_t* lengths, Bf16* q,
                      DecodeRowOut* row_outs, int32_t num_q_heads, int64_t orig,
                      CudaDecodeStageParams::Rotary rot) {
  DecodeStage<false>(kvb, rows, host_tables, host_q, host_k, host_v, q_row_bytes, kv_row_bytes,
                     lengths, q, row_outs, num_q_heads, orig, nullptr, rot);
}
__global__ void __launch_bounds__(kDecodeStageThreads)
    DecodeStageFloatRowsKernel(PagedKvBatch kvb, const DecodeStageRow* rows,
                               const int32_t* host_tables, const char* host_q, const char* host_k,
                               const char* host_v, int64_t q_row_bytes, int64_t kv_row_bytes,
                               int32_t* lengths, Bf16* q, DecodeRowOut* row_outs,
                               int32_t num_q_heads, int64_t orig, float* kv_rows,
                               CudaDecodeStageParams::Rotary rot) {
  DecodeStage<true>(kvb, rows, host_tables, host_q, host_k, host_v, q_row_bytes, kv_row_bytes,
                    lengths, q, row_outs, num_q_heads, orig, kv_rows, rot);
}

__global__ void ConvertToBf16Kernel(const void* src, int dtype, int64_t n, Bf16* dst) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    dst[i] = __float2bfloat16_rn(LoadAsFloat(src, dtype, i));
  }
}

}  // namespace cuda_kernels
}  // namespace attnd

#endif  // ATTND_KERNELS_CUDA_KV_WRITE_KERNELS_CUH_
