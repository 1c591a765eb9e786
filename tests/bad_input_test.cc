// Every kind of bad request through gRPC against an in-process daemon: each must fail with the
// documented code and a message naming the problem, and must change nothing. "Nothing changed" is
// checked three ways: the pool's pages_free is the same before and after, the sequence's next good
// request returns the expected length, and its output still matches the naive fp64 reference fed
// only the good requests (a stray append or overwritten K/V would show up there).
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/dtype.h"
#include "client/attnd_client.h"
#include "client/host_tensor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/testing/naive_dca.h"
#include "tests/test_util.h"

namespace attnd {
namespace {

using client::DecodeInput;
using client::HostTensor;
using ::testing::HasSubstr;

#define EXPECT_STATUS(expr, want_code, want_substr)                                 \
  do {                                                                              \
    const absl::Status status_ = (expr);                                            \
    EXPECT_EQ(status_.code(), absl::StatusCode::want_code) << status_;              \
    EXPECT_THAT(std::string(status_.message()), HasSubstr(want_substr)) << status_; \
  } while (0)

constexpr double kFp32Bar = 1e-4;

// A sequence on the server and its naive mirror, fed the same good requests.
struct Mirrored {
  std::string id;
  std::unique_ptr<naive::NaiveSequence> ref;
};

class BadInputTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    geometry_ = new testing::ModelGeometry();
    geometry_->name = "bad-input-tiny";
    ServerOptions options;
    options.page_size = 16;
    options.kv_dtype = "fp32";
    options.kv_cache_bytes = 8ll << 20;
    options.max_sequence_length = 256;
    // A 24-token fp32 prefill is ~147 KB; 64 tokens (~393 KB) is over.
    options.max_message_bytes = 256 << 10;
    options.compute_threads = 2;
    absl::StatusOr<std::unique_ptr<testing::TestDaemon>> daemon =
        testing::TestDaemon::Start(*geometry_, options);
    ASSERT_TRUE(daemon.ok()) << daemon.status();
    daemon_ = daemon->release();
  }
  static void TearDownTestSuite() {
    delete daemon_;
    daemon_ = nullptr;
    delete geometry_;
  }

  void SetUp() override { ASSERT_NE(daemon_, nullptr) << "the daemon did not start"; }

  void TearDown() override {
    // Whatever a test left alive; already-released ones answer NOT_FOUND, which is fine here.
    for (const std::string& id : created_) client().Release(id).IgnoreError();
    created_.clear();
  }

  static client::AttndClient& client() { return daemon_->client(); }
  const testing::ModelGeometry& g() const { return *geometry_; }

  std::unique_ptr<Mirrored> NewSequence() {
    auto m = std::make_unique<Mirrored>();
    absl::StatusOr<std::string> id = client().CreateSequence();
    EXPECT_TRUE(id.ok()) << id.status();
    m->id = id.value_or("");
    m->ref = std::make_unique<naive::NaiveSequence>(g().dca(), g().num_layers);
    created_.push_back(m->id);
    return m;
  }

  struct PrefillInputs {
    std::vector<float> q, k, v;
  };
  PrefillInputs RandomPrefill(int64_t t) {
    return {testing::RandomInputs(&rng_, t * g().q_elems_per_token()),
            testing::RandomInputs(&rng_, t * g().kv_elems_per_token()),
            testing::RandomInputs(&rng_, t * g().kv_elems_per_token())};
  }
  HostTensor Q(int64_t t, const std::vector<float>& values, DType dtype = DType::kFp32) {
    return HostTensor::FromFloats(dtype, {t, 5, g().num_q_heads, g().head_dim}, values);
  }
  HostTensor KV(int64_t t, const std::vector<float>& values, DType dtype = DType::kFp32) {
    return HostTensor::FromFloats(dtype, {t, g().num_kv_heads, g().head_dim}, values);
  }

  // A good prefill of t tokens, checked against the mirror.
  void GoodPrefill(Mirrored* m, int layer, int64_t t, std::optional<int64_t> prompt_len = {}) {
    const PrefillInputs in = RandomPrefill(t);
    absl::StatusOr<client::PrefillResult> r =
        client().Prefill(m->id, layer, Q(t, in.q), KV(t, in.k), KV(t, in.v), prompt_len);
    ASSERT_TRUE(r.ok()) << r.status();
    const int64_t want_length = m->ref->length(layer) + t;
    absl::StatusOr<std::vector<float>> want =
        m->ref->Prefill(layer, in.q, in.k, in.v, prompt_len.value_or(want_length));
    ASSERT_TRUE(want.ok()) << want.status();
    EXPECT_EQ(r->length, want_length);
    const testing::ErrorStats e = testing::CompareOutputs(r->o.ToFloats(), *want);
    EXPECT_LE(e.max_abs, kFp32Bar) << "prefill of layer " << layer;
  }

