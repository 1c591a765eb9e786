#include "client/attnd_client.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "base/status_macros.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace attnd {
namespace client {
namespace internal {

void ToProto(const TensorArg& tensor, v1::Tensor* proto) {
  if (tensor.ref.has_value()) {
    const TensorRef& r = *tensor.ref;
    proto->set_dtype(ToProtoDType(r.dtype));
    for (int64_t d : r.shape) proto->add_shape(d);
    *proto->mutable_region() = r.region;
  } else if (tensor.host != nullptr) {
    client::ToProto(*tensor.host, proto);
  }
}

void BuildPrefill(const PrefillInput& in, v1::PrefillRequest* request) {
  request->set_sequence_id(in.sequence_id);
  request->set_layer(in.layer);
  ToProto(in.q, request->mutable_q());
  ToProto(in.k, request->mutable_k());
  ToProto(in.v, request->mutable_v());
  if (in.prompt_len.has_value()) request->set_prompt_len(*in.prompt_len);
  if (in.q_layout != v1::Q_LAYOUT_VARIANTS) request->set_q_layout(in.q_layout);
  if (in.output_region.has_value()) *request->mutable_output_region() = *in.output_region;
}

void BuildDecode(int32_t layer, const std::vector<DecodeInput>& entries,
                 v1::DecodeRequest* request) {
  request->set_layer(layer);
  for (const DecodeInput& in : entries) {
    v1::DecodeEntry* e = request->add_entries();
    e->set_sequence_id(in.sequence_id);
    ToProto(in.q_ref ? TensorArg(*in.q_ref) : TensorArg(in.q), e->mutable_q());
    ToProto(in.k_ref ? TensorArg(*in.k_ref) : TensorArg(in.k), e->mutable_k());
    ToProto(in.v_ref ? TensorArg(*in.v_ref) : TensorArg(in.v), e->mutable_v());
    if (in.q_layout != v1::Q_LAYOUT_VARIANTS) e->set_q_layout(in.q_layout);
    if (in.output_region.has_value()) *e->mutable_output_region() = *in.output_region;
  }
}

namespace {

// An output the server wrote into a region: dtype and shape, no bytes, and the reference.
absl::Status ParseRegionOutput(const v1::Tensor& proto, HostTensor* o,
                               std::optional<v1::RegionRef>* o_region) {
  if (!proto.data().empty()) {
    return absl::InternalError("server returned an output with both data and a region");
  }
  ATTND_ASSIGN_OR_RETURN(*o, MetaFromProto(proto));
  *o_region = proto.region();
  return absl::OkStatus();
}

// An output tensor: its bytes (moved out of the response), or as ParseRegionOutput.
absl::Status ParseOutput(v1::Tensor* proto, HostTensor* o, std::optional<v1::RegionRef>* o_region) {
  if (proto->has_region()) return ParseRegionOutput(*proto, o, o_region);
  ATTND_ASSIGN_OR_RETURN(*o, FromProto(std::move(*proto)));
  return absl::OkStatus();
}

// The same, copying the bytes.
absl::Status ParseOutput(const v1::Tensor& proto, HostTensor* o,
                         std::optional<v1::RegionRef>* o_region) {
  if (proto.has_region()) return ParseRegionOutput(proto, o, o_region);
  ATTND_ASSIGN_OR_RETURN(*o, FromProto(proto));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<PrefillResult> ParsePrefill(const v1::PrefillResponse& response) {
  v1::PrefillResponse copy = response;
  return ParsePrefill(&copy);
}

absl::StatusOr<PrefillResult> ParsePrefill(v1::PrefillResponse* response) {
  PrefillResult result;
  ATTND_RETURN_IF_ERROR(ParseOutput(response->mutable_o(), &result.o, &result.o_region));
  result.length = response->length();
  return result;
}

absl::StatusOr<std::vector<DecodeResult>> ParseDecode(const v1::DecodeResponse& response,
                                                      size_t num_entries) {
  // A short reply would silently misattribute outputs to sequences; treat it as a server bug.
  if (static_cast<size_t>(response.outputs_size()) != num_entries) {
    return absl::InternalError(absl::StrCat("server returned ", response.outputs_size(),
                                            " decode outputs for ", num_entries, " entries"));
  }
  std::vector<DecodeResult> results(num_entries);
  for (size_t i = 0; i < num_entries; ++i) {
    ATTND_RETURN_IF_ERROR(
        ParseOutput(response.outputs(i).o(), &results[i].o, &results[i].o_region));
    results[i].length = response.outputs(i).length();
  }
  return results;
}

}  // namespace internal

namespace {

PrefillInput MakePrefillInput(const std::string& sequence_id, int32_t layer, const HostTensor& q,
                              const HostTensor& k, const HostTensor& v,
                              std::optional<int64_t> prompt_len, v1::QLayout q_layout) {
  PrefillInput in;
  in.sequence_id = sequence_id;
  in.layer = layer;
  in.q = q;
  in.k = k;
  in.v = v;
  in.prompt_len = prompt_len;
  in.q_layout = q_layout;
  return in;
}

}  // namespace

// The whole of a PEM file, or an error naming the file and what it was for.
static absl::StatusOr<std::string> ReadPem(const std::string& path, absl::string_view what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(what, " file ", path, " cannot be read"));
  std::ostringstream text;
  text << in.rdbuf();
  if (text.str().find("-----BEGIN") == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(what, " file ", path, " holds no PEM block"));
  }
  return text.str();
}

absl::Status FromGrpc(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  // absl::StatusCode and grpc::StatusCode share the google.rpc.Code values.
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

AttndClient::AttndClient(std::shared_ptr<grpc::Channel> channel, const ClientOptions& options,
                         std::string target)
    : options_(options),
      target_(std::move(target)),
      channel_(std::move(channel)),
      stub_(v1::Attention::NewStub(channel_)),
      admin_stub_(v1::Admin::NewStub(channel_)),
      prefill_method_("/attnd.v1.Attention/Prefill", grpc::internal::RpcMethod::NORMAL_RPC,
                      channel_) {}

namespace {

int MillisOf(absl::Duration d) {
  return static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>(absl::ToInt64Milliseconds(d), 60000)));
}

// A TCP connection to host:port within `timeout`: the fd, or -errno (-EAI_* codes as
// -(1000 + code) for a name that does not resolve).
int ConnectTcp(const std::string& host, const std::string& port, absl::Duration timeout) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const int gai = getaddrinfo(host.c_str(), port.c_str(), &hints, &found);
  if (gai != 0) return -(1000 + std::abs(gai));
  int result = -ECONNREFUSED;
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      result = -errno;
      continue;
    }
    int err = 0;
    if (connect(fd, a->ai_addr, a->ai_addrlen) != 0) {
      err = errno;
      if (err == EINPROGRESS) {
        pollfd p{fd, POLLOUT, 0};
        if (poll(&p, 1, MillisOf(timeout)) == 1) {
          socklen_t len = sizeof(err);
          getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
        } else {
          err = ETIMEDOUT;
        }
      }
    }
    if (err == 0) {
      freeaddrinfo(found);
      return fd;
    }
    close(fd);
    result = -err;
  }
  freeaddrinfo(found);
  return result;
}

