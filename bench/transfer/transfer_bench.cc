// The gRPC bytes path of large Prefill calls against a running attnd (issue #15, item 2), with the
// model geometry the server reports (GetServerInfo). Two measurements per token count and layout:
//
//   upload   the request is fully received and parsed by attnd, queued to a worker and rejected
//            there (layer = num_layers: INVALID_ARGUMENT) before any compute. The time is the wire
//            plus the server's parse; MB/s counts the request's bytes.
//   prefill  a real one-layer Prefill on a fresh sequence (created and released untimed): wire up,
//            compute, wire down. MB/s counts request + reply bytes.
//
// --client=raw sends a request serialized once before the loop (raw ByteBuffer method, ByteBuffer
// in and out): only the transport and the server are timed. --client=proto builds the
// v1::PrefillRequest from the tensors' bytes on every call and parses the reply (what the C++
// client library does), so the client's own copies are timed too.
//
// Channel options for the client side are flags (0 / -1 = gRPC's default); the server's are attnd's
// own flags. Prints one line per case: p50 and min over --repeat calls after --warmup.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/notification.h"
#include "attnd/v1/attention.grpc.pb.h"
#include "client/attnd_client.h"
#include "client/host_tensor.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/impl/client_unary_call.h"
#include "grpcpp/impl/rpc_method.h"

ABSL_FLAG(std::string, target, "127.0.0.1:50051", "attnd address");
ABSL_FLAG(std::string, tokens, "4096", "comma-separated token counts per Prefill call");
ABSL_FLAG(std::string, layouts, "variants,pre_rotary",
          "q layouts: variants (q [T,5,Hq,D]) and/or pre_rotary (q [T,Hq,D])");
ABSL_FLAG(std::string, modes, "upload,prefill", "upload and/or prefill (see the file comment)");
ABSL_FLAG(
    std::string, client, "raw",
    "raw (pre-serialized ByteBuffer), proto (per-call build), lib or lib_proto (AttndClient)");
ABSL_FLAG(std::string, dtype, "bf16", "bf16 or fp32 request tensors");
ABSL_FLAG(int32_t, repeat, 10, "timed calls per case");
ABSL_FLAG(int32_t, warmup, 2, "untimed calls per case first");
ABSL_FLAG(std::string, label, "", "printed in every result line");
ABSL_FLAG(int32_t, lookahead_bytes, 0,
          "client GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES (initial stream window); 0 = default");
ABSL_FLAG(int32_t, bdp_probe, -1, "client GRPC_ARG_HTTP2_BDP_PROBE 0/1; -1 = default");
ABSL_FLAG(int32_t, max_frame_size, 0, "client GRPC_ARG_HTTP2_MAX_FRAME_SIZE; 0 = default");
ABSL_FLAG(int32_t, write_buffer_size, 0, "client GRPC_ARG_HTTP2_WRITE_BUFFER_SIZE; 0 = default");
ABSL_FLAG(int32_t, read_chunk_size, 0, "client GRPC_ARG_TCP_READ_CHUNK_SIZE; 0 = default");

namespace {

namespace v1 = attnd::v1;
using Clock = std::chrono::steady_clock;

struct Geometry {
  int32_t layers = 0, hq = 0, hkv = 0, d = 0;
};

std::shared_ptr<grpc::Channel> Connect() {
  grpc::ChannelArguments args;
  args.SetMaxSendMessageSize(INT32_MAX);
  args.SetMaxReceiveMessageSize(INT32_MAX);
  if (int v = absl::GetFlag(FLAGS_lookahead_bytes); v > 0)
    args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, v);
  if (int v = absl::GetFlag(FLAGS_bdp_probe); v >= 0) args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, v);
  if (int v = absl::GetFlag(FLAGS_max_frame_size); v > 0)
    args.SetInt(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, v);
  if (int v = absl::GetFlag(FLAGS_write_buffer_size); v > 0)
    args.SetInt(GRPC_ARG_HTTP2_WRITE_BUFFER_SIZE, v);
  if (int v = absl::GetFlag(FLAGS_read_chunk_size); v > 0)
    args.SetInt(GRPC_ARG_TCP_READ_CHUNK_SIZE, v);
  return grpc::CreateCustomChannel(absl::GetFlag(FLAGS_target), grpc::InsecureChannelCredentials(),
                                   args);
}

