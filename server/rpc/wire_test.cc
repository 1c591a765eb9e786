// The hand-written wire format of server/rpc/wire.h against protobuf's own parser and serializer.
#include "server/rpc/wire.h"

#include <random>
#include <string>
#include <vector>

#include "attnd/v1/attention.pb.h"
#include "gtest/gtest.h"

namespace attnd {
namespace wire {
namespace {

std::string Bytes(const grpc::ByteBuffer& b) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(b.Dump(&slices).ok());
  std::string out;
  for (const grpc::Slice& s : slices)
    out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return out;
}

// `bytes` cut into slices at `cuts` (ascending offsets).
grpc::ByteBuffer Sliced(const std::string& bytes, const std::vector<size_t>& cuts) {
  std::vector<grpc::Slice> slices;
  size_t start = 0;
  for (size_t c : cuts) {
    c = std::min(c, bytes.size());
    if (c < start) continue;
    slices.emplace_back(bytes.data() + start, c - start);
    start = c;
  }
  slices.emplace_back(bytes.data() + start, bytes.size() - start);
  return grpc::ByteBuffer(slices.data(), slices.size());
}

grpc::ByteBuffer RandomSliced(const std::string& bytes, std::mt19937* rng, int pieces) {
  std::vector<size_t> cuts;
  std::uniform_int_distribution<size_t> at(0, bytes.size());
  for (int i = 0; i < pieces; ++i) cuts.push_back(at(*rng));
  std::sort(cuts.begin(), cuts.end());
  return Sliced(bytes, cuts);
}

std::string Data(size_t n, std::mt19937* rng) {
  std::string s(n, '\0');
  for (char& c : s) c = static_cast<char>((*rng)() & 0xff);
  return s;
}

v1::PrefillRequest Sample(std::mt19937* rng, int64_t t, bool prompt_len, int q_layout) {
  v1::PrefillRequest r;
  r.set_sequence_id("0123456789abcdef0123456789abcdef");
  r.set_layer(static_cast<int32_t>((*rng)() % 40));
  auto fill = [&](v1::Tensor* x, std::vector<int64_t> shape, size_t bytes) {
    x->set_dtype(v1::DTYPE_BF16);
    x->mutable_shape()->Assign(shape.begin(), shape.end());
    x->set_data(Data(bytes, rng));
  };
  fill(r.mutable_q(), {t, 5, 4, 8}, t * 5 * 4 * 8 * 2);
  fill(r.mutable_k(), {t, 2, 8}, t * 2 * 8 * 2);
  fill(r.mutable_v(), {t, 2, 8}, t * 2 * 8 * 2);
  if (prompt_len) r.set_prompt_len(t + 1000);
  r.set_q_layout(static_cast<v1::QLayout>(q_layout));
  return r;
}

void ExpectTensor(const v1::Tensor& want, const WireTensor& got) {
  EXPECT_EQ(want.dtype(), got.dtype);
  EXPECT_EQ(std::vector<int64_t>(want.shape().begin(), want.shape().end()), got.shape);
  EXPECT_EQ(want.data(), std::string(got.bytes));
}

void ExpectSame(const v1::PrefillRequest& want, const WirePrefillRequest& got) {
  EXPECT_EQ(want.sequence_id(), got.sequence_id);
  EXPECT_EQ(want.layer(), got.layer);
  ExpectTensor(want.q(), got.q);
  ExpectTensor(want.k(), got.k);
  ExpectTensor(want.v(), got.v);
  EXPECT_EQ(want.has_prompt_len(), got.prompt_len.has_value());
  if (want.has_prompt_len() && got.prompt_len.has_value()) {
    EXPECT_EQ(want.prompt_len(), *got.prompt_len);
  }
  EXPECT_EQ(static_cast<int>(want.q_layout()), got.q_layout);
}

TEST(WireParse, RoundTripsWhateverTheSlicing) {
  auto pool = std::make_shared<BufferPool>(64 << 20);
  std::mt19937 rng(1);
  for (int trial = 0; trial < 200; ++trial) {
    const int64_t t = 1 + static_cast<int64_t>(rng() % 300);
    const v1::PrefillRequest want = Sample(&rng, t, trial % 2 == 0, trial % 3 == 0 ? 1 : 0);
    const std::string bytes = want.SerializeAsString();
    const grpc::ByteBuffer in = RandomSliced(bytes, &rng, static_cast<int>(rng() % 40));
    WirePrefillRequest got;
    ASSERT_TRUE(ParsePrefillRequest(in, pool.get(), &got)) << "trial " << trial;
    ExpectSame(want, got);
  }
}

TEST(WireParse, OneSliceIsReadInPlace) {
  auto pool = std::make_shared<BufferPool>(64 << 20);
  std::mt19937 rng(2);
  const v1::PrefillRequest want = Sample(&rng, 64, true, 0);
  const grpc::ByteBuffer in = Sliced(want.SerializeAsString(), {});
  WirePrefillRequest got;
  ASSERT_TRUE(ParsePrefillRequest(in, pool.get(), &got));
  ExpectSame(want, got);
  const char* begin = reinterpret_cast<const char*>(got.slices.at(0).begin());
  EXPECT_GE(got.q.bytes.data(), begin);
  EXPECT_LE(got.q.bytes.data() + got.q.bytes.size(), begin + got.slices[0].size());
  EXPECT_EQ(got.q.owned.data(), nullptr);
  EXPECT_EQ(pool->allocations(), 0);
}

TEST(WireParse, DefaultsAndExtremeValues) {
  auto pool = std::make_shared<BufferPool>(0);
  v1::PrefillRequest want;  // empty: every field at its default
  WirePrefillRequest got;
  ASSERT_TRUE(ParsePrefillRequest(Sliced(want.SerializeAsString(), {}), pool.get(), &got));
  ExpectSame(want, got);

  want.set_layer(-1);
  want.set_prompt_len(0);  // present though zero
  want.mutable_q()->set_dtype(static_cast<v1::DType>(77));
  want.mutable_q()->add_shape(-5);
  want.mutable_q()->add_shape(INT64_MAX);
  want.mutable_q()->add_shape(INT64_MIN);
  want.mutable_k();  // present and empty
  want.set_q_layout(static_cast<v1::QLayout>(-3));
  WirePrefillRequest got2;
  ASSERT_TRUE(
      ParsePrefillRequest(Sliced(want.SerializeAsString(), {1, 2, 3, 5, 8}), pool.get(), &got2));
  ExpectSame(want, got2);
}

// Messages protobuf parses that are not the simple shape: the hand parser declines them.
TEST(WireParse, DeclinesWhatIsNotTheSimpleShape) {
  auto pool = std::make_shared<BufferPool>(0);
  std::mt19937 rng(3);
  const std::string base = Sample(&rng, 4, true, 0).SerializeAsString();
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"unknown varint field 99", base + std::string("\x98\x06\x01", 3)},
      {"unknown length field 8", base + std::string("\x42\x02xy", 4)},
      {"layer twice", base + std::string("\x10\x05", 2)},
      {"k twice (protobuf merges)", base + std::string("\x22\x02\x08\x01", 4)},
      {"unknown field in a tensor", base + std::string("\x22\x02\x20\x01", 4)},
      {"unpacked shape", std::string("\x1a\x04\x10\x02\x10\x03", 6)},
      {"layer as fixed32", std::string("\x15\x01\x00\x00\x00", 5)},
      {"non-ASCII sequence id", std::string("\x0a\x02\xc3\xa9", 4)},
  };
  for (const auto& [name, bytes] : cases) {
    v1::PrefillRequest proto;
    EXPECT_TRUE(proto.ParseFromString(bytes)) << name << ": the case must be valid protobuf";
    WirePrefillRequest got;
    EXPECT_FALSE(ParsePrefillRequest(Sliced(bytes, {}), pool.get(), &got)) << name;
  }
}

