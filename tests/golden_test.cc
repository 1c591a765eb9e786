// Replays the golden DCA cases dense_gqa_chunked and dense_pre_rotary (tests/testdata/dca;
// pre-rotary q and k: the server applies the dual-chunk rotary) through a daemon over loopback
// gRPC: chunked prefill with the case's prompt_len, then batched decode of two sequences across a
// chunk boundary; unary, over a Session stream, with every tensor in a registered shm region
// (docs/regions.md), and through a version 2 shared-memory ring (binary frames), whose every output
// must also equal a Session's for the same step bit for bit (a twin sequence on the same daemon;
// on the CPU backend). fp32 requests must match the golden outputs within 1e-4; bf16 requests
// within DCA.md's bf16 bars.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <numeric>
#include <optional>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "base/dtype.h"
#include "client/attnd_client.h"
#include "client/host_tensor.h"
#include "client/regions.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "server/engine/cuda_engine.h"
#include "tests/test_util.h"
#include "tests/testdata/golden_dir.h"

// golden_cuda_test builds this file with ATTND_GOLDEN_ON_CUDA: the same replay against the CUDA
// backend (bf16 K/V on the device, so every request dtype is held to DCA.md's bf16 bars).
#ifdef ATTND_GOLDEN_ON_CUDA
#include <cuda_runtime_api.h>
constexpr bool kOnCuda = true;
#else
constexpr bool kOnCuda = false;
#endif

namespace attnd {
namespace {

using client::DecodeInput;
using client::HostTensor;

struct Tensor {
  std::string dtype;  // "bf16" | "f32"
  std::vector<int64_t> shape;
  std::vector<float> values;
};

class GoldenCase {
 public:
  bool Load(const std::string& dir) {
    std::ifstream json_file(dir + "/case.json");
    if (!json_file) return false;
    json_file >> json_;
    std::ifstream bin(dir + "/tensors.bin", std::ios::binary);
    std::stringstream buffer;
    buffer << bin.rdbuf();
    blob_ = buffer.str();
    return !blob_.empty();
  }
  const nlohmann::json& json() const { return json_; }

  Tensor Get(const std::string& name) const {
    const nlohmann::json& entry = json_.at("tensors").at(name);
    Tensor t;
    t.dtype = entry.at("dtype").get<std::string>();
    t.shape = entry.at("shape").get<std::vector<int64_t>>();
    const int64_t offset = entry.at("offset").get<int64_t>();
    const int64_t nbytes = entry.at("nbytes").get<int64_t>();
    const DType dtype = t.dtype == "bf16" ? DType::kBf16 : DType::kFp32;
    const size_t n = nbytes / ElementSize(dtype);
    t.values.resize(n);
    ConvertToFloat(blob_.data() + offset, dtype, n, t.values.data());
    return t;
  }

 private:
  nlohmann::json json_;
  std::string blob_;
};

// Memory a region names: written and read by the test as the client would.
class RegionMemory {
 public:
  static constexpr size_t kBytes = 64 << 20;
  virtual ~RegionMemory() = default;
  virtual void Write(uint64_t at, const void* src, size_t n) = 0;
  virtual std::string Read(uint64_t at, size_t n) = 0;
  virtual void Fill(uint64_t at, size_t n) = 0;  // 0xff: NaN in every dtype unless attnd writes it
  virtual void Describe(v1::RegisterRegionRequest* request) = 0;
};

class ShmMemory : public RegionMemory {
 public:
  ShmMemory() {
    static int counter = 0;
    name_ = absl::StrCat("/attnd-golden-", getpid(), "-", counter++);
    fd_ = shm_open(name_.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    if (fd_ < 0 || ftruncate(fd_, kBytes) != 0) return;
    base_ = static_cast<char*>(mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0));
  }
  ~ShmMemory() override {
    if (base_ != nullptr) munmap(base_, kBytes);
    if (fd_ >= 0) close(fd_);
    shm_unlink(name_.c_str());
  }
  void Write(uint64_t at, const void* src, size_t n) override { std::memcpy(base_ + at, src, n); }
  std::string Read(uint64_t at, size_t n) override { return std::string(base_ + at, n); }
  void Fill(uint64_t at, size_t n) override { std::memset(base_ + at, 0xff, n); }
  void Describe(v1::RegisterRegionRequest* request) override {
    request->mutable_system_shm()->set_name(name_);
    request->mutable_system_shm()->set_byte_size(kBytes);
  }

