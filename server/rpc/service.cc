#include "server/rpc/service.h"

#include <array>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "attnd/v1/shm_ring.h"
#include "base/catch_all.h"
#include "base/status_macros.h"
#include "server/rpc/auth.h"
#include "server/rpc/packed_decode.h"
#include "server/rpc/region_tensors.h"
#include "server/rpc/status.h"
#include "server/sched/request_context.h"

namespace attnd {

// When one request reached the handler, when a worker picked it up and when the worker was done.
// As the request's RequestObserver, it is told the start by whoever dequeues the request.
struct RequestClock : RequestObserver {
  void OnStarted(absl::Time t) override { started = t; }

  absl::Time received = absl::Now();
  absl::Time started = absl::InfinitePast();   // InfinitePast: no worker ran it
  absl::Time finished = absl::InfinitePast();  // InfinitePast: not known (e.g. a merged batch)
  // For the request log (Describe): who asked, about which sequence, for how many tokens.
  std::string tenant;
  std::string sequence_id;
  int64_t tokens = -1;
};

// The request log's view of each request (RequestLogEntry): its sequence and token count.
void Describe(const v1::GetServerInfoRequest&, RequestClock*) {}
void Describe(const v1::CreateSequenceRequest&, RequestClock*) {}
void Describe(const v1::ReleaseSequenceRequest& r, RequestClock* c) {
  c->sequence_id = r.sequence_id();
}
void Describe(const v1::PrefillRequest& r, RequestClock* c) {
  c->sequence_id = r.sequence_id();
  if (r.q().shape_size() > 0) c->tokens = r.q().shape(0);
}
void Describe(const v1::DecodeRequest& r, RequestClock* c) {
  if (r.entries_size() > 0) c->sequence_id = r.entries(0).sequence_id();
  if (r.sequence_ids_size() > 0) c->sequence_id = r.sequence_ids(0);
  c->tokens = r.entries_size() + r.sequence_ids_size();
}
void Describe(const v1::SessionRequest& r, RequestClock* c) {
  if (r.has_prefill()) Describe(r.prefill(), c);
  if (r.has_decode()) Describe(r.decode(), c);
}

namespace {

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

// The RPC's deadline and cancellation (`cancelled`: the flag the reactor's OnCancel sets) for the
// queues, and `clock` (which must outlive the answer) to be told when a worker picks it up.
absl::Time DeadlineOf(const grpc::CallbackServerContext* context) {
  const std::chrono::system_clock::time_point deadline = context->deadline();
  return deadline == std::chrono::system_clock::time_point::max() ? absl::InfiniteFuture()
                                                                  : absl::FromChrono(deadline);
}

RequestContext ContextOf(const grpc::CallbackServerContext* context,
                         std::shared_ptr<const std::atomic<bool>> cancelled, RequestClock* clock) {
  RequestContext c;
  c.deadline = DeadlineOf(context);
  c.cancelled = std::move(cancelled);
  c.enqueue_time = clock->received;
  c.observer = clock;
  return c;
}

// PrefillCall::keep_going of a call with this deadline and cancel flag: once the client has
// cancelled or its deadline has passed, the call stops before its next device step.
std::function<absl::Status()> StopWhenGone(absl::Time deadline,
                                           std::shared_ptr<const std::atomic<bool>> cancelled) {
  return [deadline, cancelled = std::move(cancelled)]() -> absl::Status {
    if (cancelled != nullptr && cancelled->load(std::memory_order_acquire)) {
      return absl::CancelledError(
          "the call was cancelled while it ran; it stopped between two device steps and changed "
          "nothing");
    }
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(
          "the client's deadline passed while the call ran; it stopped between two device steps "
          "and changed nothing");
    }
    return absl::OkStatus();
  };
}

// `settings_only`: the counters are server-wide, so a tenant-scoped answer leaves them out.
// `graphs`: whether the engine replays captured CUDA graphs (Engine::decode_graphs).
void FillBatchingStats(const BatchingDecodeQueue& batcher, bool settings_only, bool graphs,
                       v1::DecodeBatchingStats* out) {
  const DecodeBatcherOptions& o = batcher.options();
  out->set_enabled(true);
  out->set_max_decode_batch(o.max_decode_batch);
  out->set_max_queue_delay_us(absl::ToInt64Microseconds(o.max_queue_delay));
  out->mutable_cuda_graph_batch_sizes()->Assign(o.flush_batch_sizes.begin(),
                                                o.flush_batch_sizes.end());
  out->set_cuda_graphs_enabled(graphs);
  if (settings_only) return;
  const DecodeBatchingStats s = batcher.Stats();
  out->set_calls_submitted(s.calls_submitted);
  out->set_calls_completed(s.calls_completed);
  out->set_calls_deadline_exceeded(s.calls_deadline_exceeded);
  out->set_calls_cancelled(s.calls_cancelled);
  out->set_batches(s.batches);
  out->set_entries(s.entries);
  for (const auto& [size, batches] : s.batches_by_size) {
    v1::DecodeBatchingStats::SizeCount* c = out->add_batches_by_size();
    c->set_size(size);
    c->set_batches(batches);
  }
  out->set_padding_entries(s.padding_entries);
  out->set_eager_launches(s.eager_launches);
  out->set_graph_replays(s.graph_replays);
  out->set_split_retries(s.split_retries);
  for (int i = 0; i < DecodeBatchingStats::kNumDelayBuckets; ++i) {
    out->add_queue_delay_bucket_upper_us(DecodeBatchingStats::kDelayBucketUpperUs[i]);
    out->add_queue_delay_count(s.queue_delay_count[i]);
  }
  out->set_queue_delay_total_us(s.queue_delay_total_us);
  out->set_queued_calls(s.queued_calls);
  out->set_inflight_batches(s.inflight_batches);
}

const absl::Status& ShuttingDown() {
  static const absl::Status* status =
      new absl::Status(absl::UnavailableError("the server is shutting down"));
  return *status;
}

// Linux's boot id: two processes that read the same one run on one host (one kernel), which is
// what sharing memory needs. Read once.
const std::string& HostBootId() {
  static const std::string* id = [] {
    std::string s;
    if (FILE* f = std::fopen("/proc/sys/kernel/random/boot_id", "r")) {
      char buf[64] = {};
      if (std::fgets(buf, sizeof(buf), f) != nullptr) s = buf;
      std::fclose(f);
    }
    while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
    return new std::string(s);
  }();
  return *id;
}

int64_t SizeOf(const google::protobuf::Message& m) {
  return static_cast<int64_t>(m.ByteSizeLong());
}

}  // namespace

// One request's passage through the front end, whatever carried it (a unary call, the wire
// prefill, a ring): its clock (which the queue tells when a worker starts it), its tenant, its
// share of --max-inflight-request-bytes and its one record in the request log and the metrics.
// Admit takes the share; End records the outcome and gives the share back, once (a scope dropped
// without End gives it back unrecorded). Shared between the handler and the work it submits.
class RequestScope {
 public:
  RequestScope(AttentionService* service, absl::string_view rpc, int64_t request_bytes)
      : service_(service), rpc_(rpc), bytes_(request_bytes) {}
  ~RequestScope() {
    if (taken_) service_->GiveRequestBytes(bytes_);
  }
  RequestScope(const RequestScope&) = delete;
  RequestScope& operator=(const RequestScope&) = delete;

  // The caller's tenant (UNAUTHENTICATED and the like when its metadata do not name one), then
  // UNAVAILABLE while draining, then the share of the budget (RESOURCE_EXHAUSTED past it).
  absl::Status Admit(const grpc::CallbackServerContext& context) {
    absl::StatusOr<std::string> tenant = TenantOf(service_->tokens_.get(), context);
    if (!tenant.ok()) return tenant.status();
    return Admit(*std::move(tenant));
  }
  // The same for a tenant already known. `share`: false when the request's bytes are held in the
  // budget already (a ring's copy of its request, server/dataplane/ring.h).
  absl::Status Admit(std::string tenant, bool share = true) {
    clock_.tenant = std::move(tenant);
    if (service_->shutting_down()) return ShuttingDown();
    if (!share) return absl::OkStatus();
    ATTND_RETURN_IF_ERROR(service_->TakeRequestBytes(bytes_));
    taken_ = true;
    return absl::OkStatus();
  }

