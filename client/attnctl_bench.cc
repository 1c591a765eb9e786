#include <algorithm>
#include <chrono>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "client/attnctl.h"
#include "client/cuda_buffer.h"
#include "client/regions.h"

namespace attnd {
namespace client {
namespace {

using Clock = std::chrono::steady_clock;

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t i = std::min(v.size() - 1, static_cast<size_t>(p * (v.size() - 1) + 0.5));
  return v[i];
}

struct Row {
  int64_t context = 0;
  std::string skipped;  // why the context was not run, or ""
  double prefill_tokens_per_s = 0;
  double prefill_ms_per_call = 0;
  double decode_steps_per_s = 0;
  double decode_p50_ms = 0;
  double decode_p99_ms = 0;
  double decode_layer_p50_us = 0;  // one layer's Decode call
  double decode_layer_p99_us = 0;
};

// Random inputs are made once per size and reused: generating them is client work, and the
// server's arithmetic does not depend on the values.
class Inputs {
 public:
  Inputs(DType dtype, int32_t hq, int32_t hkv, int32_t d, uint64_t seed, v1::QLayout layout)
      : dtype_(dtype),
        hq_(hq),
        hkv_(hkv),
        d_(d),
        rng_(static_cast<uint32_t>(seed)),
        pre_rotary_(layout == v1::Q_LAYOUT_PRE_ROTARY) {}

  struct Prefill {
    HostTensor q, k, v;
  };
  const Prefill& ForPrefill(int64_t t) {
    auto it = prefill_.find(t);
    if (it != prefill_.end()) return it->second;
    const std::vector<int64_t> q_shape =
        pre_rotary_ ? std::vector<int64_t>{t, hq_, d_} : std::vector<int64_t>{t, 5, hq_, d_};
    const int64_t q_n = (pre_rotary_ ? 1 : 5) * t * hq_ * d_;
    Prefill p{HostTensor::FromFloats(dtype_, q_shape, Random(q_n)),
              HostTensor::FromFloats(dtype_, {t, hkv_, d_}, Random(t * hkv_ * d_)),
              HostTensor::FromFloats(dtype_, {t, hkv_, d_}, Random(t * hkv_ * d_))};
    return prefill_.emplace(t, std::move(p)).first->second;
  }
  bool pre_rotary() const { return pre_rotary_; }
  DecodeInput ForDecode(const std::string& id) {
    if (decode_.q.data.empty()) {
      decode_.q = pre_rotary_ ? HostTensor::FromFloats(dtype_, {hq_, d_}, Random(hq_ * d_))
                              : HostTensor::FromFloats(dtype_, {3, hq_, d_}, Random(3 * hq_ * d_));
      decode_.q_layout = pre_rotary_ ? v1::Q_LAYOUT_PRE_ROTARY : v1::Q_LAYOUT_VARIANTS;
      decode_.k = HostTensor::FromFloats(dtype_, {hkv_, d_}, Random(hkv_ * d_));
      decode_.v = HostTensor::FromFloats(dtype_, {hkv_, d_}, Random(hkv_ * d_));
    }
    DecodeInput in = decode_;
    in.sequence_id = id;
    return in;
  }

 private:
  std::vector<float> Random(int64_t n) {
    std::uniform_real_distribution<float> dist(-1.f, 1.f);
    std::vector<float> v(n);
    for (float& x : v) x = dist(rng_);
    return v;
  }
  DType dtype_;
  int32_t hq_, hkv_, d_;
  std::mt19937 rng_;
  std::map<int64_t, Prefill> prefill_;
  DecodeInput decode_;
  bool pre_rotary_ = false;
};

// Where a region transport keeps the tensors it names: a registered shm buffer or device buffer.
class Staging {
 public:
  virtual ~Staging() = default;
  virtual absl::Status Write(uint64_t offset, const std::string& bytes) = 0;
  virtual absl::StatusOr<std::string> Read(uint64_t offset, uint64_t n) = 0;
  virtual std::string Describe() const = 0;
  const std::string& region_id() const { return region_.id(); }

 protected:
  explicit Staging(RegisteredRegion region) : region_(std::move(region)) {}
  RegisteredRegion region_;
};

class ShmStaging : public Staging {
 public:
  static absl::StatusOr<std::unique_ptr<Staging>> Create(AttndClient& client, uint64_t bytes) {
    absl::StatusOr<std::unique_ptr<ShmBuffer>> buf = ShmBuffer::CreateFor(client, bytes);
    if (!buf.ok()) return buf.status();
    absl::StatusOr<RegisteredRegion> region = RegisteredRegion::Shm(client, **buf);
    if (!region.ok()) return region.status();
    return std::unique_ptr<Staging>(new ShmStaging(std::move(*buf), std::move(*region)));
  }
  absl::Status Write(uint64_t offset, const std::string& bytes) override {
    std::memcpy(buf_->data() + offset, bytes.data(), bytes.size());
    return absl::OkStatus();
  }
  absl::StatusOr<std::string> Read(uint64_t offset, uint64_t n) override {
    return std::string(reinterpret_cast<const char*>(buf_->data() + offset), n);
  }
  std::string Describe() const override {
    return absl::StrFormat("a registered %.1f MiB shm region", buf_->size() / 1048576.0);
  }