  DecodeInput RandomDecode(const std::string& id, std::vector<float>* q, std::vector<float>* k,
                           std::vector<float>* v) {
    *q = testing::RandomInputs(&rng_, g().q_elems_per_token());
    *k = testing::RandomInputs(&rng_, g().kv_elems_per_token());
    *v = testing::RandomInputs(&rng_, g().kv_elems_per_token());
    DecodeInput in;
    in.sequence_id = id;
    in.q = HostTensor::FromFloats(DType::kFp32, {5, g().num_q_heads, g().head_dim}, *q);
    in.k = HostTensor::FromFloats(DType::kFp32, {g().num_kv_heads, g().head_dim}, *k);
    in.v = HostTensor::FromFloats(DType::kFp32, {g().num_kv_heads, g().head_dim}, *v);
    return in;
  }

  // One good decode of each sequence in one batch, checked against the mirrors: proves every
  // layer length and all cached K/V are what the good requests alone produced.
  void GoodDecode(const std::vector<Mirrored*>& ms, int layer) {
    std::vector<DecodeInput> entries;
    std::vector<std::vector<float>> qs(ms.size()), ks(ms.size()), vs(ms.size());
    for (size_t i = 0; i < ms.size(); ++i) {
      entries.push_back(RandomDecode(ms[i]->id, &qs[i], &ks[i], &vs[i]));
    }
    absl::StatusOr<std::vector<client::DecodeResult>> r = client().Decode(layer, entries);
    ASSERT_TRUE(r.ok()) << r.status();
    for (size_t i = 0; i < ms.size(); ++i) {
      absl::StatusOr<std::vector<float>> want = ms[i]->ref->Decode(layer, qs[i], ks[i], vs[i]);
      ASSERT_TRUE(want.ok()) << want.status();
      EXPECT_EQ((*r)[i].length, ms[i]->ref->length(layer)) << "entry " << i;
      const testing::ErrorStats e = testing::CompareOutputs((*r)[i].o.ToFloats(), *want);
      EXPECT_LE(e.max_abs, kFp32Bar) << "decode entry " << i << " layer " << layer;
    }
  }
  void GoodDecode(Mirrored* m, int layer) { GoodDecode(std::vector<Mirrored*>{m}, layer); }

  int64_t PagesFree() {
    absl::StatusOr<v1::GetServerInfoResponse> info = client().Info();
    EXPECT_TRUE(info.ok()) << info.status();
    return info.ok() ? info->kv_cache().pages_free() : -1;
  }

  // A well-formed prefill request for `id` as a proto, to be broken by the caller.
  v1::PrefillRequest GoodPrefillProto(const std::string& id, int layer, int64_t t) {
    const PrefillInputs in = RandomPrefill(t);
    v1::PrefillRequest request;
    request.set_sequence_id(id);
    request.set_layer(layer);
    client::ToProto(Q(t, in.q), request.mutable_q());
    client::ToProto(KV(t, in.k), request.mutable_k());
    client::ToProto(KV(t, in.v), request.mutable_v());
    return request;
  }

  static testing::ModelGeometry* geometry_;
  static testing::TestDaemon* daemon_;
  std::mt19937 rng_{1234};
  std::vector<std::string> created_;  // ids, released in TearDown
};

testing::ModelGeometry* BadInputTest::geometry_ = nullptr;
testing::TestDaemon* BadInputTest::daemon_ = nullptr;

