// The serving path per transport (docs/regions.md, issue #15), against the engine alone on the
// same shapes, all in one run:
//   prefill: 4096-token chunks into a sequence up to each --contexts length; tok/s per transport
//            (grpc bytes, shm regions, cuda-ipc regions) and, with --engine, the CUDA engine
//            in-process on device-resident inputs (its kernels plus device-to-device copies);
//   decode:  per-layer steps at --decode-context for each --decode-batches size; p50/p99 per
//            transport (grpc unary, session stream, shm regions over unary, ring, and the ring
//            naming q/k/v/o in a CUDA IPC region: what a serving stack on the same GPU sends).
// Run it against a daemon on the same host:
//   data_plane_bench --target 127.0.0.1:50051
//                    [--transports grpc,shm,cuda-ipc,session,ring,ring-cuda-ipc]
//                    [--contexts 16384,131072] [--decode-batches 1,8,64] [--engine]
// Lines are tab-separated: section, transport, size, figures.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "attnd/v1/attention.grpc.pb.h"
#include "attnd/v1/shm_ring.h"
#include "base/dtype.h"
#include "bench/common/bench_common.h"
#include "grpcpp/grpcpp.h"

#ifdef ATTND_BENCH_CUDA
#include <cuda_runtime_api.h>

#include "kernels/cuda/rotary_cuda.h"
#include "kernels/dual_chunk_rotary.h"
#include "server/engine/cuda_engine.h"
#include "server/engine/engine.h"
#include "server/engine/engine_jobs_for_testing.h"
#endif

ABSL_FLAG(std::string, target, "127.0.0.1:50051", "the daemon");
ABSL_FLAG(std::string, transports, "grpc,shm,cuda-ipc,session,ring,ring-cuda-ipc",
          "prefill: grpc, shm, cuda-ipc; decode: grpc, session, shm, ring, ring-cuda-ipc");
ABSL_FLAG(std::string, contexts, "16384,131072", "prefill: tokens per sequence");
ABSL_FLAG(int64_t, chunk, 4096, "prefill: tokens per call");
ABSL_FLAG(std::string, decode_batches, "1,8,64", "decode: entries per call");
ABSL_FLAG(int64_t, decode_context, 4096, "decode: tokens in each sequence before the steps");
ABSL_FLAG(int32_t, decode_steps, 300, "decode: timed steps per batch and transport");
ABSL_FLAG(std::string, decode_q_layout, "pre_rotary",
          "decode: pre_rotary (q [Hq, D]) or variants (q [3, Hq, D], rotated by the caller)");
ABSL_FLAG(bool, engine, false, "also time the CUDA engine in-process (needs a GPU, no daemon)");
ABSL_FLAG(bool, skip_prefill, false, "decode only");
ABSL_FLAG(
    std::string, q_layout, "pre_rotary",
    "prefill: pre_rotary (q [T, Hq, D], attnd applies the rotary) or variants (q [T, 5, Hq, D])");
ABSL_FLAG(bool, skip_decode, false, "prefill only");
ABSL_FLAG(double, prefill_repeat_seconds, 0,
          "prefill: prompt after prompt (a new sequence each) of every context and transport until "
          "this many seconds have passed, one line each as it ends: a continuous prefill stream "
          "beside another client's decodes; 0 = once");

