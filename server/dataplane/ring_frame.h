// Version 2 ring frames (proto/attnd/v1/ring_frame.h), attnd's side: the request frame's parser,
// which checks every field against the frame's bounds before anything reads through it, and the
// answer a handler fills, which the ring encodes into its response half.
#ifndef ATTND_SERVER_DATAPLANE_RING_FRAME_H_
#define ATTND_SERVER_DATAPLANE_RING_FRAME_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "attnd/v1/ring_frame.h"

namespace attnd {

// One tensor of a parsed frame: its claims (dtype, shape) and where its bytes are.
struct FrameTensor {
  ring::v2::Where where = ring::v2::kAbsent;
  int32_t dtype = 0;  // the wire value, unchecked (the shared validation judges it)
  int rank = 0;
  int64_t shape[ring::v2::kMaxRank] = {};
  absl::string_view data;       // kInline: inside the frame
  absl::string_view region_id;  // kRegion: inside the frame
  uint64_t offset = 0;          // kRegion
  uint64_t bytes = 0;           // kRegion
  absl::Span<const int64_t> dims() const { return absl::MakeConstSpan(shape, rank); }
};

struct RequestFrame {
  uint64_t bytes = 0;  // the whole frame's
  ring::v2::Op op = ring::v2::kPrefill;
  uint64_t tag = 0;
  int32_t layer = 0;
  int32_t q_layout = 0;  // the wire value, unchecked
  std::optional<int64_t> prompt_len;
  std::vector<absl::string_view> sequence_ids;  // 1 for kPrefill, B for kDecode; inside the frame
  FrameTensor q, k, v;
  FrameTensor o;                // kAbsent or kRegion
  bool device_ordered = false;  // ring::v2::kDeviceOrdered
  // With device_ordered, the ring's "output written" event (cudaEvent_t) for the engine to record;
  // RingServer sets it once the client's "ready" event has completed (the parser leaves it null).
  void* done_event = nullptr;
  // A device-ordered decode whose ring has a gate (DeviceMemoryOpener::Gate): the engine's stream
  // waits until the word at gate_word (a device address) reaches gate_value; null: the ring has
  // already waited for "ready" on the host.
  const void* gate_word = nullptr;
  uint64_t gate_value = 0;
  // RingServer sets it on a decode when the client has posted a decode of the same layer right
  // behind it (a ring of several slots): it then waits in the batcher for that one
  // (RequestContext::more_follow).
  bool more_follow = false;
};

// Reads `frame` (all of it: the bytes the length field names). Every offset and length is checked
// against the frame without overflow, counts against their caps, and enums against their values;
// INVALID_ARGUMENT names the field and what was expected. The views in `out` point into `frame`.
// What the tensors claim (dtypes, shapes, sizes) is left to the checks every transport shares.
absl::Status ParseRequestFrame(absl::string_view frame, RequestFrame* out);

// The tag of a frame too short or malformed to parse, if its header's first bytes are there (0
// otherwise): the answer to a broken frame still carries it.
uint64_t FrameTag(absl::string_view frame);

// What a handler answers a frame with. The inline output (o absent in the request) is written by
// the engine into the buffer output_buffer gives (the ring's, reused), from which the ring copies
// it into the response half once.
struct FrameAnswer {
  // Set by the ring before the handler runs: a buffer of `bytes` for the inline output of a call
  // with `num_lengths` sequences, or RESOURCE_EXHAUSTED when the response half cannot hold it.
  std::function<absl::StatusOr<char*>(uint64_t bytes, uint64_t num_lengths)> output_buffer;

  // Set by the handler on success.
  int32_t dtype = 0;
  std::vector<int64_t> shape;    // o's, [T or B, Hq, D]
  std::vector<int64_t> lengths;  // one per sequence
  bool output_in_region = false;
  const char* output = nullptr;  // the inline output (from output_buffer)
  uint64_t output_bytes = 0;

  void Clear() {
    dtype = 0;
    shape.clear();
    lengths.clear();
    output_in_region = false;
    output = nullptr;
    output_bytes = 0;
  }
};

// The response frame's layout: its header, the lengths, the message, then o at a 64-byte offset.
uint64_t ResponseOutputOffset(uint64_t num_lengths, uint64_t message_bytes);
// All of a response frame with these parts.
uint64_t ResponseBytes(uint64_t num_lengths, uint64_t message_bytes, uint64_t output_bytes);

// Everything of the response frame before o's bytes (header, lengths, message): `status` not OK
// gives a frame with its code and message and nothing else.
std::string EncodeResponseHead(uint64_t tag, uint16_t op, const absl::Status& status,
                               const FrameAnswer& answer);

}  // namespace attnd

#endif  // ATTND_SERVER_DATAPLANE_RING_FRAME_H_