// A sequence with 20 tokens in layer 0 and 7 in layer 1 is the victim of every bad prefill.
TEST_F(BadInputTest, MalformedPrefillTensorsChangeNothing) {
  std::unique_ptr<Mirrored> m = NewSequence();
  GoodPrefill(m.get(), 0, 20);
  GoodPrefill(m.get(), 1, 7);
  const int64_t free_before = PagesFree();
  const int64_t t = 8;

  struct Case {
    std::string what;
    std::function<void(v1::PrefillRequest*)> mutate;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"q dtype unspecified",
       [](v1::PrefillRequest* r) { r->mutable_q()->set_dtype(v1::DTYPE_UNSPECIFIED); },
       "q dtype must be bf16, fp16 or fp32, got unspecified (0)"},
      {"k dtype out of the enum",
       [](v1::PrefillRequest* r) { r->mutable_k()->set_dtype(static_cast<v1::DType>(7)); },
       "k dtype must be bf16, fp16 or fp32"},
      // The one-byte KV dtypes name the cache's element type only, never a request tensor's.
      {"v dtype int8", [](v1::PrefillRequest* r) { r->mutable_v()->set_dtype(v1::DTYPE_INT8); },
       "v dtype must be bf16, fp16 or fp32, got int8 (5, a KV cache dtype only)"},
      {"q dtype fp8", [](v1::PrefillRequest* r) { r->mutable_q()->set_dtype(v1::DTYPE_FP8_E4M3); },
       "q dtype must be bf16, fp16 or fp32, got fp8_e4m3 (4, a KV cache dtype only)"},
      {"mixed dtypes",
       [&](v1::PrefillRequest* r) {
         client::ToProto(
             KV(t, testing::RandomInputs(&rng_, t * g().kv_elems_per_token()), DType::kBf16),
             r->mutable_v());
       },
       "q, k and v must share one dtype, got q fp32, k fp32, v bf16"},
      {"q rank 3",
       [&](v1::PrefillRequest* r) {
         r->mutable_q()->clear_shape();
         for (int64_t d : {t, int64_t{5} * g().num_q_heads, int64_t{g().head_dim}}) {
           r->mutable_q()->add_shape(d);
         }
       },
       "q must have shape [T, 5, 4, 64] (T >= 1), got [8, 20, 64]"},
      {"3 query variants in a prefill",
       [&](v1::PrefillRequest* r) {
         HostTensor q3 = HostTensor::FromFloats(
             DType::kFp32, {t, 3, g().num_q_heads, g().head_dim},
             testing::RandomInputs(&rng_, t * 3 * g().num_q_heads * g().head_dim));
         client::ToProto(q3, r->mutable_q());
       },
       "q must have shape [T, 5, 4, 64] (T >= 1), got [8, 3, 4, 64]"},
      {"wrong q head count", [&](v1::PrefillRequest* r) { r->mutable_q()->set_shape(2, 8); },
       "q must have shape [T, 5, 4, 64] (T >= 1), got [8, 5, 8, 64]"},
      {"wrong kv head count", [&](v1::PrefillRequest* r) { r->mutable_k()->set_shape(1, 4); },
       "k must have shape [8, 2, 64] (T = 8 from q), got [8, 4, 64]"},
      {"wrong head_dim", [&](v1::PrefillRequest* r) { r->mutable_v()->set_shape(2, 32); },
       "v must have shape [8, 2, 64] (T = 8 from q), got [8, 2, 32]"},
      {"k and v disagree with q on T",
       [&](v1::PrefillRequest* r) { r->mutable_k()->set_shape(0, 4); },
       "k must have shape [8, 2, 64] (T = 8 from q), got [4, 2, 64]"},
      {"byte count mismatch",
       [&](v1::PrefillRequest* r) { r->mutable_v()->mutable_data()->resize(t * 128 * 4 - 4); },
       "v holds 4092 bytes of data, but shape [8, 2, 64] of fp32 needs 4096"},
      {"zero tokens",
       [&](v1::PrefillRequest* r) {
         for (v1::Tensor* x : {r->mutable_q(), r->mutable_k(), r->mutable_v()}) {
           x->set_shape(0, 0);
           x->clear_data();
         }
       },
       "q must have shape [T, 5, 4, 64] (T >= 1), got [0, 5, 4, 64]"},
      {"layer -1", [](v1::PrefillRequest* r) { r->set_layer(-1); }, "layer -1 is not in [0, 2)"},
      {"layer num_layers", [](v1::PrefillRequest* r) { r->set_layer(2); },
       "layer 2 is not in [0, 2)"},
      {"prompt_len below the new length", [](v1::PrefillRequest* r) { r->set_prompt_len(27); },
       "prompt_len 27 is less than the layer's length after this call (28)"},
      {"prompt_len past the maximum", [](v1::PrefillRequest* r) { r->set_prompt_len(257); },
       "prompt_len 257 is past the maximum sequence length 256"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    v1::PrefillRequest request = GoodPrefillProto(m->id, 0, t);
    c.mutate(&request);
    const absl::StatusCode want = absl::StrContains(c.message, "maximum")
                                      ? absl::StatusCode::kOutOfRange
                                      : absl::StatusCode::kInvalidArgument;
    const absl::Status s = client().PrefillRaw(request).status();
    EXPECT_EQ(s.code(), want) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(c.message));
    EXPECT_EQ(PagesFree(), free_before);
  }
  // Both layers still hold exactly the good tokens, with the right K/V.
  GoodDecode(m.get(), 0);
  GoodDecode(m.get(), 1);
  GoodPrefill(m.get(), 1, 5);
}