namespace attnd {
namespace {

using bench::Clock;
using bench::ParseList;
using bench::Percentile;
using bench::RandomBf16;
using bench::Us;

bool Has(const std::string& list, absl::string_view what) {
  for (absl::string_view item : absl::StrSplit(list, ',')) {
    if (item == what) return true;
  }
  return false;
}

struct Geometry {
  int32_t layers = 0, hq = 0, hkv = 0, d = 0;
};

void SetTensor(v1::Tensor* t, std::vector<int64_t> shape, const std::string& bytes) {
  t->set_dtype(v1::DTYPE_BF16);
  for (int64_t s : shape) t->add_shape(s);
  t->set_data(bytes);
}

void SetRef(v1::Tensor* t, std::vector<int64_t> shape, const std::string& region, uint64_t offset,
            uint64_t bytes) {
  t->set_dtype(v1::DTYPE_BF16);
  for (int64_t s : shape) t->add_shape(s);
  t->mutable_region()->set_region_id(region);
  t->mutable_region()->set_offset(offset);
  t->mutable_region()->set_byte_size(bytes);
}

// A shm object of the client's, mapped.
struct Shm {
  explicit Shm(size_t n) : bytes(n) {
    name = absl::StrCat("/attnd-bench-", getpid(), "-", counter++);
    fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    if (fd < 0 || ftruncate(fd, static_cast<off_t>(n)) != 0) std::abort();
    base = static_cast<char*>(mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
  }
  ~Shm() {
    munmap(base, bytes);
    close(fd);
    shm_unlink(name.c_str());
  }
  static inline int counter = 0;
  size_t bytes;
  std::string name;
  int fd = -1;
  char* base = nullptr;
};

// Device memory on the current GPU shared by CUDA IPC, holding a copy of a host image; empty
// (Read a no-op) until Create. Methods return "" or what went wrong.
class DeviceRegion {
 public:
  DeviceRegion() = default;
  DeviceRegion(const DeviceRegion&) = delete;
  DeviceRegion& operator=(const DeviceRegion&) = delete;
#ifdef ATTND_BENCH_CUDA
  ~DeviceRegion() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  std::string Create(const std::string& image, std::string* handle) {
    if (cudaError_t e = cudaMalloc(&ptr_, image.size()); e != cudaSuccess)
      return Error("cudaMalloc", e);
    bytes_ = image.size();
    if (cudaError_t e = cudaMemcpy(ptr_, image.data(), bytes_, cudaMemcpyHostToDevice);
        e != cudaSuccess) {
      return Error("cudaMemcpy", e);
    }
    cudaIpcMemHandle_t h;
    if (cudaError_t e = cudaIpcGetMemHandle(&h, ptr_); e != cudaSuccess) {
      return Error("cudaIpcGetMemHandle", e);
    }
    handle->assign(reinterpret_cast<const char*>(&h), sizeof(h));
    return "";
  }
  std::string Read(std::string* image) const {
    if (ptr_ == nullptr) return "";
    if (cudaError_t e = cudaMemcpy(image->data(), ptr_, bytes_, cudaMemcpyDeviceToHost);
        e != cudaSuccess) {
      return Error("cudaMemcpy", e);
    }
    return "";
  }

 private:
  static std::string Error(const char* what, cudaError_t e) {
    return absl::StrCat(what, ": ", cudaGetErrorString(e));
  }
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
#else
  std::string Create(const std::string&, std::string*) { return "built without CUDA"; }
  std::string Read(std::string*) const { return ""; }
#endif
};

class Bench {
 public:
  explicit Bench(const std::string& target) {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(1 << 30);
    args.SetMaxSendMessageSize(1 << 30);
    stub_ = v1::Attention::NewStub(
        grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args));
  }

  bool Init() {
    grpc::ClientContext c;
    v1::GetServerInfoResponse info;
    grpc::Status s = stub_->GetServerInfo(&c, v1::GetServerInfoRequest(), &info);
    if (!s.ok()) {
      std::fprintf(stderr, "GetServerInfo: %s\n", s.error_message().c_str());
      return false;
    }
    g_.layers = info.model().num_layers();
    g_.hq = info.model().num_q_heads();
    g_.hkv = info.model().num_kv_heads();
    g_.d = info.model().head_dim();
    info_ = info;
    std::printf("# server\t%s %s (%s), model %s, regions %d kinds\n", info.backend().c_str(),
                info.version().c_str(), info.device().c_str(), info.model().name().c_str(),
                info.regions().kinds_size());
    return true;
  }

  std::string NewSequence() {
    grpc::ClientContext c;
    v1::CreateSequenceResponse r;
    if (!stub_->CreateSequence(&c, v1::CreateSequenceRequest(), &r).ok()) std::abort();
    return r.sequence_id();
  }
  void Release(const std::string& id) {
    grpc::ClientContext c;
    v1::ReleaseSequenceRequest req;
    req.set_sequence_id(id);
    v1::ReleaseSequenceResponse r;
    stub_->ReleaseSequence(&c, req, &r);
  }

  std::string Register(v1::RegisterRegionRequest request) {
    grpc::ClientContext c;
    v1::RegisterRegionResponse r;
    grpc::Status s = stub_->RegisterRegion(&c, request, &r);
    if (!s.ok()) {
      std::fprintf(stderr, "RegisterRegion: %s\n", s.error_message().c_str());
      return "";
    }
    return r.region_id();
  }
  void Unregister(const std::string& id) {
    grpc::ClientContext c;
    v1::UnregisterRegionRequest req;
    req.set_region_id(id);
    v1::UnregisterRegionResponse r;
    stub_->UnregisterRegion(&c, req, &r);
  }