  const std::string& tenant() const { return clock_.tenant; }
  RequestClock* clock() { return &clock_; }
  int64_t request_bytes() const { return bytes_; }

  void End(const absl::Status& status, int64_t response_bytes) {
    if (ended_) return;
    ended_ = true;
    service_->Record(rpc_, static_cast<int>(status.code()), clock_, bytes_, response_bytes);
    if (taken_) service_->GiveRequestBytes(bytes_);
    taken_ = false;
  }

 private:
  AttentionService* const service_;
  const absl::string_view rpc_;  // a literal
  const int64_t bytes_;
  RequestClock clock_;
  bool taken_ = false;
  bool ended_ = false;
};

// One Session stream: read a request, run it, write its response, read the next. Exactly one
// request is in flight per stream, which is what keeps responses in request order. Every path ends
// in exactly one Finish; the reactor deletes itself in OnDone.
class SessionReactor : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  // Registers before taking mu_: BeginShutdown takes the service's lock, then each session's.
  SessionReactor(AttentionService* service, grpc::CallbackServerContext* context)
      : service_(service),
        context_(context),
        tenant_(TenantOf(service->tokens_.get(), *context)),
        registered_(service->Register(this)) {
    MutexLock lock(&mu_);
    // A shutdown that began after Register saw this session still starting and skipped it.
    if (!registered_ || service_->shutting_down()) {
      FinishLocked(ToGrpcStatus(ShuttingDown()));
      return;
    }
    if (!tenant_.ok()) {
      FinishLocked(ToGrpcStatus(tenant_.status()));
      return;
    }
    state_ = State::kReading;
    StartRead(&frame_);
  }

  void OnReadDone(bool ok) override {
    {
      MutexLock lock(&mu_);
      if (state_ == State::kFinished) return;  // ended by BeginShutdown while reading
      if (!ok) {  // the client closed its side (or the call was cancelled)
        FinishLocked(grpc::Status::OK);
        return;
      }
      ++frames_;
      request_.Clear();
      const grpc::Status parsed =
          grpc::SerializationTraits<v1::SessionRequest>::Deserialize(&frame_, &request_);
      if (!parsed.ok()) {
        // Every earlier request has been answered (one at a time); nothing after this is read.
        FinishLocked(
            grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                         absl::StrCat("cannot parse attnd.v1.SessionRequest (message ", frames_,
                                      " on this stream): the stream ends here; the ", frames_ - 1,
                                      " requests before it were answered")));
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
    const v1::SessionRequest::RequestCase kind = request_.request_case();
    scope_.emplace(service_,
                   kind == v1::SessionRequest::kPrefill  ? "Session.Prefill"
                   : kind == v1::SessionRequest::kDecode ? "Session.Decode"
                                                         : "Session.Invalid",
                   SizeOf(request_));
    Describe(request_, scope_->clock());
    absl::Status submitted = scope_->Admit(*tenant_);
    if (!submitted.ok() && submitted.code() != absl::StatusCode::kUnavailable) {
      Complete(submitted);  // this request fails at once; the stream goes on
      return;
    }
    if (submitted.ok()) {
      switch (kind) {
        case v1::SessionRequest::kPrefill:
          submitted = service_->work_queue_->Submit(
              ContextOf(context_, cancelled_, scope_->clock()), [this](absl::Status s) {
                if (s.ok()) {
                  // A stream cancelled while its prefill runs stops it between two device steps.
                  s = service_->RunPrefill(request_.prefill(), *tenant_,
                                           response_.mutable_prefill(),
                                           StopWhenGone(DeadlineOf(context_), cancelled_));
                }
                scope_->clock()->finished = absl::Now();
                Complete(std::move(s));
              });
          break;
        case v1::SessionRequest::kDecode:
          submitted = service_->SubmitDecodeFromGrpcThread(
              request_.decode(), *tenant_, ContextOf(context_, cancelled_, scope_->clock()),
              response_.mutable_decode(), [this](absl::Status s) {
                scope_->clock()->finished = absl::Now();
                Complete(std::move(s));
              });
          break;
        default:
          Complete(absl::InvalidArgumentError(
              "a session request must hold a prefill or a decode request"));
          return;
      }
    }
    if (submitted.ok()) return;
    if (submitted.code() == absl::StatusCode::kUnavailable) {
      scope_.reset();  // draining: the stream ends; the request is not recorded
      MutexLock lock(&mu_);
      FinishLocked(ToGrpcStatus(submitted));
      return;
    }
    Complete(submitted);  // e.g. a full queue: this request fails, the stream goes on
  }

  void OnWriteDone(bool ok) override {
    MutexLock lock(&mu_);
    if (!ok) {
      FinishLocked(grpc::Status(grpc::StatusCode::CANCELLED, "the session stream broke"));
      return;
    }
    if (service_->shutting_down()) {
      FinishLocked(ToGrpcStatus(ShuttingDown()));
      return;
    }
    state_ = State::kReading;
    StartRead(&frame_);
  }

  // Nothing to undo: a pending read or write fails after a cancel, and that path finishes. A
  // request waiting in a queue sees the flag (RequestContext::cancelled) and is not run.
  void OnCancel() override { cancelled_->store(true, std::memory_order_release); }

  void OnDone() override {
    if (registered_) service_->Unregister(this);
    delete this;
  }

  // From AttentionService::BeginShutdown: an idle stream ends now; a busy one after its response.
  void OnServerShutdown() {
    MutexLock lock(&mu_);
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
    scope_->End(status, SizeOf(response_));
    out_.Clear();
    bool own_buffer = false;
    grpc::Status serialized =
        grpc::SerializationTraits<v1::SessionResponse>::Serialize(response_, &out_, &own_buffer);
    MutexLock lock(&mu_);
    if (!serialized.ok()) {
      FinishLocked(grpc::Status(
          grpc::StatusCode::INTERNAL,
          absl::StrCat("cannot serialize a session response: ", serialized.error_message())));
      return;
    }
    state_ = State::kWriting;
    StartWrite(&out_);
  }

  void FinishLocked(grpc::Status status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    state_ = State::kFinished;
    // The stream itself: counted by its final code; its lifetime is not a request latency.
    RequestClock no_latency;
    no_latency.received = absl::InfinitePast();
    service_->Record("Session", static_cast<int>(status.error_code()), no_latency, 0, 0);
    Finish(std::move(status));
  }

  AttentionService* const service_;
  grpc::CallbackServerContext* const context_;
  const absl::StatusOr<std::string> tenant_;  // the stream's own metadata, read once
  const bool registered_;
  const std::shared_ptr<std::atomic<bool>> cancelled_ = NewCancelFlag();  // set by OnCancel
  Mutex mu_;
  State state_ ABSL_GUARDED_BY(mu_) = State::kStarting;
  // Owned by the one request in flight: the work reads request_ and fills response_.
  grpc::ByteBuffer frame_;  // the request as read, parsed into request_
  grpc::ByteBuffer out_;    // response_ serialized, being written
  int64_t frames_ ABSL_GUARDED_BY(mu_) = 0;
  v1::SessionRequest request_;
  v1::SessionResponse response_;
  std::optional<RequestScope> scope_;  // the request in flight's
};

AttentionService::AttentionService(Runtime* runtime, WorkQueue* work_queue,
                                   DecodeQueue* decode_queue, AttndMetrics* metrics,
                                   const BatchingDecodeQueue* batcher,
                                   std::shared_ptr<const TokenStore> tokens,
                                   int64_t max_inflight_request_bytes, RequestLog* request_log,
                                   RegionRegistry* regions, RingServer* rings,
                                   std::shared_ptr<wire::BufferPool> buffers)
    : runtime_(runtime),
      work_queue_(work_queue),
      decode_queue_(decode_queue),
      metrics_(metrics),
      batcher_(batcher),
      tokens_(std::move(tokens)),
      budget_(max_inflight_request_bytes),
      max_tensor_bytes_(runtime->Info().limits.max_message_bytes),
      request_log_(request_log),
      regions_(regions),
      rings_(rings),
      buffers_(std::move(buffers)) {}

