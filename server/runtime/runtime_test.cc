// Runtime with the real CpuEngine on the tiny geometry: every bad request returns the documented
// code and message and changes nothing (layer lengths, free pages); pool exhaustion and release;
// outputs of prefill + decode against the fp64 naive reference.
#include "server/runtime/runtime.h"

#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/dtype.h"
#include "gtest/gtest.h"
#include "kernels/dca.h"
#include "kernels/testing/naive_dca.h"
#include "server/config/model_config.h"
#include "server/config/test_models.h"
#include "server/engine/engine.h"
#include "server/engine/engine_factory.h"

namespace attnd {
namespace {

constexpr int kHq = 4, kHkv = 2, kD = 64;
constexpr int64_t kPageBytes = 32768;  // 2 layers x K,V x 16 tokens x 2 heads x 64 x fp32
constexpr int64_t kMaxLen = 512;

using test_models::TinyModel;

// Delegates to a real engine; fails every job while `fail` is set, after the runtime has reserved
// pages, which is what a device error looks like.
class FlakyEngine : public Engine {
 public:
  explicit FlakyEngine(std::unique_ptr<Engine> inner) : inner_(std::move(inner)) {}
  std::string backend() const override { return inner_->backend(); }
  std::string device_name() const override { return inner_->device_name(); }
  const KvLayout& layout() const override { return inner_->layout(); }
  const DcaGeometry& geometry() const override { return inner_->geometry(); }
  absl::Status Prefill(const PrefillJob& job) override {
    return fail ? absl::DataLossError("injected") : inner_->Prefill(job);
  }
  absl::StatusOr<DecodeStats> Decode(const DecodeJob& job) override {
    if (fail) return absl::DataLossError("injected");
    return inner_->Decode(job);
  }
  bool fail = false;

 private:
  std::unique_ptr<Engine> inner_;
};

struct Owned {
  DType dtype = DType::kFp32;
  std::vector<int64_t> shape;
  std::string bytes;
  std::vector<float> values;  // what the bytes hold, as fp32
  RequestTensor req() const { return RequestTensor{dtype, shape, bytes}; }
};

Owned Random(std::vector<int64_t> shape, std::mt19937* rng, DType dtype = DType::kFp32) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::normal_distribution<float> dist(0.f, 1.f);
  std::vector<float> raw(n);
  for (float& x : raw) x = dist(*rng);
  Owned t;
  t.dtype = dtype;
  t.shape = std::move(shape);
  t.bytes.resize(n * ElementSize(dtype));
  t.values.resize(n);
  if (n == 0) return t;  // memcpy of null pointers is undefined even for 0 bytes
  ConvertFromFloat(raw.data(), n, dtype, t.bytes.data());
  ConvertToFloat(t.bytes.data(), dtype, n, t.values.data());
  return t;
}

class RuntimeTest : public testing::Test {
 protected:
  void Start(int64_t pages, int64_t max_sequences = 0, const std::string& instance = "") {
    EngineOptions eo;
    eo.device = "cpu";
    eo.geometry = TinyModel().geometry();
    eo.num_layers = 2;
    eo.page_size = 16;
    eo.kv_cache_bytes = pages * kPageBytes;
    eo.compute_threads = 2;
    absl::StatusOr<std::unique_ptr<Engine>> engine = CreateEngine(eo);
    ASSERT_TRUE(engine.ok()) << engine.status();
    auto flaky = std::make_unique<FlakyEngine>(*std::move(engine));
    engine_ = flaky.get();
    RuntimeOptions ro;
    ro.version = "test";
    ro.max_message_bytes = 1 << 20;
    ro.max_sequence_length = kMaxLen;
    ro.max_sequences = max_sequences;
    ro.instance_name = instance;
    ro.advertise_address = instance.empty() ? "" : instance + ".fleet:50051";
    absl::StatusOr<std::unique_ptr<Runtime>> rt =
        Runtime::Create(TinyModel(), std::move(flaky), ro);
    ASSERT_TRUE(rt.ok()) << rt.status();
    rt_ = *std::move(rt);
  }

  std::string NewSequence() {
    absl::StatusOr<std::string> id = rt_->CreateSequence("");
    EXPECT_TRUE(id.ok()) << id.status();
    return id.ok() ? *id : "";
  }

  std::vector<int64_t> Lengths(const std::string& id) {
    absl::StatusOr<std::vector<int64_t>> l = rt_->LayerLengths(id, "");
    EXPECT_TRUE(l.ok()) << l.status();
    return l.ok() ? *l : std::vector<int64_t>{};
  }

  int64_t PagesFree() { return rt_->Info().kv_cache.pages_free; }

