// Shared-memory request/response rings (docs/regions.md, "Rings"; layout in
// proto/attnd/v1/shm_ring.h): one server thread per open ring waits for the client's doorbell
// (spinning a while after each request, then on the futex), copies the request out of the ring,
// hands it to the handler (the service: prefills to the work queue, decodes to the cross-client
// batcher) and the handler's completion writes the response back into the ring and rings the
// client's doorbell, on whichever thread completed it. The ring's header version says what its
// halves carry: version 1 a serialized SessionRequest / SessionResponse (Handler), version 2 the
// binary frames of proto/attnd/v1/ring_frame.h (FrameHandler).
#ifndef ATTND_SERVER_DATAPLANE_RING_H_
#define ATTND_SERVER_DATAPLANE_RING_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "attnd/v1/attention.pb.h"
#include "base/byte_budget.h"
#include "base/mutex.h"
#include "server/dataplane/regions.h"
#include "server/dataplane/ring_frame.h"

namespace attnd {

struct RingOptions {
  // After each request the ring's thread spins this long for the next one before it sleeps on
  // the futex (the client's next layer usually comes within tens of microseconds).
  absl::Duration spin = absl::Microseconds(50);
  // While its request runs elsewhere (a batch another thread launched), the ring's thread spins
  // this long for the answer before it sleeps: a sleeping thread wakes tens of microseconds late.
  absl::Duration answer_spin = absl::Milliseconds(2);
  absl::Duration idle_timeout = absl::Seconds(300);  // no request this long: closed (0 = never)
  // A device-ordered frame waits this long at most for its client's "ready" event (its stream
  // passing the inputs' writes) before it is answered DEADLINE_EXCEEDED.
  absl::Duration ready_timeout = absl::Seconds(10);
  uint64_t max_ring_bytes = uint64_t{1} << 30;  // one ring's object at most
  // Spinning costs a core while it lasts, so it is rationed: at most this many ring threads of
  // one tenant, and of all tenants together, spin at once (after a request, or for an answer);
  // the others sleep on the futex at once. 0 = none may spin.
  int max_spinning_per_tenant = 1;
  int max_spinning = 2;
};

// How much the rings spun (RingServer::spin_stats), for tests and metrics.
struct RingSpinStats {
  int64_t max_spinning_seen = 0;             // most ring threads spinning at once, all tenants
  int64_t max_spinning_one_tenant_seen = 0;  // most of one tenant's at once
  int64_t spins = 0;                         // spins granted
  int64_t spins_refused = 0;                 // spins refused by the limits (the thread slept)
};

class RingServer {
 public:
  // Runs one request as `tenant`; calls done exactly once (after filling response) unless it
  // returns an error. Called on the ring's own thread, which then only waits for done: the
  // handler may run the work right there.
  using Handler = std::function<absl::Status(
      const v1::SessionRequest& request, absl::string_view tenant, v1::SessionResponse* response,
      std::function<void(absl::Status)> done)>;

  // Runs one version 2 frame as `tenant`; calls done exactly once (after filling answer) unless it
  // returns an error. The frame's views stay valid until done.
  using FrameHandler =
      std::function<absl::Status(const RequestFrame& frame, absl::string_view tenant,
                                 FrameAnswer* answer, std::function<void(absl::Status)> done)>;

  // registry must outlive the server; the handlers are set once, before the first Open.
  RingServer(RegionRegistry* registry, const RingOptions& options);
  ~RingServer();  // Shutdown()
  RingServer(const RingServer&) = delete;
  RingServer& operator=(const RingServer&) = delete;

  void SetHandler(Handler handler);
  // Without one, OpenRing refuses version 2 rings.
  void SetFrameHandler(FrameHandler handler);
  // Where device-ordered rings' events come from (the engine's device; must outlive the server).
  // Without it Open refuses device_events. Set once, before the first Open.
  void SetDeviceEvents(DeviceMemoryOpener* events);
  bool device_events() const { return events_ != nullptr; }
  // Each request copied out of a ring is request bytes: taken from `budget` (may be null) while
  // attnd holds the copy, and no request may be longer than max_request_bytes (0: no cap), the
  // message limit. Set once, before the first Open.
  void SetRequestBudget(ByteBudget* budget, int64_t max_request_bytes);
  const RingOptions& options() const { return options_; }
  RingSpinStats spin_stats() const;

  struct Opened {
    std::string ring_id;
    uint64_t request_capacity = 0;
    uint64_t response_capacity = 0;
    // With device_events: the two events' CUDA IPC handles (ready: the client records it, done:
    // attnd does), as OpenRingResponse carries them.
    std::string ready_event;
    std::string done_event;
  };
  // Maps the client's object, checks its header, starts its thread; with device_events also
  // creates the ring's two events (a version 2 ring only). INVALID_ARGUMENT for a bad object or
  // header (a version other than 1 or 2 among them), RESOURCE_EXHAUSTED for the tenant's limits,
  // FAILED_PRECONDITION for device_events without SetDeviceEvents, UNAVAILABLE after Shutdown.
  absl::StatusOr<Opened> Open(absl::string_view tenant, absl::string_view name, uint64_t bytes,
                              bool device_events = false);
  // Stops the ring's thread once its request in flight (if any) is answered, marks it closed and
  // unmaps it. NOT_FOUND for an unknown id or another tenant's ring.
  absl::Status Close(absl::string_view tenant, absl::string_view id);
  // Closes every ring with no request for idle_timeout. Returns how many.
  int ReclaimIdle();
  // Closes every ring; Open answers UNAVAILABLE from now on. Idempotent.
  void Shutdown();

  int64_t open_rings() const;

 private:
  class Ring;
  absl::Status CloseRing(std::unique_ptr<Ring> ring);
  // The spin ration (RingOptions::max_spinning*): whether `tenant`'s ring thread may spin now; if
  // so, EndSpin once it stops.
  bool BeginSpin(const std::string& tenant);
  void EndSpin(const std::string& tenant);

  // A device-ordered ring's events (RingServer::Open with device_events), else null.
  struct RingEvents {
    void* ready = nullptr;
    void* done = nullptr;
  };

  RegionRegistry* const registry_;
  const RingOptions options_;
  DeviceMemoryOpener* events_ = nullptr;
  Handler handler_;
  FrameHandler frame_handler_;
  ByteBudget* budget_ = nullptr;
  int64_t max_request_bytes_ = 0;
  mutable Mutex spin_mu_;
  absl::flat_hash_map<std::string, int> spinning_ ABSL_GUARDED_BY(spin_mu_);  // by tenant
  int spinning_total_ ABSL_GUARDED_BY(spin_mu_) = 0;
  RingSpinStats spin_stats_ ABSL_GUARDED_BY(spin_mu_);
  mutable Mutex mu_;
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
  absl::flat_hash_map<std::string, std::unique_ptr<Ring>> rings_ ABSL_GUARDED_BY(mu_);
  // Tenants one of whose rings held a gate shut until attnd opened it: every step on the shared
  // decode stream waited that long, so their later rings wait for "ready" on the host (a client
  // cannot stall the others again by opening another ring). For the daemon's life.
  absl::flat_hash_set<std::string> gates_revoked_ ABSL_GUARDED_BY(mu_);
  void RevokeGates(const std::string& tenant);
};

}  // namespace attnd

#endif  // ATTND_SERVER_DATAPLANE_RING_H_
