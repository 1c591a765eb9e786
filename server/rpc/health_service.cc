#include "server/rpc/health_service.h"

#include <optional>
#include <utility>

namespace attnd {

using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;

// One Watch stream: writes the current status, then each change, one write at a time (the latest
// status wins while a write is in flight); after the service's Shutdown, its last write ends the
// stream with OK. Deletes itself in OnDone.
class HealthWatch : public grpc::ServerWriteReactor<HealthCheckResponse> {
 public:
  HealthWatch(HealthService* service, std::string name)
      : service_(service), name_(std::move(name)) {
    MutexLock service_lock(&service_->mu_);
    service_->watches_.insert(this);
    Update(service_->StatusOfLocked(name_), service_->shut_down_);
  }

  // Called with the service's lock held (lock order: the service's, then this stream's).
  void Update(HealthService::Status status, bool last) {
    MutexLock lock(&mu_);
    if (finished_) return;
    pending_ = status;
    last_ = last_ || last;
    if (!writing_) NextLocked();
  }

  void OnWriteDone(bool ok) override {
    MutexLock lock(&mu_);
    writing_ = false;
    if (!ok) {
      FinishLocked(grpc::Status(grpc::StatusCode::CANCELLED, "the watch stream broke"));
      return;
    }
    NextLocked();
  }

  void OnCancel() override {
    MutexLock lock(&mu_);
    if (!writing_) FinishLocked(grpc::Status(grpc::StatusCode::CANCELLED, "cancelled"));
  }

  const std::string& name() const { return name_; }

  void OnDone() override {
    service_->Unregister(this);
    delete this;
  }

 private:
  void NextLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_) return;
    if (pending_.has_value() && (!sent_.has_value() || *pending_ != *sent_)) {
      sent_ = pending_;
      response_.set_status(*pending_);
      writing_ = true;
      StartWrite(&response_);
      return;
    }
    if (last_) FinishLocked(grpc::Status::OK);
  }

  void FinishLocked(grpc::Status status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_) return;
    finished_ = true;
    Finish(std::move(status));
  }

  HealthService* const service_;
  const std::string name_;
  Mutex mu_;
  std::optional<HealthService::Status> pending_ ABSL_GUARDED_BY(mu_);
  std::optional<HealthService::Status> sent_ ABSL_GUARDED_BY(mu_);
  bool last_ ABSL_GUARDED_BY(mu_) = false;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  HealthCheckResponse response_;  // owned by the write in flight
};

HealthService::HealthService(std::vector<std::string> services) {
  MutexLock lock(&mu_);
  for (std::string& s : services) services_.insert(std::move(s));
  services_.insert("");
}

HealthService::Status HealthService::StatusOfLocked(const std::string& service) const {
  if (!services_.contains(service)) return HealthCheckResponse::SERVICE_UNKNOWN;
  return serving_ && !shut_down_ ? HealthCheckResponse::SERVING : HealthCheckResponse::NOT_SERVING;
}

void HealthService::SetServing(bool serving) {
  MutexLock lock(&mu_);
  if (shut_down_ || serving_ == serving) return;
  serving_ = serving;
  for (HealthWatch* w : watches_) w->Update(StatusOfLocked(w->name()), false);
}

void HealthService::Shutdown() {
  MutexLock lock(&mu_);
  if (shut_down_) return;
  shut_down_ = true;
  for (HealthWatch* w : watches_) w->Update(StatusOfLocked(w->name()), true);
}

void HealthService::Unregister(HealthWatch* watch) {
  MutexLock lock(&mu_);
  watches_.erase(watch);
}

grpc::ServerUnaryReactor* HealthService::Check(grpc::CallbackServerContext* context,
                                               const HealthCheckRequest* request,
                                               HealthCheckResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  MutexLock lock(&mu_);
  const Status status = StatusOfLocked(request->service());
  if (status == HealthCheckResponse::SERVICE_UNKNOWN) {
    reactor->Finish(
        grpc::Status(grpc::StatusCode::NOT_FOUND, "unknown service '" + request->service() + "'"));
    return reactor;
  }
  response->set_status(status);
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerWriteReactor<HealthCheckResponse>* HealthService::Watch(
    grpc::CallbackServerContext* /*context*/, const HealthCheckRequest* request) {
  return new HealthWatch(this, request->service());
}

}  // namespace attnd
