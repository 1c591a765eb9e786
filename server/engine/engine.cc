#include "server/engine/engine.h"

#include <cstring>

#include "absl/strings/str_cat.h"

namespace attnd {

int64_t NumElements(const TensorView& view) {
  int64_t n = 1;
  for (int64_t d : view.shape) n *= d;
  return n;
}

int64_t NumRows(const TensorView& view) {
  int64_t n = 1;
  for (size_t i = 0; i + 2 < view.shape.size(); ++i) n *= view.shape[i];
  return n;
}

int64_t RowBytes(const TensorView& view) {
  const size_t rank = view.shape.size();
  int64_t n = 1;
  for (size_t i = rank < 2 ? 0 : rank - 2; i < rank; ++i) n *= view.shape[i];
  return n * ElementSize(view.dtype);
}

int64_t RowPitch(const TensorView& view) {
  return view.row_pitch != 0 ? view.row_pitch : RowBytes(view);
}

TensorView SliceHeads(const TensorView& view, int64_t first, int64_t count) {
  TensorView slice = view;
  const size_t rank = view.shape.size();
  const int64_t head_bytes = view.shape[rank - 1] * ElementSize(view.dtype);
  slice.row_pitch = RowPitch(view);
  slice.data = static_cast<const char*>(view.data) + first * head_bytes;
  slice.shape[rank - 2] = count;
  return slice;
}

void CopyRowsToDense(const TensorView& view, int64_t first_row, int64_t rows, void* dst) {
  const int64_t row = RowBytes(view), pitch = RowPitch(view);
  const char* src = static_cast<const char*>(view.data) + first_row * pitch;
  char* out = static_cast<char*>(dst);
  if (pitch == row) {
    std::memcpy(out, src, rows * row);
    return;
  }
  for (int64_t r = 0; r < rows; ++r) std::memcpy(out + r * row, src + r * pitch, row);
}

absl::Status CheckElements(absl::string_view name, const TensorView& view, int64_t expected) {
  if (view.data == nullptr || NumElements(view) != expected) {
    return absl::InvalidArgumentError(absl::StrCat("engine: ", name, " has ", NumElements(view),
                                                   " elements, expected ", expected));
  }
  return absl::OkStatus();
}

const std::vector<int32_t>& DefaultDecodeBatchSizes() {
  static const std::vector<int32_t> sizes = {1,  2,  4,  8,   16,  24,  32,
                                             48, 64, 96, 128, 160, 192, 256};
  return sizes;
}

namespace {

// Engine::StartPrefill's default: the whole job in one step.
class OneStepPrefill : public PrefillRun {
 public:
  OneStepPrefill(Engine* engine, const PrefillJob& job) : engine_(engine), job_(job) {}
  bool done() const override { return done_; }
  absl::Status Step() override {
    if (done_) return absl::FailedPreconditionError("the prefill run is done");
    done_ = true;
    return engine_->Prefill(job_);
  }

 private:
  Engine* const engine_;
  const PrefillJob& job_;
  bool done_ = false;
};

}  // namespace

absl::StatusOr<std::unique_ptr<PrefillRun>> Engine::StartPrefill(const PrefillJob& job) {
  return std::unique_ptr<PrefillRun>(new OneStepPrefill(this, job));
}

std::vector<EngineShard> Engine::shards() const {
  EngineShard shard;
  shard.device = device();
  shard.device_name = device_name();
  shard.device_uuid = device_uuid();
  shard.num_kv_heads = geometry().num_kv_heads;
  shard.num_q_heads = geometry().num_q_heads;
  shard.pool_bytes = layout().pool_bytes();
  return {shard};
}

}  // namespace attnd
