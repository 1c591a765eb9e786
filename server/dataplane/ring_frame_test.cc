// The version 2 frame parser against frames laid out by hand from proto/attnd/v1/ring_frame.h:
// every field comes back as written, and every field that points outside the frame, overflows or
// holds an unknown value is refused with a message that names it.
#include "server/dataplane/ring_frame.h"

#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "attnd/v1/ring_frame.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace attnd {
namespace {

namespace v2 = ring::v2;
using ::testing::HasSubstr;

// A frame written field by field: the header at 0, then whatever Put appends.
struct Frame {
  v2::RequestHeader h{};
  std::string tail = std::string(sizeof(v2::RequestHeader), '\0');

  Frame(v2::Op op, std::vector<std::string> ids) {
    h.magic = v2::kRequestMagic;
    h.op = op;
    h.tag = 0x1122334455667788ull;
    h.layer = 3;
    h.num_sequences = static_cast<uint32_t>(ids.size());
    std::vector<v2::StrRef> refs;
    for (const std::string& id : ids) refs.push_back(Put(id));
    h.ids_offset = tail.size();
    for (const v2::StrRef& r : refs) tail.append(reinterpret_cast<const char*>(&r), sizeof(r));
  }
  v2::StrRef Put(const std::string& bytes) {
    v2::StrRef r{static_cast<uint32_t>(tail.size()), static_cast<uint32_t>(bytes.size())};
    tail += bytes;
    return r;
  }
  void Inline(v2::Tensor* t, int32_t dtype, std::vector<int64_t> shape, const std::string& bytes) {
    t->where = v2::kInline;
    t->dtype = dtype;
    t->rank = static_cast<uint16_t>(shape.size());
    for (size_t i = 0; i < shape.size(); ++i) t->shape[i] = shape[i];
    t->offset = Put(bytes).offset;
    t->bytes = bytes.size();
  }
  void Region(v2::Tensor* t, const std::string& id, uint64_t offset, uint64_t bytes) {
    t->where = v2::kRegion;
    t->region_id = Put(id);
    t->offset = offset;
    t->bytes = bytes;
  }
  std::string Bytes() const {
    std::string f = tail;
    std::memcpy(f.data(), &h, sizeof(h));
    return f;
  }
};

Frame Prefill() {
  Frame f(v2::kPrefill, {"seq-a"});
  f.Inline(&f.h.q, 3, {2, 5, 1, 4}, std::string(160, 'q'));
  f.Inline(&f.h.k, 3, {2, 1, 4}, std::string(32, 'k'));
  f.Region(&f.h.v, "region-v", 4096, 32);
  v2::Tensor& v = f.h.v;
  v.dtype = 3;
  v.rank = 3;
  v.shape[0] = 2;
  v.shape[1] = 1;
  v.shape[2] = 4;
  return f;
}

absl::Status Parse(const std::string& bytes, RequestFrame* out = nullptr) {
  RequestFrame scratch;
  return ParseRequestFrame(bytes, out != nullptr ? out : &scratch);
}

TEST(RingFrame, PrefillComesBackAsWritten) {
  Frame f = Prefill();
  f.h.flags = v2::kHasPromptLen;
  f.h.prompt_len = 77;
  f.h.q_layout = 1;
  f.Region(&f.h.o, "region-o", 8192, 64);
  const std::string bytes = f.Bytes();
  RequestFrame r;
  ASSERT_TRUE(Parse(bytes, &r).ok()) << Parse(bytes);
  EXPECT_EQ(r.bytes, bytes.size());
  EXPECT_EQ(r.op, v2::kPrefill);
  EXPECT_EQ(r.tag, 0x1122334455667788ull);
  EXPECT_EQ(r.layer, 3);
  EXPECT_EQ(r.q_layout, 1);
  ASSERT_TRUE(r.prompt_len.has_value());
  EXPECT_EQ(*r.prompt_len, 77);
  ASSERT_EQ(r.sequence_ids.size(), 1u);
  EXPECT_EQ(r.sequence_ids[0], "seq-a");
  EXPECT_EQ(r.q.where, v2::kInline);
  EXPECT_EQ(r.q.dtype, 3);
  EXPECT_EQ(std::vector<int64_t>(r.q.dims().begin(), r.q.dims().end()),
            (std::vector<int64_t>{2, 5, 1, 4}));
  EXPECT_EQ(r.q.data, std::string(160, 'q'));
  EXPECT_EQ(r.k.data, std::string(32, 'k'));
  EXPECT_EQ(r.v.where, v2::kRegion);
  EXPECT_EQ(r.v.region_id, "region-v");
  EXPECT_EQ(r.v.offset, 4096u);
  EXPECT_EQ(r.v.bytes, 32u);
  EXPECT_EQ(r.v.rank, 3);
  EXPECT_EQ(r.o.where, v2::kRegion);
  EXPECT_EQ(r.o.region_id, "region-o");
  EXPECT_EQ(r.o.offset, 8192u);
  EXPECT_EQ(r.o.bytes, 64u);
  // The views are into the frame itself: nothing was copied.
  EXPECT_GE(r.q.data.data(), bytes.data());
  EXPECT_LE(r.q.data.data() + r.q.data.size(), bytes.data() + bytes.size());
}

TEST(RingFrame, DecodeNamesEverySequenceAndNoPromptLen) {
  Frame f(v2::kDecode, {"a", "bb", "ccc"});
  f.Inline(&f.h.q, 1, {3, 2, 4}, std::string(48, 'q'));
  f.Inline(&f.h.k, 1, {3, 1, 4}, std::string(24, 'k'));
  f.Inline(&f.h.v, 1, {3, 1, 4}, std::string(24, 'v'));
  RequestFrame r;
  const std::string bytes = f.Bytes();  // r's ids are views into it
  ASSERT_TRUE(Parse(bytes, &r).ok()) << Parse(bytes);
  EXPECT_EQ(r.op, v2::kDecode);
  EXPECT_EQ(r.sequence_ids, (std::vector<absl::string_view>{"a", "bb", "ccc"}));
  EXPECT_FALSE(r.prompt_len.has_value());
  EXPECT_EQ(r.o.where, v2::kAbsent);
  EXPECT_FALSE(r.device_ordered);
  // The ring fills in its events for a device-ordered frame; a reused frame starts without them.
  r.done_event = &r;
  r.gate_word = &r;
  r.gate_value = 9;
  f.h.flags = v2::kDeviceOrdered;
  const std::string ordered = f.Bytes();
  ASSERT_TRUE(Parse(ordered, &r).ok());
  EXPECT_TRUE(r.device_ordered);
  EXPECT_EQ(r.done_event, nullptr);
  EXPECT_EQ(r.gate_word, nullptr);
  EXPECT_EQ(r.gate_value, 0u);
  f.h.flags = v2::kHasPromptLen;
  EXPECT_THAT(Parse(f.Bytes()).message(), HasSubstr("a decode carries no prompt_len"));
}

// Each mutation of a good frame, and the words its refusal must say.
TEST(RingFrame, EveryBadFieldIsRefusedByName) {
  constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();
  struct Case {
    const char* what;
    void (*mutate)(Frame*);
    const char* says;
  };
  const Case cases[] = {
      {"magic", [](Frame* f) { f->h.magic = 0x12345678; }, "magic is 0x12345678"},
      {"op", [](Frame* f) { f->h.op = 9; }, "op 9 is neither prefill (1) nor decode (2)"},
      {"flags", [](Frame* f) { f->h.flags = 12; }, "unknown flags 0xc"},
      {"reserved", [](Frame* f) { f->h.reserved = 1; }, "reserved 1 set"},
      {"prefill of two", [](Frame* f) { f->h.num_sequences = 2; },
       "a prefill names 1 sequence, got num_sequences 2"},
      {"decode of none",
       [](Frame* f) {
         f->h.op = v2::kDecode;
         f->h.num_sequences = 0;
       },
       "a decode names 1 to 4096 sequences, got 0"},
      {"decode of too many",
       [](Frame* f) {
         f->h.op = v2::kDecode;
         f->h.num_sequences = 4097;
       },
       "got 4097"},
      {"ids table past the end", [](Frame* f) { f->h.ids_offset = f->tail.size() - 4; },
       "sequence ids' table at"},
      {"ids table offset overflowing", [](Frame* f) { f->h.ids_offset = kMax - 2; },
       "lies outside the"},
      {"q absent", [](Frame* f) { f->h.q.where = v2::kAbsent; }, "q is absent"},
      {"k where", [](Frame* f) { f->h.k.where = 7; }, "k's where is 7"},
      {"q past the end", [](Frame* f) { f->h.q.bytes += 1 << 20; }, "q's inline bytes"},
      {"q offset overflowing",
       [](Frame* f) {
         f->h.q.offset = kMax;
         f->h.q.bytes = 2;
       },
       "q's inline bytes"},
      {"q bytes overflowing", [](Frame* f) { f->h.q.bytes = kMax; }, "q's inline bytes"},
      {"rank", [](Frame* f) { f->h.k.rank = 5; }, "k's rank is 5; at most 4"},
      {"region id past the end", [](Frame* f) { f->h.v.region_id.bytes = 1 << 30; },
       "v's region id"},
      {"inline output", [](Frame* f) { f->h.o.where = v2::kInline; }, "o is inline"},
  };
  ASSERT_TRUE(Parse(Prefill().Bytes()).ok());
  for (const Case& c : cases) {
    Frame f = Prefill();
    c.mutate(&f);
    const absl::Status s = Parse(f.Bytes());
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.what;
    EXPECT_THAT(s.message(), HasSubstr(c.says)) << c.what;
    EXPECT_THAT(s.message(), HasSubstr("ring frame: ")) << c.what;
  }
  // A sequence id whose range leaves the frame.
  Frame f = Prefill();
  std::string bytes = f.Bytes();
  v2::StrRef bad{static_cast<uint32_t>(bytes.size() - 2), 3};
  std::memcpy(bytes.data() + f.h.ids_offset, &bad, sizeof(bad));
  EXPECT_THAT(Parse(bytes).message(), HasSubstr("sequence id 0 ["));
  // Every truncation of a good frame is refused, never read past.
  const std::string good = Prefill().Bytes();
  for (size_t n = 0; n < good.size(); ++n) {
    const std::string cut = good.substr(0, n);
    EXPECT_FALSE(Parse(cut).ok()) << n;
  }
  EXPECT_THAT(Parse(good.substr(0, 100)).message(),
              HasSubstr("a request frame is at least its 304-byte header, got 100 bytes"));
}

TEST(RingFrame, TagOfABrokenFrame) {
  const std::string good = Prefill().Bytes();
  EXPECT_EQ(FrameTag(good.substr(0, 16)), 0x1122334455667788ull);
  EXPECT_EQ(FrameTag(good.substr(0, 15)), 0u);
}

TEST(RingFrame, ResponseHeadLaysOutLengthsMessageAndOutput) {
  FrameAnswer answer;
  answer.dtype = 1;
  answer.shape = {2, 3, 4};
  answer.lengths = {10, 11};
  answer.output_bytes = 48;
  const std::string ok = EncodeResponseHead(42, v2::kDecode, absl::OkStatus(), answer);
  v2::ResponseHeader h;
  ASSERT_EQ(ok.size(), sizeof(h) + 16);
  std::memcpy(&h, ok.data(), sizeof(h));
  EXPECT_EQ(h.magic, v2::kResponseMagic);
  EXPECT_EQ(h.code, 0);
  EXPECT_EQ(h.tag, 42u);
  EXPECT_EQ(h.op, v2::kDecode);
  EXPECT_EQ(h.dtype, 1);
  EXPECT_EQ(h.rank, 3);
  EXPECT_EQ(h.shape[0], 2);
  EXPECT_EQ(h.shape[2], 4);
  EXPECT_EQ(h.num_lengths, 2u);
  EXPECT_EQ(h.flags, 0u);
  int64_t lengths[2];
  std::memcpy(lengths, ok.data() + h.lengths_offset, sizeof(lengths));
  EXPECT_EQ(lengths[0], 10);
  EXPECT_EQ(lengths[1], 11);
  EXPECT_EQ(h.o_offset, 128u);  // 104 + 16 rounded up to 64
  EXPECT_EQ(h.o_bytes, 48u);
  EXPECT_EQ(ResponseBytes(2, 0, 48), 128u + 48u);

  answer.output_in_region = true;
  const std::string in_region = EncodeResponseHead(42, v2::kDecode, absl::OkStatus(), answer);
  std::memcpy(&h, in_region.data(), sizeof(h));
  EXPECT_EQ(h.flags, v2::kOutputInRegion);
  EXPECT_EQ(h.o_bytes, 0u);

  const std::string bad =
      EncodeResponseHead(7, v2::kPrefill, absl::NotFoundError("sequence x not found"), answer);
  std::memcpy(&h, bad.data(), sizeof(h));
  EXPECT_EQ(h.code, static_cast<int32_t>(absl::StatusCode::kNotFound));
  EXPECT_EQ(h.num_lengths, 0u);
  EXPECT_EQ(h.o_bytes, 0u);
  EXPECT_EQ(bad.substr(h.message_offset, h.message_bytes), "sequence x not found");
  EXPECT_EQ(bad.size(), h.message_offset + h.message_bytes);
}

}  // namespace
}  // namespace attnd