 private:
  std::string name_;
  int fd_ = -1;
  char* base_ = nullptr;
};

// The GPUs of a sharded CUDA run: ATTND_TEST_DEVICES (e.g. "0,1" on a two-GPU machine) used in
// turn, else every shard on GPU 0.
std::vector<std::string> ShardDevices(int shards) {
  const char* env = std::getenv("ATTND_TEST_DEVICES");
  std::vector<std::string> listed =
      absl::StrSplit(env != nullptr && *env != '\0' ? env : "0", ',', absl::SkipEmpty());
  if (listed.empty()) listed = {"0"};
  std::vector<std::string> devices;
  for (int i = 0; i < shards; ++i) devices.push_back(listed[i % listed.size()]);
  return devices;
}

#ifdef ATTND_GOLDEN_ON_CUDA
// Device memory of this process, shared with the daemon (another process) by a CUDA IPC handle.
class CudaMemory : public RegionMemory {
 public:
  CudaMemory() { ok_ = cudaMalloc(&base_, kBytes) == cudaSuccess; }
  ~CudaMemory() override {
    if (ok_) cudaFree(base_);
  }
  void Write(uint64_t at, const void* src, size_t n) override {
    EXPECT_EQ(cudaMemcpy(static_cast<char*>(base_) + at, src, n, cudaMemcpyHostToDevice),
              cudaSuccess);
  }
  std::string Read(uint64_t at, size_t n) override {
    std::string out(n, '\0');
    EXPECT_EQ(cudaMemcpy(out.data(), static_cast<char*>(base_) + at, n, cudaMemcpyDeviceToHost),
              cudaSuccess);
    return out;
  }
  void Fill(uint64_t at, size_t n) override {
    EXPECT_EQ(cudaMemset(static_cast<char*>(base_) + at, 0xff, n), cudaSuccess);
  }
  void Describe(v1::RegisterRegionRequest* request) override {
    cudaIpcMemHandle_t handle;
    EXPECT_EQ(cudaIpcGetMemHandle(&handle, base_), cudaSuccess);
    request->mutable_cuda_ipc()->set_handle(&handle, sizeof(handle));
    request->mutable_cuda_ipc()->set_byte_size(kBytes);
  }

