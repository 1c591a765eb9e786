// The packed Decode form's checks (each bad input named, with what was expected) and its views:
// row i of q/k/v is entry i's tensor in place, and entry i's output is row i of the reply's o.
#include "server/rpc/packed_decode.h"

#include <string>
#include <vector>

#include "attnd/v1/attention.pb.h"
#include "gtest/gtest.h"

namespace attnd {
namespace {

constexpr int kHq = 4, kHkv = 2, kD = 8;

ModelConfig Model() {
  ModelConfig m;
  m.num_q_heads = kHq;
  m.num_kv_heads = kHkv;
  m.head_dim = kD;
  return m;
}

// Fills t with `shape` of bf16 whose byte j is j % 251, so rows are told apart by their bytes.
void Fill(v1::Tensor* t, std::vector<int64_t> shape) {
  t->set_dtype(v1::DTYPE_BF16);
  t->mutable_shape()->Assign(shape.begin(), shape.end());
  int64_t n = 2;
  for (int64_t d : shape) n *= d;
  std::string data(static_cast<size_t>(n), '\0');
  for (int64_t j = 0; j < n; ++j) data[static_cast<size_t>(j)] = static_cast<char>(j % 251);
  t->set_data(data);
}

v1::DecodeRequest Packed(int b) {
  v1::DecodeRequest r;
  r.set_layer(1);
  for (int i = 0; i < b; ++i) r.add_sequence_ids(std::string(32, static_cast<char>('a' + i)));
  Fill(r.mutable_q(), {b, 5, kHq, kD});
  Fill(r.mutable_k(), {b, kHkv, kD});
  Fill(r.mutable_v(), {b, kHkv, kD});
  return r;
}

absl::Status Unpack(const v1::DecodeRequest& r, DecodeCall* call, v1::DecodeResponse* resp) {
  return UnpackDecode(r, Model(), call, resp);
}

void ExpectRefused(const v1::DecodeRequest& r, const std::string& message) {
  DecodeCall call;
  v1::DecodeResponse resp;
  absl::Status s = Unpack(r, &call, &resp);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_EQ(s.message(), message);
  EXPECT_TRUE(call.entries.empty());
  EXPECT_FALSE(resp.has_o());
}

TEST(PackedDecodeTest, TheEntriesFormIsNotPacked) {
  v1::DecodeRequest r;
  r.add_entries()->set_sequence_id("x");
  EXPECT_FALSE(IsPackedDecode(r));
  EXPECT_TRUE(IsPackedDecode(Packed(1)));
  v1::DecodeRequest layout_only;
  layout_only.set_q_layout(v1::Q_LAYOUT_PRE_ROTARY);
  EXPECT_TRUE(IsPackedDecode(layout_only));
}

TEST(PackedDecodeTest, RowsAreViewsAndOutputsAreRowsOfO) {
  const v1::DecodeRequest r = Packed(3);
  DecodeCall call;
  v1::DecodeResponse resp;
  ASSERT_TRUE(Unpack(r, &call, &resp).ok());
  ASSERT_EQ(call.entries.size(), 3u);
  const int64_t q_row = 5 * kHq * kD * 2, kv_row = kHkv * kD * 2, o_row = kHq * kD * 2;
  ASSERT_EQ(resp.o().data().size(), static_cast<size_t>(3 * o_row));
  for (int i = 0; i < 3; ++i) {
    const DecodeCall::Entry& e = call.entries[i];
    EXPECT_EQ(e.sequence_id, r.sequence_ids(i));
    EXPECT_EQ(e.q_layout, QLayout::kVariants);
    EXPECT_EQ(std::vector<int64_t>(e.q.shape.begin(), e.q.shape.end()),
              (std::vector<int64_t>{5, kHq, kD}));
    EXPECT_EQ(std::vector<int64_t>(e.k.shape.begin(), e.k.shape.end()),
              (std::vector<int64_t>{kHkv, kD}));
    EXPECT_EQ(e.q.dtype, DType::kBf16);
    // In place: the very bytes of row i.
    EXPECT_EQ(e.q.bytes.data(), r.q().data().data() + i * q_row);
    EXPECT_EQ(e.q.bytes.size(), static_cast<size_t>(q_row));
    EXPECT_EQ(e.k.bytes.data(), r.k().data().data() + i * kv_row);
    EXPECT_EQ(e.v.bytes.data(), r.v().data().data() + i * kv_row);
    EXPECT_EQ(e.v.bytes.size(), static_cast<size_t>(kv_row));
    EXPECT_EQ(e.output(o_row), resp.o().data().data() + i * o_row);
    EXPECT_EQ(e.output(o_row + 2), nullptr);  // not an [Hq, D] row of q's dtype
  }
  DecodeResult result;
  for (int i = 0; i < 3; ++i) {
    DecodeResult::Output o;
    o.out_dtype = DType::kBf16;
    o.out_shape = {kHq, kD};
    o.length = 100 + i;
    result.outputs.push_back(o);
  }
  FinishPackedDecode(result, &resp);
  EXPECT_EQ(resp.o().dtype(), v1::DTYPE_BF16);
  EXPECT_EQ(std::vector<int64_t>(resp.o().shape().begin(), resp.o().shape().end()),
            (std::vector<int64_t>{3, kHq, kD}));
  EXPECT_EQ(std::vector<int64_t>(resp.lengths().begin(), resp.lengths().end()),
            (std::vector<int64_t>{100, 101, 102}));
  EXPECT_EQ(resp.outputs_size(), 0);
}

TEST(PackedDecodeTest, PreRotaryAndThreeVariantsAreAccepted) {
  v1::DecodeRequest r = Packed(2);
  Fill(r.mutable_q(), {2, 3, kHq, kD});
  DecodeCall call;
  v1::DecodeResponse resp;
  EXPECT_TRUE(Unpack(r, &call, &resp).ok());
  r.set_q_layout(v1::Q_LAYOUT_PRE_ROTARY);
  Fill(r.mutable_q(), {2, kHq, kD});
  DecodeCall call2;
  v1::DecodeResponse resp2;
  ASSERT_TRUE(Unpack(r, &call2, &resp2).ok());
  EXPECT_EQ(call2.entries[1].q_layout, QLayout::kPreRotary);
  EXPECT_EQ(call2.entries[1].q.bytes.size(), static_cast<size_t>(kHq * kD * 2));
}

TEST(PackedDecodeTest, BadFormsAreRefusedSayingWhatWasExpected) {
  {
    v1::DecodeRequest r = Packed(2);
    r.add_entries()->set_sequence_id("x");
    ExpectRefused(r,
                  "a DecodeRequest carries entries (1) or the packed form (sequence_ids, q, k, "
                  "v, q_layout), not both");
  }
  {
    v1::DecodeRequest r = Packed(2);
    r.clear_sequence_ids();
    ExpectRefused(r,
                  "a packed DecodeRequest needs at least one sequence_id (one per row of q, k "
                  "and v)");
  }
  {
    v1::DecodeRequest r = Packed(2);
    r.set_q_layout(static_cast<v1::QLayout>(7));
    ExpectRefused(r,
                  "packed q_layout must be Q_LAYOUT_VARIANTS (0) or Q_LAYOUT_PRE_ROTARY (1), "
                  "got 7");
  }
  {
    v1::DecodeRequest r = Packed(2);
    r.add_sequence_ids(std::string(32, 'z'));  // 3 ids, 2 rows
    ExpectRefused(r,
                  "packed q: shape must be [3, 3, 4, 8] or [3, 5, 4, 8] (one row per "
                  "sequence_id, 3 sequence_ids), got [2, 5, 4, 8]");
  }
  {
    v1::DecodeRequest r = Packed(2);
    Fill(r.mutable_k(), {2, kHkv + 1, kD});
    ExpectRefused(r,
                  "packed k: shape must be [2, 2, 8] (one row per sequence_id, 2 "
                  "sequence_ids), got [2, 3, 8]");
  }
  {
    v1::DecodeRequest r = Packed(2);
    r.set_q_layout(v1::Q_LAYOUT_PRE_ROTARY);  // q still [2, 5, Hq, D]
    ExpectRefused(r,
                  "packed q: shape must be [2, 4, 8] (one row per sequence_id, 2 "
                  "sequence_ids), got [2, 5, 4, 8]");
  }
  {
    v1::DecodeRequest r = Packed(2);
    r.mutable_v()->mutable_data()->pop_back();
    ExpectRefused(r, "packed v: shape [2, 2, 8] of bf16 needs 64 bytes of data, got 63");
  }
  {
    v1::DecodeRequest r = Packed(2);
    r.clear_v();
    ExpectRefused(r, "packed v: dtype must be bf16, fp16 or fp32, got wire value 0");
  }
  {
    v1::DecodeRequest r = Packed(2);
    r.mutable_k()->set_dtype(v1::DTYPE_FP16);
    ExpectRefused(r, "packed q, k and v must have one dtype, got bf16, fp16 and bf16");
  }
  {
    v1::DecodeRequest r = Packed(2);
    r.mutable_q()->clear_data();
    r.mutable_q()->mutable_region()->set_region_id("r");
    ExpectRefused(r,
                  "packed q: carries a region reference; the packed form's tensors travel "
                  "inline (data): send tensors in regions with the entries form");
  }
}

}  // namespace
}  // namespace attnd