  // Prefill: `transport` is grpc, shm or cuda-ipc. Returns false if it cannot run.
  bool Prefill(const std::string& transport, int64_t context) {
    const int64_t t = absl::GetFlag(FLAGS_chunk);
    const bool variants = absl::GetFlag(FLAGS_q_layout) == "variants";
    const int64_t nv = variants ? 5 : 1;
    const int64_t q_bytes = t * nv * g_.hq * g_.d * 2, kv_bytes = t * g_.hkv * g_.d * 2;
    const int64_t o_bytes = t * g_.hq * g_.d * 2;
    const std::vector<int64_t> q_shape =
        variants ? std::vector<int64_t>{t, 5, g_.hq, g_.d} : std::vector<int64_t>{t, g_.hq, g_.d};
    std::mt19937 rng(1);
    const std::string q = RandomBf16(&rng, q_bytes / 2), k = RandomBf16(&rng, kv_bytes / 2),
                      v = RandomBf16(&rng, kv_bytes / 2);
    v1::PrefillRequest request;
    request.set_layer(0);
    request.set_q_layout(variants ? v1::Q_LAYOUT_VARIANTS : v1::Q_LAYOUT_PRE_ROTARY);
    request.set_prompt_len(context);
    std::unique_ptr<Shm> shm;
    std::string region;
    void* device = nullptr;
    const uint64_t q_off = 0, k_off = q_bytes, v_off = k_off + kv_bytes, o_off = v_off + kv_bytes;
    const uint64_t total = o_off + o_bytes;
    if (transport == "grpc") {
      SetTensor(request.mutable_q(), q_shape, q);
      SetTensor(request.mutable_k(), {t, g_.hkv, g_.d}, k);
      SetTensor(request.mutable_v(), {t, g_.hkv, g_.d}, v);
    } else if (transport == "shm") {
      shm = std::make_unique<Shm>(total);
      std::memcpy(shm->base + q_off, q.data(), q_bytes);
      std::memcpy(shm->base + k_off, k.data(), kv_bytes);
      std::memcpy(shm->base + v_off, v.data(), kv_bytes);
      v1::RegisterRegionRequest r;
      r.mutable_system_shm()->set_name(shm->name);
      r.mutable_system_shm()->set_byte_size(total);
      region = Register(r);
    } else if (transport == "cuda-ipc") {
#ifdef ATTND_BENCH_CUDA
      if (cudaMalloc(&device, total) != cudaSuccess) return false;
      cudaMemcpy(static_cast<char*>(device) + q_off, q.data(), q_bytes, cudaMemcpyHostToDevice);
      cudaMemcpy(static_cast<char*>(device) + k_off, k.data(), kv_bytes, cudaMemcpyHostToDevice);
      cudaMemcpy(static_cast<char*>(device) + v_off, v.data(), kv_bytes, cudaMemcpyHostToDevice);
      cudaIpcMemHandle_t handle;
      if (cudaIpcGetMemHandle(&handle, device) != cudaSuccess) return false;
      v1::RegisterRegionRequest r;
      r.mutable_cuda_ipc()->set_handle(&handle, sizeof(handle));
      r.mutable_cuda_ipc()->set_byte_size(total);
      region = Register(r);
#else
      std::printf("prefill\tcuda-ipc\t-\tskipped: built without CUDA\n");
      return false;
#endif
    } else {
      return false;
    }
    if (transport != "grpc") {
      if (region.empty()) return false;
      SetRef(request.mutable_q(), q_shape, region, q_off, q_bytes);
      SetRef(request.mutable_k(), {t, g_.hkv, g_.d}, region, k_off, kv_bytes);
      SetRef(request.mutable_v(), {t, g_.hkv, g_.d}, region, v_off, kv_bytes);
      request.mutable_output_region()->set_region_id(region);
      request.mutable_output_region()->set_offset(o_off);
      request.mutable_output_region()->set_byte_size(o_bytes);
    }
    const std::string seq = NewSequence();
    request.set_sequence_id(seq);
    std::vector<double> calls;
    bool ok = true;
    const auto begin = Clock::now();
    for (int64_t done = 0; done < context; done += t) {
      grpc::ClientContext c;
      v1::PrefillResponse r;
      const auto start = Clock::now();
      grpc::Status s = stub_->Prefill(&c, request, &r);
      calls.push_back(Us(Clock::now() - start));
      if (!s.ok()) {
        std::fprintf(stderr, "prefill %s: %s\n", transport.c_str(), s.error_message().c_str());
        ok = false;
        break;
      }
    }
    const double total_us = Us(Clock::now() - begin);
    Release(seq);
    if (!region.empty()) Unregister(region);
#ifdef ATTND_BENCH_CUDA
    if (device != nullptr) cudaFree(device);
#endif
    if (!ok) return false;
    std::printf(
        "prefill\t%s %s\tcontext %lld\t%.0f tok/s\tlast chunk %.2f ms\tmedian chunk "
        "%.2f ms\trequest %.1f MB\n",
        transport.c_str(), variants ? "variants" : "pre_rotary", static_cast<long long>(context),
        static_cast<double>(context) / (total_us / 1e6), calls.back() / 1e3,
        Percentile(calls, 0.5) / 1e3, static_cast<double>(request.ByteSizeLong()) / 1e6);
    std::fflush(stdout);  // a stream run (--prefill_repeat_seconds) may be stopped at any time
    return true;
  }

