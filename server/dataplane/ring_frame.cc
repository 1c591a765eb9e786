#include "server/dataplane/ring_frame.h"

#include <algorithm>
#include <cstring>
#include <tuple>

#include "absl/strings/str_cat.h"

namespace attnd {
namespace {

namespace v2 = ring::v2;

absl::Status Bad(absl::string_view what) {
  return absl::InvalidArgumentError(
      absl::StrCat("ring frame: ", what, " (proto/attnd/v1/ring_frame.h)"));
}

// [offset, offset + bytes) lies inside a frame of `size` bytes (no overflow: offset <= size first).
bool Inside(uint64_t offset, uint64_t bytes, uint64_t size) {
  return offset <= size && bytes <= size - offset;
}

absl::Status ReadStr(absl::string_view frame, const v2::StrRef& ref, absl::string_view what,
                     absl::string_view* out) {
  if (!Inside(ref.offset, ref.bytes, frame.size())) {
    return Bad(absl::StrCat(what, " [", ref.offset, ", +", ref.bytes, ") lies outside the ",
                            frame.size(), "-byte frame"));
  }
  *out = frame.substr(ref.offset, ref.bytes);
  return absl::OkStatus();
}

absl::Status ReadTensor(absl::string_view frame, const v2::Tensor& t, absl::string_view name,
                        bool output, FrameTensor* out) {
  *out = FrameTensor();
  switch (t.where) {
    case v2::kAbsent:
      if (!output)
        return Bad(absl::StrCat(name, " is absent; it must be inline (1) or a region (2)"));
      return absl::OkStatus();
    case v2::kInline:
      if (output) {
        return Bad(absl::StrCat(name,
                                " is inline; it must be absent (0: the output comes back in "
                                "the response frame) or a region (2)"));
      }
      if (!Inside(t.offset, t.bytes, frame.size())) {
        return Bad(absl::StrCat(name, "'s inline bytes [", t.offset, ", +", t.bytes,
                                ") lie outside the ", frame.size(), "-byte frame"));
      }
      out->data = frame.substr(t.offset, t.bytes);
      break;
    case v2::kRegion: {
      absl::Status s =
          ReadStr(frame, t.region_id, absl::StrCat(name, "'s region id"), &out->region_id);
      if (!s.ok()) return s;
      out->offset = t.offset;
      out->bytes = t.bytes;
      break;
    }
    default:
      return Bad(absl::StrCat(name, "'s where is ", t.where,
                              "; it must be absent (0), inline (1) or a region (2)"));
  }
  out->where = static_cast<v2::Where>(t.where);
  if (output) return absl::OkStatus();  // only the reference is read
  if (t.rank > v2::kMaxRank) {
    return Bad(absl::StrCat(name, "'s rank is ", t.rank, "; at most ", v2::kMaxRank));
  }
  out->dtype = t.dtype;
  out->rank = t.rank;
  for (int i = 0; i < t.rank; ++i) out->shape[i] = t.shape[i];
  return absl::OkStatus();
}

}  // namespace

absl::Status ParseRequestFrame(absl::string_view frame, RequestFrame* out) {
  v2::RequestHeader h;
  if (frame.size() < sizeof(h)) {
    return Bad(absl::StrCat("a request frame is at least its ", sizeof(h), "-byte header, got ",
                            frame.size(), " bytes"));
  }
  std::memcpy(&h, frame.data(), sizeof(h));
  if (h.magic != v2::kRequestMagic) {
    return Bad(absl::StrCat("the request header's magic is 0x", absl::Hex(h.magic), ", not 0x",
                            absl::Hex(v2::kRequestMagic)));
  }
  if (h.op != v2::kPrefill && h.op != v2::kDecode) {
    return Bad(absl::StrCat("op ", h.op, " is neither prefill (1) nor decode (2)"));
  }
  constexpr uint32_t kKnownFlags = v2::kHasPromptLen | v2::kDeviceOrdered;
  if ((h.flags & ~kKnownFlags) != 0 || h.reserved != 0) {
    return Bad(absl::StrCat("unknown flags 0x", absl::Hex(h.flags & ~kKnownFlags), " or reserved ",
                            h.reserved, " set; both must be 0"));
  }
  const uint32_t n = h.num_sequences;
  if (h.op == v2::kPrefill && n != 1) {
    return Bad(absl::StrCat("a prefill names 1 sequence, got num_sequences ", n));
  }
  if (n < 1 || n > v2::kMaxSequences) {
    return Bad(absl::StrCat("a decode names 1 to ", v2::kMaxSequences, " sequences, got ", n));
  }
  if (h.op == v2::kDecode && (h.flags & v2::kHasPromptLen) != 0) {
    return Bad("a decode carries no prompt_len");
  }
  if (!Inside(h.ids_offset, uint64_t{n} * sizeof(v2::StrRef), frame.size())) {
    return Bad(absl::StrCat("the ", n, " sequence ids' table at ", h.ids_offset,
                            " lies outside the ", frame.size(), "-byte frame"));
  }
  out->bytes = frame.size();
  out->op = static_cast<v2::Op>(h.op);
  out->tag = h.tag;
  out->layer = h.layer;
  out->q_layout = h.q_layout;
  out->prompt_len.reset();
  if ((h.flags & v2::kHasPromptLen) != 0) out->prompt_len = h.prompt_len;
  out->device_ordered = (h.flags & v2::kDeviceOrdered) != 0;
  out->done_event = nullptr;
  out->gate_word = nullptr;
  out->more_follow = false;
  out->gate_value = 0;
  out->sequence_ids.resize(n);
  for (uint32_t i = 0; i < n; ++i) {
    v2::StrRef ref;
    std::memcpy(&ref, frame.data() + h.ids_offset + i * sizeof(ref), sizeof(ref));
    absl::Status s = ReadStr(frame, ref, absl::StrCat("sequence id ", i), &out->sequence_ids[i]);
    if (!s.ok()) return s;
  }
  for (auto [name, t, f, output] :
       {std::make_tuple("q", &h.q, &out->q, false), std::make_tuple("k", &h.k, &out->k, false),
        std::make_tuple("v", &h.v, &out->v, false), std::make_tuple("o", &h.o, &out->o, true)}) {
    absl::Status s = ReadTensor(frame, *t, name, output, f);
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

uint64_t FrameTag(absl::string_view frame) {
  v2::RequestHeader h;
  if (frame.size() < offsetof(v2::RequestHeader, tag) + sizeof(h.tag)) return 0;
  std::memcpy(&h.tag, frame.data() + offsetof(v2::RequestHeader, tag), sizeof(h.tag));
  return h.tag;
}

uint64_t ResponseOutputOffset(uint64_t num_lengths, uint64_t message_bytes) {
  return v2::AlignUp(sizeof(v2::ResponseHeader) + num_lengths * 8 + message_bytes,
                     v2::kTensorAlign);
}

uint64_t ResponseBytes(uint64_t num_lengths, uint64_t message_bytes, uint64_t output_bytes) {
  if (output_bytes == 0) return sizeof(v2::ResponseHeader) + num_lengths * 8 + message_bytes;
  return ResponseOutputOffset(num_lengths, message_bytes) + output_bytes;
}

std::string EncodeResponseHead(uint64_t tag, uint16_t op, const absl::Status& status,
                               const FrameAnswer& answer) {
  v2::ResponseHeader h;
  std::memset(&h, 0, sizeof(h));
  h.magic = v2::kResponseMagic;
  h.code = static_cast<int32_t>(status.code());
  h.tag = tag;
  h.op = op;
  const bool ok = status.ok();
  const uint64_t lengths = ok ? answer.lengths.size() : 0;
  const absl::string_view message = ok ? absl::string_view() : status.message();
  h.num_lengths = static_cast<uint32_t>(lengths);
  h.lengths_offset = sizeof(h);
  h.message_offset = sizeof(h) + lengths * 8;
  h.message_bytes = message.size();
  if (ok) {
    h.dtype = answer.dtype;
    h.rank = static_cast<uint16_t>(std::min<size_t>(answer.shape.size(), v2::kMaxRank));
    for (int i = 0; i < h.rank; ++i) h.shape[i] = answer.shape[i];
    h.flags = answer.output_in_region ? v2::kOutputInRegion : 0;
    h.o_bytes = answer.output_in_region ? 0 : answer.output_bytes;
    h.o_offset = h.o_bytes > 0 ? ResponseOutputOffset(lengths, 0) : 0;
  }
  std::string head(sizeof(h) + lengths * 8 + message.size(), '\0');
  std::memcpy(head.data(), &h, sizeof(h));
  if (lengths > 0) std::memcpy(head.data() + sizeof(h), answer.lengths.data(), lengths * 8);
  if (!message.empty()) std::memcpy(head.data() + h.message_offset, message.data(), message.size());
  return head;
}

}  // namespace attnd