 private:
  ShmStaging(std::unique_ptr<ShmBuffer> buf, RegisteredRegion region)
      : Staging(std::move(region)), buf_(std::move(buf)) {}
  std::unique_ptr<ShmBuffer> buf_;
};

class CudaStaging : public Staging {
 public:
  static absl::StatusOr<std::unique_ptr<Staging>> Create(AttndClient& client, uint64_t bytes,
                                                         int device) {
    absl::StatusOr<std::unique_ptr<DeviceBuffer>> buf = DeviceBuffer::Create(bytes, device);
    if (!buf.ok()) return buf.status();
    absl::StatusOr<std::string> handle = (*buf)->IpcHandle();
    if (!handle.ok()) return handle.status();
    absl::StatusOr<RegisteredRegion> region = RegisteredRegion::CudaIpc(client, *handle, bytes);
    if (!region.ok()) return region.status();
    return std::unique_ptr<Staging>(new CudaStaging(std::move(*buf), std::move(*region), device));
  }
  absl::Status Write(uint64_t offset, const std::string& bytes) override {
    return buf_->Write(offset, bytes.data(), bytes.size());
  }
  absl::StatusOr<std::string> Read(uint64_t offset, uint64_t n) override {
    std::string out(n, '\0');
    absl::Status s = buf_->Read(offset, out.data(), n);
    if (!s.ok()) return s;
    return out;
  }
  std::string Describe() const override {
    return absl::StrFormat("%.1f MiB of device memory on local GPU %d, shared by CUDA IPC",
                           buf_->size() / 1048576.0, device_);
  }

 private:
  CudaStaging(std::unique_ptr<DeviceBuffer> buf, RegisteredRegion region, int device)
      : Staging(std::move(region)), buf_(std::move(buf)), device_(device) {}
  std::unique_ptr<DeviceBuffer> buf_;
  int device_;
};

uint64_t AlignUp(uint64_t n, uint64_t to) { return (n + to - 1) / to * to; }

// Offsets of the staged tensors: one prefill chunk's q, k, v, o, then the decode batch's q, k, v
// and o, each tensor's rows back to back (entry b's at the first one's offset + b * its size), as
// a version 2 ring frame names a batch's tensor with one reference.
struct RegionLayout {
  uint64_t pq = 0, pk = 0, pv = 0, po = 0;
  std::vector<uint64_t> dq, dk, dv, dout;
  uint64_t total = 0;

  static RegionLayout For(int64_t chunk, int32_t batch, int64_t hq, int64_t hkv, int64_t d,
                          int64_t es, bool pre_rotary) {
    RegionLayout l;
    uint64_t at = 0;
    auto take = [&](uint64_t bytes) {
      const uint64_t off = at;
      at = AlignUp(at + bytes, 256);
      return off;
    };
    l.pq = take(chunk * (pre_rotary ? 1 : 5) * hq * d * es);
    l.pk = take(chunk * hkv * d * es);
    l.pv = take(chunk * hkv * d * es);
    l.po = take(chunk * hq * d * es);
    const uint64_t q_row = (pre_rotary ? 1 : 3) * hq * d * es, kv_row = hkv * d * es,
                   o_row = hq * d * es;
    const uint64_t q0 = take(batch * q_row), k0 = take(batch * kv_row), v0 = take(batch * kv_row),
                   o0 = take(batch * o_row);
    for (int32_t b = 0; b < batch; ++b) {
      l.dq.push_back(q0 + b * q_row);
      l.dk.push_back(k0 + b * kv_row);
      l.dv.push_back(v0 + b * kv_row);
      l.dout.push_back(o0 + b * o_row);
    }
    l.total = AlignUp(std::max<uint64_t>(at, 1), 4096);
    return l;
  }
};

enum class Carrier { kUnary, kSession, kRing };

// One transport: how requests travel (carrier) and where their tensors are (bytes or staging).
class Transport {
 public:
  Transport(AttndClient& client, Carrier carrier, std::unique_ptr<Staging> staging,
            RegionLayout layout, int64_t hq, int64_t d)
      : client_(client),
        carrier_(carrier),
        staging_(std::move(staging)),
        layout_(layout),
        hq_(hq),
        d_(d) {}

