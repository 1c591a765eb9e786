// Many client threads against one daemon: each owns a few sequences, prefills them in chunks over
// all layers in a thread-specific interleaving (layer-major, chunk-major, shuffled), decodes them
// in batches (some over a Session stream), and releases them. Every output is checked against the
// naive fp64 reference; at the end no sequence or page may be left behind.
#include <algorithm>
#include <atomic>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/dtype.h"
#include "base/mutex.h"
#include "client/attnd_client.h"
#include "client/host_tensor.h"
#include "gtest/gtest.h"
#include "kernels/testing/naive_dca.h"
#include "tests/test_util.h"

namespace attnd {
namespace {

using client::DecodeInput;
using client::HostTensor;

constexpr int kThreads = 12;
constexpr int kSequencesPerThread = 3;
constexpr int kDecodeSteps = 6;

struct Seq {
  std::string id;
  std::unique_ptr<naive::NaiveSequence> ref;
  std::vector<int64_t> chunks;  // prefill chunk sizes; they sum to the prompt length
  int64_t prompt_len = 0;
};

// Failures are collected, not asserted, from worker threads, then reported by the main thread.
class Errors {
 public:
  void Add(std::string message) {
    MutexLock lock(&mu_);
    if (messages_.size() < 20) messages_.push_back(std::move(message));
    ++count_;
  }
  int count() {
    MutexLock lock(&mu_);
    return count_;
  }
  std::string Summary() {
    MutexLock lock(&mu_);
    std::string s;
    for (const std::string& m : messages_) absl::StrAppend(&s, "\n  ", m);
    return s;
  }

 private:
  Mutex mu_;
  std::vector<std::string> messages_ ABSL_GUARDED_BY(mu_);
  int count_ ABSL_GUARDED_BY(mu_) = 0;
};

class Worker {
 public:
  Worker(int index, const testing::ModelGeometry& geometry, client::AttndClient* client,
         Errors* errors)
      : index_(index), g_(geometry), client_(client), errors_(errors), rng_(1000 + index) {
    // Even threads send fp32 (1e-4 against the reference), odd ones bf16 (DCA.md's bars).
    dtype_ = index % 2 == 0 ? DType::kFp32 : DType::kBf16;
    max_bar_ = dtype_ == DType::kFp32 ? 1e-4 : 2e-2;
    mean_bar_ = dtype_ == DType::kFp32 ? 1e-4 : 2e-3;
  }

