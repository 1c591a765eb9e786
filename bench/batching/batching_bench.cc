// Decode throughput of one layer under N concurrent loopback clients, each sending batch-1 Decode
// RPCs back to back, against a running attnd (run.sh starts one with and one without cross-RPC
// batching). Every client has its own channel (its own HTTP/2 connection) and its own sequence.
//
// Per client count N, rounds of: create N sequences and prefill `--context` tokens into
// `--layer` (untimed), then all N clients start together and each sends `--decodes` decodes
// (timed: from the common start to the last client's last reply), then release. Rounds repeat
// until `--min-seconds` of decode time is collected. Throughput = decodes / decode time. When the
// server reports DecodeBatchingStats, the mean merged batch size over the timed phases is printed.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "attnd/v1/attention.grpc.pb.h"
#include "grpcpp/grpcpp.h"

ABSL_FLAG(std::string, target, "127.0.0.1:50051", "attnd address");
ABSL_FLAG(std::string, clients, "1,4,16,64", "concurrent client counts to measure");
ABSL_FLAG(int32_t, layer, 0, "the one layer every client decodes");
ABSL_FLAG(int64_t, context, 256, "tokens prefilled per sequence before the timed decodes");
ABSL_FLAG(int32_t, decodes, 128, "decodes per client per round");
ABSL_FLAG(double, min_seconds, 2.0, "decode time to collect per client count");
ABSL_FLAG(int32_t, max_rounds, 50, "most rounds per client count");
ABSL_FLAG(std::string, label, "", "printed in each result line (e.g. the server's mode)");
ABSL_FLAG(bool, session, false,
          "send the decodes over one Session stream per client instead of unary Decode RPCs");
ABSL_FLAG(std::string, dtype, "fp32", "tensor dtype the clients send: fp32 or bf16");
ABSL_FLAG(int32_t, server_pid, 0,
          "attnd's pid on this machine: also report its CPU time (utime + stime from /proc) per "
          "decode over the timed phases, which other load on the machine disturbs less than "
          "wall-clock throughput; 0 = off");