  absl::Status Open(const RingOptions& ring_options) {
    if (carrier_ == Carrier::kSession) {
      absl::StatusOr<std::unique_ptr<Session>> s = client_.OpenSession();
      if (!s.ok()) return s.status();
      session_ = std::move(*s);
    } else if (carrier_ == Carrier::kRing) {
      absl::StatusOr<std::unique_ptr<RingClient>> r = RingClient::Open(client_, ring_options);
      if (!r.ok()) return r.status();
      ring_ = std::move(*r);
      ring_slots_ = static_cast<int32_t>(ring_options.slots);
      device_ordered_ = ring_options.device_events;
      cuda_device_ = ring_options.cuda_device;
    }
    return absl::OkStatus();
  }

  // The end of a decode step: a device-ordered ring answers once attnd has queued the work, so the
  // step is over when the stream has run it (timed: the step's figure includes the device's work).
  absl::Status Settle() {
    if (!device_ordered_) return absl::OkStatus();
    return RingEvents::Synchronize(nullptr, cuda_device_);
  }

  bool staged() const { return staging_ != nullptr; }
  Staging* staging() const { return staging_.get(); }

  // Untimed: the request's tensors (into the region when they changed) and the request itself.
  absl::StatusOr<PrefillInput> PrefillArgs(const Inputs::Prefill& in, int64_t t) {
    PrefillInput p;
    if (!staged()) {
      p.q = in.q;
      p.k = in.k;
      p.v = in.v;
      return p;
    }
    if (staged_prefill_ != &in) {
      for (auto [off, tensor] : {std::pair<uint64_t, const HostTensor*>{layout_.pq, &in.q},
                                 {layout_.pk, &in.k},
                                 {layout_.pv, &in.v}}) {
        absl::Status s = staging_->Write(off, tensor->data);
        if (!s.ok()) return s;
      }
      staged_prefill_ = &in;
    }
    const std::string& id = staging_->region_id();
    p.q = TensorRef::In(id, layout_.pq, in.q.dtype, in.q.shape);
    p.k = TensorRef::In(id, layout_.pk, in.k.dtype, in.k.shape);
    p.v = TensorRef::In(id, layout_.pv, in.v.dtype, in.v.shape);
    v1::RegionRef o;
    o.set_region_id(id);
    o.set_offset(layout_.po);
    o.set_byte_size(static_cast<uint64_t>(t * hq_ * d_) * ElementSize(in.q.dtype));
    p.output_region = o;
    return p;
  }

  // Untimed: decode entries for `ids`; with staging, references to each entry's slot.
  absl::StatusOr<std::vector<DecodeInput>> DecodeArgs(Inputs& inputs,
                                                      const std::vector<std::string>& ids) {
    std::vector<DecodeInput> entries;
    for (size_t b = 0; b < ids.size(); ++b) {
      DecodeInput e = inputs.ForDecode(ids[b]);
      if (staged()) {
        if (!decode_staged_) {
          for (auto [off, tensor] : {std::pair<uint64_t, const HostTensor*>{layout_.dq[b], &e.q},
                                     {layout_.dk[b], &e.k},
                                     {layout_.dv[b], &e.v}}) {
            absl::Status s = staging_->Write(off, tensor->data);
            if (!s.ok()) return s;
          }
        }
        const std::string& id = staging_->region_id();
        e.q_ref = TensorRef::In(id, layout_.dq[b], e.q.dtype, e.q.shape);
        e.k_ref = TensorRef::In(id, layout_.dk[b], e.k.dtype, e.k.shape);
        e.v_ref = TensorRef::In(id, layout_.dv[b], e.v.dtype, e.v.shape);
        v1::RegionRef o;
        o.set_region_id(id);
        o.set_offset(layout_.dout[b]);
        o.set_byte_size(static_cast<uint64_t>(hq_ * d_) * ElementSize(e.q.dtype));
        e.output_region = o;
        e.q = HostTensor();
        e.k = HostTensor();
        e.v = HostTensor();
      }
      entries.push_back(std::move(e));
    }
    decode_staged_ = decode_staged_ || staged();
    return entries;
  }

  absl::StatusOr<PrefillResult> Prefill(const PrefillInput& in) {
    switch (carrier_) {
      case Carrier::kUnary:
        return client_.Prefill(in);
      case Carrier::kSession:
        return session_->Prefill(in);
      case Carrier::kRing:
        return ring_->Prefill(in);
    }
    return absl::InternalError("unknown carrier");
  }
  absl::StatusOr<std::vector<DecodeResult>> Decode(int32_t layer,
                                                   const std::vector<DecodeInput>& entries) {
    switch (carrier_) {
      case Carrier::kUnary:
        return client_.Decode(layer, entries);
      case Carrier::kSession:
        return session_->Decode(layer, entries);
      case Carrier::kRing:
        if (ring_slots_ > 1 && entries.size() > 1) return MicroBatchDecode(layer, entries);
        return ring_->Decode(layer, entries);
    }
    return absl::InternalError("unknown carrier");
  }

