// The packed form of a Decode (attention.proto, DecodeRequest): the batch's q, k and v as one
// tensor each, answered with one output tensor. It exists so that a client writes and reads a batch
// with one copy per tensor and no per-entry framing (a Python client spends ~10 us of interpreter
// time per DecodeEntry it builds or reads). Here row i of each tensor becomes entry i of a
// DecodeCall as views into the request, and entry i's output is written straight into row i of the
// response's o: the packed form adds no copies over the entries form.
#ifndef ATTND_SERVER_RPC_PACKED_DECODE_H_
#define ATTND_SERVER_RPC_PACKED_DECODE_H_

#include "absl/status/status.h"
#include "attnd/v1/attention.pb.h"
#include "server/config/model_config.h"
#include "server/runtime/runtime.h"

namespace attnd {

// True when `request` uses any field of the packed form (sequence_ids, q, k, v, q_layout).
bool IsPackedDecode(const v1::DecodeRequest& request);

// Checks a packed request's form against the model (one form, not both; B sequence ids; q, k and
// v inline, one dtype, B rows of the shapes the layout needs, data that fills each shape) and fills
// call->entries with views into `request` (which must outlive the call) whose outputs are rows of
// response->o. INVALID_ARGUMENT says what was expected; on error `call` and `response` are cleared
// of what this wrote. The runtime still checks each entry (ids, values) as for the entries form.
absl::Status UnpackDecode(const v1::DecodeRequest& request, const ModelConfig& model,
                          DecodeCall* call, v1::DecodeResponse* response);

// The answer's o dtype and shape ([B, Hq, D]) and lengths from the engine's result; o's data was
// written by the engine through the entries' outputs.
void FinishPackedDecode(const DecodeResult& result, v1::DecodeResponse* response);

}  // namespace attnd

#endif  // ATTND_SERVER_RPC_PACKED_DECODE_H_