absl::Status AttentionService::TakeRequestBytes(int64_t bytes) {
  // One message alone always fits: the flags guarantee the budget holds the largest message.
  if (budget_.TryTake(bytes, /*alone_may_exceed=*/true)) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat(
      "attnd is serving ", budget_.used(), " bytes of requests already; this one (", bytes,
      " bytes) would pass --max-inflight-request-bytes ", budget_.limit(), ": retry later"));
}

void AttentionService::GiveRequestBytes(int64_t bytes) {
  if (bytes > 0) budget_.Give(bytes);
}

void AttentionService::Record(absl::string_view rpc, int code, const RequestClock& clock,
                              int64_t bytes_received, int64_t bytes_sent) {
  if (request_log_ != nullptr) {
    const int64_t latency_us = clock.received != absl::InfinitePast()
                                   ? absl::ToInt64Microseconds(absl::Now() - clock.received)
                                   : -1;
    request_log_->Log({rpc, clock.tenant, clock.sequence_id, clock.tokens, code, latency_us});
  }
  if (metrics_ == nullptr) return;
  const absl::Time now = absl::Now();
  const absl::Time past = absl::InfinitePast();
  const bool started = clock.started != past;
  const double queue_s = started && clock.received != past
                             ? absl::ToDoubleSeconds(clock.started - clock.received)
                             : -1;
  const double compute_s = started && clock.finished != past
                               ? absl::ToDoubleSeconds(clock.finished - clock.started)
                               : -1;
  const double total_s = clock.received != past ? absl::ToDoubleSeconds(now - clock.received) : -1;
  metrics_->RecordRequest(rpc, StatusCodeName(code), queue_s, compute_s, total_s, bytes_received,
                          bytes_sent);
}

void AttentionService::BeginShutdown() {
  shutting_down_.store(true);
  MutexLock lock(&mu_);
  // OnDone (which unregisters) never runs inline here: it waits for the read that Finish ends.
  for (SessionReactor* session : sessions_) session->OnServerShutdown();
}

bool AttentionService::shutting_down() const { return shutting_down_.load(); }

bool AttentionService::WaitForCallsToEnd(absl::Time deadline) {
  while (true) {
    bool idle = live_calls_.load() == 0;
    if (idle) {
      MutexLock lock(&mu_);
      idle = sessions_.empty();
    }
    if (idle) return true;
    if (absl::Now() >= deadline) return false;
    absl::SleepFor(absl::Milliseconds(2));
  }
}

bool AttentionService::Register(SessionReactor* session) {
  MutexLock lock(&mu_);
  if (shutting_down_.load()) return false;
  sessions_.insert(session);
  return true;
}

void AttentionService::Unregister(SessionReactor* session) {
  MutexLock lock(&mu_);
  sessions_.erase(session);
}

void UnaryCall::Finish(grpc::Status status) {
  if (status.ok()) {
    bool own_buffer = false;
    grpc::Status serialized = grpc::SerializationTraits<google::protobuf::Message>::Serialize(
        *response_, reply_, &own_buffer);
    if (!serialized.ok()) {
      status = grpc::Status(grpc::StatusCode::INTERNAL,
                            "cannot serialize the response: " + serialized.error_message());
    }
  }
  grpc::ServerUnaryReactor::Finish(std::move(status));
}

namespace {

template <typename Request, typename Response>
class TypedUnaryCall final : public UnaryCall {
 public:
  explicit TypedUnaryCall(grpc::ByteBuffer* reply) : UnaryCall(&response, reply) {}
  Request request;
  Response response;
};

}  // namespace

// The reactor of a unary Prefill read by server/rpc/wire.h: owns the parsed request (views into its
// slices or pooled buffers) and the reply writer; the worker fills the reply before Finish.
class WirePrefillCall final : public grpc::ServerUnaryReactor {
 public:
  WirePrefillCall(wire::BufferPool* buffers, grpc::ByteBuffer* reply, std::atomic<int64_t>* live)
      : writer(buffers), reply(reply), live_(live) {
    live_->fetch_add(1);
  }
  // Counted out here, not in OnDone: a request that is not of the simple shape is deleted unserved
  // (protobuf's path takes it).
  ~WirePrefillCall() override { live_->fetch_sub(1); }
  void OnDone() override { delete this; }
  void OnCancel() override { cancelled->store(true, std::memory_order_release); }

  const std::shared_ptr<std::atomic<bool>> cancelled = NewCancelFlag();  // set by OnCancel
  wire::WirePrefillRequest request;
  wire::PrefillReplyWriter writer;
  grpc::ByteBuffer* const reply;

 private:
  std::atomic<int64_t>* const live_;
};

template <typename Request, typename Response>
grpc::ServerUnaryReactor* AttentionService::Raw(
    absl::string_view rpc, grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
    grpc::ByteBuffer* reply,
    void (AttentionService::*serve)(grpc::CallbackServerContext*, const Request*, Response*,
                                    UnaryCall*)) {
  auto* call = new TypedUnaryCall<Request, Response>(reply);
  call->CountIn(&live_calls_);
  grpc::ByteBuffer bytes(*request);  // shares the slices; Deserialize consumes its buffer
  const grpc::Status parsed =
      grpc::SerializationTraits<Request>::Deserialize(&bytes, &call->request);
  if (!parsed.ok()) {
    RequestClock clock;
    const absl::Status s = absl::InvalidArgumentError(absl::StrCat(
        "cannot parse ", Request::descriptor()->full_name(), ": the message's bytes are not a ",
        Request::descriptor()->full_name(), " (", parsed.error_message(), ")"));
    Record(rpc, static_cast<int>(s.code()), clock, static_cast<int64_t>(request->Length()), 0);
    call->Finish(ToGrpcStatus(s));
    return call;
  }
  (this->*serve)(context, &call->request, &call->response, call);
  return call;
}

grpc::ServerUnaryReactor* AttentionService::GetServerInfo(grpc::CallbackServerContext* context,
                                                          const grpc::ByteBuffer* request,
                                                          grpc::ByteBuffer* reply) {
  return Raw("GetServerInfo", context, request, reply, &AttentionService::ServeGetServerInfo);
}

grpc::ServerUnaryReactor* AttentionService::CreateSequence(grpc::CallbackServerContext* context,
                                                           const grpc::ByteBuffer* request,
                                                           grpc::ByteBuffer* reply) {
  return Raw("CreateSequence", context, request, reply, &AttentionService::ServeCreateSequence);
}

grpc::ServerUnaryReactor* AttentionService::ReleaseSequence(grpc::CallbackServerContext* context,
                                                            const grpc::ByteBuffer* request,
                                                            grpc::ByteBuffer* reply) {
  return Raw("ReleaseSequence", context, request, reply, &AttentionService::ServeReleaseSequence);
}

grpc::ServerUnaryReactor* AttentionService::Prefill(grpc::CallbackServerContext* context,
                                                    const grpc::ByteBuffer* request,
                                                    grpc::ByteBuffer* reply) {
  if (buffers_ != nullptr) {
    auto* call = new WirePrefillCall(buffers_.get(), reply, &live_calls_);
    if (wire::ParsePrefillRequest(*request, buffers_.get(), &call->request)) {
      ServeWirePrefill(context, static_cast<int64_t>(request->Length()), call);
      return call;
    }
    delete call;  // not the simple shape (or malformed): protobuf's parse, and its error
  }
  return Raw("Prefill", context, request, reply, &AttentionService::ServePrefill);
}

