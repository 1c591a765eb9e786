// The Attention gRPC service on the callback API. Handlers only translate: proto tensors become
// views into the request's bytes (no copy), the work goes to the work queue (so gRPC threads never
// compute), and outputs are written by the engine straight into the response's bytes field.
#ifndef ATTND_SERVER_RPC_SERVICE_H_
#define ATTND_SERVER_RPC_SERVICE_H_

#include <atomic>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "attnd/v1/attention.grpc.pb.h"
#include "base/byte_budget.h"
#include "base/mutex.h"
#include "server/dataplane/regions.h"
#include "server/dataplane/ring.h"
#include "server/dataplane/ring_frame.h"
#include "server/rpc/auth.h"
#include "server/rpc/metrics.h"
#include "server/rpc/request_log.h"
#include "server/rpc/wire.h"
#include "server/runtime/runtime.h"
#include "server/sched/batcher.h"
#include "server/sched/decode_queue.h"
#include "server/sched/request_context.h"
#include "server/sched/work_queue.h"

namespace attnd {

class RegionTensors;  // server/rpc/region_tensors.h

class SessionReactor;
class WirePrefillCall;
struct RequestClock;
class RequestScope;

// Thread-safe; gRPC calls the handlers from its own threads. runtime, work_queue and decode_queue
// (and metrics, if given) must outlive the service and every RPC it started.
//
// Every RPC acts as the tenant of its own metadata, TenantOf(tokens, context) ("" when auth is
// off, tokens null). A request whose client
// deadline has passed, or whose call was cancelled, by the time a worker picks it up is answered
// DEADLINE_EXCEEDED / CANCELLED without touching the KV pool. With `metrics`, each RPC is recorded
// (AttndMetrics::RecordRequest); requests on a Session stream as "Session.Prefill" and
// "Session.Decode", and the stream's own end as "Session".
// Every method is raw (ByteBuffer) so that the service, not gRPC, parses requests: a message that
// does not parse gets INVALID_ARGUMENT "cannot parse attnd.v1.<Request>" (gRPC 1.51's typed
// callback methods answered UNIMPLEMENTED with no message), and a Session frame that does not parse
// ends the stream with INVALID_ARGUMENT instead of looking like the client's half-close (gRPC's
// typed read reports both as ok=false), which silently dropped the rest.
using AttentionServiceBase = v1::Attention::WithRawCallbackMethod_GetServerInfo<
    v1::Attention::WithRawCallbackMethod_CreateSequence<
        v1::Attention::WithRawCallbackMethod_ReleaseSequence<
            v1::Attention::WithRawCallbackMethod_Prefill<
                v1::Attention::WithRawCallbackMethod_Decode<
                    v1::Attention::WithRawCallbackMethod_Session<
                        v1::Attention::WithRawCallbackMethod_RegisterRegion<
                            v1::Attention::WithRawCallbackMethod_UnregisterRegion<
                                v1::Attention::WithRawCallbackMethod_OpenRing<
                                    v1::Attention::WithRawCallbackMethod_CloseRing<
                                        v1::Attention::Service>>>>>>>>>>;

// The reactor of one raw unary call: owns the parsed request and the response, and Finish
// serializes the response (on OK) into the call's reply bytes first.
class UnaryCall : public grpc::ServerUnaryReactor {
 public:
  UnaryCall(google::protobuf::Message* response, grpc::ByteBuffer* reply)
      : response_(response), reply_(reply) {}
  void Finish(grpc::Status status);  // hides ServerUnaryReactor::Finish, on purpose
  ~UnaryCall() override {
    if (live_ != nullptr) live_->fetch_sub(1);
  }
  void OnDone() override { delete this; }
  // Counts this call in `live` until it is done (AttentionService::WaitForCallsToEnd).
  void CountIn(std::atomic<int64_t>* live) {
    live_ = live;
    live_->fetch_add(1);
  }
  // Sets the flag a queued request's RequestContext carries: a cancelled call is not run.
  void OnCancel() override { cancelled_->store(true, std::memory_order_release); }
  const std::shared_ptr<std::atomic<bool>>& cancelled() const { return cancelled_; }