  // A valid prefill call of t tokens whose tensors live in this->q_, k_, v_.
  PrefillCall MakePrefill(const std::string& id, int32_t layer, int64_t t) {
    q_ = Random({t, kNumQueryVariants, kHq, kD}, &rng_);
    k_ = Random({t, kHkv, kD}, &rng_);
    v_ = Random({t, kHkv, kD}, &rng_);
    PrefillCall call;
    call.sequence_id = id;
    call.layer = layer;
    call.q = q_.req();
    call.k = k_.req();
    call.v = v_.req();
    return call;
  }

  absl::Status PrefillOk(const std::string& id, int32_t layer, int64_t t) {
    return rt_->Prefill(MakePrefill(id, layer, t)).status();
  }

  std::mt19937 rng_{42};
  FlakyEngine* engine_ = nullptr;
  std::unique_ptr<Runtime> rt_;
  Owned q_, k_, v_;
};

TEST_F(RuntimeTest, InfoReportsModelPoolAndLimits) {
  Start(/*pages=*/40, /*max_sequences=*/7);
  const std::string id = NewSequence();
  const ServerInfo info = rt_->Info();
  EXPECT_EQ(info.version, "test");
  EXPECT_EQ(info.backend, "cpu");
  EXPECT_FALSE(info.device.empty());
  EXPECT_EQ(info.model.name, "tiny");
  EXPECT_EQ(info.model.num_layers, 2);
  EXPECT_EQ(info.model.num_q_heads, 4);
  EXPECT_EQ(info.model.num_kv_heads, 2);
  EXPECT_EQ(info.model.head_dim, 64);
  EXPECT_EQ(info.model.kv_dtype, DType::kFp32);
  EXPECT_EQ(info.model.max_position_embeddings, 4096);
  EXPECT_FLOAT_EQ(info.model.softmax_scale, 0.125f);
  EXPECT_EQ(info.dca.chunk_size, 160);
  EXPECT_EQ(info.dca.local_size, 32);
  EXPECT_EQ(info.dca.chunk_len, 128);
  EXPECT_EQ(info.dca.original_max_position_embeddings, 256);
  EXPECT_FALSE(info.dca.sparse_attention_enabled);
  EXPECT_EQ(info.dca.sparse_attention_threshold, 32768);
  EXPECT_EQ(info.dca.sparse_attention_last_q, 64);
  EXPECT_EQ(info.kv_cache.page_size, 16);
  EXPECT_EQ(info.kv_cache.pages_total, 40);
  EXPECT_EQ(info.kv_cache.pages_free, 40);
  EXPECT_EQ(info.kv_cache.bytes_per_page, kPageBytes);
  EXPECT_EQ(info.kv_cache.pool_bytes, 40 * kPageBytes);
  EXPECT_EQ(info.live_sequences, 1);
  EXPECT_EQ(info.limits.max_message_bytes, 1 << 20);
  EXPECT_EQ(info.limits.max_sequence_length, kMaxLen);
  EXPECT_EQ(info.limits.max_sequences, 7);
  // fp32 five variants: (5 x 4 x 64 + 2 x 2 x 64) x 4 = 6144 bytes a token; (1 MiB - 1 KiB) / 6144.
  EXPECT_EQ(info.limits.max_prefill_tokens_per_call, 170);
  EXPECT_EQ(info.instance.name, "");
  EXPECT_EQ(info.instance.advertise_address, "");
}

TEST(PrefillTokensPerMessageTest, SevenBGeometryAtTheDefaultMessageLimit) {
  DcaGeometry g;
  g.num_q_heads = 28;
  g.num_kv_heads = 4;
  g.head_dim = 128;
  const int64_t limit = int64_t{512} << 20;
  // (5 x 3584 + 1024) x 4 = 75776 bytes a token in fp32; (3584 + 1024) x 2 = 9216 pre-rotary bf16.
  EXPECT_EQ(PrefillTokensPerMessage(g, limit, 5, 4), (limit - 1024) / 75776);
  EXPECT_EQ(PrefillTokensPerMessage(g, limit, 5, 4), 7084);
  EXPECT_EQ(PrefillTokensPerMessage(g, limit, 1, 2), 58254);
  // Exactly three pre-rotary fp32 tokens of (3584 + 1024) x 4 bytes, and not a byte for a fourth.
  EXPECT_EQ(PrefillTokensPerMessage(g, 3 * 18432 + 1024, 1, 4), 3);
  EXPECT_EQ(PrefillTokensPerMessage(g, 4 * 18432 + 1023, 1, 4), 3);
  EXPECT_EQ(PrefillTokensPerMessage(g, 1024, 5, 4), 0);
}

TEST_F(RuntimeTest, BadInstanceNameIsRefusedAtCreate) {
  EngineOptions eo;
  eo.device = "cpu";
  eo.geometry = TinyModel().geometry();
  eo.num_layers = 2;
  eo.page_size = 16;
  eo.kv_cache_bytes = 4 * kPageBytes;
  absl::StatusOr<std::unique_ptr<Engine>> engine = CreateEngine(eo);
  ASSERT_TRUE(engine.ok()) << engine.status();
  RuntimeOptions ro;
  ro.instance_name = "Attnd_0";
  absl::StatusOr<std::unique_ptr<Runtime>> rt =
      Runtime::Create(TinyModel(), *std::move(engine), ro);
  EXPECT_EQ(rt.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StartsWith(rt.status().message(), "the instance name must be a DNS label"))
      << rt.status();
}

// A fleet member: its ids name it, and a call for another member's sequence is told where to go,
// before anything else about the call is judged, and changes nothing.
TEST_F(RuntimeTest, AnotherInstancesSequenceIsFailedPreconditionNamingTheOwner) {
  Start(40, 0, "attnd-1");
  EXPECT_EQ(rt_->Info().instance.name, "attnd-1");
  EXPECT_EQ(rt_->Info().instance.advertise_address, "attnd-1.fleet:50051");
  const std::string id = NewSequence();
  ASSERT_TRUE(absl::StartsWith(id, "attnd-1.")) << id;
  ASSERT_TRUE(PrefillOk(id, 0, 3).ok());
  const std::string foreign = "attnd-2.0123456789abcdef0123456789abcdef";
  const std::string third = "attnd-3.0123456789abcdef0123456789abcdef";
  const std::string owned_by_2 =
      "sequence attnd-2.0123456789abcdef0123456789abcdef is owned by attnd instance \"attnd-2\" "
      "(this is \"attnd-1\"); send calls for it to that instance";

  PrefillCall prefill = MakePrefill(foreign, 0, 3);
  prefill.layer = 99;  // also wrong, but the owner is what the caller needs to hear
  absl::StatusOr<PrefillResult> p = rt_->Prefill(prefill);
  EXPECT_EQ(p.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(p.status().message(), owned_by_2);

  // A batch: the first foreign entry decides.
  Owned q = Random({3, kHq, kD}, &rng_), k = Random({kHkv, kD}, &rng_);
  DecodeCall decode;
  decode.layer = 0;
  decode.entries.push_back({id, q.req(), k.req(), k.req(), nullptr});
  decode.entries.push_back({foreign, q.req(), k.req(), k.req(), nullptr});
  decode.entries.push_back({third, q.req(), k.req(), k.req(), nullptr});
  absl::StatusOr<DecodeResult> d = rt_->Decode(decode);
  EXPECT_EQ(d.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(d.status().message(), absl::StrCat("entries[1]: ", owned_by_2));
  EXPECT_EQ(Lengths(id), (std::vector<int64_t>{3, 0}));

  absl::StatusOr<int64_t> r = rt_->ReleaseSequence(foreign, "");
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(r.status().message(), owned_by_2);
  EXPECT_EQ(rt_->CheckSequenceId(foreign).message(), owned_by_2);
  EXPECT_TRUE(rt_->CheckSequenceId(id).ok());

  // A bare id cannot be this instance's: malformed, reported where malformed ids always are.
  absl::StatusOr<PrefillResult> bare = rt_->Prefill(MakePrefill(std::string(32, 'a'), 0, 3));
  EXPECT_EQ(bare.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bare.status().message(),
            absl::StrCat("sequence_id must be \"attnd-1.\" followed by 32 lowercase hex "
                         "characters, got \"",
                         std::string(32, 'a'), "\" (32 characters)"));
  EXPECT_EQ(Lengths(id), (std::vector<int64_t>{3, 0}));
  EXPECT_EQ(rt_->Info().live_sequences, 1);
}

TEST_F(RuntimeTest, PrefillBadInputsChangeNothing) {
  Start(40);
  const std::string id = NewSequence();
  ASSERT_TRUE(PrefillOk(id, 0, 10).ok());
  ASSERT_EQ(PagesFree(), 39);

  struct BadCase {
    std::string name;
    std::function<void(PrefillCall*)> mutate;
    absl::StatusCode code;
    std::string message;
  };
  Owned short_v = Random({3, kHkv, kD}, &rng_);
  short_v.bytes.resize(short_v.bytes.size() - 4);
  Owned bf16_k = Random({3, kHkv, kD}, &rng_, DType::kBf16);
  Owned q_d32 = Random({3, 5, kHq, 32}, &rng_);
  Owned q_t0 = Random({0, 5, kHq, kD}, &rng_);
  Owned k_t2 = Random({2, kHkv, kD}, &rng_);
  Owned q_pre_bad = Random({3, 1, kHq, kD}, &rng_);
  Owned q_pre_d32 = Random({3, kHq, 32}, &rng_);
  std::vector<int64_t> big_shape = {int64_t{1} << 61, 5, kHq, kD};
  std::vector<int64_t> big_kv_shape = {int64_t{1} << 61, kHkv, kD};
  const std::string unknown(32, '0');
  const std::vector<BadCase> cases = {
      {"layer too big", [](PrefillCall* c) { c->layer = 2; }, absl::StatusCode::kInvalidArgument,
       "layer 2 is not in [0, 2)"},
      {"negative layer", [](PrefillCall* c) { c->layer = -1; }, absl::StatusCode::kInvalidArgument,
       "layer -1 is not in [0, 2)"},
      {"unspecified dtype", [](PrefillCall* c) { c->q.dtype = static_cast<DType>(0); },
       absl::StatusCode::kInvalidArgument,
       "q dtype must be bf16, fp16 or fp32, got unspecified (0)"},
      {"unknown dtype", [](PrefillCall* c) { c->v.dtype = static_cast<DType>(9); },
       absl::StatusCode::kInvalidArgument, "v dtype must be bf16, fp16 or fp32, got unknown (9)"},
      {"mixed dtypes", [&](PrefillCall* c) { c->k = bf16_k.req(); },
       absl::StatusCode::kInvalidArgument,
       "q, k and v must share one dtype, got q fp32, k bf16, v fp32"},
      {"q head_dim", [&](PrefillCall* c) { c->q = q_d32.req(); },
       absl::StatusCode::kInvalidArgument,
       "q must have shape [T, 5, 4, 64] (T >= 1), got [3, 5, 4, 32]"},
      {"q no tokens", [&](PrefillCall* c) { c->q = q_t0.req(); },
       absl::StatusCode::kInvalidArgument,
       "q must have shape [T, 5, 4, 64] (T >= 1), got [0, 5, 4, 64]"},
      {"unknown q layout", [](PrefillCall* c) { c->q_layout = static_cast<QLayout>(7); },
       absl::StatusCode::kInvalidArgument,
       "q_layout 7 is not Q_LAYOUT_VARIANTS (0) or Q_LAYOUT_PRE_ROTARY (1)"},
      {"variants q sent as pre-rotary", [](PrefillCall* c) { c->q_layout = QLayout::kPreRotary; },
       absl::StatusCode::kInvalidArgument,
       "q must have shape [T, 4, 64] (T >= 1) for q_layout pre_rotary, got [3, 5, 4, 64]"},
      {"pre-rotary q of rank 4",
       [&](PrefillCall* c) {
         c->q_layout = QLayout::kPreRotary;
         c->q = q_pre_bad.req();
       },
       absl::StatusCode::kInvalidArgument,
       "q must have shape [T, 4, 64] (T >= 1) for q_layout pre_rotary, got [3, 1, 4, 64]"},
      {"pre-rotary q head_dim",
       [&](PrefillCall* c) {
         c->q_layout = QLayout::kPreRotary;
         c->q = q_pre_d32.req();
       },
       absl::StatusCode::kInvalidArgument,
       "q must have shape [T, 4, 64] (T >= 1) for q_layout pre_rotary, got [3, 4, 32]"},
      {"k tokens differ", [&](PrefillCall* c) { c->k = k_t2.req(); },
       absl::StatusCode::kInvalidArgument,
       "k must have shape [3, 2, 64] (T = 3 from q), got [2, 2, 64]"},
      {"v short data", [&](PrefillCall* c) { c->v = short_v.req(); },
       absl::StatusCode::kInvalidArgument,
       "v holds 1532 bytes of data, but shape [3, 2, 64] of fp32 needs 1536"},
      {"absurd shape", [&](PrefillCall* c) { c->q.shape = big_shape; },
       absl::StatusCode::kInvalidArgument,
       "k must have shape [2305843009213693952, 2, 64] (T = 2305843009213693952 from q), got "
       "[3, 2, 64]"},
      {"overflowing byte count",
       [&](PrefillCall* c) {
         c->q.shape = big_shape;
         c->k.shape = c->v.shape = absl::MakeConstSpan(big_kv_shape);
       },
       absl::StatusCode::kInvalidArgument,
       "q holds 15360 bytes of data, but shape [2305843009213693952, 5, 4, 64] of fp32 needs "
       "more than 2^63"},
      {"prompt_len too small", [](PrefillCall* c) { c->prompt_len = 12; },
       absl::StatusCode::kInvalidArgument,
       "prompt_len 12 is less than the layer's length after this call (13)"},
      {"prompt_len too big", [](PrefillCall* c) { c->prompt_len = kMaxLen + 1; },
       absl::StatusCode::kOutOfRange, "prompt_len 513 is past the maximum sequence length 512"},
      {"unknown sequence", [&](PrefillCall* c) { c->sequence_id = unknown; },
       absl::StatusCode::kNotFound, absl::StrCat("sequence ", unknown, " not found")},
      {"malformed id", [](PrefillCall* c) { c->sequence_id = "xyz"; },
       absl::StatusCode::kInvalidArgument,
       "sequence_id must be 32 lowercase hex characters, got \"xyz\" (3 characters)"},
  };
  for (const BadCase& c : cases) {
    PrefillCall call = MakePrefill(id, 0, 3);
    c.mutate(&call);
    absl::StatusOr<PrefillResult> r = rt_->Prefill(call);
    ASSERT_FALSE(r.ok()) << c.name;
    EXPECT_EQ(r.status().code(), c.code) << c.name;
    EXPECT_EQ(r.status().message(), c.message) << c.name;
    EXPECT_EQ(Lengths(id), (std::vector<int64_t>{10, 0})) << c.name;
    EXPECT_EQ(PagesFree(), 39) << c.name;
  }
}

TEST_F(RuntimeTest, PastTheMaximumLengthIsOutOfRange) {
  Start(40);
  const std::string id = NewSequence();
  ASSERT_TRUE(PrefillOk(id, 1, 500).ok());
  const int64_t free_before = PagesFree();
  absl::Status s = PrefillOk(id, 1, 13);
  EXPECT_EQ(s.code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(s.message(), absl::StrCat("layer 1 of sequence ", id,
                                      " holds 500 tokens; 13 more would pass the maximum sequence"
                                      " length 512"));
  ASSERT_TRUE(PrefillOk(id, 1, 12).ok());  // exactly the maximum is fine
  EXPECT_EQ(Lengths(id), (std::vector<int64_t>{0, 512}));

  Owned q = Random({3, kHq, kD}, &rng_), k = Random({kHkv, kD}, &rng_);
  DecodeCall call;
  call.layer = 1;
  call.entries.push_back({id, q.req(), k.req(), k.req(), nullptr});
  absl::StatusOr<DecodeResult> r = rt_->Decode(call);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(r.status().message(),
            absl::StrCat("entries[0]: layer 1 of sequence ", id,
                         " already holds the maximum sequence length of 512 tokens"));
  EXPECT_EQ(Lengths(id), (std::vector<int64_t>{0, 512}));
  EXPECT_EQ(PagesFree(), free_before);
}

TEST_F(RuntimeTest, DecodeBadInputsChangeNothing) {
  Start(40);
  const std::string a = NewSequence(), b = NewSequence();
  ASSERT_TRUE(PrefillOk(a, 0, 16).ok());  // a fills its page exactly: a decode needs a new one
  ASSERT_TRUE(PrefillOk(b, 1, 5).ok());
  const int64_t free_before = PagesFree();
  ASSERT_EQ(free_before, 38);

  Owned q3 = Random({3, kHq, kD}, &rng_), q5 = Random({5, kHq, kD}, &rng_);
  Owned q4 = Random({4, kHq, kD}, &rng_);
  Owned k = Random({kHkv, kD}, &rng_), k_bad = Random({kHkv + 1, kD}, &rng_);
  const std::string unknown(32, 'f');
  auto entry = [&](const std::string& id, const Owned& q) {
    return DecodeCall::Entry{id, q.req(), k.req(), k.req(), nullptr};
  };
  struct BadCase {
    std::string name;
    DecodeCall call;
    absl::StatusCode code;
    std::string message;
  };
  std::vector<BadCase> cases;
  cases.push_back({"no entries", DecodeCall{"", 0, {}}, absl::StatusCode::kInvalidArgument,
                   "a decode needs at least one entry"});
  cases.push_back({"bad layer", DecodeCall{"", 5, {entry(a, q3)}},
                   absl::StatusCode::kInvalidArgument, "layer 5 is not in [0, 2)"});
  cases.push_back({"four variants", DecodeCall{"", 0, {entry(a, q3), entry(b, q4)}},
                   absl::StatusCode::kInvalidArgument,
                   "entries[1]: q must have shape [3 or 5, 4, 64], got [4, 4, 64]"});
  DecodeCall pre_bad{"", 0, {entry(a, q3), entry(b, q3)}};
  pre_bad.entries[1].q_layout = QLayout::kPreRotary;
  cases.push_back(
      {"variants q sent as pre-rotary", pre_bad, absl::StatusCode::kInvalidArgument,
       "entries[1]: q must have shape [4, 64] for q_layout pre_rotary, got [3, 4, 64]"});
  DecodeCall bad_layout{"", 0, {entry(a, q3)}};
  bad_layout.entries[0].q_layout = static_cast<QLayout>(-1);
  cases.push_back(
      {"unknown q layout", bad_layout, absl::StatusCode::kInvalidArgument,
       "entries[0]: q_layout -1 is not Q_LAYOUT_VARIANTS (0) or Q_LAYOUT_PRE_ROTARY (1)"});
  DecodeCall bad_k{"", 0, {entry(a, q3)}};
  bad_k.entries[0].k = k_bad.req();
  cases.push_back({"k heads", bad_k, absl::StatusCode::kInvalidArgument,
                   "entries[0]: k must have shape [2, 64], got [3, 64]"});
  cases.push_back({"duplicate", DecodeCall{"", 0, {entry(a, q3), entry(b, q3), entry(a, q5)}},
                   absl::StatusCode::kInvalidArgument,
                   absl::StrCat("entries[0] and entries[2] name the same sequence ", a,
                                "; a decode takes each sequence once")});
  cases.push_back({"unknown", DecodeCall{"", 0, {entry(a, q3), entry(unknown, q3)}},
                   absl::StatusCode::kNotFound,
                   absl::StrCat("entries[1]: sequence ", unknown, " not found")});
  // a's layer 0 is valid (and needs a new page): it must not advance when b's layer 0 is empty.
  cases.push_back({"empty layer", DecodeCall{"", 0, {entry(a, q3), entry(b, q3)}},
                   absl::StatusCode::kFailedPrecondition,
                   absl::StrCat("entries[1]: layer 0 of sequence ", b,
                                " holds no tokens; prefill it before decoding")});
  for (const BadCase& c : cases) {
    absl::StatusOr<DecodeResult> r = rt_->Decode(c.call);
    ASSERT_FALSE(r.ok()) << c.name;
    EXPECT_EQ(r.status().code(), c.code) << c.name;
    EXPECT_EQ(r.status().message(), c.message) << c.name;
    EXPECT_EQ(Lengths(a), (std::vector<int64_t>{16, 0})) << c.name;
    EXPECT_EQ(Lengths(b), (std::vector<int64_t>{0, 5})) << c.name;
    EXPECT_EQ(PagesFree(), free_before) << c.name;
  }
}

TEST_F(RuntimeTest, EngineFailureIsInternalAndRollsBackPages) {
  Start(40);
  const std::string id = NewSequence();
  ASSERT_TRUE(PrefillOk(id, 0, 16).ok());
  engine_->fail = true;
  absl::Status s = PrefillOk(id, 0, 40);  // would take 3 more pages
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  EXPECT_EQ(s.message(), "the cpu backend failed: injected");
  EXPECT_EQ(Lengths(id), (std::vector<int64_t>{16, 0}));
  EXPECT_EQ(PagesFree(), 39);

  Owned q = Random({3, kHq, kD}, &rng_), k = Random({kHkv, kD}, &rng_);
  DecodeCall call;
  call.layer = 0;
  call.entries.push_back({id, q.req(), k.req(), k.req(), nullptr});
  absl::StatusOr<DecodeResult> r = rt_->Decode(call);  // would take a 2nd page
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInternal);
  EXPECT_EQ(r.status().message(), "the cpu backend failed: injected");
  EXPECT_EQ(Lengths(id), (std::vector<int64_t>{16, 0}));
  EXPECT_EQ(PagesFree(), 39);

  engine_->fail = false;
  r = rt_->Decode(call);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->outputs[0].length, 17);
  EXPECT_EQ(PagesFree(), 38);
}

TEST_F(RuntimeTest, PoolExhaustionThenReleaseFreesPages) {
  Start(/*pages=*/20);
  const std::string a = NewSequence(), b = NewSequence();
  ASSERT_TRUE(PrefillOk(a, 0, 320).ok());  // all 20 pages
  ASSERT_EQ(PagesFree(), 0);
  // Layer 1 reuses layer 0's pages: no new page is needed.
  ASSERT_TRUE(PrefillOk(a, 1, 300).ok());

  absl::Status s = PrefillOk(b, 0, 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(absl::StartsWith(s.message(), absl::StrCat("cannot back 1 tokens of sequence ", b,
                                                         " (1 pages of 16 tokens, 0 held): ")))
      << s.message();
  EXPECT_EQ(Lengths(b), (std::vector<int64_t>{0, 0}));

  Owned q = Random({3, kHq, kD}, &rng_), k = Random({kHkv, kD}, &rng_);
  DecodeCall call;
  call.layer = 0;
  call.entries.push_back({a, q.req(), k.req(), k.req(), nullptr});
  absl::StatusOr<DecodeResult> r = rt_->Decode(call);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(absl::StartsWith(r.status().message(),
                               absl::StrCat("entries[0]: cannot back 321 tokens of sequence ", a)))
      << r.status().message();
  EXPECT_EQ(Lengths(a), (std::vector<int64_t>{320, 300}));
  EXPECT_EQ(PagesFree(), 0);

  absl::StatusOr<int64_t> freed = rt_->ReleaseSequence(a, "");
  ASSERT_TRUE(freed.ok());
  EXPECT_EQ(*freed, 20);
  EXPECT_EQ(PagesFree(), 20);
  EXPECT_EQ(rt_->Info().live_sequences, 1);
  ASSERT_TRUE(PrefillOk(b, 0, 1).ok());
  EXPECT_EQ(PagesFree(), 19);

  // Released: gone for every call, with the unknown-id message.
  absl::StatusOr<int64_t> again = rt_->ReleaseSequence(a, "");
  EXPECT_EQ(again.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(again.status().message(), absl::StrCat("sequence ", a, " not found"));
  s = PrefillOk(a, 0, 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(s.message(), absl::StrCat("sequence ", a, " not found"));
}

TEST_F(RuntimeTest, TooManySequencesIsResourceExhausted) {
  Start(8, /*max_sequences=*/2);
  NewSequence();
  NewSequence();
  absl::StatusOr<std::string> third = rt_->CreateSequence("");
  EXPECT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(third.status().message(), "too many live sequences: the limit is 2; release one first");
}

TEST_F(RuntimeTest, OtherTenantsSequencesAreNotFound) {
  Start(8);
  absl::StatusOr<std::string> id = rt_->CreateSequence("alice");
  ASSERT_TRUE(id.ok());
  PrefillCall call = MakePrefill(*id, 0, 2);
  call.tenant = "bob";
  EXPECT_EQ(rt_->Prefill(call).status().code(), absl::StatusCode::kNotFound);
  call.tenant = "alice";
  EXPECT_TRUE(rt_->Prefill(call).ok());
}

// Batches naming the same sequences in opposite orders, from several threads at once: the id-order
// locking must neither deadlock nor lose a token.
TEST_F(RuntimeTest, ConcurrentBatchesInOppositeOrdersAllCommit) {
  Start(40);
  const std::string a = NewSequence(), b = NewSequence();
  ASSERT_TRUE(PrefillOk(a, 0, 1).ok());
  ASSERT_TRUE(PrefillOk(b, 0, 1).ok());
  Owned q = Random({3, kHq, kD}, &rng_), k = Random({kHkv, kD}, &rng_);
  constexpr int kThreads = 4, kSteps = 25;
  std::vector<std::thread> threads;
  std::vector<int> failures(kThreads, 0);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      DecodeCall call;
      call.layer = 0;
      const std::string& first = t % 2 ? a : b;
      const std::string& second = t % 2 ? b : a;
      call.entries.push_back({first, q.req(), k.req(), k.req(), nullptr});
      call.entries.push_back({second, q.req(), k.req(), k.req(), nullptr});
      for (int i = 0; i < kSteps; ++i) failures[t] += rt_->Decode(call).ok() ? 0 : 1;
    });
  }
  for (std::thread& th : threads) th.join();
  EXPECT_EQ(failures, std::vector<int>(kThreads, 0));
  EXPECT_EQ(Lengths(a), (std::vector<int64_t>{1 + kThreads * kSteps, 0}));
  EXPECT_EQ(Lengths(b), (std::vector<int64_t>{1 + kThreads * kSteps, 0}));
  EXPECT_EQ(PagesFree(), 40 - 2 * 7);  // 101 tokens each: 7 pages of 16
}

// Prefill a 300-token prompt in two chunks (crossing chunk boundaries 128 and 256, s(300) > 1) in
// layer 0 and in one call in layer 1, then batched decodes with a second sequence, in bf16 I/O:
// every output against the fp64 reference.
TEST_F(RuntimeTest, OutputsMatchTheNaiveReference) {
  Start(60);
  const DcaGeometry g = TinyModel().geometry();
  const std::string a = NewSequence(), b = NewSequence();
  naive::NaiveSequence ref_a(g, 2), ref_b(g, 2);
  constexpr double kTol = 2e-2;  // bf16 outputs (the KV is fp32)
  auto expect_close = [&](absl::string_view got_bytes, const std::vector<float>& want,
                          const std::string& what) {
    std::vector<float> got(got_bytes.size() / 2);
    ConvertToFloat(got_bytes.data(), DType::kBf16, got.size(), got.data());
    ASSERT_EQ(got.size(), want.size()) << what;
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_NEAR(got[i], want[i], kTol) << what << " element " << i;
    }
  };
  auto prefill = [&](const std::string& id, naive::NaiveSequence* ref, int32_t layer, int64_t t,
                     int64_t prompt_len, int64_t want_length) {
    Owned q = Random({t, 5, kHq, kD}, &rng_, DType::kBf16);
    Owned k = Random({t, kHkv, kD}, &rng_, DType::kBf16);
    Owned v = Random({t, kHkv, kD}, &rng_, DType::kBf16);
    PrefillCall call;
    call.sequence_id = id;
    call.layer = layer;
    call.q = q.req();
    call.k = k.req();
    call.v = v.req();
    call.prompt_len = prompt_len;
    std::string into;  // the OutputBufferFn path, as the service uses it
    call.output = [&into](int64_t bytes) {
      into.resize(bytes);
      return static_cast<void*>(into.data());
    };
    absl::StatusOr<PrefillResult> r = rt_->Prefill(call);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->length, want_length);
    EXPECT_EQ(r->out_dtype, DType::kBf16);
    EXPECT_EQ(r->out_shape, (std::vector<int64_t>{t, kHq, kD}));
    EXPECT_TRUE(r->out.empty());
    absl::StatusOr<std::vector<float>> want =
        ref->Prefill(layer, q.values, k.values, v.values, prompt_len);
    ASSERT_TRUE(want.ok()) << want.status();
    expect_close(into, *want, absl::StrCat("prefill layer ", layer, " to ", want_length));
  };
  prefill(a, &ref_a, 0, 170, 300, 170);
  prefill(a, &ref_a, 0, 130, 300, 300);
  prefill(a, &ref_a, 1, 300, 300, 300);
  prefill(b, &ref_b, 0, 20, 20, 20);
  prefill(b, &ref_b, 1, 129, 129, 129);
  for (int step = 0; step < 2; ++step) {
    for (int32_t layer = 0; layer < 2; ++layer) {
      Owned qa = Random({5, kHq, kD}, &rng_, DType::kBf16);
      Owned qb = Random({3, kHq, kD}, &rng_, DType::kBf16);
      Owned ka = Random({kHkv, kD}, &rng_, DType::kBf16),
            va = Random({kHkv, kD}, &rng_, DType::kBf16);
      Owned kb = Random({kHkv, kD}, &rng_, DType::kBf16),
            vb = Random({kHkv, kD}, &rng_, DType::kBf16);
      DecodeCall call;
      call.layer = layer;
      // b first: outputs must come back in request order, not lock (id) order.
      call.entries.push_back({b, qb.req(), kb.req(), vb.req(), nullptr});
      call.entries.push_back({a, qa.req(), ka.req(), va.req(), nullptr});
      absl::StatusOr<DecodeResult> r = rt_->Decode(call);
      ASSERT_TRUE(r.ok()) << r.status();
      ASSERT_EQ(r->outputs.size(), 2u);
      EXPECT_EQ(r->outputs[0].length, (layer == 0 ? 21 : 130) + step);
      EXPECT_EQ(r->outputs[1].length, 301 + step);
      EXPECT_EQ(r->outputs[1].out_shape, (std::vector<int64_t>{kHq, kD}));
      absl::StatusOr<std::vector<float>> want_b =
          ref_b.Decode(layer, qb.values, kb.values, vb.values);
      absl::StatusOr<std::vector<float>> want_a =
          ref_a.Decode(layer, qa.values, ka.values, va.values);
      ASSERT_TRUE(want_a.ok() && want_b.ok());
      expect_close(r->outputs[0].out, *want_b, absl::StrCat("decode b layer ", layer));
      expect_close(r->outputs[1].out, *want_a, absl::StrCat("decode a layer ", layer));
    }
  }
  EXPECT_EQ(Lengths(a), (std::vector<int64_t>{302, 302}));
  EXPECT_EQ(Lengths(b), (std::vector<int64_t>{22, 131}));
}

}  // namespace
}  // namespace attnd