TEST_F(BadInputTest, SequenceIds) {
  std::unique_ptr<Mirrored> m = NewSequence();
  GoodPrefill(m.get(), 0, 9);
  const int64_t free_before = PagesFree();

  // Well formed but never created.
  const std::string unknown = "0123456789abcdef0123456789abcdef";
  v1::PrefillRequest request = GoodPrefillProto(unknown, 0, 4);
  EXPECT_STATUS(client().PrefillRaw(request).status(), kNotFound,
                absl::StrCat("sequence ", unknown, " not found"));
  EXPECT_STATUS(client().Release(unknown).status(), kNotFound,
                absl::StrCat("sequence ", unknown, " not found"));

  // Malformed: wrong length, upper case, non-hex, empty.
  for (const std::string& bad :
       {std::string("xyz"), std::string("0123456789ABCDEF0123456789ABCDEF"),
        std::string("0123456789abcdef0123456789abcdeg"), std::string()}) {
    SCOPED_TRACE(bad);
    request = GoodPrefillProto(bad, 0, 4);
    EXPECT_STATUS(client().PrefillRaw(request).status(), kInvalidArgument,
                  "sequence_id must be 32 lowercase hex characters");
    EXPECT_STATUS(client().Release(bad).status(), kInvalidArgument,
                  "sequence_id must be 32 lowercase hex characters");
    std::vector<float> q, k, v;
    EXPECT_STATUS(client().Decode(0, {RandomDecode(bad, &q, &k, &v)}).status(), kInvalidArgument,
                  "entries[0]: sequence_id must be 32 lowercase hex characters");
  }
  EXPECT_EQ(PagesFree(), free_before);
  GoodDecode(m.get(), 0);

  // Released: every call is NOT_FOUND with the same message as an unknown id, and the pages are
  // back in the pool.
  std::unique_ptr<Mirrored> gone = NewSequence();
  GoodPrefill(gone.get(), 0, 33);  // 3 pages of 16
  const int64_t free_with_gone = PagesFree();
  absl::StatusOr<int64_t> freed = client().Release(gone->id);
  ASSERT_TRUE(freed.ok()) << freed.status();
  EXPECT_EQ(*freed, 3);
  EXPECT_EQ(PagesFree(), free_with_gone + 3);
  const std::string not_found = absl::StrCat("sequence ", gone->id, " not found");
  EXPECT_STATUS(client().Release(gone->id).status(), kNotFound, not_found);
  EXPECT_STATUS(client().PrefillRaw(GoodPrefillProto(gone->id, 0, 4)).status(), kNotFound,
                not_found);
  std::vector<float> q, k, v;
  EXPECT_STATUS(client().Decode(0, {RandomDecode(gone->id, &q, &k, &v)}).status(), kNotFound,
                absl::StrCat("entries[0]: ", not_found));
  EXPECT_EQ(PagesFree(), free_with_gone + 3);
  GoodDecode(m.get(), 0);
}

TEST_F(BadInputTest, BadDecodeBatchesChangeNothing) {
  std::unique_ptr<Mirrored> a = NewSequence();
  std::unique_ptr<Mirrored> b = NewSequence();
  std::unique_ptr<Mirrored> empty = NewSequence();
  GoodPrefill(a.get(), 0, 16);  // decode of a needs a new page: a rollback must return it
  GoodPrefill(b.get(), 0, 5);
  GoodPrefill(empty.get(), 1, 3);  // layer 0 of `empty` holds nothing
  const int64_t free_before = PagesFree();
  std::vector<float> q, k, v;

  EXPECT_STATUS(client().Decode(0, {}).status(), kInvalidArgument,
                "a decode needs at least one entry");
  // Decode on an empty layer, alone and behind good entries.
  EXPECT_STATUS(client().Decode(0, {RandomDecode(empty->id, &q, &k, &v)}).status(),
                kFailedPrecondition,
                absl::StrCat("entries[0]: layer 0 of sequence ", empty->id,
                             " holds no tokens; prefill it before decoding"));
  EXPECT_STATUS(client()
                    .Decode(0, {RandomDecode(a->id, &q, &k, &v), RandomDecode(b->id, &q, &k, &v),
                                RandomDecode(empty->id, &q, &k, &v)})
                    .status(),
                kFailedPrecondition, absl::StrCat("entries[2]: layer 0 of sequence ", empty->id));
  // The same sequence twice.
  EXPECT_STATUS(client()
                    .Decode(0, {RandomDecode(a->id, &q, &k, &v), RandomDecode(b->id, &q, &k, &v),
                                RandomDecode(a->id, &q, &k, &v)})
                    .status(),
                kInvalidArgument,
                absl::StrCat("entries[0] and entries[2] name the same sequence ", a->id));
  // One malformed entry among good ones.
  DecodeInput bad_shape = RandomDecode(b->id, &q, &k, &v);
  bad_shape.k.shape = {g().num_kv_heads + 1, g().head_dim};
  EXPECT_STATUS(client().Decode(0, {RandomDecode(a->id, &q, &k, &v), bad_shape}).status(),
                kInvalidArgument, "entries[1]: k must have shape [2, 64], got [3, 64]");
  DecodeInput bad_q = RandomDecode(b->id, &q, &k, &v);
  bad_q.q = HostTensor::FromFloats(DType::kFp32, {4, g().num_q_heads, g().head_dim},
                                   testing::RandomInputs(&rng_, 4 * g().o_elems_per_token()));
  EXPECT_STATUS(client().Decode(0, {RandomDecode(a->id, &q, &k, &v), bad_q}).status(),
                kInvalidArgument, "entries[1]: q must have shape [3 or 5, 4, 64], got [4, 4, 64]");
  DecodeInput bad_bytes = RandomDecode(b->id, &q, &k, &v);
  bad_bytes.v.data.pop_back();
  EXPECT_STATUS(client().Decode(0, {RandomDecode(a->id, &q, &k, &v), bad_bytes}).status(),
                kInvalidArgument,
                "entries[1]: v holds 511 bytes of data, but shape [2, 64] of fp32 needs 512");
  DecodeInput mixed = RandomDecode(b->id, &q, &k, &v);
  mixed.k = HostTensor::FromFloats(DType::kFp16, mixed.k.shape, k);
  EXPECT_STATUS(client().Decode(0, {RandomDecode(a->id, &q, &k, &v), mixed}).status(),
                kInvalidArgument, "entries[1]: q, k and v must share one dtype");
  const std::string unknown = "fedcba9876543210fedcba9876543210";
  EXPECT_STATUS(client()
                    .Decode(0, {RandomDecode(a->id, &q, &k, &v), RandomDecode(unknown, &q, &k, &v)})
                    .status(),
                kNotFound, absl::StrCat("entries[1]: sequence ", unknown, " not found"));
  // Unspecified dtype needs a hand-built proto.
  v1::DecodeRequest raw;
  raw.set_layer(0);
  client::DecodeInput good = RandomDecode(a->id, &q, &k, &v);
  v1::DecodeEntry* e = raw.add_entries();
  e->set_sequence_id(a->id);
  client::ToProto(good.q, e->mutable_q());
  client::ToProto(good.k, e->mutable_k());
  client::ToProto(good.v, e->mutable_v());
  e->mutable_q()->set_dtype(v1::DTYPE_UNSPECIFIED);
  EXPECT_STATUS(client().DecodeRaw(raw).status(), kInvalidArgument,
                "entries[0]: q dtype must be bf16, fp16 or fp32, got unspecified (0)");
  // Layers out of range.
  EXPECT_STATUS(client().Decode(-1, {RandomDecode(a->id, &q, &k, &v)}).status(), kInvalidArgument,
                "layer -1 is not in [0, 2)");
  EXPECT_STATUS(client().Decode(2, {RandomDecode(a->id, &q, &k, &v)}).status(), kInvalidArgument,
                "layer 2 is not in [0, 2)");

  EXPECT_EQ(PagesFree(), free_before);
  GoodDecode({a.get(), b.get()}, 0);
  GoodPrefill(empty.get(), 0, 2);
  GoodDecode({empty.get(), b.get(), a.get()}, 0);
}

