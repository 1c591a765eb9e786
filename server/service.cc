#include "server/service.h"

#include <atomic>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/status.h"

namespace attnd {
namespace {

// The wire enum and DType share their numbers (DTYPE_BF16 = kBf16 = 1, ...); an unknown wire value
// passes through so the runtime can name it in its error.
RequestTensor FromProto(const v1::Tensor& t) {
  RequestTensor r;
  r.dtype = static_cast<DType>(t.dtype());
  r.shape = absl::MakeConstSpan(t.shape().data(), t.shape().size());
  r.bytes = t.data();
  return r;
}

v1::DType ToProto(DType t) { return static_cast<v1::DType>(static_cast<int>(t)); }

// Where the engine writes an output tensor: straight into `tensor`'s bytes field.
OutputBufferFn IntoTensor(v1::Tensor* tensor) {
  return [tensor](int64_t bytes) -> void* {
    std::string* data = tensor->mutable_data();
    data->resize(static_cast<size_t>(bytes));
    return data->data();
  };
}

void SetMeta(DType dtype, const std::vector<int64_t>& shape, v1::Tensor* tensor) {
  tensor->set_dtype(ToProto(dtype));
  tensor->mutable_shape()->Assign(shape.begin(), shape.end());
}

const absl::Status& ShuttingDown() {
  static const absl::Status* status =
      new absl::Status(absl::UnavailableError("the server is shutting down"));
  return *status;
}

}  // namespace

// One Session stream: read a request, run it, write its response, read the next. Exactly one
// request is in flight per stream, which is what keeps responses in request order. Every path ends
// in exactly one Finish; the reactor deletes itself in OnDone.
class SessionReactor : public grpc::ServerBidiReactor<v1::SessionRequest, v1::SessionResponse> {
 public:
  // Registers before taking mu_: BeginShutdown takes the service's lock, then each session's.
  explicit SessionReactor(AttentionService* service)
      : service_(service), registered_(service->Register(this)) {
    absl::MutexLock lock(&mu_);
    // A shutdown that began after Register saw this session still starting and skipped it.
    if (!registered_ || service_->shutting_down()) {
      FinishLocked(ToGrpcStatus(ShuttingDown()));
      return;
    }
    state_ = State::kReading;
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    {
      absl::MutexLock lock(&mu_);
      if (state_ == State::kFinished) return;  // ended by BeginShutdown while reading
      if (!ok) {  // the client closed its side (or the call was cancelled)
        FinishLocked(grpc::Status::OK);
        return;
      }
      if (service_->shutting_down()) {
        FinishLocked(ToGrpcStatus(ShuttingDown()));
        return;
      }
      state_ = State::kWorking;
    }
    // Not under mu_: the work may complete (and call Complete) before Submit returns.
    response_.Clear();
    response_.set_tag(request_.tag());
    absl::Status submitted;
    switch (request_.request_case()) {
      case v1::SessionRequest::kPrefill:
        submitted = service_->work_queue_->Submit([this] {
          Complete(service_->RunPrefill(request_.prefill(), response_.mutable_prefill()));
        });
        break;
      case v1::SessionRequest::kDecode:
        submitted = service_->SubmitDecode(request_.decode(), response_.mutable_decode(),
                                           [this](absl::Status s) { Complete(std::move(s)); });
        break;
      default:
        submitted = absl::OkStatus();
        Complete(absl::InvalidArgumentError(
            "a session request must hold a prefill or a decode request"));
        break;
    }
    if (submitted.ok()) return;
    if (submitted.code() == absl::StatusCode::kUnavailable) {
      absl::MutexLock lock(&mu_);
      FinishLocked(ToGrpcStatus(submitted));
      return;
    }
    Complete(submitted);  // e.g. a full queue: this request fails, the stream goes on
  }

  void OnWriteDone(bool ok) override {
    absl::MutexLock lock(&mu_);
    if (!ok) {
      FinishLocked(grpc::Status(grpc::StatusCode::CANCELLED, "the session stream broke"));
      return;
    }
    if (service_->shutting_down()) {
      FinishLocked(ToGrpcStatus(ShuttingDown()));
      return;
    }
    state_ = State::kReading;
    request_.Clear();
    StartRead(&request_);
  }

  // Nothing to undo: a pending read or write fails after a cancel, and that path finishes.
  void OnCancel() override {}

  void OnDone() override {
    if (registered_) service_->Unregister(this);
    delete this;
  }

