// One decode step of one layer as the CUDA engine runs it, planned once and launched with one
// params struct: the memory layout of the step (pinned slots the host fills, device buffers the
// stage kernel fills, the split-K workspace) and the kernels in order on one stream: the stage
// (dca_cuda.h, LaunchDecodeStage, which also applies the dual-chunk rotary to pre-rotary rows),
// for a one-byte pool the quantiser of the new rows, the split-K kernel and the reduction. Every
// address comes from the layout, so a step captured into a CUDA graph serves any later step of its
// batch size.
#ifndef ATTND_KERNELS_CUDA_DECODE_STEP_H_
#define ATTND_KERNELS_CUDA_DECODE_STEP_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "base/dtype.h"
#include "kernels/cuda/dca_cuda.h"
#include "kernels/dca.h"

namespace attnd {

// Where a step's inputs and state live for up to max_batch rows, and the split-K plan:
//   pinned block:  DecodeStageRow [B] | q slots [B] | k slots [B] | v slots [B] (fp32-sized rows);
//   device block:  lengths int32 [B] | q bf16 [B, 3, Hq, D];
//   page tables:   [B, table_stride] int32, pinned and on the device alike;
//   output:        pinned fp32 [B, Hq, D];
//   workspace:     the largest split-K workspace of any planned batch size up to B.
struct CudaDecodeStepLayout {
  int32_t max_batch = 0;
  int64_t max_length = 0;                     // tokens of the longest sequence the pool holds
  int64_t table_stride = 0;                   // page ids per row: the pool's pages, rounded up to 4
  size_t q_slot = 0;                          // bytes of one row's q slot: 3 variants as fp32
  size_t kv_slot = 0;                         // bytes of one row's k or v slot, as fp32
  size_t host_q = 0, host_k = 0, host_v = 0;  // offsets of the slots in the pinned block
  size_t host_bytes = 0;
  size_t device_q = 0;  // offset of q in the device block (lengths at 0)
  size_t device_bytes = 0;
  size_t table_bytes = 0;   // each of the pinned and the device tables
  size_t output_bytes = 0;  // the pinned output
  size_t workspace_floats = 0;

  // The layout for `plan`'s geometry and a pool of num_pages pages of page_size tokens.
  static CudaDecodeStepLayout For(const CudaKernelPlan& plan, int32_t max_batch, int64_t num_pages,
                                  int32_t page_size);
  // Splits of a step planned for `planned_batch` rows: the same for its graph and its eager launch,
  // whatever the lengths.
  int32_t Splits(const CudaKernelPlan& plan, int32_t planned_batch) const;
};

// What one step reads and writes, all laid out by a CudaDecodeStepLayout.
struct CudaDecodeStepParams {
  DType kv_dtype = DType::kBf16;  // the pool's: bf16, int8 or fp8 E4M3
  void* k = nullptr;              // the layer's K and V data ([pages, page_size, Hkv, D])
  void* v = nullptr;
  float* k_scale = nullptr;  // one-byte pools: the layer's scale regions
  float* v_scale = nullptr;
  int32_t page_size = 0;
  void* host = nullptr;                  // the pinned block
  const int32_t* host_tables = nullptr;  // pinned tables
  int32_t* device_tables = nullptr;      // device tables, which the stage fills
  void* device = nullptr;                // the device block
  float* out = nullptr;                  // the pinned output
  float* workspace = nullptr;
  DecodeRowOut* row_outs = nullptr;  // device [B]: each row's output destination
  float* kv_rows = nullptr;          // one-byte pools: device fp32 [B, 2, Hkv, D], else null
  const float* inv_freq = nullptr;   // device rotary frequencies, or null: no pre-rotary rows
  int32_t rows = 0;                  // rows of this step (<= planned_batch)
  int32_t planned_batch = 0;         // the batch size the step is planned (and captured) for
};

// Enqueues the step's kernels on `stream` (no host synchronisation; capturable).
absl::Status LaunchDecodeStep(const CudaKernelPlan& plan, const CudaDecodeStepLayout& layout,
                              const CudaDecodeStepParams& params, cudaStream_t stream);

}  // namespace attnd

#endif  // ATTND_KERNELS_CUDA_DECODE_STEP_H_