TEST_F(BadInputTest, MaximumSequenceLength) {
  std::unique_ptr<Mirrored> m = NewSequence();
  for (int i = 0; i < 10; ++i) GoodPrefill(m.get(), 0, 20, 256);  // 200 tokens
  const int64_t free_before = PagesFree();
  // Every chunk of one prompt carries one prompt_len (it picks the length scale and the sparse
  // path of all of them).
  for (std::optional<int64_t> other : {std::optional<int64_t>(250), std::optional<int64_t>()}) {
    const PrefillInputs in = RandomPrefill(4);
    EXPECT_STATUS(client().Prefill(m->id, 0, Q(4, in.q), KV(4, in.k), KV(4, in.v), other).status(),
                  kInvalidArgument,
                  absl::StrCat("holds 200 tokens of a prompt sent with prompt_len 256; every chunk "
                               "of that prompt must carry prompt_len 256, got ",
                               other ? "250" : "none"));
    EXPECT_EQ(PagesFree(), free_before);
  }
  v1::PrefillRequest request = GoodPrefillProto(m->id, 0, 57);
  request.set_prompt_len(256);
  // 57 fp32 tokens would be over the message limit; the length check must not depend on that.
  for (v1::Tensor* x : {request.mutable_q(), request.mutable_k(), request.mutable_v()}) {
    HostTensor h = *client::FromProto(*x);
    client::ToProto(HostTensor::FromFloats(DType::kBf16, h.shape, h.ToFloats()), x);
  }
  EXPECT_STATUS(client().PrefillRaw(request).status(), kOutOfRange,
                absl::StrCat("layer 0 of sequence ", m->id,
                             " holds 200 tokens; 57 more would pass the maximum sequence length"
                             " 256"));
  EXPECT_EQ(PagesFree(), free_before);
  GoodPrefill(m.get(), 0, 24, 256);
  GoodPrefill(m.get(), 0, 24, 256);
  GoodPrefill(m.get(), 0, 7, 256);
  GoodDecode(m.get(), 0);  // 256: full
  std::vector<float> q, k, v;
  const int64_t free_full = PagesFree();
  EXPECT_STATUS(client().Decode(0, {RandomDecode(m->id, &q, &k, &v)}).status(), kOutOfRange,
                absl::StrCat("entries[0]: layer 0 of sequence ", m->id,
                             " already holds the maximum sequence length of 256 tokens"));
  EXPECT_EQ(PagesFree(), free_full);
  // The other layer is unaffected and still usable.
  GoodPrefill(m.get(), 1, 3);
  GoodDecode(m.get(), 1);
}

