// Version 2 of the shared-memory ring's messages (docs/regions.md, "Ring frames"): a fixed binary
// frame instead of a serialized SessionRequest / SessionResponse, so that a tensor crosses the
// ring with one copy on each side (the client writes q, k and v into the request half; attnd copies
// the frame out once and hands the engine views into that copy; the engine's output is copied into
// the response half once). A ring carries these frames when its header's version (shm_ring.h) is
// kVersion; version 1 rings carry protobuf, as before.
//
// A half holds, as in version 1, the frame's length (uint64) and then the frame. Every offset below
// counts from the frame's first byte (the half's ninth); every field is little-endian (the host's
// order: the ring never leaves the host). The structs are copied out of the frame with memcpy, so
// the frame needs no alignment; the client places inline tensors at 64-byte offsets all the same.
//
// Request frame: RequestHeader, then (anywhere after it, at the offsets it names) the sequence ids'
// StrRefs, the id bytes, region ids and inline tensor bytes.
//   op kPrefill: one sequence; q [T, 5, Hq, D] (or [T, Hq, D] pre-rotary), k and v [T, Hkv, D].
//   op kDecode: B sequences; q [B, 3 or 5, Hq, D] (or [B, Hq, D] pre-rotary), k and v [B, Hkv, D]:
//     row i belongs to sequence i (the packed Decode form of attention.proto).
//   q, k, v: kInline (bytes inside the frame) or kRegion (a registered region); o: kAbsent (the
//   output comes back inline in the response frame) or kRegion (attnd writes it there).
// Response frame: ResponseHeader, then the message, the lengths and o's bytes where it says.
#ifndef ATTND_PROTO_ATTND_V1_RING_FRAME_H_
#define ATTND_PROTO_ATTND_V1_RING_FRAME_H_

#include <cstddef>
#include <cstdint>

