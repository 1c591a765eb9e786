#include "kernels/cuda/decode_step.h"

#include <algorithm>
#include <cstdint>

#include "base/status_macros.h"
#include "kernels/dual_chunk_rotary.h"

namespace attnd {
namespace {

// Every slot and buffer starts on a 256-byte boundary (the stage kernel's 16-byte loads need 16).
constexpr size_t kAlign = 256;
size_t AlignUp(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

char* At(void* base, size_t offset) { return static_cast<char*>(base) + offset; }

// The one-byte pool's view for the quantiser and the split-K kernel.
template <typename CodeT>
PagedKvBatchScaled<CodeT> ScaledBatch(const CudaDecodeStepParams& p, const PagedKvBatch& kvb) {
  PagedKvBatchScaled<CodeT> kv;
  kv.k = static_cast<CodeT*>(p.k);
  kv.v = static_cast<CodeT*>(p.v);
  kv.k_scale = p.k_scale;
  kv.v_scale = p.v_scale;
  kv.page_tables = kvb.page_tables;
  kv.page_table_stride = kvb.page_table_stride;
  kv.page_size = kvb.page_size;
  kv.num_kv_heads = kvb.num_kv_heads;
  kv.head_dim = kvb.head_dim;
  return kv;
}

// The quantiser (one-byte pools) and the split-K kernel with its reduction over a pool of KvT.
template <typename KvT>
absl::Status LaunchAttention(const CudaKernelPlan& plan, const CudaDecodeParams& dp,
                             const CudaDecodeStepParams& p, const PagedKvBatch& kvb,
                             cudaStream_t stream) {
  if constexpr (std::is_same<KvT, Bf16>::value) {
    return LaunchDcaDecode(plan, dp, stream);
  } else {
    const PagedKvBatchScaled<KvT> kv = ScaledBatch<KvT>(p, kvb);
    CudaDecodeQuantizeRowsParamsOf<KvT> qp;
    qp.kv = kv;
    qp.lengths = dp.lengths;
    qp.kv_rows = p.kv_rows;
    qp.batch = dp.batch;
    ATTND_RETURN_IF_ERROR(LaunchDecodeQuantizeRows(qp, stream));
    CudaDecodeParamsOf<KvT> dc;
    dc.kv = kv;
    dc.lengths = dp.lengths;
    dc.q = dp.q;
    dc.out = dp.out;
    dc.out_dtype = dp.out_dtype;
    dc.batch = dp.batch;
    dc.max_splits = dp.max_splits;
    dc.planned_batch = dp.planned_batch;
    dc.partial_out = dp.partial_out;
    dc.partial_lse = dp.partial_lse;
    dc.row_outs = dp.row_outs;
    return LaunchDcaDecode(plan, dc, stream);
  }
}

}  // namespace

CudaDecodeStepLayout CudaDecodeStepLayout::For(const CudaKernelPlan& plan, int32_t max_batch,
                                               int64_t num_pages, int32_t page_size) {
  const DcaGeometry& g = plan.geometry();
  const size_t b = static_cast<size_t>(max_batch);
  const size_t hq = g.num_q_heads, hkv = g.num_kv_heads, d = g.head_dim;
  CudaDecodeStepLayout l;
  l.max_batch = max_batch;
  l.max_length = num_pages * page_size;
  l.table_stride = (num_pages + 3) / 4 * 4;  // the stage kernel copies 4 ids at a time
  l.q_slot = AlignUp(kNumDecodeVariants * hq * d * 4);
  l.kv_slot = AlignUp(hkv * d * 4);
  l.host_q = AlignUp(b * sizeof(DecodeStageRow));
  l.host_k = l.host_q + b * l.q_slot;
  l.host_v = l.host_k + b * l.kv_slot;
  l.host_bytes = l.host_v + b * l.kv_slot;
  l.device_q = AlignUp(b * 4);
  l.device_bytes = l.device_q + b * kNumDecodeVariants * hq * d * 2;
  l.table_bytes = b * static_cast<size_t>(l.table_stride) * 4;
  l.output_bytes = b * hq * d * 4;
  for (int32_t batch = 1; batch <= max_batch; ++batch) {
    l.workspace_floats =
        std::max(l.workspace_floats, plan.DecodeWorkspaceFloats(batch, l.Splits(plan, batch)));
  }
  return l;
}

int32_t CudaDecodeStepLayout::Splits(const CudaKernelPlan& plan, int32_t planned_batch) const {
  return plan.DecodeSplits(planned_batch, max_length);
}

absl::Status LaunchDecodeStep(const CudaKernelPlan& plan, const CudaDecodeStepLayout& layout,
                              const CudaDecodeStepParams& p, cudaStream_t stream) {
  const DcaGeometry& g = plan.geometry();
  const bool scaled = HasRowScale(p.kv_dtype);
  if ((p.kv_dtype != DType::kBf16 && !scaled) || p.rows < 0 || p.rows > p.planned_batch ||
      p.planned_batch > layout.max_batch || (scaled && p.kv_rows == nullptr)) {
    return absl::InvalidArgumentError(
        "decode step: bad params (a KV dtype other than bf16, int8 or fp8, rows past the planned "
        "batch or the layout's, or a one-byte pool without its rows buffer)");
  }
  PagedKvBatch kvb;
  if (!scaled) {  // a one-byte pool's stage leaves the new rows in kv_rows instead
    kvb.k = static_cast<Bf16*>(p.k);
    kvb.v = static_cast<Bf16*>(p.v);
  }
  kvb.page_tables = p.device_tables;
  kvb.page_table_stride = layout.table_stride;
  kvb.page_size = p.page_size;
  kvb.num_kv_heads = g.num_kv_heads;
  kvb.head_dim = g.head_dim;
  int32_t* lengths = static_cast<int32_t*>(p.device);
  Bf16* q = reinterpret_cast<Bf16*>(At(p.device, layout.device_q));

  CudaDecodeStageParams sp;
  sp.kv = kvb;
  sp.rows = static_cast<const DecodeStageRow*>(p.host);
  sp.host_tables = p.host_tables;
  sp.host_q = At(p.host, layout.host_q);
  sp.host_k = At(p.host, layout.host_k);
  sp.host_v = At(p.host, layout.host_v);
  sp.q_row_bytes = static_cast<int64_t>(layout.q_slot);
  sp.kv_row_bytes = static_cast<int64_t>(layout.kv_slot);
  sp.lengths = lengths;
  sp.q = q;
  sp.row_outs = p.row_outs;
  sp.num_q_heads = g.num_q_heads;
  sp.batch = p.rows;
  sp.original_max_position_embeddings = g.original_max_position_embeddings;
  if (scaled) sp.kv_rows = p.kv_rows;
  if (p.inv_freq != nullptr) {  // the model has a rotary: pre-rotary rows may come
    ATTND_RETURN_IF_ERROR(CheckRotaryGeometry(g));
    sp.rotary.inv_freq = p.inv_freq;
    sp.rotary.half = g.rotary_dim / 2;
    sp.rotary.chunk_size = g.chunk_size;
    sp.rotary.chunk_len = g.chunk_len;
  }
  ATTND_RETURN_IF_ERROR(LaunchDecodeStage(sp, stream));

  CudaDecodeParams dp;
  dp.kv = kvb;
  dp.lengths = lengths;
  dp.q = q;
  dp.out = p.out;  // pinned: the reduction writes the host's buffer directly
  dp.out_dtype = DType::kFp32;
  dp.batch = p.rows;
  // Planned for the batch's captured size and the longest sequence the pool holds: the same
  // split layout whether this step is replayed or launched, whatever the lengths are.
  dp.planned_batch = p.planned_batch;
  dp.max_splits = layout.Splits(plan, p.planned_batch);
  if (plan.DecodeWorkspaceFloats(p.rows, dp.max_splits) > layout.workspace_floats) {
    return absl::InternalError("decode step: workspace too small");
  }
  dp.partial_out = p.workspace;
  dp.partial_lse =
      dp.partial_out + static_cast<size_t>(p.rows) * g.num_q_heads * dp.max_splits * g.head_dim;
  dp.row_outs = p.row_outs;
  switch (p.kv_dtype) {
    case DType::kInt8:
      return LaunchAttention<Int8Kv>(plan, dp, p, kvb, stream);
    case DType::kFp8E4m3:
      return LaunchAttention<Fp8E4m3>(plan, dp, p, kvb, stream);
    default:
      return LaunchAttention<Bf16>(plan, dp, p, kvb, stream);
  }
}

}  // namespace attnd