 private:
  const std::shared_ptr<std::atomic<bool>> cancelled_ = NewCancelFlag();
  std::atomic<int64_t>* live_ = nullptr;
  google::protobuf::Message* const response_;
  grpc::ByteBuffer* const reply_;
};

class AttentionService : public AttentionServiceBase {
 public:
  // `batcher`: decode_queue when it is a BatchingDecodeQueue, for GetServerInfo's decode_batching
  // counters (nullptr: batching is reported off). `request_log` (may be null; must outlive the
  // service) gets every recorded RPC. `buffers`: unary Prefill requests of the simple shape are
  // read by server/rpc/wire.h (tensors gathered from the message's slices into these buffers) and
  // their replies written around the engine's output (nullptr: protobuf parses and serializes
  // every message).
  AttentionService(Runtime* runtime, WorkQueue* work_queue, DecodeQueue* decode_queue,
                   AttndMetrics* metrics = nullptr, const BatchingDecodeQueue* batcher = nullptr,
                   std::shared_ptr<const TokenStore> tokens = nullptr,
                   int64_t max_inflight_request_bytes = 0, RequestLog* request_log = nullptr,
                   RegionRegistry* regions = nullptr, RingServer* rings = nullptr,
                   std::shared_ptr<wire::BufferPool> buffers = nullptr);

  // Runs one request of a ring (as `tenant`, with no client deadline): a prefill on the work
  // queue, a decode through the decode queue. done gets its status after `response` is filled;
  // request and response must stay valid until then. An error returned here means done is never
  // called. on_caller: the calling thread only waits for done (a ring's own thread), so the
  // prefill, or a decode batch this request completes, runs on it instead of on a worker.
  absl::Status SubmitSessionRequest(const v1::SessionRequest& request, absl::string_view tenant,
                                    v1::SessionResponse* response,
                                    std::function<void(absl::Status)> done, bool on_caller = false);

  // Runs one version 2 ring frame (server/dataplane/ring_frame.h) as `tenant`, as
  // SubmitSessionRequest runs the same request: the same checks (a decode is the packed form, its
  // q, k and v inline or in regions), engine calls and records, with the tensors viewed in the
  // frame and an inline output written by the engine into answer's buffer. The same contract.
  absl::Status SubmitRingFrame(const RequestFrame& frame, absl::string_view tenant,
                               FrameAnswer* answer, std::function<void(absl::Status)> done,
                               bool on_caller = false);

  // Sessions waiting for their next request end now with UNAVAILABLE; busy ones end after the
  // response they are computing. Call before grpc::Server::Shutdown so idle streams do not hold
  // the drain until its deadline.
  void BeginShutdown();
  // After BeginShutdown: waits until no call of this service is in flight (unary calls and
  // sessions), or until `deadline`; true if none is. Until gRPC's own Shutdown, new calls still
  // reach the handlers, which answer UNAVAILABLE with a message, whereas gRPC's Shutdown cancels
  // the calls it has received but not yet handed over (CANCELLED, no message): so the server
  // waits here first.
  bool WaitForCallsToEnd(absl::Time deadline);

  // Bytes of requests being served now (the --max-inflight-request-bytes budget's use).
  int64_t inflight_request_bytes() const { return budget_.used(); }
  // That budget, for whatever else holds request bytes (the rings' request copies).
  ByteBudget* request_budget() { return &budget_; }

  grpc::ServerUnaryReactor* GetServerInfo(grpc::CallbackServerContext* context,
                                          const grpc::ByteBuffer* request,
                                          grpc::ByteBuffer* reply) override;
  grpc::ServerUnaryReactor* CreateSequence(grpc::CallbackServerContext* context,
                                           const grpc::ByteBuffer* request,
                                           grpc::ByteBuffer* reply) override;
  grpc::ServerUnaryReactor* ReleaseSequence(grpc::CallbackServerContext* context,
                                            const grpc::ByteBuffer* request,
                                            grpc::ByteBuffer* reply) override;
  grpc::ServerUnaryReactor* Prefill(grpc::CallbackServerContext* context,
                                    const grpc::ByteBuffer* request,
                                    grpc::ByteBuffer* reply) override;
  grpc::ServerUnaryReactor* Decode(grpc::CallbackServerContext* context,
                                   const grpc::ByteBuffer* request,
                                   grpc::ByteBuffer* reply) override;
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* Session(
      grpc::CallbackServerContext* context) override;
  grpc::ServerUnaryReactor* RegisterRegion(grpc::CallbackServerContext* context,
                                           const grpc::ByteBuffer* request,
                                           grpc::ByteBuffer* reply) override;
  grpc::ServerUnaryReactor* UnregisterRegion(grpc::CallbackServerContext* context,
                                             const grpc::ByteBuffer* request,
                                             grpc::ByteBuffer* reply) override;
  grpc::ServerUnaryReactor* OpenRing(grpc::CallbackServerContext* context,
                                     const grpc::ByteBuffer* request,
                                     grpc::ByteBuffer* reply) override;
  grpc::ServerUnaryReactor* CloseRing(grpc::CallbackServerContext* context,
                                      const grpc::ByteBuffer* request,
                                      grpc::ByteBuffer* reply) override;

 private:
  friend class SessionReactor;