// The first bytes the peer sends back after an HTTP/1.0 request ("" when it sends nothing in time).
std::string HttpProbe(int fd, absl::string_view host, absl::Duration timeout) {
  const std::string request = absl::StrCat("GET /healthz HTTP/1.0\r\nHost: ", host, "\r\n\r\n");
  if (send(fd, request.data(), request.size(), MSG_NOSIGNAL) < 0) return "";
  char buffer[16];
  pollfd p{fd, POLLIN, 0};
  if (poll(&p, 1, MillisOf(timeout)) != 1) return "";
  const ssize_t n = recv(fd, buffer, sizeof(buffer), 0);
  return n > 0 ? std::string(buffer, static_cast<size_t>(n)) : "";
}

}  // namespace

absl::Status DiagnoseUnreachable(const std::string& target, bool tls, absl::Duration timeout) {
  const std::string prefix = absl::StrCat("cannot reach attnd at ", target, ": ");
  absl::string_view address = target;
  if (absl::ConsumePrefix(&address, "dns:")) absl::ConsumePrefix(&address, "///");
  if (!absl::ConsumePrefix(&address, "ipv4:")) absl::ConsumePrefix(&address, "ipv6:");
  const size_t colon = address.rfind(':');
  if (absl::StartsWith(target, "unix:") || colon == absl::string_view::npos) {
    return absl::UnavailableError(
        absl::StrCat(prefix, "no gRPC connection (expected host:port, e.g. 127.0.0.1:50051)"));
  }
  std::string host(address.substr(0, colon));
  const std::string port(address.substr(colon + 1));
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']')
    host = host.substr(1, host.size() - 2);
  const int fd = ConnectTcp(host, port, timeout);
  if (fd <= -1000) {
    return absl::UnavailableError(absl::StrCat(prefix, "the host name \"", host,
                                               "\" does not resolve (", gai_strerror(-(fd + 1000)),
                                               ")"));
  }
  if (fd == -ECONNREFUSED) {
    return absl::UnavailableError(
        absl::StrCat(prefix,
                     "connection refused; is the daemon running? (start it with script/server; it "
                     "listens on --listen, default 127.0.0.1:50051)"));
  }
  if (fd < 0) return absl::UnavailableError(absl::StrCat(prefix, std::strerror(-fd)));
  const std::string answer = HttpProbe(fd, host, timeout);
  close(fd);
  if (absl::StartsWith(answer, "HTTP/")) {
    return absl::UnavailableError(
        absl::StrCat(prefix,
                     "it answers HTTP, not gRPC: that is attnd's metrics port (--metrics-listen, "
                     "default 127.0.0.1:9400) or another web server; point --target at attnd's "
                     "--listen address (default 127.0.0.1:50051)"));
  }
  return absl::UnavailableError(absl::StrCat(
      prefix, "it accepts TCP connections but the gRPC connection failed",
      tls ? " (TLS is on: is the server plaintext, or its certificate not signed by --tls-ca?)"
          : " (is the server TLS? then pass --tls-ca)"));
}