// A NaN or an infinity in q, k or v would poison every later output of the sequence (the cached
// K/V, or a softmax): refused, in every dtype and q layout, changing nothing.
TEST_F(BadInputTest, NonFiniteInputsAreRefused) {
  std::unique_ptr<Mirrored> m = NewSequence();
  GoodPrefill(m.get(), 0, 6);
  const int64_t free_before = PagesFree();
  const float bad_values[] = {std::numeric_limits<float>::quiet_NaN(),
                              std::numeric_limits<float>::infinity(),
                              -std::numeric_limits<float>::infinity()};
  for (DType dtype : {DType::kFp32, DType::kBf16, DType::kFp16}) {
    for (float bad : bad_values) {
      for (int which = 0; which < 3; ++which) {
        PrefillInputs in = RandomPrefill(3);
        std::vector<float>* target = which == 0 ? &in.q : which == 1 ? &in.k : &in.v;
        (*target)[target->size() / 2] = bad;
        const std::string name = which == 0 ? "q" : which == 1 ? "k" : "v";
        EXPECT_STATUS(
            client()
                .Prefill(m->id, 0, Q(3, in.q, dtype), KV(3, in.k, dtype), KV(3, in.v, dtype))
                .status(),
            kInvalidArgument, absl::StrCat(name, " holds a NaN or an infinity"));
        std::vector<float> q, k, v;
        DecodeInput d = RandomDecode(m->id, &q, &k, &v);
        std::vector<float>* dt = which == 0 ? &q : which == 1 ? &k : &v;
        (*dt)[dt->size() / 3] = bad;
        d.q = HostTensor::FromFloats(dtype, d.q.shape, q);
        d.k = HostTensor::FromFloats(dtype, d.k.shape, k);
        d.v = HostTensor::FromFloats(dtype, d.v.shape, v);
        EXPECT_STATUS(client().Decode(0, {d}).status(), kInvalidArgument,
                      absl::StrCat("entries[0]: ", name, " holds a NaN or an infinity"));
      }
    }
  }
  EXPECT_EQ(PagesFree(), free_before);
  GoodPrefill(m.get(), 0, 2);  // the mirror agrees: nothing was appended
  GoodDecode(m.get(), 0);
}

TEST_F(BadInputTest, OversizedMessage) {
  std::unique_ptr<Mirrored> m = NewSequence();
  GoodPrefill(m.get(), 0, 4);
  const int64_t free_before = PagesFree();
  const int64_t t = 64;  // ~393 KB of fp32 against a 256 KB limit
  const PrefillInputs in = RandomPrefill(t);
  EXPECT_STATUS(client().Prefill(m->id, 0, Q(t, in.q), KV(t, in.k), KV(t, in.v)).status(),
                kResourceExhausted, "larger than max");
  EXPECT_EQ(PagesFree(), free_before);
  GoodDecode(m.get(), 0);
  // The same over a Session: the stream reports it as the stream's status.
  absl::StatusOr<std::unique_ptr<client::Session>> session = client().OpenSession();
  ASSERT_TRUE(session.ok()) << session.status();
  EXPECT_STATUS((*session)->Prefill(m->id, 0, Q(t, in.q), KV(t, in.k), KV(t, in.v)).status(),
                kResourceExhausted, "larger than max");
  EXPECT_EQ(PagesFree(), free_before);
  GoodDecode(m.get(), 0);
}

// The limit GetServerInfo reports is what the message really allows: a call of that many fp32
// tokens goes through, and a client that asks MaxPrefillTokens for bf16 may send that many.
TEST_F(BadInputTest, PrefillTokenLimitIsWhatTheMessageAllows) {
  absl::StatusOr<v1::GetServerInfoResponse> info = client().Info();
  ASSERT_TRUE(info.ok()) << info.status();
  const int64_t n = info->limits().max_prefill_tokens_per_call();
  // fp32 five variants: (5 x Hq x D + 2 x Hkv x D) x 4 bytes a token, 1 KiB of framing.
  const int64_t per_token = (g().q_elems_per_token() + 2 * g().kv_elems_per_token()) * 4;
  EXPECT_EQ(n, ((256 << 10) - 1024) / per_token);
  EXPECT_EQ(client::MaxPrefillTokens(*info, DType::kFp32, v1::Q_LAYOUT_VARIANTS), n);
  const int64_t n_bf16 = client::MaxPrefillTokens(*info, DType::kBf16, v1::Q_LAYOUT_VARIANTS);
  EXPECT_EQ(n_bf16, ((256 << 10) - 1024) / (per_token / 2));
  std::unique_ptr<Mirrored> m = NewSequence();
  GoodPrefill(m.get(), 0, n);
  const PrefillInputs in = RandomPrefill(n_bf16);
  absl::StatusOr<client::PrefillResult> r =
      client().Prefill(m->id, 1, Q(n_bf16, in.q, DType::kBf16), KV(n_bf16, in.k, DType::kBf16),
                       KV(n_bf16, in.v, DType::kBf16));
  EXPECT_TRUE(r.ok()) << r.status();
  // One call past it is refused, saying where the limits are.
  const PrefillInputs over = RandomPrefill(n + 2);
  EXPECT_STATUS(
      client().Prefill(m->id, 0, Q(n + 2, over.q), KV(n + 2, over.k), KV(n + 2, over.v)).status(),
      kResourceExhausted, "limits.max_prefill_tokens_per_call");
}