  // Why this process or this server cannot run the ring with CUDA IPC references, or "".
  std::string CudaIpcRingSkip() const {
#ifndef ATTND_BENCH_CUDA
    return "built without CUDA";
#else
    if (!info_.regions().rings()) return "the server does not serve rings";
    for (int k : info_.regions().kinds()) {
      if (k == v1::REGION_KIND_CUDA_IPC) return "";
    }
    return absl::StrCat("the server (backend ", info_.backend(), ") accepts no CUDA IPC regions");
#endif
  }

  // Decode: grpc, session, shm, ring or ring-cuda-ipc. A transport that cannot run here prints
  // why and counts as run.
  bool Decode(const std::string& transport, int64_t batch) {
    if (transport == "ring-cuda-ipc") {
      const std::string why = CudaIpcRingSkip();
      if (!why.empty()) {
        std::printf("decode\tring-cuda-ipc\tbatch %lld\tskipped: %s\n",
                    static_cast<long long>(batch), why.c_str());
        return true;
      }
    }
    const int64_t context = absl::GetFlag(FLAGS_decode_context);
    const int32_t steps = absl::GetFlag(FLAGS_decode_steps);
    std::mt19937 rng(2);
    std::vector<std::string> seqs;
    {  // every sequence to `context` tokens in layer 0, through plain gRPC
      const int64_t t = std::min<int64_t>(context, 4096);
      v1::PrefillRequest p;
      p.set_layer(0);
      p.set_q_layout(v1::Q_LAYOUT_PRE_ROTARY);
      SetTensor(p.mutable_q(), {t, g_.hq, g_.d}, RandomBf16(&rng, t * g_.hq * g_.d));
      SetTensor(p.mutable_k(), {t, g_.hkv, g_.d}, RandomBf16(&rng, t * g_.hkv * g_.d));
      SetTensor(p.mutable_v(), {t, g_.hkv, g_.d}, RandomBf16(&rng, t * g_.hkv * g_.d));
      for (int64_t i = 0; i < batch; ++i) {
        seqs.push_back(NewSequence());
        p.set_sequence_id(seqs.back());
        for (int64_t done = 0; done < context; done += t) {
          grpc::ClientContext c;
          v1::PrefillResponse r;
          grpc::Status s = stub_->Prefill(&c, p, &r);
          if (!s.ok()) {
            std::fprintf(stderr, "decode setup: %s\n", s.error_message().c_str());
            return false;
          }
        }
      }
    }
    const bool variants = absl::GetFlag(FLAGS_decode_q_layout) == "variants";
    const int64_t nv = variants ? 3 : 1;
    const std::vector<int64_t> q_shape =
        variants ? std::vector<int64_t>{3, g_.hq, g_.d} : std::vector<int64_t>{g_.hq, g_.d};
    const int64_t q_bytes = nv * g_.hq * g_.d * 2, kv_bytes = g_.hkv * g_.d * 2;
    const int64_t o_bytes = g_.hq * g_.d * 2;
    const std::string q = RandomBf16(&rng, q_bytes / 2), k = RandomBf16(&rng, kv_bytes / 2),
                      v = RandomBf16(&rng, kv_bytes / 2);
    v1::DecodeRequest request;
    request.set_layer(0);
    std::unique_ptr<Shm> shm;
    std::string region;
    const uint64_t row = q_bytes + 2 * kv_bytes + o_bytes;  // q, k, v, o per entry
    const bool staged = transport == "shm" || transport == "ring-cuda-ipc";
    // The region's contents: every entry's q, k, v and a zeroed o (so a missing write shows).
    std::string image(std::max<uint64_t>(4096, batch * row), '\0');
    for (int64_t i = 0; i < batch && staged; ++i) {
      std::memcpy(image.data() + i * row, q.data(), q_bytes);
      std::memcpy(image.data() + i * row + q_bytes, k.data(), kv_bytes);
      std::memcpy(image.data() + i * row + q_bytes + kv_bytes, v.data(), kv_bytes);
    }
    DeviceRegion device;
    auto give_up = [&](const std::string& why) {
      std::fprintf(stderr, "decode %s: %s\n", transport.c_str(), why.c_str());
      for (const std::string& s : seqs) Release(s);
      return false;
    };
    if (transport == "shm") {
      shm = std::make_unique<Shm>(image.size());
      std::memcpy(shm->base, image.data(), image.size());
      v1::RegisterRegionRequest r;
      r.mutable_system_shm()->set_name(shm->name);
      r.mutable_system_shm()->set_byte_size(shm->bytes);
      region = Register(r);
      if (region.empty()) return give_up("the shm region was not registered");
    } else if (transport == "ring-cuda-ipc") {
      std::string handle;
      if (std::string e = device.Create(image, &handle); !e.empty()) return give_up(e);
      v1::RegisterRegionRequest r;
      r.mutable_cuda_ipc()->set_handle(handle);
      r.mutable_cuda_ipc()->set_byte_size(image.size());
      region = Register(r);
      if (region.empty()) return give_up("the CUDA IPC region was not registered");
    }
    for (int64_t i = 0; i < batch; ++i) {
      v1::DecodeEntry* e = request.add_entries();
      e->set_sequence_id(seqs[i]);
      e->set_q_layout(variants ? v1::Q_LAYOUT_VARIANTS : v1::Q_LAYOUT_PRE_ROTARY);
      if (staged) {
        const uint64_t at = i * row;
        SetRef(e->mutable_q(), q_shape, region, at, q_bytes);
        SetRef(e->mutable_k(), {g_.hkv, g_.d}, region, at + q_bytes, kv_bytes);
        SetRef(e->mutable_v(), {g_.hkv, g_.d}, region, at + q_bytes + kv_bytes, kv_bytes);
        e->mutable_output_region()->set_region_id(region);
        e->mutable_output_region()->set_offset(at + q_bytes + 2 * kv_bytes);
        e->mutable_output_region()->set_byte_size(o_bytes);
      } else {
        SetTensor(e->mutable_q(), q_shape, q);
        SetTensor(e->mutable_k(), {g_.hkv, g_.d}, k);
        SetTensor(e->mutable_v(), {g_.hkv, g_.d}, v);
      }
    }
    std::vector<double> lat;
    bool ok = true;
    const int warmup = 20;
    if (transport == "grpc" || transport == "shm") {
      for (int i = 0; i < steps + warmup && ok; ++i) {
        grpc::ClientContext c;
        v1::DecodeResponse r;
        const auto start = Clock::now();
        grpc::Status s = stub_->Decode(&c, request, &r);
        if (i >= warmup) lat.push_back(Us(Clock::now() - start));
        if (!s.ok()) {
          std::fprintf(stderr, "decode %s: %s\n", transport.c_str(), s.error_message().c_str());
          ok = false;
        }
      }
    } else if (transport == "session") {
      grpc::ClientContext c;
      auto stream = stub_->Session(&c);
      v1::SessionRequest sr;
      *sr.mutable_decode() = request;
      for (int i = 0; i < steps + warmup && ok; ++i) {
        v1::SessionResponse r;
        const auto start = Clock::now();
        ok = stream->Write(sr) && stream->Read(&r) && r.code() == 0;
        if (i >= warmup) lat.push_back(Us(Clock::now() - start));
        if (!ok) std::fprintf(stderr, "decode session: %s\n", r.message().c_str());
      }
      stream->WritesDone();
      stream->Finish().IgnoreError();
    } else if (transport == "ring" || transport == "ring-cuda-ipc") {
      ok = RingDecode(request, steps, warmup, &lat);
    } else {
      ok = false;
    }
    // Every entry's output must have landed in the region (all zero bytes = never written).
    if (ok && staged) {
      std::string now = image;
      if (shm != nullptr) std::memcpy(now.data(), shm->base, now.size());
      if (std::string e = device.Read(&now); !e.empty()) {
        std::fprintf(stderr, "decode %s: %s\n", transport.c_str(), e.c_str());
        ok = false;
      }
      for (int64_t i = 0; i < batch && ok; ++i) {
        const char* o = now.data() + i * row + q_bytes + 2 * kv_bytes;
        if (std::all_of(o, o + o_bytes, [](char c) { return c == 0; })) {
          std::fprintf(stderr, "decode %s: entry %lld's output was not written to the region\n",
                       transport.c_str(), static_cast<long long>(i));
          ok = false;
        }
      }
    }
    for (const std::string& s : seqs) Release(s);
    if (!region.empty()) Unregister(region);
    if (!ok) return false;
    std::printf("decode\t%s %s\tbatch %lld\tp50 %.1f us\tp99 %.1f us\tmean %.1f us\n",
                transport.c_str(), variants ? "variants" : "pre_rotary",
                static_cast<long long>(batch), Percentile(lat, 0.5), Percentile(lat, 0.99),
                std::accumulate(lat.begin(), lat.end(), 0.0) / static_cast<double>(lat.size()));
    return true;
  }

