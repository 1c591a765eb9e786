// The packed form of a Decode (attention.proto, DecodeRequest): the batch's q, k and v as one
// tensor each, answered with one output tensor. It exists so that a client writes and reads a batch
// with one copy per tensor and no per-entry framing (a Python client spends ~10 us of interpreter
// time per DecodeEntry it builds or reads). Here row i of each tensor becomes entry i of a
// DecodeCall as views into the request, and entry i's output is written straight into row i of the
// response's o: the packed form adds no copies over the entries form.
#ifndef ATTND_SERVER_RPC_PACKED_DECODE_H_
#define ATTND_SERVER_RPC_PACKED_DECODE_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "attnd/v1/attention.pb.h"
#include "server/config/model_config.h"
#include "server/runtime/runtime.h"

namespace attnd {

// True when `request` uses any field of the packed form (sequence_ids, q, k, v, q_layout).
bool IsPackedDecode(const v1::DecodeRequest& request);

// The packed form as any transport carries it (a DecodeRequest, a version 2 ring frame).
struct PackedTensor {
  int32_t dtype = 0;  // the wire value, unchecked
  absl::Span<const int64_t> shape;
  absl::string_view data;                 // inline bytes
  const v1::RegionRef* region = nullptr;  // or a region reference (data empty)
};
struct PackedDecodeArgs {
  absl::Span<const absl::string_view> sequence_ids;  // B
  int32_t q_layout = 0;                              // the wire value, unchecked
  PackedTensor q, k, v;
};
// The bytes of one row of each tensor and of the output ([Hq, D] of q's dtype).
struct PackedRows {
  int64_t q = 0, k = 0, v = 0, out = 0;
};

// Checks the form against the model (q_layout; q, k and v of one known dtype and B rows of the
// shapes the layout needs; inline data that fills each shape) and sets *rows. A region reference
// is refused unless `regions_allowed` (its byte_size is RegionTensors::Input's to check).
// INVALID_ARGUMENT says what was expected.
absl::Status CheckPackedDecode(const PackedDecodeArgs& args, const ModelConfig& model,
                               bool regions_allowed, PackedRows* rows);

// Fills call->entries with row i of q, k and v (RequestTensors of all B rows, inline or resolved
// from their regions; the views must outlive the call) and output row i at out + i * rows.out.
void FillPackedEntries(const PackedDecodeArgs& args, const PackedRows& rows, const RequestTensor& q,
                       const RequestTensor& k, const RequestTensor& v, char* out,
                       bool out_on_device, DecodeCall* call);

// Checks a DecodeRequest's packed form (one form, not both; B sequence ids; q, k and v inline;
// CheckPackedDecode) and fills call->entries with views into `request` (which must outlive the
// call) whose outputs are rows of response->o. INVALID_ARGUMENT says what was expected; on error
// `call` and `response` are cleared of what this wrote. The runtime still checks each entry (ids,
// values) as for the entries form.
absl::Status UnpackDecode(const v1::DecodeRequest& request, const ModelConfig& model,
                          DecodeCall* call, v1::DecodeResponse* response);

// The answer's o dtype and shape ([B, Hq, D]) and lengths from the engine's result; o's data was
// written by the engine through the entries' outputs.
void FinishPackedDecode(const DecodeResult& result, v1::DecodeResponse* response);

}  // namespace attnd

#endif  // ATTND_SERVER_RPC_PACKED_DECODE_H_