  // From AttentionService::BeginShutdown: an idle stream ends now; a busy one after its response.
  void OnServerShutdown() {
    absl::MutexLock lock(&mu_);
    if (state_ == State::kReading) FinishLocked(ToGrpcStatus(ShuttingDown()));
  }

 private:
  enum class State { kStarting, kReading, kWorking, kWriting, kFinished };

  void Complete(absl::Status status) {
    if (!status.ok()) {
      response_.clear_response();
      response_.set_code(static_cast<int32_t>(status.code()));
      response_.set_message(std::string(status.message()));
    }
    absl::MutexLock lock(&mu_);
    state_ = State::kWriting;
    StartWrite(&response_);
  }

  void FinishLocked(grpc::Status status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    state_ = State::kFinished;
    Finish(std::move(status));
  }

  AttentionService* const service_;
  const bool registered_;
  absl::Mutex mu_;
  State state_ ABSL_GUARDED_BY(mu_) = State::kStarting;
  // Owned by the one request in flight: the work reads request_ and fills response_.
  v1::SessionRequest request_;
  v1::SessionResponse response_;
};

AttentionService::AttentionService(Runtime* runtime, WorkQueue* work_queue,
                                   DecodeQueue* decode_queue)
    : runtime_(runtime), work_queue_(work_queue), decode_queue_(decode_queue) {}

void AttentionService::BeginShutdown() {
  shutting_down_.store(true);
  absl::MutexLock lock(&mu_);
  // OnDone (which unregisters) never runs inline here: it waits for the read that Finish ends.
  for (SessionReactor* session : sessions_) session->OnServerShutdown();
}

bool AttentionService::shutting_down() const { return shutting_down_.load(); }

bool AttentionService::Register(SessionReactor* session) {
  absl::MutexLock lock(&mu_);
  if (shutting_down_.load()) return false;
  sessions_.insert(session);
  return true;
}

void AttentionService::Unregister(SessionReactor* session) {
  absl::MutexLock lock(&mu_);
  sessions_.erase(session);
}

grpc::ServerUnaryReactor* AttentionService::GetServerInfo(grpc::CallbackServerContext* context,
                                                          const v1::GetServerInfoRequest*,
                                                          v1::GetServerInfoResponse* response) {
  // Cheap and lock-light: answered on the gRPC thread.
  const ServerInfo info = runtime_->Info();
  response->set_version(info.version);
  response->set_backend(info.backend);
  response->set_device(info.device);
  v1::ModelInfo* model = response->mutable_model();
  model->set_name(info.model.name);
  model->set_num_layers(info.model.num_layers);
  model->set_num_q_heads(info.model.num_q_heads);
  model->set_num_kv_heads(info.model.num_kv_heads);
  model->set_head_dim(info.model.head_dim);
  model->set_kv_dtype(ToProto(info.model.kv_dtype));
  model->set_max_position_embeddings(info.model.max_position_embeddings);
  model->set_softmax_scale(info.model.softmax_scale);
  v1::DcaConfig* dca = response->mutable_dca();
  dca->set_chunk_size(info.dca.chunk_size);
  dca->set_local_size(info.dca.local_size);
  dca->set_chunk_len(info.dca.chunk_len);
  dca->set_original_max_position_embeddings(info.dca.original_max_position_embeddings);
  dca->set_sparse_attention_enabled(info.dca.sparse_attention_enabled);
  dca->set_sparse_attention_threshold(info.dca.sparse_attention_threshold);
  dca->set_sparse_attention_last_q(info.dca.sparse_attention_last_q);
  v1::KvCacheInfo* kv = response->mutable_kv_cache();
  kv->set_page_size(info.kv_cache.page_size);
  kv->set_pages_total(info.kv_cache.pages_total);
  kv->set_pages_free(info.kv_cache.pages_free);
  kv->set_bytes_per_page(info.kv_cache.bytes_per_page);
  kv->set_pool_bytes(info.kv_cache.pool_bytes);
  response->set_live_sequences(info.live_sequences);
  v1::Limits* limits = response->mutable_limits();
  limits->set_max_message_bytes(info.limits.max_message_bytes);
  limits->set_max_sequence_length(info.limits.max_sequence_length);
  limits->set_max_sequences(info.limits.max_sequences);
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* AttentionService::CreateSequence(grpc::CallbackServerContext* context,
                                                           const v1::CreateSequenceRequest*,
                                                           v1::CreateSequenceResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  absl::Status submitted = work_queue_->Submit([this, reactor, response] {
    absl::StatusOr<std::string> id = runtime_->CreateSequence(/*tenant=*/"");
    if (id.ok()) response->set_sequence_id(*id);
    reactor->Finish(ToGrpcStatus(id.status()));
  });
  if (!submitted.ok()) reactor->Finish(ToGrpcStatus(submitted));
  return reactor;
}

grpc::ServerUnaryReactor* AttentionService::ReleaseSequence(
    grpc::CallbackServerContext* context, const v1::ReleaseSequenceRequest* request,
    v1::ReleaseSequenceResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  // On a worker: Release waits for a request in flight on the sequence.
  absl::Status submitted = work_queue_->Submit([this, reactor, request, response] {
    absl::StatusOr<int64_t> freed = runtime_->ReleaseSequence(request->sequence_id(), "");
    if (freed.ok()) response->set_pages_freed(*freed);
    reactor->Finish(ToGrpcStatus(freed.status()));
  });
  if (!submitted.ok()) reactor->Finish(ToGrpcStatus(submitted));
  return reactor;
}

absl::Status AttentionService::RunPrefill(const v1::PrefillRequest& request,
                                          v1::PrefillResponse* response) {
  PrefillCall call;
  call.sequence_id = request.sequence_id();
  call.layer = request.layer();
  call.q = FromProto(request.q());
  call.k = FromProto(request.k());
  call.v = FromProto(request.v());
  if (request.has_prompt_len()) call.prompt_len = request.prompt_len();
  call.output = IntoTensor(response->mutable_o());
  absl::StatusOr<PrefillResult> result = runtime_->Prefill(call);
  if (!result.ok()) {
    response->Clear();
    return result.status();
  }
  SetMeta(result->out_dtype, result->out_shape, response->mutable_o());
  response->set_length(result->length);
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* AttentionService::Prefill(grpc::CallbackServerContext* context,
                                                    const v1::PrefillRequest* request,
                                                    v1::PrefillResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  absl::Status submitted = work_queue_->Submit([this, reactor, request, response] {
    reactor->Finish(ToGrpcStatus(RunPrefill(*request, response)));
  });
  if (!submitted.ok()) reactor->Finish(ToGrpcStatus(submitted));
  return reactor;
}

absl::Status AttentionService::SubmitDecode(const v1::DecodeRequest& request,
                                            v1::DecodeResponse* response,
                                            std::function<void(absl::Status)> done) {
  DecodeCall call;
  call.layer = request.layer();
  call.entries.resize(request.entries_size());
  response->Clear();
  // Outputs exist before the engine runs so it can write into them; their addresses are stable.
  for (int i = 0; i < request.entries_size(); ++i) response->add_outputs();
  for (int i = 0; i < request.entries_size(); ++i) {
    const v1::DecodeEntry& in = request.entries(i);
    DecodeCall::Entry& e = call.entries[i];
    e.sequence_id = in.sequence_id();
    e.q = FromProto(in.q());
    e.k = FromProto(in.k());
    e.v = FromProto(in.v());
    e.output = IntoTensor(response->mutable_outputs(i)->mutable_o());
  }
  return decode_queue_->Submit(
      std::move(call), [response, done = std::move(done)](absl::StatusOr<DecodeResult> result) {
        if (!result.ok()) {
          response->Clear();
          done(result.status());
          return;
        }
        for (size_t i = 0; i < result->outputs.size(); ++i) {
          const DecodeResult::Output& out = result->outputs[i];
          v1::DecodeOutput* o = response->mutable_outputs(static_cast<int>(i));
          SetMeta(out.out_dtype, out.out_shape, o->mutable_o());
          o->set_length(out.length);
        }
        done(absl::OkStatus());
      });
}

grpc::ServerUnaryReactor* AttentionService::Decode(grpc::CallbackServerContext* context,
                                                   const v1::DecodeRequest* request,
                                                   v1::DecodeResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  absl::Status submitted = SubmitDecode(
      *request, response, [reactor](absl::Status s) { reactor->Finish(ToGrpcStatus(s)); });
  if (!submitted.ok()) reactor->Finish(ToGrpcStatus(submitted));
  return reactor;
}

grpc::ServerBidiReactor<v1::SessionRequest, v1::SessionResponse>* AttentionService::Session(
    grpc::CallbackServerContext*) {
  return new SessionReactor(this);
}

}  // namespace attnd