  void Run() {
    if (index_ % 3 == 2) {
      absl::StatusOr<std::unique_ptr<client::Session>> session = client_->OpenSession();
      if (!session.ok()) return Fail("OpenSession", session.status().ToString());
      session_ = std::move(*session);
    }
    std::vector<Seq> seqs(kSequencesPerThread);
    for (Seq& s : seqs) {
      absl::StatusOr<std::string> id = client_->CreateSequence();
      if (!id.ok()) return Fail("CreateSequence", id.status().ToString());
      s.id = *id;
      s.ref = std::make_unique<naive::NaiveSequence>(g_.dca(), g_.num_layers);
      // Prompts of 60..300 tokens: most cross one or two DCA chunk boundaries (chunk_len 128).
      s.prompt_len = std::uniform_int_distribution<int64_t>(60, 300)(rng_);
      for (int64_t left = s.prompt_len; left > 0;) {
        const int64_t t = std::min(left, std::uniform_int_distribution<int64_t>(1, 110)(rng_));
        s.chunks.push_back(t);
        left -= t;
      }
    }
    // The (sequence, layer, chunk) prefill calls in this thread's order; each layer's chunks of a
    // sequence stay in order, everything else interleaves.
    struct Call {
      int seq, layer, chunk;
    };
    std::vector<Call> calls;
    for (int s = 0; s < kSequencesPerThread; ++s) {
      for (int l = 0; l < g_.num_layers; ++l) {
        for (int c = 0; c < static_cast<int>(seqs[s].chunks.size()); ++c)
          calls.push_back({s, l, c});
      }
    }
    switch (index_ % 3) {
      case 0:  // layer-major per sequence: as built
        break;
      case 1:  // chunk-major: every layer gets chunk c before any gets chunk c+1
        std::stable_sort(calls.begin(), calls.end(),
                         [](const Call& a, const Call& b) { return a.chunk < b.chunk; });
        break;
      default: {  // random interleaving that keeps each (seq, layer)'s chunks in order
        std::vector<Call> shuffled;
        std::vector<std::vector<Call>> queues;
        for (const Call& c : calls) {
          if (c.chunk == 0) queues.emplace_back();
          queues.back().push_back(c);
        }
        std::vector<size_t> next(queues.size(), 0);
        while (shuffled.size() < calls.size()) {
          const size_t q = std::uniform_int_distribution<size_t>(0, queues.size() - 1)(rng_);
          if (next[q] < queues[q].size()) shuffled.push_back(queues[q][next[q]++]);
        }
        calls = std::move(shuffled);
      }
    }
    for (const Call& c : calls) {
      if (!Prefill(&seqs[c.seq], c.layer, seqs[c.seq].chunks[c.chunk])) return;
    }
    // Decode steps: all of the thread's sequences in one batch, layers in a shuffled order each
    // step.
    std::vector<int> layers(g_.num_layers);
    for (int l = 0; l < g_.num_layers; ++l) layers[l] = l;
    for (int step = 0; step < kDecodeSteps; ++step) {
      std::shuffle(layers.begin(), layers.end(), rng_);
      for (int l : layers) {
        if (!Decode(&seqs, l, step)) return;
      }
    }
    if (session_ != nullptr) {
      absl::Status closed = session_->Close();
      if (!closed.ok()) Fail("Session::Close", closed.ToString());
    }
    for (Seq& s : seqs) {
      absl::StatusOr<int64_t> freed = client_->Release(s.id);
      if (!freed.ok()) return Fail("Release", freed.status().ToString());
      const int64_t pages = (s.ref->length(0) + 15) / 16;  // page_size 16; all layers equal now
      if (*freed != pages) Fail("Release", absl::StrCat("freed ", *freed, " pages, want ", pages));
    }
  }

 private:
  void Fail(const std::string& what, const std::string& detail) {
    errors_->Add(absl::StrCat("thread ", index_, " ", what, ": ", detail));
  }

  void Check(const std::string& what, const HostTensor& o, const std::vector<float>& want) {
    if (o.dtype != dtype_) Fail(what, absl::StrCat("output dtype ", DTypeName(o.dtype)));
    const testing::ErrorStats e = testing::CompareOutputs(o.ToFloats(), want);
    if (!e.finite || !(e.max_abs <= max_bar_) || !(e.mean_abs <= mean_bar_)) {
      Fail(what,
           absl::StrCat("max abs ", e.max_abs, " mean abs ", e.mean_abs, " finite ", e.finite));
    }
  }

  bool Prefill(Seq* s, int layer, int64_t t) {
    const std::vector<float> q = testing::RandomInputs(&rng_, t * g_.q_elems_per_token());
    const std::vector<float> k = testing::RandomInputs(&rng_, t * g_.kv_elems_per_token());
    const std::vector<float> v = testing::RandomInputs(&rng_, t * g_.kv_elems_per_token());
    const HostTensor hq = HostTensor::FromFloats(dtype_, {t, 5, g_.num_q_heads, g_.head_dim}, q);
    const HostTensor hk = HostTensor::FromFloats(dtype_, {t, g_.num_kv_heads, g_.head_dim}, k);
    const HostTensor hv = HostTensor::FromFloats(dtype_, {t, g_.num_kv_heads, g_.head_dim}, v);
    absl::StatusOr<client::PrefillResult> r =
        session_ != nullptr ? session_->Prefill(s->id, layer, hq, hk, hv, s->prompt_len)
                            : client_->Prefill(s->id, layer, hq, hk, hv, s->prompt_len);
    const std::string what = absl::StrCat("prefill layer ", layer, " at ", s->ref->length(layer));
    if (!r.ok()) {
      Fail(what, r.status().ToString());
      return false;
    }
    absl::StatusOr<std::vector<float>> want = s->ref->Prefill(layer, q, k, v, s->prompt_len);
    if (!want.ok()) {
      Fail(what, want.status().ToString());
      return false;
    }
    if (r->length != s->ref->length(layer)) {
      Fail(what, absl::StrCat("length ", r->length, ", want ", s->ref->length(layer)));
    }
    Check(what, r->o, *want);
    return true;
  }