// A Session answers a bad request in-stream and keeps going.
TEST_F(BadInputTest, SessionSurvivesBadRequests) {
  std::unique_ptr<Mirrored> m = NewSequence();
  GoodPrefill(m.get(), 0, 12);
  absl::StatusOr<std::unique_ptr<client::Session>> session = client().OpenSession();
  ASSERT_TRUE(session.ok()) << session.status();
  const PrefillInputs in = RandomPrefill(3);
  EXPECT_STATUS((*session)->Prefill(m->id, 5, Q(3, in.q), KV(3, in.k), KV(3, in.v)).status(),
                kInvalidArgument, "layer 5 is not in [0, 2)");
  std::vector<float> q, k, v;
  EXPECT_STATUS((*session)->Decode(1, {RandomDecode(m->id, &q, &k, &v)}).status(),
                kFailedPrecondition, "holds no tokens");
  // Good requests on the same stream, checked against the mirror.
  absl::StatusOr<client::PrefillResult> r =
      (*session)->Prefill(m->id, 0, Q(3, in.q), KV(3, in.k), KV(3, in.v));
  ASSERT_TRUE(r.ok()) << r.status();
  absl::StatusOr<std::vector<float>> want = m->ref->Prefill(0, in.q, in.k, in.v, 15);
  ASSERT_TRUE(want.ok());
  EXPECT_EQ(r->length, 15);
  EXPECT_LE(testing::CompareOutputs(r->o.ToFloats(), *want).max_abs, kFp32Bar);
  DecodeInput d = RandomDecode(m->id, &q, &k, &v);
  absl::StatusOr<std::vector<client::DecodeResult>> dr = (*session)->Decode(0, {d});
  ASSERT_TRUE(dr.ok()) << dr.status();
  want = m->ref->Decode(0, q, k, v);
  ASSERT_TRUE(want.ok());
  EXPECT_EQ((*dr)[0].length, 16);
  EXPECT_LE(testing::CompareOutputs((*dr)[0].o.ToFloats(), *want).max_abs, kFp32Bar);
  EXPECT_TRUE((*session)->Close().ok());
}