grpc::ServerUnaryReactor* AttentionService::Decode(grpc::CallbackServerContext* context,
                                                   const grpc::ByteBuffer* request,
                                                   grpc::ByteBuffer* reply) {
  return Raw("Decode", context, request, reply, &AttentionService::ServeDecode);
}

grpc::ServerUnaryReactor* AttentionService::RegisterRegion(grpc::CallbackServerContext* context,
                                                           const grpc::ByteBuffer* request,
                                                           grpc::ByteBuffer* reply) {
  return Raw("RegisterRegion", context, request, reply, &AttentionService::ServeRegisterRegion);
}

grpc::ServerUnaryReactor* AttentionService::UnregisterRegion(grpc::CallbackServerContext* context,
                                                             const grpc::ByteBuffer* request,
                                                             grpc::ByteBuffer* reply) {
  return Raw("UnregisterRegion", context, request, reply, &AttentionService::ServeUnregisterRegion);
}

grpc::ServerUnaryReactor* AttentionService::OpenRing(grpc::CallbackServerContext* context,
                                                     const grpc::ByteBuffer* request,
                                                     grpc::ByteBuffer* reply) {
  return Raw("OpenRing", context, request, reply, &AttentionService::ServeOpenRing);
}

grpc::ServerUnaryReactor* AttentionService::CloseRing(grpc::CallbackServerContext* context,
                                                      const grpc::ByteBuffer* request,
                                                      grpc::ByteBuffer* reply) {
  return Raw("CloseRing", context, request, reply, &AttentionService::ServeCloseRing);
}

template <typename Request, typename Response>
void AttentionService::ServeInline(absl::string_view rpc, grpc::CallbackServerContext* context,
                                   const Request* request, Response* response, UnaryCall* reactor,
                                   const std::function<absl::Status(const std::string&)>& body) {
  RequestClock clock;
  absl::StatusOr<std::string> tenant = TenantOf(tokens_.get(), *context);
  if (tenant.ok()) clock.tenant = *tenant;
  absl::Status s = tenant.status();
  if (s.ok() && shutting_down()) s = ShuttingDown();
  if (s.ok()) s = body(*tenant);
  if (!s.ok()) response->Clear();
  Record(rpc, static_cast<int>(s.code()), clock, SizeOf(*request), SizeOf(*response));
  reactor->Finish(ToGrpcStatus(s));
}

namespace {

absl::Status NoRegions(absl::string_view what) {
  return absl::FailedPreconditionError(
      absl::StrCat("this server serves no ", what, " (it runs with --max-regions-per-tenant 0)"));
}

// The engine reads a device-ordered call's inputs and writes its output on its stream, after the
// client's event: host memory would be read or written at the wrong time.
absl::Status CheckDeviceOrdered(bool q, bool k, bool v, bool o) {
  if (q && k && v && o) return absl::OkStatus();
  std::vector<std::string> not_device;
  for (auto [name, on_device] : {std::pair{"q", q}, {"k", k}, {"v", v}, {"the output", o}}) {
    if (!on_device) not_device.push_back(name);
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "a device-ordered frame (flag kDeviceOrdered) needs q, k, v and its output in CUDA IPC "
      "regions; not so: ",
      absl::StrJoin(not_device, ", ")));
}

}  // namespace

void AttentionService::ServeRegisterRegion(grpc::CallbackServerContext* context,
                                           const v1::RegisterRegionRequest* request,
                                           v1::RegisterRegionResponse* response,
                                           UnaryCall* reactor) {
  // On the gRPC thread: mapping a shm object or opening a handle is quick and computes nothing.
  ServeInline(
      "RegisterRegion", context, request, response, reactor,
      [this, request, response](const std::string& tenant) -> absl::Status {
        if (regions_ == nullptr) return NoRegions("tensor regions");
        absl::StatusOr<std::shared_ptr<const Region>> region;
        switch (request->kind_case()) {
          case v1::RegisterRegionRequest::kSystemShm:
            region = regions_->RegisterShm(
                tenant, request->system_shm().name(), request->system_shm().offset(),
                request->system_shm().byte_size(), RegionKind::kSystemShm);
            break;
          case v1::RegisterRegionRequest::kCudaIpc:
            region = regions_->RegisterCudaIpc(tenant, request->cuda_ipc().handle(),
                                               request->cuda_ipc().byte_size());
            break;
          default:
            return absl::InvalidArgumentError("RegisterRegionRequest needs system_shm or cuda_ipc");
        }
        if (!region.ok()) return region.status();
        response->set_region_id((*region)->id);
        response->set_byte_size((*region)->bytes);
        return absl::OkStatus();
      });
}

void AttentionService::ServeUnregisterRegion(grpc::CallbackServerContext* context,
                                             const v1::UnregisterRegionRequest* request,
                                             v1::UnregisterRegionResponse* response,
                                             UnaryCall* reactor) {
  ServeInline("UnregisterRegion", context, request, response, reactor,
              [this, request](const std::string& tenant) -> absl::Status {
                if (regions_ == nullptr) return NoRegions("tensor regions");
                return regions_->Unregister(tenant, request->region_id(), /*ring=*/false);
              });
}

void AttentionService::ServeOpenRing(grpc::CallbackServerContext* context,
                                     const v1::OpenRingRequest* request,
                                     v1::OpenRingResponse* response, UnaryCall* reactor) {
  ServeInline("OpenRing", context, request, response, reactor,
              [this, request, response](const std::string& tenant) -> absl::Status {
                if (rings_ == nullptr) return NoRegions("rings");
                absl::StatusOr<RingServer::Opened> opened = rings_->Open(
                    tenant, request->name(), request->byte_size(), request->device_events());
                if (!opened.ok()) return opened.status();
                response->set_ring_id(opened->ring_id);
                response->set_request_capacity(opened->request_capacity);
                response->set_response_capacity(opened->response_capacity);
                response->set_ready_event(opened->ready_event);
                response->set_done_event(opened->done_event);
                return absl::OkStatus();
              });
}

void AttentionService::ServeCloseRing(grpc::CallbackServerContext* context,
                                      const v1::CloseRingRequest* request,
                                      v1::CloseRingResponse* response, UnaryCall* reactor) {
  ServeInline("CloseRing", context, request, response, reactor,
              [this, request](const std::string& tenant) -> absl::Status {
                if (rings_ == nullptr) return NoRegions("rings");
                return rings_->Close(tenant, request->ring_id());
              });
}

absl::Status AttentionService::SubmitSessionRequest(const v1::SessionRequest& request,
                                                    absl::string_view tenant,
                                                    v1::SessionResponse* response,
                                                    std::function<void(absl::Status)> done,
                                                    bool on_caller) {
  const bool prefill = request.request_case() == v1::SessionRequest::kPrefill;
  auto scope = std::make_shared<RequestScope>(this, prefill ? "Ring.Prefill" : "Ring.Decode",
                                              SizeOf(request));
  ATTND_RETURN_IF_ERROR(scope->Admit(std::string(tenant), /*share=*/false));
  Describe(request, scope->clock());
  switch (request.request_case()) {
    case v1::SessionRequest::kPrefill: {
      auto run = [this, &request, response, scope, done = std::move(done)] {
        scope->clock()->started = absl::Now();
        absl::Status s =
            RunPrefill(request.prefill(), scope->tenant(), response->mutable_prefill());
        scope->clock()->finished = absl::Now();
        scope->End(s, 0);
        done(std::move(s));
      };
      return RunHereOrQueue(on_caller, std::move(run));
    }
    case v1::SessionRequest::kDecode: {
      RequestContext context;
      context.run_on_caller = on_caller;
      return SubmitDecode(request.decode(), scope->tenant(), context, response->mutable_decode(),
                          [scope, done = std::move(done)](absl::Status s) {
                            scope->clock()->finished = absl::Now();
                            scope->End(s, 0);
                            done(std::move(s));
                          });
    }
    default:
      return absl::InvalidArgumentError(
          "a session request must hold a prefill or a decode request");
  }
}