  bool Decode(std::vector<Seq>* seqs, int layer, int step) {
    std::vector<DecodeInput> entries;
    std::vector<std::vector<float>> qs, ks, vs;
    for (const Seq& s : *seqs) {
      // Alternate 3 and 5 query variants: the server must ignore the critical two.
      const int64_t variants = (step + index_) % 2 == 0 ? 3 : 5;
      qs.push_back(testing::RandomInputs(&rng_, variants * g_.o_elems_per_token()));
      ks.push_back(testing::RandomInputs(&rng_, g_.kv_elems_per_token()));
      vs.push_back(testing::RandomInputs(&rng_, g_.kv_elems_per_token()));
      entries.push_back(
          {s.id, HostTensor::FromFloats(dtype_, {variants, g_.num_q_heads, g_.head_dim}, qs.back()),
           HostTensor::FromFloats(dtype_, {g_.num_kv_heads, g_.head_dim}, ks.back()),
           HostTensor::FromFloats(dtype_, {g_.num_kv_heads, g_.head_dim}, vs.back())});
    }
    absl::StatusOr<std::vector<client::DecodeResult>> r =
        session_ != nullptr ? session_->Decode(layer, entries) : client_->Decode(layer, entries);
    const std::string what = absl::StrCat("decode step ", step, " layer ", layer);
    if (!r.ok()) {
      Fail(what, r.status().ToString());
      return false;
    }
    for (size_t i = 0; i < seqs->size(); ++i) {
      Seq& s = (*seqs)[i];
      absl::StatusOr<std::vector<float>> want = s.ref->Decode(layer, qs[i], ks[i], vs[i]);
      if (!want.ok()) {
        Fail(what, want.status().ToString());
        return false;
      }
      if ((*r)[i].length != s.ref->length(layer)) {
        Fail(what, absl::StrCat("length ", (*r)[i].length, ", want ", s.ref->length(layer)));
      }
      Check(absl::StrCat(what, " entry ", i), (*r)[i].o, *want);
    }
    return true;
  }

  const int index_;
  const testing::ModelGeometry& g_;
  client::AttndClient* client_;
  Errors* errors_;
  std::mt19937 rng_;
  DType dtype_;
  double max_bar_, mean_bar_;
  std::unique_ptr<client::Session> session_;
};

TEST(ConcurrencyTest, ManyThreadsManySequencesInterleavedLayers) {
  testing::ModelGeometry geometry;
  geometry.name = "concurrency-tiny";
  geometry.num_layers = 3;
  ServerOptions options;
  options.page_size = 16;
  options.kv_dtype = "fp32";
  options.kv_cache_bytes = 64ll << 20;
  options.compute_threads = 2;
  options.request_workers = 4;
  absl::StatusOr<std::unique_ptr<testing::TestDaemon>> daemon =
      testing::TestDaemon::Start(geometry, options);
  ASSERT_TRUE(daemon.ok()) << daemon.status();

  // Half the threads share the daemon's client (one channel), the rest have their own channels.
  std::vector<std::unique_ptr<client::AttndClient>> own_clients;
  Errors errors;
  std::vector<std::unique_ptr<Worker>> workers;
  for (int i = 0; i < kThreads; ++i) {
    client::AttndClient* c = &(*daemon)->client();
    if (i % 2 == 1) {
      absl::StatusOr<std::unique_ptr<client::AttndClient>> own = (*daemon)->NewClient();
      ASSERT_TRUE(own.ok()) << own.status();
      own_clients.push_back(std::move(*own));
      c = own_clients.back().get();
    }
    workers.push_back(std::make_unique<Worker>(i, geometry, c, &errors));
  }
  std::vector<std::thread> threads;
  for (auto& w : workers) threads.emplace_back([&w] { w->Run(); });
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(errors.count(), 0) << errors.Summary();

  absl::StatusOr<v1::GetServerInfoResponse> info = (*daemon)->client().Info();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->live_sequences(), 0);
  EXPECT_EQ(info->kv_cache().pages_free(), info->kv_cache().pages_total());
  EXPECT_GT(info->kv_cache().pages_total(), 0);
}

}  // namespace
}  // namespace attnd
