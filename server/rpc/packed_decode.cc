#include "server/rpc/packed_decode.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/dtype.h"
#include "kernels/dca.h"

namespace attnd {
namespace {

std::string Shape(absl::Span<const int64_t> shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// The form the layout needs after the batch dimension, for messages and the check.
std::vector<std::vector<int64_t>> RowShapes(const char* name, int32_t q_layout,
                                            const ModelConfig& m) {
  if (name[0] != 'q') return {{m.num_kv_heads, m.head_dim}};
  if (q_layout == v1::Q_LAYOUT_PRE_ROTARY) return {{m.num_q_heads, m.head_dim}};
  return {{kNumDecodeVariants, m.num_q_heads, m.head_dim},
          {kNumQueryVariants, m.num_q_heads, m.head_dim}};
}

std::string Expected(int64_t b, const std::vector<std::vector<int64_t>>& rows) {
  std::vector<std::string> forms;
  for (const std::vector<int64_t>& r : rows) {
    forms.push_back(absl::StrCat("[", b, ", ", absl::StrJoin(r, ", "), "]"));
  }
  return absl::StrJoin(forms, " or ");
}

// Checks one packed tensor; returns the bytes of one row.
absl::Status CheckPacked(const char* name, const PackedTensor& t, int64_t b, int32_t q_layout,
                         const ModelConfig& m, bool regions_allowed, int64_t* row_bytes) {
  const auto fail = [&](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat("packed ", name, ": ", what));
  };
  if (t.region != nullptr && !regions_allowed) {
    return fail(
        "carries a region reference; the packed form's tensors travel inline (data): "
        "send tensors in regions with the entries form");
  }
  const DType dtype = static_cast<DType>(t.dtype);
  if (!IsKnownDType(dtype)) {
    return fail(absl::StrCat("dtype must be bf16, fp16 or fp32, got wire value ", t.dtype));
  }
  const std::vector<std::vector<int64_t>> rows = RowShapes(name, q_layout, m);
  bool shaped = false;
  for (const std::vector<int64_t>& r : rows) {
    shaped = shaped || (t.shape.size() == r.size() + 1 && t.shape[0] == b &&
                        std::equal(r.begin(), r.end(), t.shape.begin() + 1));
  }
  if (!shaped) {
    return fail(absl::StrCat("shape must be ", Expected(b, rows), " (one row per sequence_id, ", b,
                             " sequence_ids), got ", Shape(t.shape)));
  }
  int64_t row = static_cast<int64_t>(ElementSize(dtype));
  for (size_t i = 1; i < t.shape.size(); ++i)
    row *= t.shape[i];  // small: checked against the model
  if (t.region == nullptr && static_cast<int64_t>(t.data.size()) != row * b) {
    return fail(absl::StrCat("shape ", Shape(t.shape), " of ", DTypeName(dtype), " needs ", row * b,
                             " bytes of data, got ", t.data.size()));
  }
  *row_bytes = row;
  return absl::OkStatus();
}

RequestTensor Row(const RequestTensor& t, int64_t i, int64_t row_bytes) {
  RequestTensor r;
  r.dtype = t.dtype;
  r.shape = t.shape.subspan(1);
  r.bytes = t.bytes.substr(static_cast<size_t>(i * row_bytes), static_cast<size_t>(row_bytes));
  r.on_device = t.on_device;
  return r;
}

PackedTensor FromProto(const v1::Tensor& t) {
  PackedTensor p;
  p.dtype = t.dtype();
  p.shape = absl::MakeConstSpan(t.shape().data(), t.shape().size());
  p.data = t.data();
  if (t.has_region()) p.region = &t.region();
  return p;
}

RequestTensor Inline(const PackedTensor& t) {
  RequestTensor r;
  r.dtype = static_cast<DType>(t.dtype);
  r.shape = t.shape;
  r.bytes = t.data;
  return r;
}

}  // namespace

bool IsPackedDecode(const v1::DecodeRequest& request) {
  return request.sequence_ids_size() > 0 || request.has_q() || request.has_k() || request.has_v() ||
         request.q_layout() != 0;
}

absl::Status CheckPackedDecode(const PackedDecodeArgs& args, const ModelConfig& model,
                               bool regions_allowed, PackedRows* rows) {
  const int64_t b = static_cast<int64_t>(args.sequence_ids.size());
  const int32_t layout = args.q_layout;
  if (layout != v1::Q_LAYOUT_VARIANTS && layout != v1::Q_LAYOUT_PRE_ROTARY) {
    return absl::InvalidArgumentError(absl::StrCat(
        "packed q_layout must be Q_LAYOUT_VARIANTS (0) or Q_LAYOUT_PRE_ROTARY (1), got ", layout));
  }
  for (const auto& [name, t, row] :
       {std::make_tuple("q", &args.q, &rows->q), std::make_tuple("k", &args.k, &rows->k),
        std::make_tuple("v", &args.v, &rows->v)}) {
    if (absl::Status s = CheckPacked(name, *t, b, layout, model, regions_allowed, row); !s.ok()) {
      return s;
    }
  }
  if (args.q.dtype != args.k.dtype || args.q.dtype != args.v.dtype) {
    return absl::InvalidArgumentError(absl::StrCat(
        "packed q, k and v must have one dtype, got ", DTypeName(static_cast<DType>(args.q.dtype)),
        ", ", DTypeName(static_cast<DType>(args.k.dtype)), " and ",
        DTypeName(static_cast<DType>(args.v.dtype))));
  }
  rows->out = static_cast<int64_t>(model.num_q_heads) * model.head_dim *
              static_cast<int64_t>(ElementSize(static_cast<DType>(args.q.dtype)));
  return absl::OkStatus();
}

void FillPackedEntries(const PackedDecodeArgs& args, const PackedRows& rows, const RequestTensor& q,
                       const RequestTensor& k, const RequestTensor& v, char* out,
                       bool out_on_device, DecodeCall* call) {
  const int64_t b = static_cast<int64_t>(args.sequence_ids.size());
  const int32_t layout = args.q_layout;
  call->entries.resize(static_cast<size_t>(b));
  for (int64_t i = 0; i < b; ++i) {
    DecodeCall::Entry& e = call->entries[static_cast<size_t>(i)];
    e.sequence_id = args.sequence_ids[static_cast<size_t>(i)];
    e.q_layout = static_cast<QLayout>(layout);
    e.q = Row(q, i, rows.q);
    e.k = Row(k, i, rows.k);
    e.v = Row(v, i, rows.v);
    char* row = out + i * rows.out;
    const int64_t out_row = rows.out;
    e.output = [row, out_row](int64_t bytes) -> void* { return bytes == out_row ? row : nullptr; };
    e.output_on_device = out_on_device;
  }
}

absl::Status UnpackDecode(const v1::DecodeRequest& request, const ModelConfig& model,
                          DecodeCall* call, v1::DecodeResponse* response) {
  if (request.entries_size() > 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("a DecodeRequest carries entries (", request.entries_size(),
                     ") or the packed form (sequence_ids, q, k, v, q_layout), not both"));
  }
  const int64_t b = request.sequence_ids_size();
  if (b == 0) {
    return absl::InvalidArgumentError(
        "a packed DecodeRequest needs at least one sequence_id (one per row of q, k and v)");
  }
  // Views of the ids, for as long as the call: the entries hold string_views of them already.
  const std::vector<absl::string_view> ids(request.sequence_ids().begin(),
                                           request.sequence_ids().end());
  PackedDecodeArgs args;
  args.sequence_ids = ids;
  args.q_layout = request.q_layout();
  args.q = FromProto(request.q());
  args.k = FromProto(request.k());
  args.v = FromProto(request.v());
  PackedRows rows;
  if (absl::Status s = CheckPackedDecode(args, model, /*regions_allowed=*/false, &rows); !s.ok()) {
    return s;
  }
  // The engine writes entry i's [Hq, D] output into row i of o: sized once, before it runs.
  std::string* out = response->mutable_o()->mutable_data();
  out->resize(static_cast<size_t>(rows.out * b));
  FillPackedEntries(args, rows, Inline(args.q), Inline(args.k), Inline(args.v), out->data(),
                    /*out_on_device=*/false, call);
  return absl::OkStatus();
}

void FinishPackedDecode(const DecodeResult& result, v1::DecodeResponse* response) {
  v1::Tensor* o = response->mutable_o();
  if (!result.outputs.empty()) {
    const DecodeResult::Output& first = result.outputs.front();
    o->set_dtype(static_cast<v1::DType>(static_cast<int>(first.out_dtype)));
    o->mutable_shape()->Clear();
    o->add_shape(static_cast<int64_t>(result.outputs.size()));
    for (int64_t d : first.out_shape) o->add_shape(d);
  }
  response->mutable_lengths()->Reserve(static_cast<int>(result.outputs.size()));
  for (const DecodeResult::Output& out : result.outputs) response->add_lengths(out.length);
}

}  // namespace attnd