// A pool of four pages and at most two live sequences: running out of either fails cleanly, all
// or nothing, and the other sequences go on.
TEST(PoolExhaustedTest, FailsWithoutChangingAnything) {
  testing::ModelGeometry geometry;
  geometry.name = "pool-exhausted-tiny";
  ServerOptions options;
  options.page_size = 16;
  options.kv_dtype = "fp32";
  // One page: 2 layers x (K + V) x 16 tokens x 2 kv heads x 64 x 4 B = 32 KB. Four pages.
  options.kv_cache_bytes = 4 * 32768;
  options.max_sequences = 2;
  options.compute_threads = 2;
  absl::StatusOr<std::unique_ptr<testing::TestDaemon>> daemon =
      testing::TestDaemon::Start(geometry, options);
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  client::AttndClient& c = (*daemon)->client();
  absl::StatusOr<v1::GetServerInfoResponse> info = c.Info();
  ASSERT_TRUE(info.ok()) << info.status();
  ASSERT_EQ(info->kv_cache().bytes_per_page(), 32768);
  ASSERT_EQ(info->kv_cache().pages_total(), 4);
  auto pages_free = [&] { return c.Info().value().kv_cache().pages_free(); };

  std::mt19937 rng(99);
  const DcaGeometry dca = geometry.dca();
  auto prefill = [&](const std::string& id, naive::NaiveSequence* ref, int layer,
                     int64_t t) -> absl::Status {
    const std::vector<float> q = testing::RandomInputs(&rng, t * geometry.q_elems_per_token());
    const std::vector<float> k = testing::RandomInputs(&rng, t * geometry.kv_elems_per_token());
    const std::vector<float> v = testing::RandomInputs(&rng, t * geometry.kv_elems_per_token());
    absl::StatusOr<client::PrefillResult> r =
        c.Prefill(id, layer, HostTensor::FromFloats(DType::kFp32, {t, 5, 4, 64}, q),
                  HostTensor::FromFloats(DType::kFp32, {t, 2, 64}, k),
                  HostTensor::FromFloats(DType::kFp32, {t, 2, 64}, v));
    if (!r.ok()) return r.status();
    absl::StatusOr<std::vector<float>> want = ref->Prefill(layer, q, k, v, ref->length(layer) + t);
    EXPECT_TRUE(want.ok());
    EXPECT_EQ(r->length, ref->length(layer));
    EXPECT_LE(testing::CompareOutputs(r->o.ToFloats(), *want).max_abs, kFp32Bar);
    return absl::OkStatus();
  };
  // Decodes each (id, ref) in one batch; checks against the refs only on success.
  auto decode = [&](std::vector<std::pair<std::string, naive::NaiveSequence*>> seqs,
                    int layer) -> absl::Status {
    std::vector<DecodeInput> entries;
    std::vector<std::vector<float>> qs, ks, vs;
    for (const auto& [id, ref] : seqs) {
      qs.push_back(testing::RandomInputs(&rng, geometry.q_elems_per_token()));
      ks.push_back(testing::RandomInputs(&rng, geometry.kv_elems_per_token()));
      vs.push_back(testing::RandomInputs(&rng, geometry.kv_elems_per_token()));
      entries.push_back({id, HostTensor::FromFloats(DType::kFp32, {5, 4, 64}, qs.back()),
                         HostTensor::FromFloats(DType::kFp32, {2, 64}, ks.back()),
                         HostTensor::FromFloats(DType::kFp32, {2, 64}, vs.back())});
    }
    absl::StatusOr<std::vector<client::DecodeResult>> r = c.Decode(layer, entries);
    if (!r.ok()) return r.status();
    for (size_t i = 0; i < seqs.size(); ++i) {
      absl::StatusOr<std::vector<float>> want = seqs[i].second->Decode(layer, qs[i], ks[i], vs[i]);
      EXPECT_TRUE(want.ok());
      EXPECT_EQ((*r)[i].length, seqs[i].second->length(layer));
      EXPECT_LE(testing::CompareOutputs((*r)[i].o.ToFloats(), *want).max_abs, kFp32Bar);
    }
    return absl::OkStatus();
  };

  const std::string a = c.CreateSequence().value(), b = c.CreateSequence().value();
  naive::NaiveSequence ra(dca, 2), rb(dca, 2);
  // max_sequences 2: a third is refused and nothing is created.
  EXPECT_STATUS(c.CreateSequence().status(), kResourceExhausted,
                "too many live sequences: the limit is 2; release one first");
  EXPECT_EQ(c.Info().value().live_sequences(), 2);
  ASSERT_TRUE(prefill(a, &ra, 0, 48).ok());  // 3 pages
  EXPECT_EQ(pages_free(), 1);
  EXPECT_STATUS(prefill(b, &rb, 0, 32), kResourceExhausted,
                "out of KV cache pages: 2 needed, 1 free of 4");
  EXPECT_EQ(pages_free(), 1);
  // b gained nothing: its layer 0 is still empty.
  EXPECT_STATUS(decode({{b, &rb}}, 0), kFailedPrecondition, "holds no tokens");
  ASSERT_TRUE(prefill(b, &rb, 0, 16).ok());  // the last page
  EXPECT_EQ(pages_free(), 0);
  // a and b both need a new page for position 48 / 16: nothing is applied, a's page given back.
  EXPECT_STATUS(decode({{a, &ra}, {b, &rb}}, 0), kResourceExhausted, "out of KV cache pages");
  EXPECT_STATUS(decode({{b, &rb}, {a, &ra}}, 0), kResourceExhausted, "out of KV cache pages");
  EXPECT_EQ(pages_free(), 0);
  // Layers share pages: filling layer 1 up to what layer 0 holds needs no new page.
  ASSERT_TRUE(prefill(a, &ra, 1, 40).ok());
  ASSERT_TRUE(decode({{a, &ra}}, 1).ok());
  ASSERT_TRUE(prefill(b, &rb, 1, 16).ok());
  EXPECT_EQ(pages_free(), 0);
  // Releasing b makes room for a, whose K/V survived every failure (checked by the reference).
  absl::StatusOr<int64_t> freed = c.Release(b);
  ASSERT_TRUE(freed.ok()) << freed.status();
  EXPECT_EQ(*freed, 1);
  // A slot is free again.
  absl::StatusOr<std::string> third = c.CreateSequence();
  ASSERT_TRUE(third.ok()) << third.status();
  ASSERT_TRUE(c.Release(*third).ok());
  ASSERT_TRUE(decode({{a, &ra}}, 0).ok());
  EXPECT_EQ(ra.length(0), 49);
  EXPECT_EQ(pages_free(), 0);
  freed = c.Release(a);
  ASSERT_TRUE(freed.ok()) << freed.status();
  EXPECT_EQ(*freed, 4);
  info = c.Info();
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->kv_cache().pages_free(), 4);
  EXPECT_EQ(info->live_sequences(), 0);
}

}  // namespace
}  // namespace attnd