  // Runs on a worker: validates and computes one prefill as `tenant`, filling `response` on
  // success.
  // keep_going: PrefillCall::keep_going (a unary call's cancellation and deadline), or null.
  absl::Status RunPrefill(const v1::PrefillRequest& request, absl::string_view tenant,
                          v1::PrefillResponse* response,
                          std::function<absl::Status()> keep_going = nullptr);
  absl::Status RunPrefillUnsafe(const v1::PrefillRequest& request, absl::string_view tenant,
                                v1::PrefillResponse* response,
                                std::function<absl::Status()> keep_going);  // without CatchAll
  // One prefill as any transport carries it: each tensor's claims (dtype, shape) and inline bytes,
  // or its region reference.
  struct PrefillArgs {
    absl::string_view sequence_id;
    int32_t layer = 0;
    int32_t q_layout = 0;  // the wire value
    std::optional<int64_t> prompt_len;
    RequestTensor q, k, v;
    const v1::RegionRef* q_region = nullptr;  // null: inline
    const v1::RegionRef* k_region = nullptr;
    const v1::RegionRef* v_region = nullptr;
    const v1::RegionRef* output_region = nullptr;  // null: into `output`
    const DeviceOrder* order = nullptr;            // a device-ordered ring frame's events
  };
  // Checks and runs it (region references judged by their claims before any region memory is
  // read); without an output region the engine writes o through `output`.
  absl::StatusOr<PrefillResult> RunPrefillArgs(const PrefillArgs& args, absl::string_view tenant,
                                               OutputBufferFn output,
                                               std::function<absl::Status()> keep_going);
  // SubmitRingFrame's decode (without CatchAll).
  absl::Status SubmitFrameDecode(const RequestFrame& frame, absl::string_view tenant,
                                 FrameAnswer* answer, bool on_caller,
                                 std::function<void(absl::Status)> done);
  absl::Status SubmitDecodeUnsafe(const v1::DecodeRequest& request, absl::string_view tenant,
                                  const RequestContext& context, v1::DecodeResponse* response,
                                  std::function<void(absl::Status)> done);  // without CatchAll
  // SubmitDecodeUnsafe for the packed form (server/rpc/packed_decode.h).
  // Runs `run` right here (a ring's thread, which would only wait for it), or queues it for a
  // worker.
  absl::Status RunHereOrQueue(bool here, std::function<void()> run);
  // The start of every decode's completion: the regions' leases (may be null) end before the
  // answer reaches the client, and without the batcher one request is one executed batch (the
  // batcher observes its merged batches itself). Returns result.ok().
  bool DecodeSettled(RegionTensors* regions, int64_t entries,
                     const absl::StatusOr<DecodeResult>& result);
  absl::Status SubmitPackedDecode(const v1::DecodeRequest& request, absl::string_view tenant,
                                  const RequestContext& context, v1::DecodeResponse* response,
                                  std::function<void(absl::Status)> done);
  // Queues one decode as `tenant` on the decode queue; `done` gets its status after `response` is
  // filled. `context` (the RPC's deadline, cancellation and start observer) goes to the queue
  // with the call, which checks it before anything is looked up. `request` and `tenant` must stay
  // valid until done. When this returns an error, done is never called.
  absl::Status SubmitDecode(const v1::DecodeRequest& request, absl::string_view tenant,
                            const RequestContext& context, v1::DecodeResponse* response,
                            std::function<void(absl::Status)> done);
  // SubmitDecode for a gRPC thread: a decode that would copy much region memory is submitted from
  // a worker instead (same contract: an error returned means done is never called).
  absl::Status SubmitDecodeFromGrpcThread(const v1::DecodeRequest& request,
                                          absl::string_view tenant, const RequestContext& context,
                                          v1::DecodeResponse* response,
                                          std::function<void(absl::Status)> done);
  // The unary RPCs that run on a worker (CreateSequence, ReleaseSequence, Prefill): queues `body`
  // (called with the caller's tenant) behind the deadline/cancellation check, records the call and
  // finishes it; a Submit the queue refuses is recorded and finished at once.
  template <typename Request, typename Response>
  void ServeOnWorker(absl::string_view rpc, grpc::CallbackServerContext* context,
                     const Request* request, Response* response, UnaryCall* reactor,
                     std::function<absl::Status(const std::string&)> body);
  // The typed handlers, behind the raw methods' parsing (Raw in service.cc).
  void ServeGetServerInfo(grpc::CallbackServerContext* context,
                          const v1::GetServerInfoRequest* request,
                          v1::GetServerInfoResponse* response, UnaryCall* reactor);
  void ServeCreateSequence(grpc::CallbackServerContext* context,
                           const v1::CreateSequenceRequest* request,
                           v1::CreateSequenceResponse* response, UnaryCall* reactor);
  void ServeReleaseSequence(grpc::CallbackServerContext* context,
                            const v1::ReleaseSequenceRequest* request,
                            v1::ReleaseSequenceResponse* response, UnaryCall* reactor);
  void ServePrefill(grpc::CallbackServerContext* context, const v1::PrefillRequest* request,
                    v1::PrefillResponse* response, UnaryCall* reactor);
  // A Prefill parsed by server/rpc/wire.h (the same checks, queueing and records as ServePrefill).
  void ServeWirePrefill(grpc::CallbackServerContext* context, int64_t request_bytes,
                        WirePrefillCall* call);
  absl::Status RunWirePrefill(WirePrefillCall* call, absl::string_view tenant,
                              std::function<absl::Status()> keep_going);
  void ServeDecode(grpc::CallbackServerContext* context, const v1::DecodeRequest* request,
                   v1::DecodeResponse* response, UnaryCall* reactor);
  void ServeRegisterRegion(grpc::CallbackServerContext* context,
                           const v1::RegisterRegionRequest* request,
                           v1::RegisterRegionResponse* response, UnaryCall* reactor);
  void ServeUnregisterRegion(grpc::CallbackServerContext* context,
                             const v1::UnregisterRegionRequest* request,
                             v1::UnregisterRegionResponse* response, UnaryCall* reactor);
  void ServeOpenRing(grpc::CallbackServerContext* context, const v1::OpenRingRequest* request,
                     v1::OpenRingResponse* response, UnaryCall* reactor);
  void ServeCloseRing(grpc::CallbackServerContext* context, const v1::CloseRingRequest* request,
                      v1::CloseRingResponse* response, UnaryCall* reactor);
  // The region RPCs: resolves the tenant, runs `body` on the gRPC thread (they only map memory),
  // records and finishes.
  template <typename Request, typename Response>
  void ServeInline(absl::string_view rpc, grpc::CallbackServerContext* context,
                   const Request* request, Response* response, UnaryCall* reactor,
                   const std::function<absl::Status(const std::string&)>& body);
  // Parses `request` as Request (INVALID_ARGUMENT "cannot parse attnd.v1.<Request>" when it does
  // not) and runs `serve` with a reactor that owns the request and response.
  template <typename Request, typename Response>
  grpc::ServerUnaryReactor* Raw(absl::string_view rpc, grpc::CallbackServerContext* context,
                                const grpc::ByteBuffer* request, grpc::ByteBuffer* reply,
                                void (AttentionService::*serve)(grpc::CallbackServerContext*,
                                                                const Request*, Response*,
                                                                UnaryCall*));
  friend class RequestScope;
  // Records one finished request with its google.rpc code in the metrics and the request log.
  // Latencies the clock does not know (InfinitePast) are not observed.
  void Record(absl::string_view rpc, int code, const RequestClock& clock, int64_t bytes_received,
              int64_t bytes_sent);