  // The batch as up to ring_slots_ micro-batches of consecutive entries (their region
  // references stay back to back), posted together before the first is collected.
  absl::StatusOr<std::vector<DecodeResult>> MicroBatchDecode(
      int32_t layer, const std::vector<DecodeInput>& entries) {
    const size_t parts = std::min<size_t>(static_cast<size_t>(ring_slots_), entries.size());
    std::vector<std::vector<DecodeInput>> micro(parts);
    size_t begin = 0;
    for (size_t p = 0; p < parts; ++p) {
      const size_t end = begin + (entries.size() - begin) / (parts - p);
      micro[p].assign(entries.begin() + static_cast<std::ptrdiff_t>(begin),
                      entries.begin() + static_cast<std::ptrdiff_t>(end));
      begin = end;
    }
    if (absl::Status s = ring_->SubmitDecodes(layer, micro); !s.ok()) return s;
    std::vector<DecodeResult> results;
    results.reserve(entries.size());
    absl::Status first = absl::OkStatus();
    for (size_t p = 0; p < parts; ++p) {
      absl::StatusOr<std::vector<DecodeResult>> part = ring_->AwaitDecode();
      if (!part.ok()) {
        first.Update(part.status());
        continue;
      }
      for (DecodeResult& r : *part) results.push_back(std::move(r));
    }
    if (!first.ok()) return first;
    return results;
  }

  // An output's bytes: from the region it went to, or from the reply.
  absl::StatusOr<std::string> OutputBytes(const HostTensor& o,
                                          const std::optional<v1::RegionRef>& where) {
    if (!where.has_value()) return o.data;
    if (!staged() || where->region_id() != staging_->region_id()) {
      return absl::InternalError("an output went to a region this bench did not name");
    }
    return staging_->Read(where->offset(), where->byte_size());
  }

  const RingStats* ring_stats() const { return ring_ ? &ring_->stats() : nullptr; }

