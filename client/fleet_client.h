// A client for a fleet of attnd daemons (docs/fleet.md): many daemons, each started with its own
// --instance-name, behind a list of targets or one DNS name. CreateSequence places a new sequence
// on one daemon; the id it returns names that daemon ("<instance>.<32 hex>"), and every later call
// for the sequence goes there. The single-daemon AttndClient is unchanged; this builds on it.
//
// Placement (DNS names resolved again first, so new pods take sequences): the reachable daemon with
// the most free KV pages (GetServerInfo's
// kv_cache.pages_free), ties taken in turn (round robin), so empty daemons fill evenly. With tokens
// on, daemons hide pages_free (tenant_scoped): placement is then round robin. Unreachable daemons
// are skipped; CreateSequence fails (UNAVAILABLE) only when none is reachable.
//
// Routing: the client learns which endpoint is which instance from GetServerInfo, at Connect and
// again whenever an id names an instance it does not know (Refresh: DNS names are resolved again).
// A call for a sequence whose daemon is down fails UNAVAILABLE naming the instance; once the daemon
// is back, its sequences are gone (NOT_FOUND): re-create and re-prefill them.
//
// Thread safety: FleetClient is thread-safe. A Session is per daemon: open it on ClientFor(id).
#ifndef ATTND_CLIENT_FLEET_CLIENT_H_
#define ATTND_CLIENT_FLEET_CLIENT_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "base/mutex.h"
#include "client/attnd_client.h"

namespace attnd {
namespace client {

enum class Placement {
  kLeastLoaded,  // most pages_free; round robin among ties, and when pages_free is hidden
  kRoundRobin,   // each reachable daemon in turn
};

struct FleetOptions {
  ClientOptions client;  // every daemon's connection (timeouts, token, TLS)
  Placement placement = Placement::kLeastLoaded;
  // How long asking an endpoint who it is and how loaded (GetServerInfo, and connecting first
  // when needed), and CreateSequence on the daemon picked, may take: a hung daemon is skipped after
  // this rather than stalling placements.
  absl::Duration probe_timeout = absl::Seconds(5);
};

// What the client knows of one endpoint (no RPC is made to report it).
struct FleetEndpoint {
  std::string target;    // host:port, as given or as resolved from a DNS name
  std::string instance;  // the daemon's --instance-name; "" until it answered GetServerInfo
  bool connected = false;
  std::string last_error;  // why the last call to it failed; "" when none did
};

class FleetClient {
 public:
  // Each target is "host:port" or "dns:///host:port" (every address the name resolves to, by
  // getaddrinfo, becomes an endpoint). Fails only when no endpoint is reachable (UNAVAILABLE,
  // saying why for each), or a reachable daemon has no --instance-name (FAILED_PRECONDITION).
  static absl::StatusOr<std::unique_ptr<FleetClient>> Connect(
      const std::vector<std::string>& targets, const FleetOptions& options = {});
  // The endpoints `targets` stand for, "dns:///" names resolved, in order, without duplicates.
  // INVALID_ARGUMENT for an empty list or a malformed target; UNAVAILABLE for a name that does not
  // resolve.
  static absl::StatusOr<std::vector<std::string>> Resolve(const std::vector<std::string>& targets);
  // The instance that owns `sequence_id` (its prefix); INVALID_ARGUMENT for an id without one.
  static absl::StatusOr<std::string> OwnerOf(absl::string_view sequence_id);

  // Placed as the header says; the id names its daemon.
  absl::StatusOr<std::string> CreateSequence();
  absl::StatusOr<int64_t> Release(const std::string& sequence_id);
  absl::StatusOr<PrefillResult> Prefill(const std::string& sequence_id, int32_t layer,
                                        const HostTensor& q, const HostTensor& k,
                                        const HostTensor& v,
                                        std::optional<int64_t> prompt_len = std::nullopt,
                                        v1::QLayout q_layout = v1::Q_LAYOUT_VARIANTS);
  absl::StatusOr<PrefillResult> Prefill(const PrefillInput& input);
  // Entries of one daemon go in one Decode (all or nothing, as ever). Entries of several daemons
  // go in one Decode per daemon, concurrently; if one fails, its error is returned (naming the
  // instance) while the other daemons' entries were applied: all or nothing holds per daemon only.
  absl::StatusOr<std::vector<DecodeResult>> Decode(int32_t layer,
                                                   const std::vector<DecodeInput>& entries);

  // The connected client of the daemon that owns `sequence_id`, for what this class does not wrap
  // (Session, regions, rings, Info). UNAVAILABLE naming the instance when it cannot be reached.
  absl::StatusOr<std::shared_ptr<AttndClient>> ClientFor(const std::string& sequence_id);
  // Resolves the targets again, reconnects, and asks every endpoint who it is. OK when at least
  // one endpoint answered.
  absl::Status Refresh();
  std::vector<FleetEndpoint> Endpoints() const;

 private:
  struct Endpoint {
    std::string target;
    std::shared_ptr<AttndClient> client;  // null until connected, and after it became unreachable
    std::string instance;
    absl::Status last_error;
  };
  struct Probe {
    std::shared_ptr<Endpoint> endpoint;
    v1::GetServerInfoResponse info;
  };

  FleetClient(std::vector<std::string> targets, const FleetOptions& options);

  // Resolves targets_ again: endpoints still resolved keep their connection and name, new ones
  // are added, vanished ones dropped.
  absl::Status Reresolve();
  bool Named() const;  // some target is a dns:/// name
  // The endpoint's client, connecting first (for at most `timeout`) when it has none.
  absl::StatusOr<std::shared_ptr<AttndClient>> Connected(
      const std::shared_ptr<Endpoint>& e, absl::Duration timeout = absl::InfiniteDuration());
  // GetServerInfo on `e`: records its instance, or why it failed.
  absl::StatusOr<v1::GetServerInfoResponse> Ask(const std::shared_ptr<Endpoint>& e);
  // Every endpoint that answers, in endpoint order; UNAVAILABLE listing each failure if none does.
  absl::StatusOr<std::vector<Probe>> AskAll();
  // Notes a failed call on `client` of `e`: an unreachable daemon gets a fresh connection next time
  // (a kept channel would wait out gRPC's reconnect backoff), and the status names the instance.
  absl::Status Failed(const std::shared_ptr<Endpoint>& e,
                      const std::shared_ptr<AttndClient>& client, const absl::Status& status);
  // The endpoint that is `instance`, asking every endpoint once when none is known to be.
  absl::StatusOr<std::shared_ptr<Endpoint>> Find(const std::string& instance);
  // After `e`, the endpoint of `instance`, could not be reached: true when a Refresh finds the
  // instance at another endpoint (its pod came back at a new address).
  bool MovedAway(const std::string& instance, const std::shared_ptr<Endpoint>& e);
  // Runs `call` on the owner of `sequence_id`; once more after a Refresh when the daemon there
  // says the sequence is another instance's (the endpoint's daemon changed).
  template <typename T, typename Call>
  absl::StatusOr<T> OnOwner(const std::string& sequence_id, const Call& call);

  const std::vector<std::string> targets_;  // as given
  const FleetOptions options_;
  mutable Mutex mu_;
  // Endpoint fields are guarded by mu_ too.
  std::vector<std::shared_ptr<Endpoint>> endpoints_ ABSL_GUARDED_BY(mu_);
  size_t next_ ABSL_GUARDED_BY(mu_) = 0;  // where round robin starts next
};

}  // namespace client
}  // namespace attnd

#endif  // ATTND_CLIENT_FLEET_CLIENT_H_