 private:
  void* base_ = nullptr;
  bool ok_ = false;
};

// attnd in its own process: a CUDA IPC handle opens only in a process other than its exporter's.
class ChildDaemon {
 public:
  ~ChildDaemon() {
    if (pid_ > 0) {
      kill(pid_, SIGTERM);
      int status = 0;
      waitpid(pid_, &status, 0);
    }
  }
  absl::Status Start(const std::string& config, int shards) {
    std::string binary;
    if (const char* srcdir = std::getenv("TEST_SRCDIR")) {
      const std::string candidate = absl::StrCat(srcdir, "/attnd/server/attnd");
      if (access(candidate.c_str(), X_OK) == 0) binary = candidate;
    }
    if (binary.empty()) binary = "attnd";  // the GPU machine's bundle puts it on PATH
    // A free port: bound and released (another process could take it meanwhile; unlikely here).
    const int probe = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(addr);
    if (bind(probe, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
        getsockname(probe, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
      close(probe);
      return absl::InternalError("no free port");
    }
    close(probe);
    target_ = absl::StrCat("127.0.0.1:", ntohs(addr.sin_port));
    std::vector<std::string> args = {binary,
                                     "--device=cuda",
                                     "--kv-dtype=bf16",
                                     "--listen=" + target_,
                                     "--metrics-listen=",
                                     "--model-config=" + config,
                                     "--kv-cache-bytes=33554432",
                                     "--page-size=16"};
    if (shards > 1) {  // every shard on this GPU
      args.push_back("--devices=" + absl::StrJoin(ShardDevices(shards), ","));
    }
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    const int err = posix_spawnp(&pid_, binary.c_str(), nullptr, nullptr, argv.data(), environ);
    if (err != 0) {
      pid_ = -1;
      return absl::InternalError(absl::StrCat(
          "cannot start ", binary, ": ", std::strerror(err),
          " (looked in $TEST_SRCDIR/attnd/server/attnd, then PATH: bundle server/attnd with it)"));
    }
    return absl::OkStatus();
  }
  const std::string& target() const { return target_; }
  // Why the child is gone, if it exited (reaped here); nullopt while it runs.
  std::optional<std::string> Exited() {
    if (pid_ <= 0) return "never started";
    int status = 0;
    if (waitpid(pid_, &status, WNOHANG) != pid_) return std::nullopt;
    pid_ = -1;
    return WIFEXITED(status) ? absl::StrCat("exited with status ", WEXITSTATUS(status))
                             : absl::StrCat("killed by signal ", WTERMSIG(status));
  }

 private:
  pid_t pid_ = -1;
  std::string target_;
};
#endif

// The tensors of every request in a registered region instead of inline (docs/regions.md): shm,
// or CUDA IPC device memory; inputs bump-allocated from the region's start, outputs after them.
class RegionTransport {
 public:
  RegionTransport(const std::string& target, client::AttndClient* client,
                  std::unique_ptr<RegionMemory> memory)
      : client_(client), memory_(std::move(memory)) {
    auto stub =
        v1::Attention::NewStub(grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
    v1::RegisterRegionRequest request;
    memory_->Describe(&request);
    v1::RegisterRegionResponse response;
    grpc::ClientContext context;
    status_ = stub->RegisterRegion(&context, request, &response);
    region_ = response.region_id();
  }
  const grpc::Status& status() const { return status_; }

  absl::StatusOr<client::PrefillResult> Prefill(const std::string& id, int32_t layer,
                                                const HostTensor& q, const HostTensor& k,
                                                const HostTensor& v, int64_t prompt_len,
                                                v1::QLayout layout) {
    used_ = 0;
    v1::PrefillRequest request;
    request.set_sequence_id(id);
    request.set_layer(layer);
    request.set_prompt_len(prompt_len);
    request.set_q_layout(layout);
    Put(q, request.mutable_q());
    Put(k, request.mutable_k());
    Put(v, request.mutable_v());
    const std::vector<int64_t> o_shape = {q.shape[0], q.shape[q.shape.size() - 2], q.shape.back()};
    const uint64_t o_at = Output(o_shape, q.dtype, request.mutable_output_region());
    absl::StatusOr<v1::PrefillResponse> r = client_->PrefillRaw(request);
    if (!r.ok()) return r.status();
    client::PrefillResult result;
    result.length = r->length();
    result.o = Get(o_shape, q.dtype, o_at);
    if (!r->o().data().empty() || r->o().region().region_id() != region_) {
      return absl::InternalError("the reply carried bytes or another region");
    }
    return result;
  }

  absl::StatusOr<std::vector<client::DecodeResult>> Decode(
      int32_t layer, const std::vector<client::DecodeInput>& entries) {
    used_ = 0;
    v1::DecodeRequest request;
    request.set_layer(layer);
    std::vector<uint64_t> at;
    std::vector<std::vector<int64_t>> shapes;
    for (const client::DecodeInput& in : entries) {
      v1::DecodeEntry* e = request.add_entries();
      e->set_sequence_id(in.sequence_id);
      e->set_q_layout(in.q_layout);
      Put(in.q, e->mutable_q());
      Put(in.k, e->mutable_k());
      Put(in.v, e->mutable_v());
      shapes.push_back({in.q.shape[in.q.shape.size() - 2], in.q.shape.back()});
      at.push_back(Output(shapes.back(), in.q.dtype, e->mutable_output_region()));
    }
    absl::StatusOr<v1::DecodeResponse> r = client_->DecodeRaw(request);
    if (!r.ok()) return r.status();
    std::vector<client::DecodeResult> results;
    for (int i = 0; i < r->outputs_size(); ++i) {
      client::DecodeResult d;
      d.length = r->outputs(i).length();
      d.o = Get(shapes[i], entries[i].q.dtype, at[i]);
      results.push_back(std::move(d));
    }
    return results;
  }

 private:
  // 64-byte aligned bump allocation in the region.
  uint64_t Take(size_t n) {
    const uint64_t at = used_;
    used_ = (used_ + n + 63) / 64 * 64;
    EXPECT_LE(used_, RegionMemory::kBytes) << "the golden case outgrew the test's region";
    return at;
  }
  void Put(const HostTensor& t, v1::Tensor* out) {
    const uint64_t at = Take(t.data.size());
    memory_->Write(at, t.data.data(), t.data.size());
    out->set_dtype(client::ToProtoDType(t.dtype));
    for (int64_t d : t.shape) out->add_shape(d);
    out->mutable_region()->set_region_id(region_);
    out->mutable_region()->set_offset(at);
    out->mutable_region()->set_byte_size(t.data.size());
  }
  uint64_t Output(const std::vector<int64_t>& shape, DType dtype, v1::RegionRef* ref) {
    int64_t n = ElementSize(dtype);
    for (int64_t d : shape) n *= d;
    const uint64_t at = Take(n);
    memory_->Fill(at, n);
    ref->set_region_id(region_);
    ref->set_offset(at);
    ref->set_byte_size(n);
    return at;
  }
  HostTensor Get(const std::vector<int64_t>& shape, DType dtype, uint64_t at) const {
    int64_t n = ElementSize(dtype);
    for (int64_t d : shape) n *= d;
    return HostTensor::FromBytes(dtype, shape, memory_->Read(at, n));
  }

  client::AttndClient* const client_;
  std::unique_ptr<RegionMemory> memory_;
  grpc::Status status_;
  std::string region_;
  uint64_t used_ = 0;
};

enum class Transport { kUnary, kSession, kShm, kCudaIpc, kRing };

// (request dtype, how requests travel, engine shards: 2 splits the kv heads over two shards,
// --shards 2 on the CPU and --devices 0,0 on one GPU)
class GoldenTest : public ::testing::TestWithParam<std::tuple<DType, Transport, int>> {
 protected:
  // The case's steps as requests (pre_rotary: q [T, Hq, D] / [Hq, D], Q_LAYOUT_PRE_ROTARY).
  void Replay(const GoldenCase& golden, const std::string& name, bool pre_rotary);
};

TEST_P(GoldenTest, DenseGqaChunked) {
  const std::string dir = testing::GoldenCaseDir("dense_gqa_chunked");
  GoldenCase golden;
  ASSERT_TRUE(golden.Load(dir)) << "cannot read the golden case in " << dir
                                << " (//tests/testdata:dca in the test's data)";
  Replay(golden, "golden-dense-gqa-chunked", /*pre_rotary=*/false);
}

TEST_P(GoldenTest, DensePreRotary) {
  const std::string dir = testing::GoldenCaseDir("dense_pre_rotary");
  GoldenCase golden;
  ASSERT_TRUE(golden.Load(dir)) << "cannot read the golden case in " << dir
                                << " (//tests/testdata:dca in the test's data)";
  const nlohmann::json& c = golden.json();
  ASSERT_EQ(c.at("q_layout"), "pre_rotary");
  ASSERT_EQ(c.at("rope_style"), "neox");
  ASSERT_EQ(c.at("rotary_dim"), c.at("head_dim")) << "the config below has no partial rotary";
  Replay(golden, "golden-dense-pre-rotary", /*pre_rotary=*/true);
}

void GoldenTest::Replay(const GoldenCase& golden, const std::string& name, bool pre_rotary) {
  const DType dtype = std::get<0>(GetParam());
  const Transport transport = std::get<1>(GetParam());
  const bool use_session = transport == Transport::kSession;
  const bool use_ring = transport == Transport::kRing;
  const nlohmann::json& c = golden.json();
  testing::ModelGeometry geometry;
  geometry.name = name;
  if (pre_rotary) geometry.rope_theta = c.at("rope_theta").get<double>();
  geometry.num_layers = 1;
  geometry.num_q_heads = c.at("num_q_heads");
  geometry.num_kv_heads = c.at("num_kv_heads");
  geometry.head_dim = c.at("head_dim");
  const nlohmann::json& dca = c.at("dual_chunk_attention_config");
  geometry.chunk_size = dca.at("chunk_size");
  geometry.local_size = dca.at("local_size");
  geometry.original_max_position_embeddings = dca.at("original_max_position_embeddings");
  geometry.max_position_embeddings = 8192;
  ASSERT_FLOAT_EQ(c.at("softmax_scale").get<float>(), geometry.dca().softmax_scale)
      << "the case's softmax scale is not 1/sqrt(head_dim); the config cannot express it";
  // The shards split the kv heads: as many as asked for that divide the case's kv heads (a case
  // with one kv head runs unsharded only).
  const int shards = std::gcd(std::get<2>(GetParam()), geometry.num_kv_heads);
  if (shards < std::get<2>(GetParam()) && shards == 1) {
    GTEST_SKIP() << "the case has " << geometry.num_kv_heads
                 << " kv head(s): nothing to split over " << std::get<2>(GetParam()) << " shards";
  }

  if (kOnCuda && attnd::CudaDeviceCount() == 0) {
    std::fprintf(stderr, "*** SKIPPING GPU TEST: golden_cuda_test: no CUDA device ***\n");
    GTEST_SKIP() << "no CUDA device: golden_cuda_test runs on a GPU machine (docs/BENCHMARKS.md)";
  }
  ServerOptions options;
  options.page_size = 16;
  ASSERT_EQ(geometry.chunk_len() % options.page_size, 0);
  options.device = kOnCuda ? "cuda" : "cpu";
  options.kv_dtype = kOnCuda ? "bf16" : "fp32";
  options.kv_cache_bytes = 32ll << 20;
  options.compute_threads = 2;
  if (shards > 1) {
    if (kOnCuda) {
      options.devices = absl::StrJoin(ShardDevices(shards), ",");
    } else {
      options.shards = shards;
    }
  }
  std::unique_ptr<testing::TestDaemon> in_process;
  std::string target;
  std::unique_ptr<client::AttndClient> child_client;
#ifdef ATTND_GOLDEN_ON_CUDA
  ChildDaemon child;
#endif
  if (transport != Transport::kCudaIpc) {
    absl::StatusOr<std::unique_ptr<testing::TestDaemon>> daemon =
        testing::TestDaemon::Start(geometry, options);
    ASSERT_TRUE(daemon.ok()) << daemon.status();
    in_process = *std::move(daemon);
    target = in_process->target();
  } else {
#ifdef ATTND_GOLDEN_ON_CUDA
    absl::StatusOr<std::string> config = testing::WriteModelConfig(geometry);
    ASSERT_TRUE(config.ok()) << config.status();
    absl::Status started = child.Start(*config, shards);
    ASSERT_TRUE(started.ok()) << started;
    target = child.target();
    // Connect fails at once while nothing listens: retry until the child serves (start-up
    // captures the decode graphs).
    absl::StatusOr<std::unique_ptr<client::AttndClient>> connected =
        absl::UnavailableError("not tried");
    for (const absl::Time until = absl::Now() + absl::Seconds(60);
         !connected.ok() && absl::Now() < until; absl::SleepFor(absl::Milliseconds(100))) {
      // A child that failed to start is reported at once, not after the whole wait.
      if (std::optional<std::string> gone = child.Exited()) {
        FAIL() << "the child attnd " << *gone << " before it served (its log is above)";
      }
      connected = client::AttndClient::Connect(target);
    }
    ASSERT_TRUE(connected.ok()) << connected.status();
    child_client = *std::move(connected);
#else
    GTEST_SKIP() << "CUDA IPC regions need the CUDA backend (golden_cuda_test)";
#endif
  }
  client::AttndClient& client = in_process != nullptr ? in_process->client() : *child_client;
  std::unique_ptr<client::Session> session;
  std::unique_ptr<client::RingClient> ring;
  if (use_ring) {
    client::RingOptions ring_options;  // version 2 frames
    ring_options.half_bytes = 4 << 20;
    absl::StatusOr<std::unique_ptr<client::RingClient>> opened =
        client::RingClient::Open(client, ring_options);
    ASSERT_TRUE(opened.ok()) << opened.status();
    ring = std::move(*opened);
  }
  if (use_session || use_ring) {
    absl::StatusOr<std::unique_ptr<client::Session>> opened = client.OpenSession();
    ASSERT_TRUE(opened.ok()) << opened.status();
    session = std::move(*opened);
  }
  std::unique_ptr<RegionTransport> shm;  // shm or CUDA IPC regions
  if (transport == Transport::kShm) {
    shm = std::make_unique<RegionTransport>(target, &client, std::make_unique<ShmMemory>());
  }
#ifdef ATTND_GOLDEN_ON_CUDA
  if (transport == Transport::kCudaIpc) {
    shm = std::make_unique<RegionTransport>(target, &client, std::make_unique<CudaMemory>());
  }
#endif
  if (shm != nullptr) {
    ASSERT_TRUE(shm->status().ok()) << "RegisterRegion: " << shm->status().error_message();
  }

  // The case's sequence numbers -> server ids, created on first use.
  // With the ring, each has a twin that the Session replays the same steps on.
  std::vector<std::string> ids, twins;
  auto id_of = [&](int seq) -> std::string {
    while (static_cast<int>(ids.size()) <= seq) {
      for (std::vector<std::string>* list : {&ids, &twins}) {
        absl::StatusOr<std::string> id = client.CreateSequence();
        EXPECT_TRUE(id.ok()) << id.status();
        list->push_back(id.ok() ? *id : "");
      }
    }
    return ids[seq];
  };
  auto twin_of = [&](const std::string& id) {
    return twins[std::find(ids.begin(), ids.end(), id) - ids.begin()];
  };

  // fp32 is the golden path (1e-4); bf16 has DCA.md's bars against the fp32 reference.
  const bool exact = dtype == DType::kFp32 && !kOnCuda;
  const double max_bar = exact ? 1e-4 : 2e-2;
  const double mean_bar = exact ? 1e-4 : 2e-3;
  const v1::QLayout layout = pre_rotary ? v1::Q_LAYOUT_PRE_ROTARY : v1::Q_LAYOUT_VARIANTS;
  const int64_t q_variants = pre_rotary ? 1 : 5;  // q rows per token as sent
  const int64_t q_row = q_variants * geometry.num_q_heads * geometry.head_dim;
  const int64_t kv_row = geometry.kv_elems_per_token();
  const int64_t o_row = geometry.o_elems_per_token();
  int steps = 0;
  double worst = 0;
  for (const nlohmann::json& step : c.at("steps")) {
    const std::string op = step.at("op");
    const Tensor q = golden.Get(step.at("q"));
    const Tensor k = golden.Get(step.at("k"));
    const Tensor v = golden.Get(step.at("v"));
    const Tensor out = golden.Get(step.at("out"));
    SCOPED_TRACE(absl::StrCat("step ", steps, " (", op, ")"));
    if (op == "prefill") {
      const int64_t tokens = step.at("tokens");
      const int64_t start = step.at("start");
      const std::string id = id_of(step.at("seq"));
      // AttndClient and Session have the same Prefill signature.
      auto prefill = [&](auto& target, const std::string& sequence) {
        const int64_t hq = geometry.num_q_heads, hkv = geometry.num_kv_heads;
        const int64_t d = geometry.head_dim;
        const std::vector<int64_t> q_shape = pre_rotary ? std::vector<int64_t>{tokens, hq, d}
                                                        : std::vector<int64_t>{tokens, 5, hq, d};
        return target.Prefill(sequence, 0, HostTensor::FromFloats(dtype, q_shape, q.values),
                              HostTensor::FromFloats(dtype, {tokens, hkv, d}, k.values),
                              HostTensor::FromFloats(dtype, {tokens, hkv, d}, v.values),
                              step.at("prompt_len").get<int64_t>(), layout);
      };
      absl::StatusOr<client::PrefillResult> r = use_ring         ? prefill(*ring, id)
                                                : use_session    ? prefill(*session, id)
                                                : shm != nullptr ? prefill(*shm, id)
                                                                 : prefill(client, id);
      ASSERT_TRUE(r.ok()) << r.status();
      if (use_ring) {
        absl::StatusOr<client::PrefillResult> s = prefill(*session, twin_of(id));
        ASSERT_TRUE(s.ok()) << s.status();
        EXPECT_EQ(r->length, s->length);
        EXPECT_EQ(r->o.shape, s->o.shape);
        if (!kOnCuda)
          EXPECT_TRUE(r->o.data == s->o.data) << "the ring's o differs from the Session's";
      }
      EXPECT_EQ(r->length, start + tokens);
      EXPECT_EQ(r->o.dtype, dtype);
      EXPECT_EQ(r->o.shape,
                (std::vector<int64_t>{tokens, geometry.num_q_heads, geometry.head_dim}));
      const testing::ErrorStats e = testing::CompareOutputs(r->o.ToFloats(), out.values);
      EXPECT_TRUE(e.finite);
      EXPECT_LE(e.max_abs, max_bar);
      EXPECT_LE(e.mean_abs, mean_bar);
      worst = std::max(worst, e.max_abs);
    } else {
      ASSERT_EQ(op, "decode");
      const std::vector<int> seqs = step.at("seqs");
      const std::vector<int64_t> lens = step.at("lens_after");
      std::vector<DecodeInput> entries;
      for (size_t i = 0; i < seqs.size(); ++i) {
        DecodeInput in;
        in.sequence_id = id_of(seqs[i]);
        const std::vector<int64_t> q_shape =
            pre_rotary ? std::vector<int64_t>{geometry.num_q_heads, geometry.head_dim}
                       : std::vector<int64_t>{5, geometry.num_q_heads, geometry.head_dim};
        in.q = HostTensor::FromFloats(dtype, q_shape, testing::Rows(q.values, q_row, i, i + 1));
        in.q_layout = layout;
        in.k = HostTensor::FromFloats(dtype, {geometry.num_kv_heads, geometry.head_dim},
                                      testing::Rows(k.values, kv_row, i, i + 1));
        in.v = HostTensor::FromFloats(dtype, {geometry.num_kv_heads, geometry.head_dim},
                                      testing::Rows(v.values, kv_row, i, i + 1));
        entries.push_back(std::move(in));
      }
      absl::StatusOr<std::vector<client::DecodeResult>> r =
          use_ring         ? ring->Decode(0, entries)
          : use_session    ? session->Decode(0, entries)
          : shm != nullptr ? shm->Decode(0, entries)
                           : client.Decode(0, entries);
      ASSERT_TRUE(r.ok()) << r.status();
      ASSERT_EQ(r->size(), seqs.size());
      if (use_ring) {
        std::vector<DecodeInput> twin_entries = entries;
        for (DecodeInput& e : twin_entries) e.sequence_id = twin_of(e.sequence_id);
        absl::StatusOr<std::vector<client::DecodeResult>> s = session->Decode(0, twin_entries);
        ASSERT_TRUE(s.ok()) << s.status();
        ASSERT_EQ(s->size(), r->size());
        for (size_t i = 0; i < r->size(); ++i) {
          EXPECT_EQ((*r)[i].length, (*s)[i].length);
          EXPECT_EQ((*r)[i].o.shape, (*s)[i].o.shape);
          if (!kOnCuda) {
            EXPECT_TRUE((*r)[i].o.data == (*s)[i].o.data)
                << "entry " << i << ": the ring's o differs from the Session's";
          }
        }
      }
      for (size_t i = 0; i < seqs.size(); ++i) {
        EXPECT_EQ((*r)[i].length, lens[i]);
        const testing::ErrorStats e = testing::CompareOutputs(
            (*r)[i].o.ToFloats(), testing::Rows(out.values, o_row, i, i + 1));
        EXPECT_TRUE(e.finite);
        EXPECT_LE(e.max_abs, max_bar) << "entry " << i;
        EXPECT_LE(e.mean_abs, mean_bar) << "entry " << i;
        worst = std::max(worst, e.max_abs);
      }
    }
    ++steps;
  }
  EXPECT_EQ(steps, static_cast<int>(c.at("steps").size()));
  std::printf("%s %s%s: %d steps, worst max abs error %.3g\n", name.c_str(),
              DTypeName(dtype).data(),
              use_ring                           ? " ring v2"
              : use_session                      ? " session"
              : transport == Transport::kShm     ? " shm regions"
              : transport == Transport::kCudaIpc ? " CUDA IPC regions"
                                                 : "",
              steps, worst);
  if (session != nullptr) {
    absl::Status closed = session->Close();
    EXPECT_TRUE(closed.ok()) << closed;
  }

  if (ring != nullptr) {
    EXPECT_EQ(ring->stats().round_trips, steps);
    absl::Status closed = ring->Close();
    EXPECT_TRUE(closed.ok()) << closed;
  }
  for (const std::vector<std::string>* list : {&ids, &twins}) {
    for (const std::string& id : *list) {
      absl::StatusOr<int64_t> freed = client.Release(id);
      EXPECT_TRUE(freed.ok()) << freed.status();
    }
  }
  absl::StatusOr<v1::GetServerInfoResponse> info = client.Info();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->live_sequences(), 0);
  EXPECT_EQ(info->kv_cache().pages_free(), info->kv_cache().pages_total());
  ASSERT_EQ(info->devices_size(), shards) << "the engine's shards";
  int64_t pool = 0;
  for (int i = 0; i < shards; ++i) {
    const v1::DeviceShard& d = info->devices(i);
    EXPECT_EQ(d.device(), kOnCuda ? "cuda:" + ShardDevices(shards)[i] : "cpu");
    EXPECT_EQ(d.num_kv_heads(), geometry.num_kv_heads / shards);
    EXPECT_EQ(d.first_kv_head(), i * d.num_kv_heads());
    EXPECT_EQ(d.num_q_heads(), geometry.num_q_heads / shards);
    EXPECT_EQ(d.first_q_head(), i * d.num_q_heads());
    EXPECT_EQ(d.bytes_used(), 0);
    pool += d.pool_bytes();
  }
  EXPECT_EQ(pool, info->kv_cache().pool_bytes());
}

INSTANTIATE_TEST_SUITE_P(
    DtypesAndTransports, GoldenTest,
    ::testing::Combine(::testing::Values(DType::kFp32, DType::kBf16),
                       ::testing::Values(Transport::kUnary, Transport::kSession, Transport::kShm,
                                         Transport::kRing
#ifdef ATTND_GOLDEN_ON_CUDA
                                         ,
                                         Transport::kCudaIpc
#endif
                                         ),
                       ::testing::Values(1, 2)),
    [](const ::testing::TestParamInfo<std::tuple<DType, Transport, int>>& info) {
      const Transport t = std::get<1>(info.param);
      return absl::StrCat(DTypeName(std::get<0>(info.param)),
                          t == Transport::kSession   ? "_session"
                          : t == Transport::kShm     ? "_shm"
                          : t == Transport::kCudaIpc ? "_cuda_ipc"
                          : t == Transport::kRing    ? "_ring_v2"
                                                     : "_unary",
                          std::get<2>(info.param) > 1 ? "_2shards" : "");
    });

}  // namespace
}  // namespace attnd