 private:
  // One ring, the client's half of proto/attnd/v1/shm_ring.h: spin on the answer (this is the
  // latency benchmark; a real client would sleep after a while).
  bool RingDecode(const v1::DecodeRequest& decode, int32_t steps, int warmup,
                  std::vector<double>* lat) {
    const uint64_t half = 4 << 20;
    Shm shm(ring::kHeaderBytes + 2 * half);
    auto* h = reinterpret_cast<ring::Header*>(shm.base);
    h->magic = ring::kMagic;
    h->version = ring::kVersion;
    h->half_bytes = half;
    v1::OpenRingRequest open;
    open.set_name(shm.name);
    open.set_byte_size(shm.bytes);
    v1::OpenRingResponse opened;
    {
      grpc::ClientContext c;
      grpc::Status s = stub_->OpenRing(&c, open, &opened);
      if (!s.ok()) {
        std::fprintf(stderr, "OpenRing: %s\n", s.error_message().c_str());
        return false;
      }
    }
    v1::SessionRequest sr;
    *sr.mutable_decode() = decode;
    std::string bytes;
    v1::SessionResponse response;
    bool ok = true;
    for (int i = 0; i < steps + warmup && ok; ++i) {
      const auto start = Clock::now();
      sr.set_tag(i);
      bytes.clear();
      sr.SerializeToString(&bytes);
      const uint32_t seq = h->request_seq.load() + 1;
      const uint64_t n = bytes.size();
      std::memcpy(shm.base + ring::RequestOffset(), &n, 8);
      std::memcpy(shm.base + ring::RequestOffset() + 8, bytes.data(), n);
      h->request_seq.store(seq, std::memory_order_seq_cst);
      if (h->server_sleeping.load(std::memory_order_seq_cst) != 0) ring::FutexWake(&h->request_seq);
      while (h->response_seq.load(std::memory_order_acquire) != seq) {
        if (h->closed.load() != 0) {
          ok = false;
          break;
        }
      }
      uint64_t len = 0;
      std::memcpy(&len, shm.base + ring::ResponseOffset(half), 8);
      ok = ok &&
           response.ParseFromArray(shm.base + ring::ResponseOffset(half) + 8,
                                   static_cast<int>(len)) &&
           response.code() == 0;
      if (i >= warmup) lat->push_back(Us(Clock::now() - start));
      if (!ok) std::fprintf(stderr, "decode ring: %s\n", response.message().c_str());
    }
    v1::CloseRingRequest close;
    close.set_ring_id(opened.ring_id());
    v1::CloseRingResponse closed;
    grpc::ClientContext c;
    stub_->CloseRing(&c, close, &closed);
    return ok;
  }

