#include "client/attnd_client.h"

#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "kernels/status_macros.h"

namespace attnd {
namespace client {
namespace {

void BuildPrefill(const std::string& sequence_id, int32_t layer, const HostTensor& q,
                  const HostTensor& k, const HostTensor& v, std::optional<int64_t> prompt_len,
                  v1::QLayout q_layout, v1::PrefillRequest* request) {
  request->set_sequence_id(sequence_id);
  request->set_layer(layer);
  ToProto(q, request->mutable_q());
  ToProto(k, request->mutable_k());
  ToProto(v, request->mutable_v());
  if (prompt_len.has_value()) request->set_prompt_len(*prompt_len);
  if (q_layout != v1::Q_LAYOUT_VARIANTS) request->set_q_layout(q_layout);
}

void BuildDecode(int32_t layer, const std::vector<DecodeInput>& entries,
                 v1::DecodeRequest* request) {
  request->set_layer(layer);
  for (const DecodeInput& in : entries) {
    v1::DecodeEntry* e = request->add_entries();
    e->set_sequence_id(in.sequence_id);
    ToProto(in.q, e->mutable_q());
    ToProto(in.k, e->mutable_k());
    ToProto(in.v, e->mutable_v());
    if (in.q_layout != v1::Q_LAYOUT_VARIANTS) e->set_q_layout(in.q_layout);
  }
}

absl::StatusOr<PrefillResult> ParsePrefill(v1::PrefillResponse* response) {
  PrefillResult result;
  ATTND_ASSIGN_OR_RETURN(result.o, FromProto(std::move(*response->mutable_o())));
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
    ATTND_ASSIGN_OR_RETURN(results[i].o, FromProto(response.outputs(i).o()));
    results[i].length = response.outputs(i).length();
  }
  return results;
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

AttndClient::AttndClient(std::shared_ptr<grpc::Channel> channel, const ClientOptions& options)
    : options_(options),
      channel_(std::move(channel)),
      stub_(v1::Attention::NewStub(channel_)),
      prefill_method_("/attnd.v1.Attention/Prefill", grpc::internal::RpcMethod::NORMAL_RPC,
                      channel_) {}

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
  if (!channel->WaitForConnected(absl::ToChronoTime(absl::Now() + options.connect_timeout))) {
    return absl::UnavailableError(absl::StrCat("cannot connect to attnd at ", target, " within ",
                                               absl::FormatDuration(options.connect_timeout)));
  }
  return std::unique_ptr<AttndClient>(new AttndClient(std::move(channel), options));
}

void AttndClient::SetDeadline(grpc::ClientContext* context) const {
  if (options_.rpc_timeout != absl::InfiniteDuration()) {
    context->set_deadline(absl::ToChronoTime(absl::Now() + options_.rpc_timeout));
  }
  if (!options_.token.empty()) context->AddMetadata("authorization", "Bearer " + options_.token);
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
  grpc::ClientContext context;
  SetDeadline(&context);
  v1::GetServerInfoResponse response;
  ATTND_RETURN_IF_ERROR(
      FromGrpc(stub_->GetServerInfo(&context, v1::GetServerInfoRequest(), &response)));
  return response;
}

absl::StatusOr<std::string> AttndClient::CreateSequence() {
  grpc::ClientContext context;
  SetDeadline(&context);
  v1::CreateSequenceResponse response;
  ATTND_RETURN_IF_ERROR(
      FromGrpc(stub_->CreateSequence(&context, v1::CreateSequenceRequest(), &response)));
  return response.sequence_id();
}

absl::StatusOr<v1::ReleaseSequenceResponse> AttndClient::ReleaseRaw(
    const v1::ReleaseSequenceRequest& request) {
  grpc::ClientContext context;
  SetDeadline(&context);
  v1::ReleaseSequenceResponse response;
  ATTND_RETURN_IF_ERROR(FromGrpc(stub_->ReleaseSequence(&context, request, &response)));
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
  ATTND_RETURN_IF_ERROR(FromGrpc(stub_->Prefill(&context, request, &response)));
  return response;
}

absl::StatusOr<v1::DecodeResponse> AttndClient::DecodeRaw(const v1::DecodeRequest& request) {
  grpc::ClientContext context;
  SetDeadline(&context);
  v1::DecodeResponse response;
  ATTND_RETURN_IF_ERROR(FromGrpc(stub_->Decode(&context, request, &response)));
  return response;
}

absl::StatusOr<PrefillResult> AttndClient::Prefill(const std::string& sequence_id, int32_t layer,
                                                   const HostTensor& q, const HostTensor& k,
                                                   const HostTensor& v,
                                                   std::optional<int64_t> prompt_len,
                                                   v1::QLayout q_layout) {
  if (!options_.wire_prefill) {
    v1::PrefillRequest request;
    BuildPrefill(sequence_id, layer, q, k, v, prompt_len, q_layout, &request);
    ATTND_ASSIGN_OR_RETURN(v1::PrefillResponse response, PrefillRaw(request));
    return ParsePrefill(&response);
  }
  // One copy of each tensor into a reused buffer, and the reply parsed once (its bytes moved into
  // the result), instead of proto building, serializing, parsing and copying out.
  const grpc::ByteBuffer request =
      EncodePrefillRequest(send_buffers_.get(), sequence_id, layer, q, k, v, prompt_len, q_layout);
  grpc::ClientContext context;
  SetDeadline(&context);
  grpc::ByteBuffer reply;
  // Blocking, like the typed stub (the callback API's thread hop cost ~3 ms per call on the
  // 2-core dev VM).
  const grpc::Status status = grpc::internal::BlockingUnaryCall<grpc::ByteBuffer, grpc::ByteBuffer>(
      channel_.get(), prefill_method_, &context, request, &reply);
  ATTND_RETURN_IF_ERROR(FromGrpc(status));
  v1::PrefillResponse response;
  const grpc::Status parsed =
      grpc::SerializationTraits<v1::PrefillResponse>::Deserialize(&reply, &response);
  if (!parsed.ok()) {
    return absl::InternalError("malformed Prefill reply from the server: " +
                               parsed.error_message());
  }
  return ParsePrefill(&response);
}

absl::StatusOr<std::vector<DecodeResult>> AttndClient::Decode(
    int32_t layer, const std::vector<DecodeInput>& entries) {
  v1::DecodeRequest request;
  BuildDecode(layer, entries, &request);
  ATTND_ASSIGN_OR_RETURN(v1::DecodeResponse response, DecodeRaw(request));
  return ParseDecode(response, entries.size());
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
  v1::SessionRequest request;
  BuildPrefill(sequence_id, layer, q, k, v, prompt_len, q_layout, request.mutable_prefill());
  ATTND_ASSIGN_OR_RETURN(v1::SessionResponse response, RoundTrip(&request));
  if (!response.has_prefill()) return absl::InternalError("Session answered a prefill without one");
  return ParsePrefill(response.mutable_prefill());
}

absl::StatusOr<std::vector<DecodeResult>> Session::Decode(int32_t layer,
                                                          const std::vector<DecodeInput>& entries) {
  v1::SessionRequest request;
  BuildDecode(layer, entries, request.mutable_decode());
  ATTND_ASSIGN_OR_RETURN(v1::SessionResponse response, RoundTrip(&request));
  if (!response.has_decode()) return absl::InternalError("Session answered a decode without one");
  return ParseDecode(response.decode(), entries.size());
}

absl::Status Session::Close() {
  if (closed_) return broken_;
  closed_ = true;
  stream_->WritesDone();
  return FromGrpc(stream_->Finish());
}

}  // namespace client
}  // namespace attnd