int64_t MaxPrefillTokens(const v1::GetServerInfoResponse& info, DType dtype, v1::QLayout q_layout) {
  constexpr int64_t kFraming = 1024;  // as the server's rule (attention.proto, Limits)
  const v1::ModelInfo& m = info.model();
  const int64_t row = int64_t{m.num_q_heads()} * m.head_dim();
  const int64_t q_rows = q_layout == v1::Q_LAYOUT_PRE_ROTARY ? 1 : 5;
  const int64_t per_token =
      (q_rows * row + 2 * int64_t{m.num_kv_heads()} * m.head_dim()) * ElementSize(dtype);
  const int64_t limit = info.limits().max_message_bytes();
  if (per_token <= 0 || limit <= kFraming) return 0;
  return (limit - kFraming) / per_token;
}

namespace {

// gRPC's own refusal of a large message names no attnd limit: say where the client reads them.
absl::Status WithPrefillLimitHint(absl::Status s) {
  if (s.code() != absl::StatusCode::kResourceExhausted ||
      !absl::StrContains(s.message(), "larger than max")) {
    return s;
  }
  return absl::ResourceExhaustedError(absl::StrCat(
      s.message(),
      "; a Prefill message must fit the server's GetServerInfo().limits.max_message_bytes (and "
      "this client's ClientOptions::max_message_bytes): send the prompt in calls of at most "
      "limits.max_prefill_tokens_per_call tokens (any encoding), or client::MaxPrefillTokens for "
      "yours"));
}

}  // namespace

absl::Status AttndClient::Checked(const grpc::Status& status, absl::string_view method) const {
  absl::Status s = FromGrpc(status);
  if (s.code() == absl::StatusCode::kUnimplemented && s.message().empty()) {
    return absl::UnimplementedError(
        absl::StrCat(target_, " serves gRPC but not attnd.v1.Attention/", method,
                     ": is it attnd's health-only port (--health-listen, which serves only "
                     "grpc.health.v1.Health)? point --target at attnd's --listen address"));
  }
  return s;
}