namespace {

// A version 2 frame's tensor as the shared checks take it: its claims and inline bytes (the
// shape points into `t`).
RequestTensor Claimed(const FrameTensor& t) {
  RequestTensor r;
  r.dtype = static_cast<DType>(t.dtype);
  r.shape = t.dims();
  r.bytes = t.data;
  return r;
}

// Its region reference, or null when it travels inline (the proto lives in `ref`).
const v1::RegionRef* RefOf(const FrameTensor& t, v1::RegionRef* ref) {
  if (t.where != ring::v2::kRegion) return nullptr;
  ref->set_region_id(std::string(t.region_id));
  ref->set_offset(t.offset);
  ref->set_byte_size(t.bytes);
  return ref;
}

PackedTensor Packed(const FrameTensor& t, v1::RegionRef* ref) {
  PackedTensor p;
  p.dtype = t.dtype;
  p.shape = t.dims();
  p.data = t.data;
  p.region = RefOf(t, ref);
  return p;
}

}  // namespace

absl::Status AttentionService::SubmitRingFrame(const RequestFrame& frame, absl::string_view tenant,
                                               FrameAnswer* answer,
                                               std::function<void(absl::Status)> done,
                                               bool on_caller) {
  const bool prefill = frame.op == ring::v2::kPrefill;
  auto scope = std::make_shared<RequestScope>(this, prefill ? "Ring.Prefill" : "Ring.Decode",
                                              static_cast<int64_t>(frame.bytes));
  ATTND_RETURN_IF_ERROR(scope->Admit(std::string(tenant), /*share=*/false));
  // For the request log, as Describe.
  if (!frame.sequence_ids.empty()) scope->clock()->sequence_id = std::string(frame.sequence_ids[0]);
  scope->clock()->tokens = prefill ? (frame.q.rank > 0 ? frame.q.shape[0] : -1)
                                   : static_cast<int64_t>(frame.sequence_ids.size());
  if (!prefill) {
    return CatchAll("the decode", [&] {
      return SubmitFrameDecode(frame, scope->tenant(), answer, on_caller,
                               [scope, done = std::move(done)](absl::Status s) {
                                 scope->clock()->finished = absl::Now();
                                 scope->End(s, 0);
                                 done(std::move(s));
                               });
    });
  }
  auto run = [this, &frame, answer, scope, done = std::move(done)] {
    scope->clock()->started = absl::Now();
    absl::Status no_room;  // why the inline output had no buffer
    absl::Status s = CatchAll("the prefill", [&] {
      v1::RegionRef refs[4];
      PrefillArgs args;
      args.sequence_id = frame.sequence_ids[0];
      args.layer = frame.layer;
      args.q_layout = frame.q_layout;
      args.prompt_len = frame.prompt_len;
      args.q = Claimed(frame.q);
      args.k = Claimed(frame.k);
      args.v = Claimed(frame.v);
      args.q_region = RefOf(frame.q, &refs[0]);
      args.k_region = RefOf(frame.k, &refs[1]);
      args.v_region = RefOf(frame.v, &refs[2]);
      args.output_region = RefOf(frame.o, &refs[3]);
      const DeviceOrder order{frame.done_event};
      if (frame.device_ordered) args.order = &order;
      OutputBufferFn output = [answer, &no_room](int64_t bytes) -> void* {
        absl::StatusOr<char*> buffer = answer->output_buffer(static_cast<uint64_t>(bytes), 1);
        if (!buffer.ok()) {
          no_room = buffer.status();
          return nullptr;
        }
        answer->output = *buffer;
        answer->output_bytes = static_cast<uint64_t>(bytes);
        return *buffer;
      };
      absl::StatusOr<PrefillResult> result =
          RunPrefillArgs(args, scope->tenant(), std::move(output), nullptr);
      if (!result.ok()) return result.status();
      answer->dtype = static_cast<int32_t>(result->out_dtype);
      answer->shape = result->out_shape;
      answer->lengths = {result->length};
      answer->output_in_region = args.output_region != nullptr;
      return absl::OkStatus();
    });
    // The runtime asked for the output's buffer before anything ran: say why there was none.
    if (!s.ok() && !no_room.ok()) s = no_room;
    if (!s.ok()) answer->Clear();
    scope->clock()->finished = absl::Now();
    scope->End(s, 0);
    done(std::move(s));
  };
  return RunHereOrQueue(on_caller, std::move(run));
}

absl::Status AttentionService::SubmitFrameDecode(const RequestFrame& frame,
                                                 absl::string_view tenant, FrameAnswer* answer,
                                                 bool on_caller,
                                                 std::function<void(absl::Status)> done) {
  // The references live as long as the call (RegionTensors keeps none of them).
  auto refs = std::make_shared<std::array<v1::RegionRef, 4>>();
  PackedDecodeArgs args;
  args.sequence_ids = frame.sequence_ids;
  args.q_layout = frame.q_layout;
  args.q = Packed(frame.q, &(*refs)[0]);
  args.k = Packed(frame.k, &(*refs)[1]);
  args.v = Packed(frame.v, &(*refs)[2]);
  const v1::RegionRef* output_region = RefOf(frame.o, &(*refs)[3]);
  const ModelConfig& m = runtime_->model();
  PackedRows rows;
  ATTND_RETURN_IF_ERROR(CheckPackedDecode(args, m, /*regions_allowed=*/true, &rows));
  const int64_t b = static_cast<int64_t>(frame.sequence_ids.size());
  // The regions' leases and copies live until the call is answered.
  auto regions = std::make_shared<RegionTensors>(regions_, tenant, &budget_, max_tensor_bytes_);
  ATTND_ASSIGN_OR_RETURN(RequestTensor q,
                         regions->Input("packed q", Claimed(frame.q), args.q.region));
  ATTND_ASSIGN_OR_RETURN(RequestTensor k,
                         regions->Input("packed k", Claimed(frame.k), args.k.region));
  ATTND_ASSIGN_OR_RETURN(RequestTensor v,
                         regions->Input("packed v", Claimed(frame.v), args.v.region));
  const uint64_t out_bytes = static_cast<uint64_t>(rows.out * b);
  char* out = nullptr;
  bool out_on_device = false;
  DecodeCall call;
  call.tenant = tenant;
  call.layer = frame.layer;
  if (output_region != nullptr) {
    OutputBufferFn fn;
    ATTND_RETURN_IF_ERROR(regions->Output("output_region", *output_region, ElementSize(q.dtype),
                                          out_bytes, &fn, &out_on_device));
    out = static_cast<char*>(fn(static_cast<int64_t>(out_bytes)));
    RegionTensors* r = regions.get();
    if (!out_on_device) call.before_commit = [r] { return r->CopyOutputs(); };
  } else {
    ATTND_ASSIGN_OR_RETURN(out, answer->output_buffer(out_bytes, static_cast<uint64_t>(b)));
    answer->output = out;
    answer->output_bytes = out_bytes;
  }
  FillPackedEntries(args, rows, q, k, v, out, out_on_device, &call);
  std::shared_ptr<const DeviceOrder> order;  // lives until the call is answered
  if (frame.device_ordered) {
    ATTND_RETURN_IF_ERROR(CheckDeviceOrdered(q.on_device, k.on_device, v.on_device, out_on_device));
    order = std::make_shared<const DeviceOrder>(
        DeviceOrder{frame.done_event, frame.gate_word, frame.gate_value});
    for (DecodeCall::Entry& e : call.entries) e.order = order.get();
  }
  const bool in_region = output_region != nullptr;
  RequestContext context;
  context.run_on_caller = on_caller;
  context.more_follow = frame.more_follow;
  return decode_queue_->Submit(
      std::move(call), context,
      [this, b, answer, regions, refs, order, in_region,
       done = std::move(done)](absl::StatusOr<DecodeResult> result) {
        if (!DecodeSettled(regions.get(), b, result)) {
          answer->Clear();
          done(result.status());
          return;
        }
        answer->lengths.clear();
        answer->lengths.reserve(result->outputs.size());
        for (const DecodeResult::Output& o : result->outputs) answer->lengths.push_back(o.length);
        if (!result->outputs.empty()) {
          const DecodeResult::Output& first = result->outputs.front();
          answer->dtype = static_cast<int32_t>(first.out_dtype);
          answer->shape = {static_cast<int64_t>(result->outputs.size())};
          answer->shape.insert(answer->shape.end(), first.out_shape.begin(), first.out_shape.end());
        }
        answer->output_in_region = in_region;
        done(absl::OkStatus());
      });
}