// Found by fuzz/wire_fuzz: a tensor's data length whose varint runs past the tensor's own end used
// to underflow the bounds check and ask the pool for 2^49 bytes (an abort).
TEST(WireParse, LengthsThatRunPastTheirSubMessageAreDeclined) {
  auto pool = std::make_shared<BufferPool>(0);
  const std::string bytes(
      "\x2a\x03\x1a\xff\xff\xff\xff\xff\xff\xff\x00\xfc\x00\x2f\x03\x09\x00\x29\x30\x18", 20);
  v1::PrefillRequest proto;
  EXPECT_FALSE(proto.ParseFromString(bytes));
  for (size_t step : {0, 1, 3}) {
    std::vector<size_t> cuts;
    for (size_t at = step; step > 0 && at < bytes.size(); at += step) cuts.push_back(at);
    WirePrefillRequest got;
    EXPECT_FALSE(ParsePrefillRequest(Sliced(bytes, cuts), pool.get(), &got));
  }
  EXPECT_EQ(pool->allocations(), 0);
}

// Mutated and truncated messages: when the hand parser accepts one, protobuf parses it to the same
// fields; whatever protobuf rejects, the hand parser declines.
TEST(WireParse, MalformedInputNeverDisagreesWithProtobuf) {
  auto pool = std::make_shared<BufferPool>(8 << 20);
  std::mt19937 rng(4);
  int accepted = 0, declined = 0;
  for (int trial = 0; trial < 20000; ++trial) {
    std::string bytes = Sample(&rng, 1 + rng() % 6, rng() % 2, rng() % 2).SerializeAsString();
    const int edits = 1 + static_cast<int>(rng() % 4);
    for (int e = 0; e < edits && !bytes.empty(); ++e) {
      const size_t at = rng() % bytes.size();
      switch (rng() % 4) {
        case 0:
          bytes[at] = static_cast<char>(rng() & 0xff);
          break;
        case 1:
          bytes.resize(at);
          break;
        case 2:
          bytes.insert(at, 1, static_cast<char>(rng() & 0xff));
          break;
        default:
          bytes.erase(at, 1 + rng() % 8);
          break;
      }
    }
    v1::PrefillRequest proto;
    const bool proto_ok = proto.ParseFromString(bytes);
    WirePrefillRequest got;
    const bool ok = ParsePrefillRequest(RandomSliced(bytes, &rng, rng() % 6), pool.get(), &got);
    if (ok) {
      ++accepted;
      ASSERT_TRUE(proto_ok) << "trial " << trial << ": accepted what protobuf rejects";
      ExpectSame(proto, got);
      if (::testing::Test::HasFailure()) return;
    } else {
      ++declined;
    }
  }
  EXPECT_GT(accepted, 100);
  EXPECT_GT(declined, 100);
}