// Bytes of n elements: small finite values (bf16 or fp32), so a real prefill computes on numbers.
std::string Payload(int64_t n, bool bf16) {
  std::string out(static_cast<size_t>(n * (bf16 ? 2 : 4)), '\0');
  for (int64_t i = 0; i < n; ++i) {
    const float x = 0.01f * static_cast<float>(i % 13) - 0.06f;
    uint32_t bits;
    std::memcpy(&bits, &x, 4);
    if (bf16) {
      const uint16_t h = static_cast<uint16_t>(bits >> 16);
      std::memcpy(&out[i * 2], &h, 2);
    } else {
      std::memcpy(&out[i * 4], &bits, 4);
    }
  }
  return out;
}

void SetTensor(v1::DType dtype, std::vector<int64_t> shape, const std::string& data,
               v1::Tensor* t) {
  t->set_dtype(dtype);
  t->mutable_shape()->Assign(shape.begin(), shape.end());
  t->set_data(data);
}

struct Case {
  std::string q, k, v;                   // bytes
  attnd::client::HostTensor hq, hk, hv;  // the same, for --client=lib
  std::vector<int64_t> q_shape, kv_shape;
  v1::DType dtype = v1::DTYPE_BF16;
  v1::QLayout layout = v1::Q_LAYOUT_VARIANTS;
  int64_t tokens = 0;
};

v1::PrefillRequest Build(const Case& c, const std::string& seq, int32_t layer) {
  v1::PrefillRequest r;
  r.set_sequence_id(seq);
  r.set_layer(layer);
  SetTensor(c.dtype, c.q_shape, c.q, r.mutable_q());
  SetTensor(c.dtype, c.kv_shape, c.k, r.mutable_k());
  SetTensor(c.dtype, c.kv_shape, c.v, r.mutable_v());
  if (c.layout != v1::Q_LAYOUT_VARIANTS) r.set_q_layout(c.layout);
  return r;
}

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

class Bench {
 public:
  explicit Bench(std::shared_ptr<grpc::Channel> channel)
      : channel_(channel),
        stub_(v1::Attention::NewStub(channel)),
        prefill_method_("/attnd.v1.Attention/Prefill", grpc::internal::RpcMethod::NORMAL_RPC,
                        channel) {}

  bool Info(Geometry* g) {
    grpc::ClientContext ctx;
    v1::GetServerInfoResponse info;
    grpc::Status s = stub_->GetServerInfo(&ctx, v1::GetServerInfoRequest(), &info);
    if (!s.ok()) {
      std::fprintf(stderr, "GetServerInfo: %s\n", s.error_message().c_str());
      return false;
    }
    g->layers = info.model().num_layers();
    g->hq = info.model().num_q_heads();
    g->hkv = info.model().num_kv_heads();
    g->d = info.model().head_dim();
    return true;
  }

  std::string Create() {
    grpc::ClientContext ctx;
    v1::CreateSequenceResponse r;
    grpc::Status s = stub_->CreateSequence(&ctx, v1::CreateSequenceRequest(), &r);
    if (!s.ok()) std::fprintf(stderr, "CreateSequence: %s\n", s.error_message().c_str());
    return r.sequence_id();
  }

  void Release(const std::string& seq) {
    grpc::ClientContext ctx;
    v1::ReleaseSequenceRequest req;
    req.set_sequence_id(seq);
    v1::ReleaseSequenceResponse r;
    stub_->ReleaseSequence(&ctx, req, &r).ok();
  }