void AttentionService::ServeGetServerInfo(grpc::CallbackServerContext* context,
                                          const v1::GetServerInfoRequest* request,
                                          v1::GetServerInfoResponse* response, UnaryCall* reactor) {
  // Cheap and lock-light: answered on the gRPC thread.
  RequestClock clock;
  absl::StatusOr<std::string> tenant = TenantOf(tokens_.get(), *context);
  // While draining every new call hears it, so a client that polls goes elsewhere before gRPC
  // shuts down (then it would see a bare CANCELLED).
  if (tenant.ok() && shutting_down()) tenant = ShuttingDown();
  if (!tenant.ok()) {
    Record("GetServerInfo", static_cast<int>(tenant.status().code()), clock, SizeOf(*request), 0);
    reactor->Finish(ToGrpcStatus(tenant.status()));
    return;
  }
  // With tokens, a tenant sees its own sequences and pages and the pool's capacity, never how
  // much the others use.
  const bool scoped = tokens_ != nullptr;
  const ServerInfo info = runtime_->Info();
  const TenantUsage usage = runtime_->Usage(*tenant);
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
  model->set_rope_theta(info.model.rope_theta);
  model->set_partial_rotary_factor(info.model.partial_rotary_factor);
  model->set_rotary_dim(info.model.rotary_dim);
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
  if (!scoped) kv->set_pages_free(info.kv_cache.pages_free);
  kv->set_tenant_pages(usage.pages);
  kv->set_bytes_per_page(info.kv_cache.bytes_per_page);
  kv->set_pool_bytes(info.kv_cache.pool_bytes);
  for (const EngineShard& shard : info.devices) {
    v1::DeviceShard* d = response->add_devices();
    d->set_device(shard.device);
    d->set_device_name(shard.device_name);
    d->set_device_uuid(shard.device_uuid);
    d->set_first_kv_head(shard.first_kv_head);
    d->set_num_kv_heads(shard.num_kv_heads);
    d->set_first_q_head(shard.first_q_head);
    d->set_num_q_heads(shard.num_q_heads);
    d->set_pool_bytes(shard.pool_bytes);
    if (!scoped) d->set_bytes_used(shard.bytes_used);
  }
  response->set_live_sequences(scoped ? usage.sequences : info.live_sequences);
  response->set_tenant_scoped(scoped);
  v1::Limits* limits = response->mutable_limits();
  limits->set_max_message_bytes(info.limits.max_message_bytes);
  limits->set_max_sequence_length(info.limits.max_sequence_length);
  limits->set_max_sequences(info.limits.max_sequences);
  limits->set_tenant_max_sequences(info.limits.tenant_max_sequences);
  limits->set_tenant_page_quota(info.limits.tenant_page_quota);
  limits->set_max_prefill_tokens_per_call(info.limits.max_prefill_tokens_per_call);
  response->mutable_instance()->set_name(info.instance.name);
  response->mutable_instance()->set_advertise_address(info.instance.advertise_address);
  if (regions_ != nullptr) {
    v1::RegionSupport* r = response->mutable_regions();
    r->add_kinds(v1::REGION_KIND_SYSTEM_SHM);
    if (regions_->cuda_ipc()) r->add_kinds(v1::REGION_KIND_CUDA_IPC);
    r->set_host_boot_id(HostBootId());
    r->set_device_uuid(runtime_->engine().device_uuid());
    r->set_max_regions_per_tenant(regions_->options().max_regions_per_tenant);
    r->set_max_region_bytes_per_tenant(regions_->options().max_bytes_per_tenant);
    r->set_idle_timeout_seconds(absl::ToInt64Seconds(regions_->options().idle_timeout));
    r->set_rings(rings_ != nullptr);
    r->set_device_ordered_rings(rings_ != nullptr && rings_->device_events());
    if (rings_ != nullptr) r->set_max_ring_slots(static_cast<int32_t>(ring::kMaxSlots));
    r->set_cuda_mps(runtime_->engine().cuda_mps());
    r->set_shm_name_prefix(ShmNamePrefix(*tenant));
  }
  if (batcher_ != nullptr) {
    FillBatchingStats(*batcher_, scoped, runtime_->engine().decode_graphs(),
                      response->mutable_decode_batching());
  } else {
    response->mutable_decode_batching()->set_enabled(false);
  }
  Record("GetServerInfo", 0, clock, SizeOf(*request), SizeOf(*response));
  reactor->Finish(grpc::Status::OK);
}

template <typename Request, typename Response>
void AttentionService::ServeOnWorker(absl::string_view rpc, grpc::CallbackServerContext* context,
                                     const Request* request, Response* response, UnaryCall* reactor,
                                     std::function<absl::Status(const std::string&)> body) {
  auto scope = std::make_shared<RequestScope>(this, rpc, SizeOf(*request));
  Describe(*request, scope->clock());
  if (absl::Status s = scope->Admit(*context); !s.ok()) {
    scope->End(s, 0);
    reactor->Finish(ToGrpcStatus(s));
    return;
  }
  absl::Status submitted =
      work_queue_->Submit(ContextOf(context, reactor->cancelled(), scope->clock()),
                          [scope, reactor, response, body = std::move(body)](absl::Status s) {
                            if (s.ok()) s = body(scope->tenant());
                            scope->clock()->finished = absl::Now();
                            scope->End(s, SizeOf(*response));
                            reactor->Finish(ToGrpcStatus(s));
                          });
  if (!submitted.ok()) {
    scope->End(submitted, 0);
    reactor->Finish(ToGrpcStatus(submitted));
  }
}

void AttentionService::ServeCreateSequence(grpc::CallbackServerContext* context,
                                           const v1::CreateSequenceRequest* request,
                                           v1::CreateSequenceResponse* response,
                                           UnaryCall* reactor) {
  ServeOnWorker("CreateSequence", context, request, response, reactor,
                [this, response](const std::string& tenant) {
                  absl::StatusOr<std::string> id = runtime_->CreateSequence(tenant);
                  if (id.ok()) response->set_sequence_id(*id);
                  return id.status();
                });
}

void AttentionService::ServeReleaseSequence(grpc::CallbackServerContext* context,
                                            const v1::ReleaseSequenceRequest* request,
                                            v1::ReleaseSequenceResponse* response,
                                            UnaryCall* reactor) {
  // On a worker: Release waits for a request in flight on the sequence.
  ServeOnWorker("ReleaseSequence", context, request, response, reactor,
                [this, request, response](const std::string& tenant) {
                  absl::StatusOr<int64_t> freed =
                      runtime_->ReleaseSequence(request->sequence_id(), tenant);
                  if (freed.ok()) response->set_pages_freed(*freed);
                  return freed.status();
                });
}

namespace {

// A tensor's claims (dtype, shape) and its inline bytes, for checks made before any region
// memory is read.
RequestTensor Claimed(const v1::Tensor& t) {
  RequestTensor r;
  r.dtype = static_cast<DType>(t.dtype());
  r.shape = absl::MakeConstSpan(t.shape().data(), t.shape().size());
  r.bytes = t.data();
  return r;
}

}  // namespace

absl::Status AttentionService::RunPrefill(const v1::PrefillRequest& request,
                                          absl::string_view tenant, v1::PrefillResponse* response,
                                          std::function<absl::Status()> keep_going) {
  absl::Status s = CatchAll("the prefill", [&] {
    return RunPrefillUnsafe(request, tenant, response, std::move(keep_going));
  });
  if (!s.ok()) response->Clear();
  return s;
}