namespace attnd::ring::v2 {

inline constexpr uint32_t kVersion = 2;                  // ring::Header::version of such a ring
inline constexpr uint32_t kRequestMagic = 0x32514652u;   // "RFQ2" read as little-endian
inline constexpr uint32_t kResponseMagic = 0x32524652u;  // "RFR2"
inline constexpr int kMaxRank = 4;
// The most sequences one decode frame names (the batcher's largest batch is far smaller).
inline constexpr uint32_t kMaxSequences = 4096;
// Where inline tensors and the response's o start within a frame (a convention, not a check).
inline constexpr uint64_t kTensorAlign = 64;

enum Op : uint16_t { kPrefill = 1, kDecode = 2 };
enum Where : uint16_t { kAbsent = 0, kInline = 1, kRegion = 2 };
// RequestHeader::flags.
inline constexpr uint32_t kHasPromptLen = 1;
// Ordered with the client's CUDA stream by the ring's two events (OpenRingRequest device_events;
// docs/regions.md, "Device-ordered rings"): attnd waits for the ready event (the client's stream
// has written q, k and v) instead of the client synchronizing, and records the done event on its
// stream once o is written; q, k, v and o must be CUDA IPC regions. attnd answers once the work is
// queued: o is there when the done event is.
inline constexpr uint32_t kDeviceOrdered = 2;
// ResponseHeader::flags: o was written into the request's output region (no bytes in the frame).
inline constexpr uint32_t kOutputInRegion = 1;

// A string inside the frame.
struct StrRef {
  uint32_t offset;
  uint32_t bytes;
};
static_assert(sizeof(StrRef) == 8);

struct Tensor {
  uint16_t where;  // Where
  uint16_t rank;   // dims in shape[0, rank); at most kMaxRank
  int32_t dtype;   // attnd.v1.DType's wire value (bf16 1, fp16 2, fp32 3)
  // kInline: the bytes at [offset, offset + bytes) of the frame. kRegion: [offset, offset + bytes)
  // of the region named by region_id (as attnd.v1.RegionRef's offset and byte_size).
  uint64_t offset;
  uint64_t bytes;
  StrRef region_id;  // kRegion only
  int64_t shape[kMaxRank];
};
static_assert(sizeof(Tensor) == 64);
static_assert(offsetof(Tensor, dtype) == 4);
static_assert(offsetof(Tensor, offset) == 8);
static_assert(offsetof(Tensor, bytes) == 16);
static_assert(offsetof(Tensor, region_id) == 24);
static_assert(offsetof(Tensor, shape) == 32);

struct RequestHeader {
  uint32_t magic;     // kRequestMagic
  uint16_t op;        // Op
  uint16_t q_layout;  // attnd.v1.QLayout's wire value (variants 0, pre-rotary 1)
  uint64_t tag;       // echoed in the response
  int32_t layer;
  uint32_t num_sequences;  // 1 for kPrefill; B (1..kMaxSequences) for kDecode
  uint32_t flags;          // kHasPromptLen
  uint32_t reserved;       // 0
  int64_t prompt_len;      // kPrefill with kHasPromptLen (PrefillRequest.prompt_len)
  uint64_t ids_offset;     // num_sequences StrRefs, the sequence ids
  Tensor q, k, v;
  Tensor o;  // kAbsent, or kRegion: the output region (only region_id, offset and bytes are read)
};
static_assert(sizeof(RequestHeader) == 304);
static_assert(offsetof(RequestHeader, op) == 4);
static_assert(offsetof(RequestHeader, q_layout) == 6);
static_assert(offsetof(RequestHeader, tag) == 8);
static_assert(offsetof(RequestHeader, layer) == 16);
static_assert(offsetof(RequestHeader, num_sequences) == 20);
static_assert(offsetof(RequestHeader, flags) == 24);
static_assert(offsetof(RequestHeader, prompt_len) == 32);
static_assert(offsetof(RequestHeader, ids_offset) == 40);
static_assert(offsetof(RequestHeader, q) == 48);
static_assert(offsetof(RequestHeader, k) == 112);
static_assert(offsetof(RequestHeader, v) == 176);
static_assert(offsetof(RequestHeader, o) == 240);

struct ResponseHeader {
  uint32_t magic;           // kResponseMagic
  int32_t code;             // google.rpc.Code (the Session's SessionResponse.code): 0 = OK
  uint64_t tag;             // the request's
  uint16_t op;              // the request's (0 when the request was not readable)
  uint16_t rank;            // o's: 3, [T or B, Hq, D]
  int32_t dtype;            // o's (q's dtype)
  uint32_t num_lengths;     // OK: 1 for kPrefill, B for kDecode
  uint32_t flags;           // kOutputInRegion
  uint64_t message_offset;  // the status message (UTF-8), when code != 0
  uint64_t message_bytes;
  uint64_t o_offset;  // OK without an output region: o's bytes inside the frame
  uint64_t o_bytes;
  uint64_t lengths_offset;  // num_lengths int64: each sequence's layer length after the call
  int64_t shape[kMaxRank];  // o's
};
static_assert(sizeof(ResponseHeader) == 104);
static_assert(offsetof(ResponseHeader, code) == 4);
static_assert(offsetof(ResponseHeader, tag) == 8);
static_assert(offsetof(ResponseHeader, op) == 16);
static_assert(offsetof(ResponseHeader, rank) == 18);
static_assert(offsetof(ResponseHeader, dtype) == 20);
static_assert(offsetof(ResponseHeader, num_lengths) == 24);
static_assert(offsetof(ResponseHeader, flags) == 28);
static_assert(offsetof(ResponseHeader, message_offset) == 32);
static_assert(offsetof(ResponseHeader, o_offset) == 48);
static_assert(offsetof(ResponseHeader, lengths_offset) == 64);
static_assert(offsetof(ResponseHeader, shape) == 72);

inline constexpr uint64_t AlignUp(uint64_t n, uint64_t to) { return (n + to - 1) / to * to; }

}  // namespace attnd::ring::v2

#endif  // ATTND_PROTO_ATTND_V1_RING_FRAME_H_