  // One Prefill call; *reply_bytes = the reply's size. Returns the status.
  grpc::Status Call(const Case& c, const std::string& seq, int32_t layer, bool raw,
                    const grpc::ByteBuffer* prebuilt, int64_t* reply_bytes) {
    if (lib_ != nullptr) {
      absl::StatusOr<attnd::client::PrefillResult> r =
          lib_->Prefill(seq, layer, c.hq, c.hk, c.hv, std::nullopt, c.layout);
      *reply_bytes = r.ok() ? static_cast<int64_t>(r->o.data.size()) : 0;
      return r.ok() ? grpc::Status::OK
                    : grpc::Status(static_cast<grpc::StatusCode>(r.status().code()),
                                   std::string(r.status().message()));
    }
    grpc::ClientContext ctx;
    if (raw) {
      grpc::ByteBuffer reply;
      grpc::Status status = grpc::internal::BlockingUnaryCall<grpc::ByteBuffer, grpc::ByteBuffer>(
          channel_.get(), prefill_method_, &ctx, *prebuilt, &reply);
      *reply_bytes = static_cast<int64_t>(reply.Length());
      return status;
    }
    v1::PrefillRequest req = Build(c, seq, layer);
    v1::PrefillResponse resp;
    grpc::Status s = stub_->Prefill(&ctx, req, &resp);
    *reply_bytes = static_cast<int64_t>(resp.ByteSizeLong());
    return s;
  }

 private:
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Attention::Stub> stub_;
  const grpc::internal::RpcMethod prefill_method_;  // raw bytes, blocking like the typed stub

 public:
  std::unique_ptr<attnd::client::AttndClient> lib_;  // --client=lib / lib_proto
};