absl::Status AttentionService::RunPrefillUnsafe(const v1::PrefillRequest& request,
                                                absl::string_view tenant,
                                                v1::PrefillResponse* response,
                                                std::function<absl::Status()> keep_going) {
  PrefillArgs args;
  args.sequence_id = request.sequence_id();
  args.layer = request.layer();
  args.q_layout = request.q_layout();
  if (request.has_prompt_len()) args.prompt_len = request.prompt_len();
  args.q = Claimed(request.q());
  args.k = Claimed(request.k());
  args.v = Claimed(request.v());
  if (request.q().has_region()) args.q_region = &request.q().region();
  if (request.k().has_region()) args.k_region = &request.k().region();
  if (request.v().has_region()) args.v_region = &request.v().region();
  if (request.has_output_region()) args.output_region = &request.output_region();
  absl::StatusOr<PrefillResult> result =
      RunPrefillArgs(args, tenant, IntoTensor(response->mutable_o()), std::move(keep_going));
  if (!result.ok()) {
    response->Clear();
    return result.status();
  }
  SetMeta(result->out_dtype, result->out_shape, response->mutable_o());
  if (request.has_output_region())
    *response->mutable_o()->mutable_region() = request.output_region();
  response->set_length(result->length);
  return absl::OkStatus();
}

absl::StatusOr<PrefillResult> AttentionService::RunPrefillArgs(
    const PrefillArgs& args, absl::string_view tenant, OutputBufferFn output,
    std::function<absl::Status()> keep_going) {
  PrefillCall call;
  call.keep_going = std::move(keep_going);
  call.sequence_id = args.sequence_id;
  call.tenant = tenant;
  call.layer = args.layer;
  call.q_layout = static_cast<QLayout>(args.q_layout);
  call.q = args.q;
  call.k = args.k;
  call.v = args.v;
  call.prompt_len = args.prompt_len;
  const bool names_regions = args.q_region != nullptr || args.k_region != nullptr ||
                             args.v_region != nullptr || args.output_region != nullptr;
  int64_t tokens = 0;
  // Region references are judged by what they claim before a byte of region memory is copied
  // (a reference costs the client nothing; the copy costs attnd its size).
  if (names_regions) ATTND_RETURN_IF_ERROR(runtime_->CheckPrefillShapes(call, &tokens));
  RegionTensors regions(regions_, tenant, &budget_, max_tensor_bytes_);
  ATTND_ASSIGN_OR_RETURN(call.q, regions.Input("q", args.q, args.q_region));
  ATTND_ASSIGN_OR_RETURN(call.k, regions.Input("k", args.k, args.k_region));
  ATTND_ASSIGN_OR_RETURN(call.v, regions.Input("v", args.v, args.v_region));
  if (args.output_region != nullptr) {
    // o is [T, Hq, D] of q's dtype, T checked above.
    const ModelConfig& m = runtime_->model();
    const uint64_t element = ElementSize(call.q.dtype);
    ATTND_RETURN_IF_ERROR(
        regions.Output("output_region", *args.output_region, element,
                       static_cast<uint64_t>(tokens) * static_cast<uint64_t>(m.num_q_heads) *
                           static_cast<uint64_t>(m.head_dim) * element,
                       &call.output, &call.output_on_device));
    call.before_commit = [&regions] { return regions.CopyOutputs(); };
  } else {
    call.output = std::move(output);
  }
  if (args.order != nullptr) {
    ATTND_RETURN_IF_ERROR(CheckDeviceOrdered(call.q.on_device, call.k.on_device, call.v.on_device,
                                             call.output_on_device));
    call.order = args.order;
  }
  return runtime_->Prefill(call);
}

void AttentionService::ServeWirePrefill(grpc::CallbackServerContext* context, int64_t request_bytes,
                                        WirePrefillCall* call) {
  auto scope = std::make_shared<RequestScope>(this, "Prefill", request_bytes);
  scope->clock()->sequence_id = call->request.sequence_id;  // for the request log, as Describe
  if (!call->request.q.shape.empty()) scope->clock()->tokens = call->request.q.shape[0];
  if (absl::Status s = scope->Admit(*context); !s.ok()) {
    scope->End(s, 0);
    call->Finish(ToGrpcStatus(s));
    return;
  }
  absl::Status submitted = work_queue_->Submit(
      ContextOf(context, call->cancelled, scope->clock()),
      [this, call, scope, deadline = DeadlineOf(context)](absl::Status s) {
        if (s.ok()) {
          s = CatchAll("the prefill", [&] {
            return RunWirePrefill(call, scope->tenant(), StopWhenGone(deadline, call->cancelled));
          });
        }
        scope->clock()->finished = absl::Now();
        scope->End(s, s.ok() ? static_cast<int64_t>(call->reply->Length()) : 0);
        call->Finish(ToGrpcStatus(s));
      });
  if (!submitted.ok()) {
    scope->End(submitted, 0);
    call->Finish(ToGrpcStatus(submitted));
  }
}

namespace {

RequestTensor FromWire(const wire::WireTensor& t) {
  RequestTensor r;
  r.dtype = static_cast<DType>(t.dtype);
  r.shape = absl::MakeConstSpan(t.shape);
  r.bytes = t.bytes;
  return r;
}

}  // namespace

absl::Status AttentionService::RunWirePrefill(WirePrefillCall* call, absl::string_view tenant,
                                              std::function<absl::Status()> keep_going) {
  const wire::WirePrefillRequest& request = call->request;
  PrefillCall c;
  c.keep_going = std::move(keep_going);
  c.sequence_id = request.sequence_id;
  c.tenant = tenant;
  c.layer = request.layer;
  c.q_layout = static_cast<QLayout>(request.q_layout);
  c.q = FromWire(request.q);
  c.k = FromWire(request.k);
  c.v = FromWire(request.v);
  c.prompt_len = request.prompt_len;
  // The engine writes o once, into a pooled buffer that the reply then references (no zero fill,
  // no serialize copy).
  wire::PrefillReplyWriter* writer = &call->writer;
  c.output = [writer](int64_t bytes) { return writer->Output(bytes); };
  absl::StatusOr<PrefillResult> result = runtime_->Prefill(c);
  if (!result.ok()) return result.status();
  *call->reply = writer->Finish(result->out_dtype, result->out_shape, result->length);
  return absl::OkStatus();
}

void AttentionService::ServePrefill(grpc::CallbackServerContext* context,
                                    const v1::PrefillRequest* request,
                                    v1::PrefillResponse* response, UnaryCall* reactor) {
  ServeOnWorker("Prefill", context, request, response, reactor,
                [this, request, response,
                 keep_going = StopWhenGone(DeadlineOf(context), reactor->cancelled())](
                    const std::string& tenant) {
                  return RunPrefill(*request, tenant, response, keep_going);
                });
}

absl::Status AttentionService::SubmitDecode(const v1::DecodeRequest& request,
                                            absl::string_view tenant, const RequestContext& context,
                                            v1::DecodeResponse* response,
                                            std::function<void(absl::Status)> done) {
  absl::Status s = CatchAll("the decode", [&] {
    return SubmitDecodeUnsafe(request, tenant, context, response, std::move(done));
  });
  if (!s.ok()) response->Clear();
  return s;
}