absl::StatusOr<std::unique_ptr<AttndClient>> AttndClient::Connect(const std::string& target,
                                                                  const ClientOptions& options) {
  if (options.max_message_bytes <= 0 || options.max_message_bytes > INT32_MAX) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_message_bytes must be in [1, 2^31), got ", options.max_message_bytes));
  }
  grpc::ChannelArguments args;
  args.SetMaxSendMessageSize(static_cast<int>(options.max_message_bytes));
  args.SetMaxReceiveMessageSize(static_cast<int>(options.max_message_bytes));
  for (const auto& [name, value] : options.channel_args) args.SetInt(name, value);
  std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::InsecureChannelCredentials();
  if (!options.tls_ca_file.empty()) {
    grpc::SslCredentialsOptions ssl;
    ATTND_ASSIGN_OR_RETURN(ssl.pem_root_certs, ReadPem(options.tls_ca_file, "TLS CA"));
    if (options.tls_cert_file.empty() != options.tls_key_file.empty()) {
      return absl::InvalidArgumentError(
          "a client certificate needs both its certificate and its key file");
    }
    if (!options.tls_cert_file.empty()) {
      ATTND_ASSIGN_OR_RETURN(ssl.pem_cert_chain,
                             ReadPem(options.tls_cert_file, "TLS client certificate"));
      ATTND_ASSIGN_OR_RETURN(ssl.pem_private_key, ReadPem(options.tls_key_file, "TLS client key"));
    }
    credentials = grpc::SslCredentials(ssl);
  } else if (!options.tls_cert_file.empty() || !options.tls_key_file.empty()) {
    return absl::InvalidArgumentError("a TLS client certificate needs the server's CA file too");
  }
  std::shared_ptr<grpc::Channel> channel = grpc::CreateCustomChannel(target, credentials, args);
  const absl::Time deadline = absl::Now() + options.connect_timeout;
  for (;;) {
    const grpc_connectivity_state state = channel->GetState(/*try_to_connect=*/true);
    if (state == GRPC_CHANNEL_READY) break;
    // The first attempt failed (gRPC would retry with backoff until the deadline): say why now.
    if (state == GRPC_CHANNEL_TRANSIENT_FAILURE || state == GRPC_CHANNEL_SHUTDOWN) {
      return DiagnoseUnreachable(target, !options.tls_ca_file.empty(),
                                 std::min(absl::Seconds(2), options.connect_timeout));
    }
    if (!channel->WaitForStateChange(state, absl::ToChronoTime(deadline))) {
      return absl::UnavailableError(absl::StrCat(
          "cannot reach attnd at ", target, ": no connection within ",
          absl::FormatDuration(options.connect_timeout),
          " (--connect-timeout); is the host up and the port not blocked by a firewall?"));
    }
  }
  return std::unique_ptr<AttndClient>(new AttndClient(std::move(channel), options, target));
}

void AttndClient::SetDeadline(grpc::ClientContext* context, absl::Duration timeout) const {
  const absl::Duration limit = std::min(timeout, options_.rpc_timeout);
  if (limit != absl::InfiniteDuration()) {
    context->set_deadline(absl::ToChronoTime(absl::Now() + limit));
  }
  if (!options_.token.empty()) context->AddMetadata("authorization", "Bearer " + options_.token);
}

absl::StatusOr<v1::AdminListSequencesResponse> AttndClient::ListSequences(
    const std::string& tenant) {
  grpc::ClientContext context;
  SetDeadline(&context);
  v1::AdminListSequencesRequest request;
  request.set_tenant(tenant);
  v1::AdminListSequencesResponse response;
  ATTND_RETURN_IF_ERROR(FromGrpc(admin_stub_->ListSequences(&context, request, &response)));
  return response;
}