grpc::ByteBuffer Serialize(const v1::PrefillRequest& r) {
  std::string bytes = r.SerializeAsString();
  grpc::Slice slice(std::move(bytes));
  return grpc::ByteBuffer(&slice, 1);
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  Bench bench(Connect());
  const std::string client = absl::GetFlag(FLAGS_client);
  if (absl::StartsWith(client, "lib")) {
    attnd::client::ClientOptions o;
    o.max_message_bytes = INT32_MAX;
    o.wire_prefill = client == "lib";
    if (int v = absl::GetFlag(FLAGS_lookahead_bytes); v > 0)
      o.channel_args.emplace_back(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, v);
    if (int v = absl::GetFlag(FLAGS_max_frame_size); v > 0)
      o.channel_args.emplace_back(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, v);
    absl::StatusOr<std::unique_ptr<attnd::client::AttndClient>> lib =
        attnd::client::AttndClient::Connect(absl::GetFlag(FLAGS_target), o);
    if (!lib.ok()) {
      std::fprintf(stderr, "%s\n", std::string(lib.status().message()).c_str());
      return 1;
    }
    bench.lib_ = *std::move(lib);
  }
  Geometry g;
  if (!bench.Info(&g)) return 1;
  const bool bf16 = absl::GetFlag(FLAGS_dtype) == "bf16";
  const bool raw = client == "raw";
  const int repeat = std::max(1, absl::GetFlag(FLAGS_repeat));
  const int warmup = std::max(0, absl::GetFlag(FLAGS_warmup));
  const std::string label = absl::GetFlag(FLAGS_label);
  std::printf(
      "# transfer_bench target=%s client=%s dtype=%s geometry Hq=%d Hkv=%d D=%d layers=%d%s%s\n",
      absl::GetFlag(FLAGS_target).c_str(), client.c_str(), bf16 ? "bf16" : "fp32", g.hq, g.hkv, g.d,
      g.layers, label.empty() ? "" : " label=", label.c_str());
  std::printf("%-8s %-10s %6s %9s %9s %9s %9s %9s %8s\n", "mode", "layout", "tokens", "req_MB",
              "reply_MB", "p50_ms", "min_ms", "p50_MB/s", "p50_GB/s");
  for (absl::string_view tok : absl::StrSplit(absl::GetFlag(FLAGS_tokens), ',')) {
    int64_t t = 0;
    if (!absl::SimpleAtoi(tok, &t) || t <= 0) {
      std::fprintf(stderr, "bad --tokens entry '%s'\n", std::string(tok).c_str());
      return 2;
    }
    for (absl::string_view layout : absl::StrSplit(absl::GetFlag(FLAGS_layouts), ',')) {
      Case c;
      c.tokens = t;
      c.dtype = bf16 ? v1::DTYPE_BF16 : v1::DTYPE_FP32;
      const bool pre = layout == "pre_rotary";
      c.layout = pre ? v1::Q_LAYOUT_PRE_ROTARY : v1::Q_LAYOUT_VARIANTS;
      c.q_shape = pre ? std::vector<int64_t>{t, g.hq, g.d} : std::vector<int64_t>{t, 5, g.hq, g.d};
      c.kv_shape = {t, g.hkv, g.d};
      c.q = Payload(t * (pre ? 1 : 5) * g.hq * g.d, bf16);
      c.k = Payload(t * g.hkv * g.d, bf16);
      c.v = c.k;
      if (absl::StartsWith(absl::GetFlag(FLAGS_client), "lib")) {
        const attnd::DType dt = bf16 ? attnd::DType::kBf16 : attnd::DType::kFp32;
        c.hq = attnd::client::HostTensor::FromBytes(dt, c.q_shape, c.q);
        c.hk = attnd::client::HostTensor::FromBytes(dt, c.kv_shape, c.k);
        c.hv = attnd::client::HostTensor::FromBytes(dt, c.kv_shape, c.v);
      }
      for (absl::string_view mode : absl::StrSplit(absl::GetFlag(FLAGS_modes), ',')) {
        const bool upload = mode == "upload";
        std::vector<double> ms;
        int64_t req_bytes = 0, reply_bytes = 0;
        bool failed = false;
        // upload: one sequence for the whole case, layer out of range on every call.
        const std::string upload_seq = upload ? bench.Create() : "";
        for (int i = 0; i < warmup + repeat && !failed; ++i) {
          const std::string seq = upload ? upload_seq : bench.Create();
          const int32_t layer = upload ? g.layers : 0;
          v1::PrefillRequest req = Build(c, seq, layer);
          req_bytes = static_cast<int64_t>(req.ByteSizeLong());
          grpc::ByteBuffer prebuilt;
          if (raw) prebuilt = Serialize(req);
          req.Clear();
          const Clock::time_point start = Clock::now();
          grpc::Status s = bench.Call(c, seq, layer, raw, &prebuilt, &reply_bytes);
          const double elapsed = Ms(Clock::now() - start);
          if (!upload) bench.Release(seq);
          const bool expected =
              upload ? s.error_code() == grpc::StatusCode::INVALID_ARGUMENT : s.ok();
          if (!expected) {
            std::fprintf(stderr, "%s %s %ld: unexpected status %d: %s\n", std::string(mode).c_str(),
                         std::string(layout).c_str(), static_cast<long>(t), s.error_code(),
                         s.error_message().c_str());
            failed = true;
            break;
          }
          if (i >= warmup) ms.push_back(elapsed);
        }
        if (upload) bench.Release(upload_seq);
        if (failed || ms.empty()) continue;
        std::sort(ms.begin(), ms.end());
        const double p50 = ms[ms.size() / 2];
        const double moved = static_cast<double>(req_bytes + (upload ? 0 : reply_bytes));
        std::printf("%-8s %-10s %6ld %9.1f %9.1f %9.2f %9.2f %9.0f %8.2f%s%s\n",
                    std::string(mode).c_str(), std::string(layout).c_str(), static_cast<long>(t),
                    req_bytes / 1e6, (upload ? 0 : reply_bytes) / 1e6, p50, ms.front(),
                    moved / 1e6 / (p50 / 1e3), moved / 1e9 / (p50 / 1e3), label.empty() ? "" : "  ",
                    label.c_str());
        std::fflush(stdout);
      }
    }
  }
  return 0;
}