absl::Status AttentionService::SubmitDecodeUnsafe(const v1::DecodeRequest& request,
                                                  absl::string_view tenant,
                                                  const RequestContext& context,
                                                  v1::DecodeResponse* response,
                                                  std::function<void(absl::Status)> done) {
  if (IsPackedDecode(request))
    return SubmitPackedDecode(request, tenant, context, response, std::move(done));
  DecodeCall call;
  call.tenant = tenant;
  call.layer = request.layer();
  call.entries.resize(request.entries_size());
  response->Clear();
  // The regions' leases and copies live until the call is answered.
  auto regions = std::make_shared<RegionTensors>(regions_, tenant, &budget_, max_tensor_bytes_);
  const ModelConfig& m = runtime_->model();
  // Outputs exist before the engine runs so it can write into them; their addresses are stable.
  for (int i = 0; i < request.entries_size(); ++i) response->add_outputs();
  bool staged_outputs = false;
  for (int i = 0; i < request.entries_size(); ++i) {
    const v1::DecodeEntry& in = request.entries(i);
    DecodeCall::Entry& e = call.entries[i];
    e.sequence_id = in.sequence_id();
    e.q_layout = static_cast<QLayout>(in.q_layout());
    const std::string at = absl::StrCat("entries[", i, "].");
    if (in.q().has_region() || in.k().has_region() || in.v().has_region() ||
        in.has_output_region()) {
      // Judged by its claims before any region memory is copied (see RunPrefillUnsafe).
      e.q = Claimed(in.q());
      e.k = Claimed(in.k());
      e.v = Claimed(in.v());
      if (absl::Status s = runtime_->CheckDecodeShapes(e); !s.ok()) {
        response->Clear();
        return absl::Status(s.code(), absl::StrCat("entries[", i, "]: ", s.message()));
      }
    }
    absl::StatusOr<RequestTensor> q = regions->Input(absl::StrCat(at, "q"), in.q());
    absl::StatusOr<RequestTensor> k = q.ok() ? regions->Input(absl::StrCat(at, "k"), in.k()) : q;
    absl::StatusOr<RequestTensor> v = k.ok() ? regions->Input(absl::StrCat(at, "v"), in.v()) : k;
    if (!v.ok()) {
      response->Clear();
      return v.status();
    }
    e.q = *q;
    e.k = *k;
    e.v = *v;
    if (in.has_output_region()) {
      const uint64_t element = ElementSize(e.q.dtype);
      if (absl::Status s = regions->Output(
              absl::StrCat(at, "output_region"), in.output_region(), element,
              static_cast<uint64_t>(m.num_q_heads) * static_cast<uint64_t>(m.head_dim) * element,
              &e.output, &e.output_on_device);
          !s.ok()) {
        response->Clear();
        return s;
      }
      staged_outputs = true;
    } else {
      e.output = IntoTensor(response->mutable_outputs(i)->mutable_o());
    }
  }
  // Staged shm outputs reach their regions before the runtime commits: a region that shrank
  // fails the call, which then changes nothing.
  if (staged_outputs) {
    RegionTensors* r = regions.get();
    call.before_commit = [r] { return r->CopyOutputs(); };
  }
  const int64_t entries = request.entries_size();
  return decode_queue_->Submit(std::move(call), context,
                               [this, entries, response, regions, &request,
                                done = std::move(done)](absl::StatusOr<DecodeResult> result) {
                                 if (!DecodeSettled(regions.get(), entries, result)) {
                                   response->Clear();
                                   done(result.status());
                                   return;
                                 }
                                 for (size_t i = 0; i < result->outputs.size(); ++i) {
                                   const DecodeResult::Output& out = result->outputs[i];
                                   v1::DecodeOutput* o =
                                       response->mutable_outputs(static_cast<int>(i));
                                   SetMeta(out.out_dtype, out.out_shape, o->mutable_o());
                                   const v1::DecodeEntry& in = request.entries(static_cast<int>(i));
                                   if (in.has_output_region())
                                     *o->mutable_o()->mutable_region() = in.output_region();
                                   o->set_length(out.length);
                                 }
                                 done(absl::OkStatus());
                               });
}

absl::Status AttentionService::RunHereOrQueue(bool here, std::function<void()> run) {
  if (!here) return work_queue_->Submit(std::move(run));
  run();
  return absl::OkStatus();
}

bool AttentionService::DecodeSettled(RegionTensors* regions, int64_t entries,
                                     const absl::StatusOr<DecodeResult>& result) {
  // The reply (done) may reach the client before this callback, and with it the last reference
  // to the regions, is destroyed: the leases end first, or an UnregisterRegion right after the
  // reply could still see a region in use.
  if (regions != nullptr) regions->ReleaseLeases();
  // DecodeBatcherOptions::on_batch observes the batcher's merged batches.
  if (result.ok() && metrics_ != nullptr && batcher_ == nullptr) {
    metrics_->ObserveDecodeBatch(entries, result->stats);
  }
  return result.ok();
}

absl::Status AttentionService::SubmitPackedDecode(const v1::DecodeRequest& request,
                                                  absl::string_view tenant,
                                                  const RequestContext& context,
                                                  v1::DecodeResponse* response,
                                                  std::function<void(absl::Status)> done) {
  DecodeCall call;
  call.tenant = tenant;
  call.layer = request.layer();
  response->Clear();
  if (absl::Status s = UnpackDecode(request, runtime_->model(), &call, response); !s.ok()) {
    response->Clear();
    return s;
  }
  const int64_t entries = request.sequence_ids_size();
  return decode_queue_->Submit(
      std::move(call), context,
      [this, entries, response, done = std::move(done)](absl::StatusOr<DecodeResult> result) {
        if (!DecodeSettled(/*regions=*/nullptr, entries, result)) {
          response->Clear();
          done(result.status());
          return;
        }
        FinishPackedDecode(*result, response);
        done(absl::OkStatus());
      });
}

namespace {

// Copies of shm tensors are made where a decode is submitted. One that claims more region bytes
// than this is submitted from a worker instead, so that no gRPC thread copies for long.
constexpr uint64_t kMaxRegionBytesOnGrpcThread = uint64_t{1} << 20;

uint64_t ClaimedRegionBytes(const v1::DecodeRequest& request) {
  uint64_t bytes = 0;
  for (const v1::DecodeEntry& e : request.entries()) {
    for (const v1::Tensor* t : {&e.q(), &e.k(), &e.v()}) {
      if (t->has_region()) bytes += std::min<uint64_t>(t->region().byte_size(), uint64_t{1} << 40);
    }
    if (e.has_output_region()) {
      bytes += std::min<uint64_t>(e.output_region().byte_size(), uint64_t{1} << 40);
    }
  }
  return bytes;
}

}  // namespace

absl::Status AttentionService::SubmitDecodeFromGrpcThread(const v1::DecodeRequest& request,
                                                          absl::string_view tenant,
                                                          const RequestContext& context,
                                                          v1::DecodeResponse* response,
                                                          std::function<void(absl::Status)> done) {
  if (ClaimedRegionBytes(request) <= kMaxRegionBytesOnGrpcThread) {
    return SubmitDecode(request, tenant, context, response, std::move(done));
  }
  auto shared_done = std::make_shared<std::function<void(absl::Status)>>(std::move(done));
  return work_queue_->Submit([this, &request, tenant, context, response, shared_done] {
    absl::Status s =
        SubmitDecode(request, tenant, context, response,
                     [shared_done](absl::Status st) { (*shared_done)(std::move(st)); });
    if (!s.ok()) (*shared_done)(std::move(s));
  });
}

void AttentionService::ServeDecode(grpc::CallbackServerContext* context,
                                   const v1::DecodeRequest* request, v1::DecodeResponse* response,
                                   UnaryCall* reactor) {
  // Shared by the queue (which tells its clock when a worker starts the call) and the reply.
  auto scope = std::make_shared<RequestScope>(this, "Decode", SizeOf(*request));
  if (absl::Status s = scope->Admit(*context); !s.ok()) {
    scope->End(s, 0);
    reactor->Finish(ToGrpcStatus(s));
    return;
  }
  Describe(*request, scope->clock());
  absl::Status submitted = SubmitDecodeFromGrpcThread(
      *request, scope->tenant(), ContextOf(context, reactor->cancelled(), scope->clock()), response,
      [reactor, response, scope](absl::Status s) {
        scope->clock()->finished = absl::Now();
        scope->End(s, SizeOf(*response));
        reactor->Finish(ToGrpcStatus(s));
      });
  if (!submitted.ok()) {
    scope->End(submitted, 0);
    reactor->Finish(ToGrpcStatus(submitted));
  }
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* AttentionService::Session(
    grpc::CallbackServerContext* context) {
  return new SessionReactor(this, context);
}

}  // namespace attnd