  // The request-bytes budget (max_inflight_request_bytes; 0 = none): takes a received message's
  // `bytes` or answers RESOURCE_EXHAUSTED with nothing taken. Every successful take is given back
  // once. (Region copies take theirs through RegionTensors.)
  absl::Status TakeRequestBytes(int64_t bytes);
  void GiveRequestBytes(int64_t bytes);

  // False once shutdown has begun (the session is then not registered).
  bool Register(SessionReactor* session);
  void Unregister(SessionReactor* session);
  bool shutting_down() const;

  Runtime* const runtime_;
  WorkQueue* const work_queue_;
  DecodeQueue* const decode_queue_;
  AttndMetrics* const metrics_;                      // may be null
  const BatchingDecodeQueue* const batcher_;         // may be null
  const std::shared_ptr<const TokenStore> tokens_;   // null: auth is off
  ByteBudget budget_;                                // max_inflight_request_bytes; 0: none
  const int64_t max_tensor_bytes_;                   // the message limit: no tensor is larger
  RequestLog* const request_log_;                    // may be null
  RegionRegistry* const regions_;                    // null: no tensor regions
  RingServer* const rings_;                          // null: no rings
  const std::shared_ptr<wire::BufferPool> buffers_;  // null: no wire fast path

  // Atomic, not under mu_: sessions read it under their own lock, and BeginShutdown takes mu_
  // before the sessions' locks.
  std::atomic<bool> shutting_down_{false};
  std::atomic<int64_t> live_calls_{0};  // unary calls not yet done (UnaryCall::CountIn)
  mutable Mutex mu_;
  absl::flat_hash_set<SessionReactor*> sessions_ ABSL_GUARDED_BY(mu_);
};

}  // namespace attnd

#endif  // ATTND_SERVER_RPC_SERVICE_H_