absl::StatusOr<v1::AdminReleaseSequenceResponse> AttndClient::AdminRelease(
    const std::string& sequence_id) {
  grpc::ClientContext context;
  SetDeadline(&context);
  v1::AdminReleaseSequenceRequest request;
  request.set_sequence_id(sequence_id);
  v1::AdminReleaseSequenceResponse response;
  ATTND_RETURN_IF_ERROR(FromGrpc(admin_stub_->ReleaseSequence(&context, request, &response)));
  return response;
}

absl::StatusOr<bool> AttndClient::Healthy(const std::string& service) {
  grpc::ClientContext context;
  SetDeadline(&context);
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  grpc::health::v1::HealthCheckResponse response;
  ATTND_RETURN_IF_ERROR(
      FromGrpc(grpc::health::v1::Health::NewStub(channel_)->Check(&context, request, &response)));
  return response.status() == grpc::health::v1::HealthCheckResponse::SERVING;
}

absl::StatusOr<v1::GetServerInfoResponse> AttndClient::Info() {
  return Info(absl::InfiniteDuration());
}

absl::StatusOr<v1::GetServerInfoResponse> AttndClient::Info(absl::Duration timeout) {
  grpc::ClientContext context;
  SetDeadline(&context, timeout);
  v1::GetServerInfoResponse response;
  ATTND_RETURN_IF_ERROR(Checked(
      stub_->GetServerInfo(&context, v1::GetServerInfoRequest(), &response), "GetServerInfo"));
  return response;
}

absl::StatusOr<std::string> AttndClient::CreateSequence() {
  return CreateSequence(absl::InfiniteDuration());
}

absl::StatusOr<std::string> AttndClient::CreateSequence(absl::Duration timeout) {
  grpc::ClientContext context;
  SetDeadline(&context, timeout);
  v1::CreateSequenceResponse response;
  ATTND_RETURN_IF_ERROR(Checked(
      stub_->CreateSequence(&context, v1::CreateSequenceRequest(), &response), "CreateSequence"));
  return response.sequence_id();
}

absl::StatusOr<v1::ReleaseSequenceResponse> AttndClient::ReleaseRaw(
    const v1::ReleaseSequenceRequest& request) {
  grpc::ClientContext context;
  SetDeadline(&context);
  v1::ReleaseSequenceResponse response;
  ATTND_RETURN_IF_ERROR(
      Checked(stub_->ReleaseSequence(&context, request, &response), "ReleaseSequence"));
  return response;
}

absl::StatusOr<int64_t> AttndClient::Release(const std::string& sequence_id) {
  v1::ReleaseSequenceRequest request;
  request.set_sequence_id(sequence_id);
  ATTND_ASSIGN_OR_RETURN(v1::ReleaseSequenceResponse response, ReleaseRaw(request));
  return response.pages_freed();
}

absl::StatusOr<v1::PrefillResponse> AttndClient::PrefillRaw(const v1::PrefillRequest& request) {
  grpc::ClientContext context;
  SetDeadline(&context);
  v1::PrefillResponse response;
  ATTND_RETURN_IF_ERROR(
      WithPrefillLimitHint(Checked(stub_->Prefill(&context, request, &response), "Prefill")));
  return response;
}

absl::StatusOr<v1::DecodeResponse> AttndClient::DecodeRaw(const v1::DecodeRequest& request) {
  grpc::ClientContext context;
  SetDeadline(&context);
  v1::DecodeResponse response;
  ATTND_RETURN_IF_ERROR(Checked(stub_->Decode(&context, request, &response), "Decode"));
  return response;
}

absl::StatusOr<PrefillResult> AttndClient::Prefill(const std::string& sequence_id, int32_t layer,
                                                   const HostTensor& q, const HostTensor& k,
                                                   const HostTensor& v,
                                                   std::optional<int64_t> prompt_len,
                                                   v1::QLayout q_layout) {
  return Prefill(MakePrefillInput(sequence_id, layer, q, k, v, prompt_len, q_layout));
}