 private:
  AttndClient& client_;
  Carrier carrier_;
  std::unique_ptr<Staging> staging_;
  RegionLayout layout_;
  int64_t hq_, d_;
  std::unique_ptr<Session> session_;
  std::unique_ptr<RingClient> ring_;
  bool device_ordered_ = false;
  int32_t ring_slots_ = 1;
  int cuda_device_ = 0;
  const Inputs::Prefill* staged_prefill_ = nullptr;
  bool decode_staged_ = false;
};

std::string LocalBootId() {
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::string id;
  std::getline(in, id);
  return std::string(absl::StripAsciiWhitespace(id));
}

bool Accepts(const v1::GetServerInfoResponse& info, v1::RegionKind kind) {
  for (int k : info.regions().kinds()) {
    if (k == kind) return true;
  }
  return false;
}

// Builds `name`'s transport, or says why it cannot run here (`skip`) or failed (error status).
absl::StatusOr<std::unique_ptr<Transport>> MakeTransport(
    AttndClient& client, const v1::GetServerInfoResponse& info, const BenchOptions& options,
    const std::string& name, const RegionLayout& layout, uint64_t ring_half_bytes,
    std::string* description, std::string* skip) {
  const v1::ModelInfo& m = info.model();
  std::unique_ptr<Staging> staging;
  Carrier carrier = Carrier::kUnary;
  // ring-cuda-ipc is the ring carrying references to device buffers: what a serving stack on the
  // same GPU sends, its q/k/v already there.
  const bool cuda = name == "cuda-ipc" || name == "ring-cuda-ipc";
  const bool ring = name == "ring" || name == "ring-cuda-ipc";
  const bool regions = name == "shm" || cuda || (name == "ring" && options.ring_regions);
  int cuda_device = 0;
  if (name == "session") carrier = Carrier::kSession;
  if (ring) carrier = Carrier::kRing;
  if (cuda && !ClientBuiltWithCuda()) {  // this binary cannot: a skip, as below
    *skip =
        absl::StrCat("attnctl was built without CUDA: ", name, " needs a CUDA build of attnctl");
    return nullptr;
  }
  if (regions || ring) {
    if (info.regions().host_boot_id().empty() && info.regions().kinds_size() == 0) {
      *skip = "the server offers no tensor regions";
      return nullptr;
    }
    if (info.regions().host_boot_id() != LocalBootId()) {
      *skip = "the server is on another host (boot ids differ): shared memory cannot work";
      return nullptr;
    }
  }
  if (ring && !info.regions().rings()) {
    *skip = "the server does not serve rings";
    return nullptr;
  }
  if (cuda) {
    if (!Accepts(info, v1::REGION_KIND_CUDA_IPC)) {
      *skip = absl::StrCat("the server (backend ", info.backend(), ") accepts no CUDA IPC regions");
      return nullptr;
    }
    int& device = cuda_device;
    device = options.cuda_device;
    if (device < 0) {
      device = 0;
      for (int i = 0; i < 64; ++i) {
        absl::StatusOr<std::string> uuid = DeviceBuffer::DeviceUuid(i);
        if (!uuid.ok()) break;
        if (*uuid == info.regions().device_uuid()) {
          device = i;
          break;
        }
      }
    }
    absl::StatusOr<std::unique_ptr<Staging>> s = CudaStaging::Create(client, layout.total, device);
    if (!s.ok()) return s.status();
    staging = std::move(*s);
  } else if (regions) {
    if (!Accepts(info, v1::REGION_KIND_SYSTEM_SHM)) {
      *skip = "the server accepts no system shm regions";
      return nullptr;
    }
    absl::StatusOr<std::unique_ptr<Staging>> s = ShmStaging::Create(client, layout.total);
    if (!s.ok()) return s.status();
    staging = std::move(*s);
  }
  if (name == "grpc") *description = "unary RPCs, tensor bytes in the messages";
  if (name == "session") *description = "one Session stream, tensor bytes in the messages";
  if (ring) {
    *description = absl::StrCat(
        "a shared-memory ring (version ", options.ring_version,
        options.ring_version == 1 ? " protobuf" : " frames", ", ", ring_half_bytes >> 10,
        " KiB halves, client spin ", options.ring_spin_us, " us",
        options.ring_device_events && cuda ? ", device-ordered: a step ends when the device ran it"
                                           : "",
        options.ring_slots > 1 ? absl::StrCat(", ", options.ring_slots,
                                              " slots: each batch as that many micro-batches "
                                              "in flight")
                               : std::string(),
        "), ",
        regions ? "q/k/v and o in " + staging->Describe() : std::string("tensor bytes inline"));
  } else if (regions) {
    *description = absl::StrCat("unary RPCs, q/k/v and o in ", staging->Describe());
  }
  auto t = std::make_unique<Transport>(client, carrier, std::move(staging), layout, m.num_q_heads(),
                                       m.head_dim());
  RingOptions ring_options;
  ring_options.half_bytes = ring_half_bytes;
  ring_options.spin = absl::Microseconds(options.ring_spin_us);
  ring_options.version = static_cast<uint32_t>(options.ring_version);
  ring_options.device_events = options.ring_device_events && name == "ring-cuda-ipc";
  ring_options.cuda_device = cuda_device;
  ring_options.slots = static_cast<uint32_t>(options.ring_slots);
  absl::Status s = t->Open(ring_options);
  if (!s.ok()) return s;
  return t;
}

// Once per region transport: a short prefill and a decode through it must write the same bytes
// into the region as plain gRPC returns for the same inputs.
absl::Status VerifyAgainstGrpc(AttndClient& client, Transport& transport, Inputs& inputs,
                               int64_t chunk, v1::QLayout q_layout) {
  const int64_t t = std::min<int64_t>(chunk, 16);
  std::vector<std::string> ids;
  auto release = [&] {
    for (const std::string& id : ids) client.Release(id).IgnoreError();
  };
  absl::Status result = [&]() -> absl::Status {
    for (int i = 0; i < 2; ++i) {
      absl::StatusOr<std::string> id = client.CreateSequence();
      if (!id.ok()) return id.status();
      ids.push_back(*id);
    }
    const Inputs::Prefill& in = inputs.ForPrefill(t);
    absl::StatusOr<PrefillResult> want = client.Prefill(ids[0], 0, in.q, in.k, in.v, t, q_layout);
    if (!want.ok()) return want.status();
    absl::StatusOr<PrefillInput> args = transport.PrefillArgs(in, t);
    if (!args.ok()) return args.status();
    args->sequence_id = ids[1];
    args->layer = 0;
    args->prompt_len = t;
    args->q_layout = q_layout;
    absl::StatusOr<PrefillResult> got = transport.Prefill(*args);
    if (!got.ok()) return got.status();
    absl::StatusOr<std::string> got_bytes = transport.OutputBytes(got->o, got->o_region);
    if (!got_bytes.ok()) return got_bytes.status();
    if (*got_bytes != want->o.data) {
      return absl::InternalError("the prefill output in the region differs from gRPC's bytes");
    }
    absl::StatusOr<std::vector<DecodeResult>> want_d = client.Decode(0, {inputs.ForDecode(ids[0])});
    if (!want_d.ok()) return want_d.status();
    absl::StatusOr<std::vector<DecodeInput>> entries = transport.DecodeArgs(inputs, {ids[1]});
    if (!entries.ok()) return entries.status();
    absl::StatusOr<std::vector<DecodeResult>> got_d = transport.Decode(0, *entries);
    if (!got_d.ok()) return got_d.status();
    absl::StatusOr<std::string> got_d_bytes =
        transport.OutputBytes((*got_d)[0].o, (*got_d)[0].o_region);
    if (!got_d_bytes.ok()) return got_d_bytes.status();
    if (*got_d_bytes != (*want_d)[0].o.data) {
      return absl::InternalError("the decode output in the region differs from gRPC's bytes");
    }
    return absl::OkStatus();
  }();
  release();
  return result;
}

// One transport's pass over every context: prefill each sequence chunk by chunk through the layers,
// then decode steps; prints the table. Only the requests are timed (staging inputs is not).
int RunTransport(AttndClient& client, Transport& transport, const v1::GetServerInfoResponse& info0,
                 const BenchOptions& options, int32_t layers, int64_t chunk, Inputs& inputs,
                 std::ostream& out, std::ostream& err) {
  const v1::GetServerInfoResponse* info = &info0;
  std::vector<Row> rows;
  std::vector<std::string> occupancy;  // per device shard, for each context
  std::vector<std::string> live;       // created and not yet released
  auto release_all = [&]() -> bool {
    bool ok = true;
    for (const std::string& id : live) {
      absl::StatusOr<int64_t> freed = client.Release(id);
      if (!freed.ok()) {
        err << "\nattnctl bench: ReleaseSequence " << id << ": " << freed.status() << "\n";
        ok = false;
      }
    }
    live.clear();
    return ok;
  };
  auto progress = [&](const std::string& line) {
    if (!options.progress) return;
    err << "\r" << absl::StrFormat("%-78s", line.substr(0, 78)) << std::flush;
  };
  int rc = 0;

  for (int64_t context : options.contexts) {
    Row row;
    row.context = context;
    const int64_t length = context + options.decode_steps;
    const int64_t page = std::max(1, info->kv_cache().page_size());
    absl::StatusOr<v1::GetServerInfoResponse> now = client.Info();
    const int64_t pages_free = now.ok() ? now->kv_cache().pages_free() : 0;
    const int64_t pages_needed = options.batch * ((length + page - 1) / page);
    if (context < 1) {
      row.skipped = "context must be >= 1";
    } else if (info->limits().max_sequence_length() > 0 &&
               length > info->limits().max_sequence_length()) {
      row.skipped = absl::StrCat("context + decode steps > max sequence length ",
                                 info->limits().max_sequence_length());
    } else if (pages_needed > pages_free) {
      // Say what the pages are for and the two ways out: a long --decode-steps run at a large
      // --batch needs its whole length in pages from the start.
      row.skipped =
          absl::StrCat("needs ", pages_needed, " KV pages (", options.batch, " sequences of ",
                       context, " + ", options.decode_steps, " decode steps), ", pages_free,
                       " free: fewer --decode-steps or --batch, or a larger attnd "
                       "--kv-cache-bytes");
    }
    if (!row.skipped.empty()) {
      rows.push_back(row);
      continue;
    }

    std::string failure;
    for (int32_t b = 0; b < options.batch && failure.empty(); ++b) {
      absl::StatusOr<std::string> id = client.CreateSequence();
      if (!id.ok()) {
        failure = absl::StrCat("CreateSequence: ", id.status().ToString());
      } else {
        live.push_back(*id);
      }
    }
    // Prefill: every sequence, chunk by chunk, each chunk through all layers (as a model runs).
    double prefill_ms = 0;
    int64_t prefill_calls = 0;
    for (size_t s = 0; s < live.size() && failure.empty(); ++s) {
      for (int64_t start = 0; start < context && failure.empty(); start += chunk) {
        const int64_t t = std::min(chunk, context - start);
        const Inputs::Prefill& in = inputs.ForPrefill(t);
        for (int32_t layer = 0; layer < layers && failure.empty(); ++layer) {
          progress(absl::StrFormat("[context %d] prefill seq %d/%d: %d/%d tokens, layer %d",
                                   context, s + 1, live.size(), start + t, context, layer));
          absl::StatusOr<PrefillInput> args = transport.PrefillArgs(in, t);
          if (!args.ok()) {
            failure = absl::StrCat("staging: ", args.status().ToString());
            break;
          }
          PrefillInput& pargs = *args;
          pargs.sequence_id = live[s];
          pargs.layer = layer;
          pargs.prompt_len = context;
          pargs.q_layout = options.q_layout;
          const Clock::time_point t0 = Clock::now();
          absl::StatusOr<PrefillResult> r = transport.Prefill(pargs);
          prefill_ms += Ms(Clock::now() - t0);
          ++prefill_calls;
          if (!r.ok()) failure = absl::StrCat("Prefill: ", r.status().ToString());
        }
      }
    }
    // Decode: one step = one batched call per layer.
    std::vector<double> step_ms;
    std::vector<double> layer_us;
    for (int64_t step = 0; step < options.decode_steps && failure.empty(); ++step) {
      progress(absl::StrFormat("[context %d] decode step %d/%d", context, step + 1,
                               options.decode_steps));
      absl::StatusOr<std::vector<DecodeInput>> entries = transport.DecodeArgs(inputs, live);
      if (!entries.ok()) {
        failure = absl::StrCat("staging: ", entries.status().ToString());
        break;
      }
      const Clock::time_point t0 = Clock::now();
      for (int32_t layer = 0; layer < layers && failure.empty(); ++layer) {
        const Clock::time_point l0 = Clock::now();
        absl::StatusOr<std::vector<DecodeResult>> r = transport.Decode(layer, *entries);
        layer_us.push_back(Ms(Clock::now() - l0) * 1000);
        if (!r.ok()) failure = absl::StrCat("Decode: ", r.status().ToString());
      }
      if (absl::Status s = transport.Settle(); !s.ok() && failure.empty()) {
        failure = absl::StrCat("waiting for the step on the device: ", s.ToString());
      }
      step_ms.push_back(Ms(Clock::now() - t0));
    }
    progress("");
    if (options.progress) err << "\r";
    // Where the sequences' pages live, before they are released (one line per device shard).
    if (failure.empty()) {
      if (absl::StatusOr<v1::GetServerInfoResponse> held = client.Info(); held.ok()) {
        for (int i = 0; i < held->devices_size(); ++i) {
          const v1::DeviceShard& d = held->devices(i);
          occupancy.push_back(absl::StrFormat(
              "# context %d, before release: shard %d %s: %d of %d KV bytes in use (%.1f%%)\n",
              context, i, d.device(), d.bytes_used(), d.pool_bytes(),
              d.pool_bytes() > 0 ? 100.0 * d.bytes_used() / d.pool_bytes() : 0));
        }
      }
    }
    const bool released = release_all();
    if (!failure.empty()) {
      err << "attnctl bench: context " << context << ": " << failure << "\n";
      row.skipped = "failed: " + failure;
      rows.push_back(row);
      rc = 2;
      break;
    }
    if (!released) rc = 2;
    row.prefill_tokens_per_s = prefill_ms > 0 ? context * options.batch / (prefill_ms / 1000.0) : 0;
    row.prefill_ms_per_call = prefill_calls > 0 ? prefill_ms / prefill_calls : 0;
    double decode_total = 0;
    for (double ms : step_ms) decode_total += ms;
    row.decode_steps_per_s = decode_total > 0 ? step_ms.size() / (decode_total / 1000.0) : 0;
    row.decode_p50_ms = Percentile(step_ms, 0.50);
    row.decode_p99_ms = Percentile(step_ms, 0.99);
    row.decode_layer_p50_us = Percentile(layer_us, 0.50);
    row.decode_layer_p99_us = Percentile(layer_us, 0.99);
    rows.push_back(row);
  }
  release_all();

  // Prefill tokens/s counts prompt tokens through all `layers` layers; a decode step is one
  // token for each of the batch's sequences through all `layers` layers.
  out << absl::StrFormat("%9s  %15s  %15s  %14s  %18s  %18s  %19s  %19s\n", "context",
                         "prefill tok/s", "prefill ms/call", "decode steps/s", "decode ms/step p50",
                         "decode ms/step p99", "decode us/layer p50", "decode us/layer p99");
  for (const Row& r : rows) {
    if (!r.skipped.empty()) {
      out << absl::StrFormat("%9d  skipped: %s\n", r.context, r.skipped);
      continue;
    }
    out << absl::StrFormat("%9d  %15.1f  %15.2f  %14.2f  %18.2f  %18.2f  %19.1f  %19.1f\n",
                           r.context, r.prefill_tokens_per_s, r.prefill_ms_per_call,
                           r.decode_steps_per_s, r.decode_p50_ms, r.decode_p99_ms,
                           r.decode_layer_p50_us, r.decode_layer_p99_us);
  }
  for (const std::string& line : occupancy) out << line;
  return rc;
}

}  // namespace

bool IsBenchTransport(const std::string& name) {
  return name == "grpc" || name == "session" || name == "shm" || name == "ring" ||
         name == "cuda-ipc" || name == "ring-cuda-ipc";
}

int RunBench(AttndClient& client, const BenchOptions& options, std::ostream& out,
             std::ostream& err) {
  absl::StatusOr<v1::GetServerInfoResponse> info = client.Info();
  if (!info.ok()) {
    err << "attnctl bench: GetServerInfo: " << info.status() << "\n";
    return 2;
  }
  const v1::ModelInfo& m = info->model();
  const int32_t layers = options.layers == 0 ? m.num_layers() : options.layers;
  if (layers < 1 || layers > m.num_layers()) {
    err << "attnctl bench: --layers " << options.layers << " is not in [1, " << m.num_layers()
        << "] (0 = all)\n";
    return 2;
  }
  if (options.batch < 1 || options.prefill_chunk < 1 || options.decode_steps < 0 ||
      options.contexts.empty() || options.transports.empty() || options.ring_spin_us < 0 ||
      (options.ring_version != 1 && options.ring_version != 2)) {
    err << "attnctl bench: --batch and --prefill-chunk must be >= 1, --decode-steps and "
           "--ring-spin-us >= 0, --ring-version 1 or 2, and --context and --transport must list "
           "at least one value\n";
    return 2;
  }
  for (const std::string& t : options.transports) {
    if (!IsBenchTransport(t)) {
      err << "attnctl bench: --transport \"" << t
          << "\" is not one of grpc, session, shm, ring, cuda-ipc, ring-cuda-ipc\n";
      return 2;
    }
  }
  const int64_t es = static_cast<int64_t>(ElementSize(options.dtype));
  const int64_t per_token =
      (int64_t{5} * m.num_q_heads() + 2 * m.num_kv_heads()) * m.head_dim() * es;
  const int64_t limit =
      std::min(info->limits().max_message_bytes(), client.options().max_message_bytes);
  const int64_t chunk_cap = std::max<int64_t>(1, (limit - (64 << 10)) * 9 / 10 / per_token);
  const int64_t chunk = std::min(options.prefill_chunk, chunk_cap);
  if (chunk < options.prefill_chunk) {
    err << "NOTE: --prefill-chunk " << options.prefill_chunk << " exceeds the message limit ("
        << limit << " bytes); using " << chunk << "\n";
  }
  out << "bench: " << m.name() << " on " << info->backend() << " (" << info->device() << "), "
      << layers << " of " << m.num_layers() << " layers, " << DTypeName(options.dtype) << ", batch "
      << options.batch << ", prefill chunk " << chunk << ", " << options.decode_steps
      << " decode steps\n";

  Inputs inputs(options.dtype, m.num_q_heads(), m.num_kv_heads(), m.head_dim(), options.seed,
                options.q_layout);
  const RegionLayout layout =
      RegionLayout::For(chunk, options.batch, m.num_q_heads(), m.num_kv_heads(), m.head_dim(), es,
                        inputs.pre_rotary());
  // A ring with inline bytes holds a whole prefill chunk (and its output, and a decode batch).
  const uint64_t ring_half_bytes =
      AlignUp(static_cast<uint64_t>(std::max<int64_t>(chunk, options.batch) *
                                    (per_token + int64_t{m.num_q_heads()} * m.head_dim() * es)) +
                  (256 << 10),
              4096);
  int rc = 0;
  for (const std::string& name : options.transports) {
    std::string description, skip;
    absl::StatusOr<std::unique_ptr<Transport>> transport =
        MakeTransport(client, *info, options, name, layout, ring_half_bytes, &description, &skip);
    out << "\ntransport: " << name;
    if (!transport.ok()) {
      out << ": failed: " << transport.status().message() << "\n";
      err << "attnctl bench: --transport " << name << ": " << transport.status() << "\n";
      rc = 2;
      continue;
    }
    if (*transport == nullptr) {
      out << ": skipped: " << skip << "\n";
      continue;
    }
    std::string verified;
    if ((*transport)->staged()) {
      absl::Status v = VerifyAgainstGrpc(client, **transport, inputs, chunk, options.q_layout);
      if (!v.ok()) {
        out << ": failed: " << v.message() << "\n";
        err << "attnctl bench: --transport " << name << ": verification: " << v << "\n";
        rc = 2;
        continue;
      }
      verified = "; outputs verified once against gRPC's bytes";
    }
    out << " (" << description << verified << ")\n";
    const int r =
        RunTransport(client, **transport, *info, options, layers, chunk, inputs, out, err);
    if (r != 0) rc = r;
  }
  return rc;
}

}  // namespace client
}  // namespace attnd