  std::unique_ptr<v1::Attention::Stub> stub_;
  Geometry g_;
  v1::GetServerInfoResponse info_;
};

#ifdef ATTND_BENCH_CUDA
// Qwen2.5-7B-Instruct-1M's attention and rotary (configs/qwen2.5-7b-instruct-1m/config.json), one
// layer of bf16 KV in pages of 16 tokens, `pages` of them.
CudaEngineOptions Qwen7bEngine(int64_t pages, bool graphs) {
  CudaEngineOptions o;
  DcaGeometry& g = o.geometry;
  g.num_q_heads = 28;
  g.num_kv_heads = 4;
  g.head_dim = 128;
  g.chunk_len = 253952;
  g.chunk_size = 262144;
  g.original_max_position_embeddings = 262144;
  g.softmax_scale = 1.f / std::sqrt(128.f);
  g.rope_theta = 10000000.0;
  g.rotary_dim = 128;
  o.layout.num_layers = 1;
  o.layout.page_size = 16;
  o.layout.num_kv_heads = 4;
  o.layout.head_dim = 128;
  o.layout.kv_dtype = DType::kBf16;
  o.layout.num_pages = pages;
  o.cuda_graphs = graphs;
  return o;
}

// The CUDA engine in-process on device-resident inputs (as a CUDA IPC region would give it):
// D2D copies in, the rotary, append, attention, D2D out. The figure the transports are held to.
void EnginePrefill(const std::vector<int64_t>& contexts) {
  const int64_t t = absl::GetFlag(FLAGS_chunk);
  int64_t max_context = 0;
  for (int64_t c : contexts) max_context = std::max(max_context, c);
  CudaEngineOptions options = Qwen7bEngine(max_context / 16 + 16, /*graphs=*/false);
  options.staging_bytes = 1ll << 30;
  const DcaGeometry& g = options.geometry;
  absl::StatusOr<std::unique_ptr<Engine>> engine = CreateCudaEngine(options);
  if (!engine.ok()) {
    std::printf("prefill\tengine\t-\tskipped: %s\n",
                std::string(engine.status().message()).c_str());
    return;
  }
  const bool variants = absl::GetFlag(FLAGS_q_layout) == "variants";
  const int64_t nv = variants ? 5 : 1;
  const int64_t q_bytes = t * nv * 28 * 128 * 2, kv_bytes = t * 4 * 128 * 2;
  std::mt19937 rng(1);
  const std::string q = RandomBf16(&rng, q_bytes / 2), k = RandomBf16(&rng, kv_bytes / 2),
                    v = RandomBf16(&rng, kv_bytes / 2);
  char* dev = nullptr;
  cudaMalloc(reinterpret_cast<void**>(&dev), q_bytes + t * 28 * 128 * 2 + 2 * kv_bytes);
  cudaMemcpy(dev, q.data(), q_bytes, cudaMemcpyHostToDevice);
  cudaMemcpy(dev + q_bytes, k.data(), kv_bytes, cudaMemcpyHostToDevice);
  cudaMemcpy(dev + q_bytes + kv_bytes, v.data(), kv_bytes, cudaMemcpyHostToDevice);
  std::vector<int32_t> pages(options.layout.num_pages);
  for (size_t i = 0; i < pages.size(); ++i) pages[i] = static_cast<int32_t>(i);
  for (int64_t context : contexts) {
    const auto begin = Clock::now();
    double last = 0;
    for (int64_t start = 0; start < context; start += t) {
      PrefillJob job = EngineJobsForTesting::Prefill();
      job.layer = 0;
      job.page_table = pages.data();
      job.num_pages = (start + t + 15) / 16;
      job.start = start;
      job.num_tokens = t;
      job.prompt_len = context;
      job.q_layout = variants ? QLayout::kVariants : QLayout::kPreRotary;
      job.q = variants ? TensorView{DType::kBf16, dev, {t, 5, 28, 128}, true}
                       : TensorView{DType::kBf16, dev, {t, 28, 128}, true};
      job.k = TensorView{DType::kBf16, dev + q_bytes, {t, 4, 128}, true};
      job.v = TensorView{DType::kBf16, dev + q_bytes + kv_bytes, {t, 4, 128}, true};
      job.out = dev + q_bytes + 2 * kv_bytes;
      job.out_dtype = DType::kBf16;
      job.out_on_device = true;
      const auto s0 = Clock::now();
      absl::Status s = (*engine)->Prefill(job);
      last = Us(Clock::now() - s0);
      if (!s.ok()) {
        std::printf("prefill\tengine\t-\tfailed: %s\n", std::string(s.message()).c_str());
        return;
      }
    }
    const double total = Us(Clock::now() - begin);
    std::printf("prefill\tengine %s\tcontext %lld\t%.0f tok/s\tlast chunk %.2f ms\n",
                variants ? "variants" : "pre_rotary", static_cast<long long>(context),
                static_cast<double>(context) / (total / 1e6), last / 1e3);
  }
  // The rotary kernel alone on one chunk (what pre-rotary adds to the prefill kernels).
  const std::vector<float> inv_freq = RotaryInvFreq(g.rope_theta, g.rotary_dim);
  float* d_freq = nullptr;
  Bf16* d_variants = nullptr;
  cudaMalloc(reinterpret_cast<void**>(&d_freq), inv_freq.size() * 4);
  cudaMemcpy(d_freq, inv_freq.data(), inv_freq.size() * 4, cudaMemcpyHostToDevice);
  cudaMalloc(reinterpret_cast<void**>(&d_variants), t * 5 * 28 * 128 * 2);
  CudaRotaryParams rp;
  rp.q = dev;
  rp.k = dev + q_bytes;
  rp.dtype = DType::kBf16;
  rp.q_variants = d_variants;
  rp.inv_freq = d_freq;
  rp.start = 28672;
  rp.num_tokens = t;
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  for (int i = 0; i < 5; ++i) LaunchDualChunkRotary(g, rp, nullptr).IgnoreError();
  const int iters = 50;
  cudaEventRecord(e0, nullptr);
  for (int i = 0; i < iters; ++i) LaunchDualChunkRotary(g, rp, nullptr).IgnoreError();
  cudaEventRecord(e1, nullptr);
  cudaEventSynchronize(e1);
  float ms = 0;
  cudaEventElapsedTime(&ms, e0, e1);
  std::printf("rotary\tkernel\t%lld tokens\t%.1f us per chunk\n", static_cast<long long>(t),
              1e3 * ms / iters);
  cudaFree(d_freq);
  cudaFree(d_variants);
  cudaFree(dev);
}

// Engine::Decode in-process with host inputs, as the daemon calls it (host packing, the pre-rotary
// rows' rotary on the host, graph replay, sync, unpack): the decode figure below the service.
void EngineDecode(const std::vector<int64_t>& batches) {
  const int64_t context = absl::GetFlag(FLAGS_decode_context);
  int64_t max_batch = 1;
  for (int64_t b : batches) max_batch = std::max(max_batch, b);
  const int64_t pages_per_seq = (context + 512) / 16 + 1;
  const CudaEngineOptions options = Qwen7bEngine(max_batch * pages_per_seq + 16, /*graphs=*/true);
  absl::StatusOr<std::unique_ptr<Engine>> engine = CreateCudaEngine(options);
  if (!engine.ok()) {
    std::printf("decode\tengine\t-\tskipped: %s\n", std::string(engine.status().message()).c_str());
    return;
  }
  std::mt19937 rng(3);
  // The KV of every sequence: one prefill of `context` tokens each (variants layout, host data).
  const std::string pq = RandomBf16(&rng, context * 5 * 28 * 128),
                    pk = RandomBf16(&rng, context * 4 * 128),
                    pv = RandomBf16(&rng, context * 4 * 128);
  std::string pout(context * 28 * 128 * 2, '\0');
  std::vector<std::vector<int32_t>> tables(max_batch);
  for (int64_t s = 0; s < max_batch; ++s) {
    for (int64_t i = 0; i < pages_per_seq; ++i) tables[s].push_back(s * pages_per_seq + i);
    PrefillJob job = EngineJobsForTesting::Prefill();
    job.page_table = tables[s].data();
    job.num_pages = (context + 15) / 16;
    job.num_tokens = context;
    job.prompt_len = context;
    job.q = TensorView{DType::kBf16, pq.data(), {context, 5, 28, 128}, false};
    job.k = TensorView{DType::kBf16, pk.data(), {context, 4, 128}, false};
    job.v = TensorView{DType::kBf16, pv.data(), {context, 4, 128}, false};
    job.out = pout.data();
    job.out_dtype = DType::kBf16;
    if (absl::Status st = (*engine)->Prefill(job); !st.ok()) {
      std::printf("decode\tengine\t-\tfailed: %s\n", std::string(st.message()).c_str());
      return;
    }
  }
  const std::string q3 = RandomBf16(&rng, 3 * 28 * 128), q1 = RandomBf16(&rng, 28 * 128),
                    k = RandomBf16(&rng, 4 * 128), v = RandomBf16(&rng, 4 * 128);
  for (bool pre : {true, false}) {
    for (int64_t b : batches) {
      std::vector<std::string> outs(b, std::string(28 * 128 * 2, '\0'));
      std::vector<double> lat;
      for (int it = 0; it < 220; ++it) {
        DecodeJob job = EngineJobsForTesting::Decode();
        job.layer = 0;
        for (int64_t s = 0; s < b; ++s) {
          DecodeJob::Entry e;
          e.page_table = tables[s].data();
          e.num_pages = (context + 16) / 16;
          e.length = context + 1;  // the same position every step: the KV stays as prefilled
          e.q = pre ? TensorView{DType::kBf16, q1.data(), {28, 128}, false}
                    : TensorView{DType::kBf16, q3.data(), {3, 28, 128}, false};
          e.q_layout = pre ? QLayout::kPreRotary : QLayout::kVariants;
          e.k = TensorView{DType::kBf16, k.data(), {4, 128}, false};
          e.v = TensorView{DType::kBf16, v.data(), {4, 128}, false};
          e.out = outs[s].data();
          e.out_dtype = DType::kBf16;
          job.entries.push_back(e);
        }
        const auto t0 = Clock::now();
        absl::Status st = (*engine)->Decode(job).status();
        if (it >= 20) lat.push_back(Us(Clock::now() - t0));
        if (!st.ok()) {
          std::printf("decode\tengine\t-\tfailed: %s\n", std::string(st.message()).c_str());
          return;
        }
      }
      std::printf("decode\tengine %s\tbatch %lld\tp50 %.1f us\tp99 %.1f us\n",
                  pre ? "pre_rotary" : "variants", static_cast<long long>(b), Percentile(lat, 0.5),
                  Percentile(lat, 0.99));
    }
  }
}
#endif

}  // namespace
}  // namespace attnd

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const std::vector<int64_t> contexts = attnd::bench::ParseList(absl::GetFlag(FLAGS_contexts));
  if (absl::GetFlag(FLAGS_engine)) {
#ifdef ATTND_BENCH_CUDA
    if (!absl::GetFlag(FLAGS_skip_prefill)) attnd::EnginePrefill(contexts);
    if (!absl::GetFlag(FLAGS_skip_decode)) {
      attnd::EngineDecode(attnd::bench::ParseList(absl::GetFlag(FLAGS_decode_batches)));
    }
#else
    std::printf("prefill\tengine\t-\tskipped: built without CUDA\n");
#endif
    return 0;
  }
  attnd::Bench bench(absl::GetFlag(FLAGS_target));
  if (!bench.Init()) return 1;
  const std::string transports = absl::GetFlag(FLAGS_transports);
  int failures = 0;
  if (!absl::GetFlag(FLAGS_skip_prefill)) {
    const auto until = std::chrono::steady_clock::now() +
                       std::chrono::duration<double>(absl::GetFlag(FLAGS_prefill_repeat_seconds));
    do {
      for (int64_t context : contexts) {
        for (const char* t : {"grpc", "shm", "cuda-ipc"}) {
          if (attnd::Has(transports, t) && !bench.Prefill(t, context)) ++failures;
        }
      }
    } while (failures == 0 && std::chrono::steady_clock::now() < until);
  }
  if (!absl::GetFlag(FLAGS_skip_decode)) {
    for (int64_t batch : attnd::bench::ParseList(absl::GetFlag(FLAGS_decode_batches))) {
      for (const char* t : {"grpc", "session", "shm", "ring", "ring-cuda-ipc"}) {
        if (attnd::Has(transports, t) && !bench.Decode(t, batch)) ++failures;
      }
    }
  }
  std::fflush(stdout);
  return failures == 0 ? 0 : 1;
}