absl::StatusOr<PrefillResult> AttndClient::Prefill(const PrefillInput& input) {
  const bool plain = input.q.host != nullptr && input.k.host != nullptr &&
                     input.v.host != nullptr && !input.output_region.has_value();
  if (!options_.wire_prefill || !plain) {
    v1::PrefillRequest request;
    internal::BuildPrefill(input, &request);
    ATTND_ASSIGN_OR_RETURN(v1::PrefillResponse response, PrefillRaw(request));
    return internal::ParsePrefill(&response);
  }
  // Host bytes: one copy of each tensor into a reused buffer, and the reply parsed once (its bytes
  // moved into the result), instead of proto building, serializing, parsing and copying out.
  const grpc::ByteBuffer request =
      EncodePrefillRequest(send_buffers_.get(), input.sequence_id, input.layer, *input.q.host,
                           *input.k.host, *input.v.host, input.prompt_len, input.q_layout);
  grpc::ClientContext context;
  SetDeadline(&context);
  grpc::ByteBuffer reply;
  // Blocking, like the typed stub: the callback API's thread hop cost more than the call on the
  // dev VM (docs/BENCHMARKS.md, "gRPC bytes path").
  const grpc::Status status = grpc::internal::BlockingUnaryCall<grpc::ByteBuffer, grpc::ByteBuffer>(
      channel_.get(), prefill_method_, &context, request, &reply);
  ATTND_RETURN_IF_ERROR(WithPrefillLimitHint(FromGrpc(status)));
  v1::PrefillResponse response;
  const grpc::Status parsed =
      grpc::SerializationTraits<v1::PrefillResponse>::Deserialize(&reply, &response);
  if (!parsed.ok()) {
    return absl::InternalError("malformed Prefill reply from the server: " +
                               parsed.error_message());
  }
  return internal::ParsePrefill(&response);
}

absl::StatusOr<std::vector<DecodeResult>> AttndClient::Decode(
    int32_t layer, const std::vector<DecodeInput>& entries) {
  v1::DecodeRequest request;
  internal::BuildDecode(layer, entries, &request);
  ATTND_ASSIGN_OR_RETURN(v1::DecodeResponse response, DecodeRaw(request));
  return internal::ParseDecode(response, entries.size());
}

TensorRef TensorRef::In(const std::string& region_id, uint64_t offset, DType dtype,
                        std::vector<int64_t> shape) {
  TensorRef r;
  r.dtype = dtype;
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  r.shape = std::move(shape);
  r.region.set_region_id(region_id);
  r.region.set_offset(offset);
  r.region.set_byte_size(static_cast<uint64_t>(n) * ElementSize(dtype));
  return r;
}

absl::StatusOr<std::string> AttndClient::RegisterShm(const std::string& name, uint64_t offset,
                                                     uint64_t bytes) {
  grpc::ClientContext context;
  SetDeadline(&context);
  v1::RegisterRegionRequest request;
  request.mutable_system_shm()->set_name(name);
  request.mutable_system_shm()->set_offset(offset);
  request.mutable_system_shm()->set_byte_size(bytes);
  v1::RegisterRegionResponse response;
  ATTND_RETURN_IF_ERROR(FromGrpc(stub_->RegisterRegion(&context, request, &response)));
  return response.region_id();
}

absl::StatusOr<std::string> AttndClient::RegisterCudaIpc(const std::string& handle,
                                                         uint64_t bytes) {
  grpc::ClientContext context;
  SetDeadline(&context);
  v1::RegisterRegionRequest request;
  request.mutable_cuda_ipc()->set_handle(handle);
  request.mutable_cuda_ipc()->set_byte_size(bytes);
  v1::RegisterRegionResponse response;
  ATTND_RETURN_IF_ERROR(FromGrpc(stub_->RegisterRegion(&context, request, &response)));
  return response.region_id();
}

absl::Status AttndClient::UnregisterRegion(const std::string& region_id) {
  grpc::ClientContext context;
  SetDeadline(&context);
  v1::UnregisterRegionRequest request;
  request.set_region_id(region_id);
  v1::UnregisterRegionResponse response;
  return FromGrpc(stub_->UnregisterRegion(&context, request, &response));
}