TEST(WireReply, ByteForByteWhatProtobufSerializes) {
  auto pool = std::make_shared<BufferPool>(64 << 20);
  std::mt19937 rng(5);
  struct Case {
    DType dtype;
    std::vector<int64_t> shape;
    size_t bytes;
    int64_t length;
  };
  const std::vector<Case> cases = {
      {DType::kBf16, {4096, 28, 128}, 4096 * 28 * 128 * 2, 4096},
      {DType::kFp32, {3, 2, 8}, 3 * 2 * 8 * 4, 1ll << 40},
      {DType::kFp16, {1, 1, 1}, 2, 0},
      {DType::kBf16, {0, 28, 128}, 0, 7},
      {DType::kFp32, {}, 0, 0},
      {DType::kFp32, {-1, 300}, 16, 1},
  };
  for (const Case& c : cases) {
    PrefillReplyWriter writer(pool.get());
    const std::string data = Data(c.bytes, &rng);
    if (c.bytes > 0 || c.shape.empty()) {
      void* out = writer.Output(static_cast<int64_t>(c.bytes));
      if (c.bytes > 0) std::memcpy(out, data.data(), c.bytes);
    }
    const grpc::ByteBuffer reply = writer.Finish(c.dtype, c.shape, c.length);
    v1::PrefillResponse want;
    want.mutable_o()->set_dtype(static_cast<v1::DType>(static_cast<int>(c.dtype)));
    want.mutable_o()->mutable_shape()->Assign(c.shape.begin(), c.shape.end());
    want.mutable_o()->set_data(data);
    want.set_length(c.length);
    EXPECT_EQ(want.SerializeAsString(), Bytes(reply)) << "length " << c.length;
  }
}

TEST(BufferPoolTest, ReusesGivesBackAndTrims) {
  auto pool = std::make_shared<BufferPool>(16 << 20);
  {
    PooledBuffer a = pool->Get(5 << 20);
    EXPECT_GE(a.capacity(), size_t{5} << 20);
  }
  EXPECT_EQ(pool->allocations(), 1);
  EXPECT_GE(pool->idle_bytes(), 5 << 20);
  {
    PooledBuffer b = pool->Get(4 << 20);  // fits the idle 5 MiB buffer
    EXPECT_EQ(pool->allocations(), 1);
    PooledBuffer c = pool->Get(100);  // too small for it, and it is taken anyway
    EXPECT_EQ(pool->allocations(), 2);
  }
  {
    PooledBuffer big = pool->Get(64 << 20);  // over the idle cap: freed when given back
  }
  EXPECT_LE(pool->idle_bytes(), 16 << 20);
  // A slice made from a buffer gives it back when the last reference goes.
  const int64_t before = pool->idle_bytes();
  {
    PooledBuffer d = pool->Get(4 << 20);  // the idle 5 MiB buffer again
    const int64_t taken = pool->idle_bytes();
    EXPECT_LT(taken, before);
    grpc::Slice s = d.ToSlice(1000);
    EXPECT_EQ(s.size(), 1000u);
    EXPECT_EQ(d.data(), nullptr);
    grpc::ByteBuffer held(&s, 1);
    EXPECT_EQ(pool->idle_bytes(), taken);
  }
  EXPECT_EQ(pool->idle_bytes(), before);
  pool->TrimIdle(absl::ZeroDuration());
  EXPECT_EQ(pool->idle_bytes(), 0);
}

}  // namespace
}  // namespace wire
}  // namespace attnd