namespace {

namespace v1 = attnd::v1;

struct Geometry {
  int64_t hq = 0, hkv = 0, d = 0;
  std::string model;
};

// n random values in --dtype (fp32, or bf16 rounded to nearest even; outputs come back in q's).
void Fill(int64_t n, std::mt19937* rng, v1::Tensor* t, std::vector<int64_t> shape) {
  std::normal_distribution<float> dist(0.f, 1.f);
  std::vector<float> values(n);
  for (float& x : values) x = dist(*rng);
  t->mutable_shape()->Assign(shape.begin(), shape.end());
  if (absl::GetFlag(FLAGS_dtype) == "bf16") {
    std::vector<uint16_t> half(n);
    for (int64_t i = 0; i < n; ++i) {
      uint32_t bits;
      std::memcpy(&bits, &values[i], 4);
      half[i] = static_cast<uint16_t>((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);  // finite only
    }
    t->set_dtype(v1::DTYPE_BF16);
    t->set_data(std::string(reinterpret_cast<const char*>(half.data()), n * 2));
    return;
  }
  t->set_dtype(v1::DTYPE_FP32);
  t->set_data(std::string(reinterpret_cast<const char*>(values.data()), n * sizeof(float)));
}

[[noreturn]] void Die(const std::string& what, const grpc::Status& s) {
  std::fprintf(stderr, "batching_bench: %s: %d %s\n", what.c_str(), s.error_code(),
               s.error_message().c_str());
  std::exit(1);
}

// utime + stime of `pid` in clock ticks; -1 when unreadable.
int64_t CpuTicks(int pid) {
  std::FILE* f = std::fopen(absl::StrCat("/proc/", pid, "/stat").c_str(), "r");
  if (f == nullptr) return -1;
  char buf[4096];
  const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[n] = '\0';
  // Fields after the command (which may hold spaces) start after the last ')': state is field 3,
  // utime 14, stime 15.
  const char* p = std::strrchr(buf, ')');
  if (p == nullptr) return -1;
  std::vector<std::string> fields = absl::StrSplit(p + 2, ' ');
  int64_t utime = 0, stime = 0;
  if (fields.size() < 13 || !absl::SimpleAtoi(fields[11], &utime) ||
      !absl::SimpleAtoi(fields[12], &stime)) {
    return -1;
  }
  return utime + stime;
}

struct BatchCounters {
  int64_t batches = 0, entries = 0;
};

BatchCounters ReadCounters(v1::Attention::Stub* stub, Geometry* geometry) {
  grpc::ClientContext ctx;
  v1::GetServerInfoRequest req;
  v1::GetServerInfoResponse resp;
  grpc::Status s = stub->GetServerInfo(&ctx, req, &resp);
  if (!s.ok()) Die("GetServerInfo", s);
  if (geometry != nullptr) {
    geometry->hq = resp.model().num_q_heads();
    geometry->hkv = resp.model().num_kv_heads();
    geometry->d = resp.model().head_dim();
    geometry->model = resp.model().name();
  }
  // Through reflection, so the benchmark also runs against a daemon built before the field existed.
  BatchCounters counters;
  const google::protobuf::FieldDescriptor* field =
      resp.GetDescriptor()->FindFieldByName("decode_batching");
  if (field == nullptr || !resp.GetReflection()->HasField(resp, field)) return counters;
  const google::protobuf::Message& stats = resp.GetReflection()->GetMessage(resp, field);
  const google::protobuf::Reflection* r = stats.GetReflection();
  const google::protobuf::Descriptor* d = stats.GetDescriptor();
  counters.batches = r->GetInt64(stats, d->FindFieldByName("batches"));
  counters.entries = r->GetInt64(stats, d->FindFieldByName("entries"));
  return counters;
}

class Client {
 public:
  Client(const std::string& target, int index, const Geometry& g, int32_t layer)
      : g_(g), layer_(layer), rng_(1000 + index) {
    grpc::ChannelArguments args;
    args.SetInt("attnd.bench.client", index);  // a distinct channel (connection) per client
    args.SetMaxReceiveMessageSize(-1);
    args.SetMaxSendMessageSize(-1);
    stub_ = v1::Attention::NewStub(
        grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args));
    v1::DecodeEntry* e = decode_.add_entries();
    decode_.set_layer(layer);
    Fill(3 * g.hq * g.d, &rng_, e->mutable_q(), {3, g.hq, g.d});
    Fill(g.hkv * g.d, &rng_, e->mutable_k(), {g.hkv, g.d});
    Fill(g.hkv * g.d, &rng_, e->mutable_v(), {g.hkv, g.d});
  }

  void Prepare(int64_t context) {
    {
      grpc::ClientContext ctx;
      // A fresh channel's first connect can fail transiently (seen once on the GPU machine:
      // "failed to connect to all addresses"); the untimed set-up waits for the connection instead.
      ctx.set_wait_for_ready(true);
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
      v1::CreateSequenceResponse resp;
      grpc::Status s = stub_->CreateSequence(&ctx, v1::CreateSequenceRequest(), &resp);
      if (!s.ok()) Die("CreateSequence", s);
      id_ = resp.sequence_id();
    }
    v1::PrefillRequest p;
    p.set_sequence_id(id_);
    p.set_layer(layer_);
    Fill(context * 5 * g_.hq * g_.d, &rng_, p.mutable_q(), {context, 5, g_.hq, g_.d});
    Fill(context * g_.hkv * g_.d, &rng_, p.mutable_k(), {context, g_.hkv, g_.d});
    Fill(context * g_.hkv * g_.d, &rng_, p.mutable_v(), {context, g_.hkv, g_.d});
    grpc::ClientContext ctx;
    v1::PrefillResponse resp;
    grpc::Status s = stub_->Prefill(&ctx, p, &resp);
    if (!s.ok()) Die("Prefill", s);
    decode_.mutable_entries(0)->set_sequence_id(id_);
  }

  // `latencies` gets one value (us) per decode.
  void Decode(int32_t n, std::vector<double>* latencies) {
    if (absl::GetFlag(FLAGS_session)) return SessionDecode(n, latencies);
    v1::DecodeResponse resp;
    for (int32_t i = 0; i < n; ++i) {
      grpc::ClientContext ctx;
      const absl::Time t0 = absl::Now();
      grpc::Status s = stub_->Decode(&ctx, decode_, &resp);
      latencies->push_back(absl::ToDoubleMicroseconds(absl::Now() - t0));
      if (!s.ok()) Die("Decode", s);
    }
  }

  // The same decodes over one Session stream: each request written, then its answer read.
  void SessionDecode(int32_t n, std::vector<double>* latencies) {
    grpc::ClientContext ctx;
    auto stream = stub_->Session(&ctx);
    v1::SessionRequest req;
    *req.mutable_decode() = decode_;
    v1::SessionResponse resp;
    for (int32_t i = 0; i < n; ++i) {
      req.set_tag(static_cast<uint64_t>(i));
      const absl::Time t0 = absl::Now();
      if (!stream->Write(req) || !stream->Read(&resp)) Die("Session", stream->Finish());
      latencies->push_back(absl::ToDoubleMicroseconds(absl::Now() - t0));
      if (resp.code() != 0 || resp.tag() != static_cast<uint64_t>(i)) {
        Die("Session decode",
            grpc::Status(static_cast<grpc::StatusCode>(resp.code()), resp.message()));
      }
    }
    stream->WritesDone();
    grpc::Status s = stream->Finish();
    if (!s.ok()) Die("Session finish", s);
  }

  void Release() {
    grpc::ClientContext ctx;
    v1::ReleaseSequenceRequest req;
    req.set_sequence_id(id_);
    v1::ReleaseSequenceResponse resp;
    grpc::Status s = stub_->ReleaseSequence(&ctx, req, &resp);
    if (!s.ok()) Die("ReleaseSequence", s);
  }

 private:
  const Geometry g_;
  const int32_t layer_;
  std::mt19937 rng_;
  std::unique_ptr<v1::Attention::Stub> stub_;
  v1::DecodeRequest decode_;
  std::string id_;
};

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  if (absl::GetFlag(FLAGS_dtype) != "fp32" && absl::GetFlag(FLAGS_dtype) != "bf16") {
    std::fprintf(stderr, "batching_bench: --dtype must be fp32 or bf16, got %s\n",
                 absl::GetFlag(FLAGS_dtype).c_str());
    return 2;
  }
  const std::string target = absl::GetFlag(FLAGS_target);
  auto info_stub =
      v1::Attention::NewStub(grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
  Geometry g;
  ReadCounters(info_stub.get(), &g);
  const int64_t context = absl::GetFlag(FLAGS_context);
  const int32_t decodes = absl::GetFlag(FLAGS_decodes);
  const int32_t layer = absl::GetFlag(FLAGS_layer);

  for (absl::string_view item :
       absl::StrSplit(absl::GetFlag(FLAGS_clients), ',', absl::SkipEmpty())) {
    int n = 0;
    if (!absl::SimpleAtoi(item, &n) || n <= 0) {
      std::fprintf(stderr, "batching_bench: bad --clients item \"%s\"\n",
                   std::string(item).c_str());
      return 1;
    }
    std::vector<std::unique_ptr<Client>> clients;
    for (int i = 0; i < n; ++i) clients.push_back(std::make_unique<Client>(target, i, g, layer));
    absl::Duration total;
    int64_t done = 0;
    BatchCounters counted;
    std::vector<double> latencies;
    int64_t server_ticks = 0;
    int64_t client_ticks = 0;  // this process: all the clients together
    const int pid = absl::GetFlag(FLAGS_server_pid);
    for (int round = 0; round < absl::GetFlag(FLAGS_max_rounds) &&
                        absl::ToDoubleSeconds(total) < absl::GetFlag(FLAGS_min_seconds);
         ++round) {
      {  // Prefill, at most 4 at a time (untimed).
        std::atomic<int> next{0};
        std::vector<std::thread> threads;
        for (int t = 0; t < std::min(n, 4); ++t) {
          threads.emplace_back([&] {
            for (int i = next++; i < n; i = next++) clients[i]->Prepare(context);
          });
        }
        for (std::thread& t : threads) t.join();
      }
      const BatchCounters before = ReadCounters(info_stub.get(), nullptr);
      absl::Notification go;
      std::vector<std::vector<double>> lat(n);
      std::vector<std::thread> threads;
      for (int i = 0; i < n; ++i) {
        lat[i].reserve(decodes);
        threads.emplace_back([&, i] {
          go.WaitForNotification();
          clients[i]->Decode(decodes, &lat[i]);
        });
      }
      const int64_t ticks_before = pid > 0 ? CpuTicks(pid) : -1;
      const int64_t own_before = CpuTicks(getpid());
      const absl::Time start = absl::Now();
      go.Notify();
      for (std::thread& t : threads) t.join();
      total += absl::Now() - start;
      const int64_t ticks_after = pid > 0 ? CpuTicks(pid) : -1;
      const int64_t own_after = CpuTicks(getpid());
      if (ticks_before >= 0 && ticks_after >= 0) server_ticks += ticks_after - ticks_before;
      if (own_before >= 0 && own_after >= 0) client_ticks += own_after - own_before;
      done += int64_t{n} * decodes;
      const BatchCounters after = ReadCounters(info_stub.get(), nullptr);
      counted.batches += after.batches - before.batches;
      counted.entries += after.entries - before.entries;
      for (auto& l : lat) latencies.insert(latencies.end(), l.begin(), l.end());
      for (auto& c : clients) c->Release();
    }
    std::sort(latencies.begin(), latencies.end());
    auto pct = [&](double p) {
      return latencies[std::min(latencies.size() - 1, static_cast<size_t>(p * latencies.size()))];
    };
    const double seconds = absl::ToDoubleSeconds(total);
    std::printf(
        "%s%s model=%s dtype=%s context=%lld clients=%d decodes=%lld seconds=%.3f "
        "throughput=%.0f/s p50=%.0fus p99=%.0fus mean_batch=%s%s client_cpu_us_per_decode=%.0f\n",
        absl::GetFlag(FLAGS_label).c_str(), absl::GetFlag(FLAGS_session) ? " session" : " unary",
        g.model.c_str(), absl::GetFlag(FLAGS_dtype).c_str(), static_cast<long long>(context), n,
        static_cast<long long>(done), seconds, done / seconds, pct(0.50), pct(0.99),
        counted.batches > 0
            ? absl::StrFormat("%.2f", static_cast<double>(counted.entries) / counted.batches)
                  .c_str()
            : "n/a",
        pid > 0 ? absl::StrFormat(" server_cpu_us_per_decode=%.0f",
                                  1e6 * server_ticks / sysconf(_SC_CLK_TCK) / done)
                      .c_str()
                : "",
        1e6 * client_ticks / sysconf(_SC_CLK_TCK) / done);
    std::fflush(stdout);
  }
  return 0;
}