absl::StatusOr<v1::OpenRingResponse> AttndClient::OpenRing(const std::string& name, uint64_t bytes,
                                                           bool device_events) {
  grpc::ClientContext context;
  SetDeadline(&context);
  v1::OpenRingRequest request;
  request.set_name(name);
  request.set_byte_size(bytes);
  request.set_device_events(device_events);
  v1::OpenRingResponse response;
  ATTND_RETURN_IF_ERROR(FromGrpc(stub_->OpenRing(&context, request, &response)));
  return response;
}

absl::Status AttndClient::CloseRing(const std::string& ring_id) {
  grpc::ClientContext context;
  SetDeadline(&context);
  v1::CloseRingRequest request;
  request.set_ring_id(ring_id);
  v1::CloseRingResponse response;
  return FromGrpc(stub_->CloseRing(&context, request, &response));
}

absl::StatusOr<std::unique_ptr<Session>> AttndClient::OpenSession() {
  std::unique_ptr<Session> session(new Session());
  // No per-RPC deadline: a session lives as long as its user keeps it.
  session->stream_ = stub_->Session(&session->context_);
  if (session->stream_ == nullptr) return absl::InternalError("failed to open a Session stream");
  return session;
}

Session::~Session() {
  if (!closed_ && stream_ != nullptr) {
    // Cancel rather than Close: a destructor must not block on a server that stopped answering.
    context_.TryCancel();
    stream_->Finish().ok();
  }
}

absl::StatusOr<v1::SessionResponse> Session::RoundTrip(v1::SessionRequest* request) {
  if (!broken_.ok()) return broken_;
  if (closed_) return absl::FailedPreconditionError("Session is closed");
  request->set_tag(next_tag_++);
  v1::SessionResponse response;
  if (!stream_->Write(*request) || !stream_->Read(&response)) {
    // The stream is gone; its final status says why (e.g. UNAVAILABLE while draining, or
    // RESOURCE_EXHAUSTED for a message over the limit).
    closed_ = true;
    absl::Status final_status = FromGrpc(stream_->Finish());
    broken_ = final_status.ok() ? absl::UnavailableError("Session stream ended by the server")
                                : final_status;
    return broken_;
  }
  if (response.tag() != request->tag()) {
    broken_ = absl::InternalError(
        absl::StrCat("Session answered tag ", response.tag(), " for request tag ", request->tag()));
    return broken_;
  }
  if (response.code() != 0) {
    return absl::Status(static_cast<absl::StatusCode>(response.code()), response.message());
  }
  return response;
}

absl::StatusOr<PrefillResult> Session::Prefill(const std::string& sequence_id, int32_t layer,
                                               const HostTensor& q, const HostTensor& k,
                                               const HostTensor& v,
                                               std::optional<int64_t> prompt_len,
                                               v1::QLayout q_layout) {
  return Prefill(MakePrefillInput(sequence_id, layer, q, k, v, prompt_len, q_layout));
}

absl::StatusOr<PrefillResult> Session::Prefill(const PrefillInput& input) {
  v1::SessionRequest request;
  internal::BuildPrefill(input, request.mutable_prefill());
  ATTND_ASSIGN_OR_RETURN(v1::SessionResponse response, RoundTrip(&request));
  if (!response.has_prefill()) return absl::InternalError("Session answered a prefill without one");
  return internal::ParsePrefill(response.mutable_prefill());
}

absl::StatusOr<std::vector<DecodeResult>> Session::Decode(int32_t layer,
                                                          const std::vector<DecodeInput>& entries) {
  v1::SessionRequest request;
  internal::BuildDecode(layer, entries, request.mutable_decode());
  ATTND_ASSIGN_OR_RETURN(v1::SessionResponse response, RoundTrip(&request));
  if (!response.has_decode()) return absl::InternalError("Session answered a decode without one");
  return internal::ParseDecode(response.decode(), entries.size());
}

absl::Status Session::Close() {
  if (closed_) return broken_;
  closed_ = true;
  stream_->WritesDone();
  return FromGrpc(stream_->Finish());
}

}  // namespace client
}  // namespace attnd
