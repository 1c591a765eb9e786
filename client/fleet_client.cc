#include "client/fleet_client.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstdint>
#include <future>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace attnd {
namespace client {
namespace {

constexpr absl::string_view kDnsScheme = "dns:///";

// "host:port" or "[v6]:port" -> host and port; false when there is no port.
bool SplitHostPort(absl::string_view target, std::string* host, std::string* port) {
  size_t colon;
  if (absl::StartsWith(target, "[")) {
    const size_t close = target.find(']');
    if (close == absl::string_view::npos || close + 1 >= target.size() ||
        target[close + 1] != ':') {
      return false;
    }
    *host = std::string(target.substr(1, close - 1));
    colon = close + 1;
  } else {
    colon = target.rfind(':');
    if (colon == absl::string_view::npos) return false;
    *host = std::string(target.substr(0, colon));
  }
  *port = std::string(target.substr(colon + 1));
  return !host->empty() && !port->empty();
}

absl::StatusOr<std::vector<std::string>> ResolveName(absl::string_view spec) {
  std::string host, port;
  if (!SplitHostPort(spec.substr(kDnsScheme.size()), &host, &port)) {
    return absl::InvalidArgumentError(
        absl::StrCat("fleet target \"", spec, "\" must be dns:///host:port"));
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const int rc = getaddrinfo(host.c_str(), port.c_str(), &hints, &found);
  if (rc != 0) {
    return absl::UnavailableError(absl::StrCat("cannot resolve ", spec, ": ", gai_strerror(rc)));
  }
  std::vector<std::string> out;
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    char text[INET6_ADDRSTRLEN] = {};
    if (a->ai_family == AF_INET) {
      const auto* in = reinterpret_cast<const sockaddr_in*>(a->ai_addr);
      inet_ntop(AF_INET, &in->sin_addr, text, sizeof(text));
      out.push_back(absl::StrCat(text, ":", ntohs(in->sin_port)));
    } else if (a->ai_family == AF_INET6) {
      const auto* in = reinterpret_cast<const sockaddr_in6*>(a->ai_addr);
      inet_ntop(AF_INET6, &in->sin6_addr, text, sizeof(text));
      out.push_back(absl::StrCat("[", text, "]:", ntohs(in->sin6_port)));
    }
  }
  freeaddrinfo(found);
  // getaddrinfo's order varies between calls (RFC 6724 sorting, round-robin DNS): sorted, the
  // endpoint order, and so placement's tie-breaking, does not.
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  if (out.empty()) {
    return absl::UnavailableError(absl::StrCat(spec, " resolves to no IPv4 or IPv6 address"));
  }
  return out;
}

bool Unreachable(const absl::Status& s) {
  return s.code() == absl::StatusCode::kUnavailable ||
         s.code() == absl::StatusCode::kDeadlineExceeded;
}

// The daemon at an endpoint is not the instance the client thought (restarted under another
// name, or a DNS name now points elsewhere): worth a Refresh and one more try.
bool Misrouted(const absl::Status& s) {
  return s.code() == absl::StatusCode::kFailedPrecondition &&
         absl::StrContains(s.message(), "is owned by attnd instance");
}

}  // namespace

absl::StatusOr<std::vector<std::string>> FleetClient::Resolve(
    const std::vector<std::string>& targets) {
  if (targets.empty()) return absl::InvalidArgumentError("a fleet needs at least one target");
  std::vector<std::string> out;
  for (const std::string& t : targets) {
    std::vector<std::string> these;
    if (absl::StartsWith(t, kDnsScheme)) {
      absl::StatusOr<std::vector<std::string>> resolved = ResolveName(t);
      if (!resolved.ok()) return resolved.status();
      these = *std::move(resolved);
    } else {
      std::string host, port;
      if (!SplitHostPort(t, &host, &port)) {
        return absl::InvalidArgumentError(
            absl::StrCat("fleet target \"", t, "\" must be host:port or dns:///host:port"));
      }
      these.push_back(t);
    }
    for (std::string& e : these) {
      if (std::find(out.begin(), out.end(), e) == out.end()) out.push_back(std::move(e));
    }
  }
  return out;
}

absl::StatusOr<std::string> FleetClient::OwnerOf(absl::string_view sequence_id) {
  const size_t dot = sequence_id.find('.');
  if (dot == absl::string_view::npos || dot == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("sequence_id \"", sequence_id.substr(0, 100),
                     "\" names no attnd instance (\"<instance>.<32 hex>\"); a fleet client routes "
                     "only ids of daemons started with --instance-name"));
  }
  return std::string(sequence_id.substr(0, dot));
}

namespace {

// Each endpoint's channel gets its own subchannel: gRPC shares them between channels to one address
// by default, and a fresh channel to a daemon that was down would then report the shared one's
// TRANSIENT_FAILURE until its reconnect backoff (seconds) ends, instead of connecting at once.
FleetOptions WithLocalSubchannels(FleetOptions options) {
  options.client.channel_args.emplace_back("grpc.use_local_subchannel_pool", 1);
  return options;
}

}  // namespace

FleetClient::FleetClient(std::vector<std::string> targets, const FleetOptions& options)
    : targets_(std::move(targets)), options_(WithLocalSubchannels(options)) {}

absl::StatusOr<std::unique_ptr<FleetClient>> FleetClient::Connect(
    const std::vector<std::string>& targets, const FleetOptions& options) {
  std::unique_ptr<FleetClient> fleet(new FleetClient(targets, options));
  const absl::Status refreshed = fleet->Refresh();
  {
    MutexLock lock(&fleet->mu_);
    for (const std::shared_ptr<Endpoint>& e : fleet->endpoints_) {
      if (e->last_error.code() == absl::StatusCode::kFailedPrecondition) return e->last_error;
    }
  }
  if (!refreshed.ok()) return refreshed;
  return fleet;
}

absl::Status FleetClient::Refresh() {
  if (absl::Status s = Reresolve(); !s.ok()) return s;
  return AskAll().status();
}

absl::Status FleetClient::Reresolve() {
  absl::StatusOr<std::vector<std::string>> resolved = Resolve(targets_);
  if (!resolved.ok()) return resolved.status();
  {
    MutexLock lock(&mu_);
    std::vector<std::shared_ptr<Endpoint>> now;
    for (const std::string& target : *resolved) {
      auto same =
          std::find_if(endpoints_.begin(), endpoints_.end(),
                       [&](const std::shared_ptr<Endpoint>& e) { return e->target == target; });
      if (same != endpoints_.end()) {
        now.push_back(*same);  // keeps its connection and what it is known to be
      } else {
        auto e = std::make_shared<Endpoint>();
        e->target = target;
        now.push_back(std::move(e));
      }
    }
    endpoints_ = std::move(now);
  }
  return absl::OkStatus();
}

bool FleetClient::Named() const {
  return std::any_of(targets_.begin(), targets_.end(),
                     [](const std::string& t) { return absl::StartsWith(t, kDnsScheme); });
}

std::vector<FleetEndpoint> FleetClient::Endpoints() const {
  MutexLock lock(&mu_);
  std::vector<FleetEndpoint> out;
  for (const std::shared_ptr<Endpoint>& e : endpoints_) {
    out.push_back(FleetEndpoint{e->target, e->instance, e->client != nullptr,
                                std::string(e->last_error.message())});
  }
  return out;
}

absl::StatusOr<std::shared_ptr<AttndClient>> FleetClient::Connected(
    const std::shared_ptr<Endpoint>& e, absl::Duration timeout) {
  std::string target, instance;
  {
    MutexLock lock(&mu_);
    if (e->client != nullptr) return e->client;
    target = e->target;
    instance = e->instance;
  }
  // Outside the lock: connecting waits for the network.
  ClientOptions options = options_.client;
  options.connect_timeout = std::min(options.connect_timeout, timeout);
  absl::StatusOr<std::unique_ptr<AttndClient>> connected = AttndClient::Connect(target, options);
  MutexLock lock(&mu_);
  if (!connected.ok()) {
    e->last_error = connected.status();
    return absl::Status(connected.status().code(),
                        instance.empty()
                            ? std::string(connected.status().message())
                            : absl::StrCat("attnd instance \"", instance, "\" at ", target,
                                           " is unavailable: ", connected.status().message()));
  }
  if (e->client == nullptr) e->client = *std::move(connected);  // else another thread won
  return e->client;
}

absl::StatusOr<v1::GetServerInfoResponse> FleetClient::Ask(const std::shared_ptr<Endpoint>& e) {
  absl::StatusOr<std::shared_ptr<AttndClient>> client = Connected(e, options_.probe_timeout);
  if (!client.ok()) return client.status();
  absl::StatusOr<v1::GetServerInfoResponse> info = (*client)->Info(options_.probe_timeout);
  if (!info.ok()) return Failed(e, *client, info.status());
  MutexLock lock(&mu_);
  if (info->instance().name().empty()) {
    e->last_error = absl::FailedPreconditionError(
        absl::StrCat("attnd at ", e->target,
                     " has no --instance-name: in a fleet every daemon needs one, so that a "
                     "sequence id says which daemon holds it"));
    return e->last_error;
  }
  e->instance = info->instance().name();
  e->last_error = absl::OkStatus();
  // The newest answer wins: a daemon that came back at another address (a rescheduled pod) is no
  // longer the instance at its old one.
  for (const std::shared_ptr<Endpoint>& other : endpoints_) {
    if (other != e && other->instance == e->instance) other->instance.clear();
  }
  return info;
}

absl::StatusOr<std::vector<FleetClient::Probe>> FleetClient::AskAll() {
  std::vector<std::shared_ptr<Endpoint>> all;
  {
    MutexLock lock(&mu_);
    all = endpoints_;
  }
  // Concurrently: a fleet's slowest endpoint, not the sum of them, bounds a placement.
  std::vector<std::future<absl::StatusOr<v1::GetServerInfoResponse>>> asked;
  for (const std::shared_ptr<Endpoint>& e : all) {
    asked.push_back(std::async(std::launch::async, [this, e] { return Ask(e); }));
  }
  std::vector<Probe> answered;
  std::vector<std::string> why;
  for (size_t i = 0; i < all.size(); ++i) {
    absl::StatusOr<v1::GetServerInfoResponse> info = asked[i].get();
    if (info.ok()) {
      answered.push_back(Probe{all[i], *std::move(info)});
    } else {
      why.push_back(absl::StrCat(all[i]->target, ": ", info.status().message()));
    }
  }
  if (answered.empty()) {
    return absl::UnavailableError(
        absl::StrCat("no attnd of the fleet is reachable (", absl::StrJoin(why, "; "), ")"));
  }
  return answered;
}

absl::Status FleetClient::Failed(const std::shared_ptr<Endpoint>& e,
                                 const std::shared_ptr<AttndClient>& client,
                                 const absl::Status& status) {
  if (!Unreachable(status)) return status;
  MutexLock lock(&mu_);
  e->last_error = status;
  // A hung daemon (DEADLINE_EXCEEDED) keeps its channel: a new one would wait for a handshake that
  // never comes.
  if (e->client == client && status.code() == absl::StatusCode::kUnavailable) e->client = nullptr;
  return absl::Status(status.code(),
                      absl::StrCat("attnd instance \"", e->instance.empty() ? "?" : e->instance,
                                   "\" at ", e->target, " is unavailable: ", status.message()));
}

absl::StatusOr<std::shared_ptr<FleetClient::Endpoint>> FleetClient::Find(
    const std::string& instance) {
  for (int attempt = 0; attempt < 2; ++attempt) {
    {
      MutexLock lock(&mu_);
      for (const std::shared_ptr<Endpoint>& e : endpoints_) {
        if (e->instance == instance) return e;
      }
    }
    if (attempt == 0) (void)Refresh();  // an instance not seen yet: ask everyone who they are
  }
  std::vector<std::string> known;
  {
    MutexLock lock(&mu_);
    for (const std::shared_ptr<Endpoint>& e : endpoints_) {
      known.push_back(absl::StrCat(e->target, " (", e->instance.empty() ? "?" : e->instance, ")"));
    }
  }
  return absl::UnavailableError(
      absl::StrCat("attnd instance \"", instance, "\" is not among this fleet's endpoints (",
                   absl::StrJoin(known, ", "),
                   "): it is down or gone; its sequences are lost once it restarts"));
}

template <typename T, typename Call>
absl::StatusOr<T> FleetClient::OnOwner(const std::string& sequence_id, const Call& call) {
  absl::StatusOr<std::string> owner = OwnerOf(sequence_id);
  if (!owner.ok()) return owner.status();
  for (int attempt = 0;; ++attempt) {
    absl::StatusOr<std::shared_ptr<Endpoint>> e = Find(*owner);
    if (!e.ok()) return e.status();
    absl::StatusOr<std::shared_ptr<AttndClient>> client = Connected(*e);
    if (!client.ok()) {
      // Down, or moved: a DNS name may now resolve to the instance's new address.
      if (attempt == 0 && Unreachable(client.status()) && MovedAway(*owner, *e)) continue;
      return client.status();
    }
    absl::StatusOr<T> r = call(**client);
    if (r.ok()) return r;
    if (attempt == 0 && Misrouted(r.status())) {
      {
        MutexLock lock(&mu_);
        (*e)->instance.clear();  // not who it was
      }
      (void)Refresh();
      continue;
    }
    absl::Status failed = Failed(*e, *client, r.status());
    if (attempt == 0 && Unreachable(r.status()) && MovedAway(*owner, *e)) continue;
    return failed;
  }
}

bool FleetClient::MovedAway(const std::string& instance, const std::shared_ptr<Endpoint>& e) {
  // Only a DNS name can start pointing elsewhere; a list of addresses cannot.
  const bool named = std::any_of(targets_.begin(), targets_.end(), [](const std::string& t) {
    return absl::StartsWith(t, kDnsScheme);
  });
  if (!named) return false;
  if (absl::Status s = Refresh(); !s.ok()) return false;
  MutexLock lock(&mu_);
  for (const std::shared_ptr<Endpoint>& other : endpoints_) {
    if (other->instance == instance) return other != e;
  }
  return false;
}

absl::StatusOr<std::shared_ptr<AttndClient>> FleetClient::ClientFor(
    const std::string& sequence_id) {
  absl::StatusOr<std::string> owner = OwnerOf(sequence_id);
  if (!owner.ok()) return owner.status();
  absl::StatusOr<std::shared_ptr<Endpoint>> e = Find(*owner);
  if (!e.ok()) return e.status();
  return Connected(*e);
}

absl::StatusOr<std::string> FleetClient::CreateSequence() {
  // A DNS name is resolved again: pods added since (scaled up, or back at a new address) take new
  // sequences at once. A failed lookup keeps the endpoints known so far.
  if (Named()) (void)Reresolve();
  absl::StatusOr<std::vector<Probe>> probes = AskAll();
  if (!probes.ok()) return probes.status();
  const size_t n = probes->size();
  bool least_loaded = options_.placement == Placement::kLeastLoaded;
  for (const Probe& p : *probes) {
    if (p.info.tenant_scoped()) least_loaded = false;  // pages_free is hidden from tenants
  }
  // Round robin: the answering endpoints rotated to start at next_; least loaded: then sorted by
  // pages_free (stable: equal ones keep their turn).
  std::vector<size_t> order(n);
  size_t start;
  {
    MutexLock lock(&mu_);
    start = next_;
  }
  for (size_t i = 0; i < n; ++i) order[i] = (start + i) % n;
  if (least_loaded) {
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      return (*probes)[a].info.kv_cache().pages_free() > (*probes)[b].info.kv_cache().pages_free();
    });
  }
  absl::Status last;
  for (size_t i : order) {
    const std::shared_ptr<Endpoint>& e = (*probes)[i].endpoint;
    absl::StatusOr<std::shared_ptr<AttndClient>> client = Connected(e);
    if (!client.ok()) {
      last = client.status();
      continue;
    }
    // Bounded like a probe: a daemon that stopped answering since its probe must not hold the
    // placement (a sequence it creates after the deadline is orphaned until idle reclaim).
    absl::StatusOr<std::string> id = (*client)->CreateSequence(options_.probe_timeout);
    if (id.ok()) {
      MutexLock lock(&mu_);
      next_ = (i + 1) % n;
      return id;
    }
    last = Failed(e, *client, id.status());
    // Full or unreachable: the next one may take it. Anything else is the caller's to see.
    if (!Unreachable(id.status()) && id.status().code() != absl::StatusCode::kResourceExhausted) {
      return last;
    }
  }
  return last;
}

absl::StatusOr<int64_t> FleetClient::Release(const std::string& sequence_id) {
  return OnOwner<int64_t>(sequence_id, [&](AttndClient& c) { return c.Release(sequence_id); });
}

absl::StatusOr<PrefillResult> FleetClient::Prefill(const std::string& sequence_id, int32_t layer,
                                                   const HostTensor& q, const HostTensor& k,
                                                   const HostTensor& v,
                                                   std::optional<int64_t> prompt_len,
                                                   v1::QLayout q_layout) {
  return OnOwner<PrefillResult>(sequence_id, [&](AttndClient& c) {
    return c.Prefill(sequence_id, layer, q, k, v, prompt_len, q_layout);
  });
}

absl::StatusOr<PrefillResult> FleetClient::Prefill(const PrefillInput& input) {
  return OnOwner<PrefillResult>(input.sequence_id,
                                [&](AttndClient& c) { return c.Prefill(input); });
}

absl::StatusOr<std::vector<DecodeResult>> FleetClient::Decode(
    int32_t layer, const std::vector<DecodeInput>& entries) {
  // Entries grouped by owner, in order of first appearance.
  std::vector<std::string> owners;
  std::vector<std::vector<size_t>> groups;
  absl::flat_hash_map<std::string, size_t> group_of;
  for (size_t i = 0; i < entries.size(); ++i) {
    absl::StatusOr<std::string> owner = OwnerOf(entries[i].sequence_id);
    if (!owner.ok()) {
      return absl::Status(owner.status().code(),
                          absl::StrCat("entries[", i, "]: ", owner.status().message()));
    }
    auto [it, fresh] = group_of.emplace(*owner, owners.size());
    if (fresh) {
      owners.push_back(*owner);
      groups.emplace_back();
    }
    groups[it->second].push_back(i);
  }
  if (entries.empty()) return absl::InvalidArgumentError("a decode needs at least one entry");
  if (groups.size() == 1) {  // one daemon's: as AttndClient::Decode, all or nothing
    return OnOwner<std::vector<DecodeResult>>(
        entries[0].sequence_id, [&](AttndClient& c) { return c.Decode(layer, entries); });
  }
  std::vector<std::future<absl::StatusOr<std::vector<DecodeResult>>>> running;
  for (const std::vector<size_t>& group : groups) {
    running.push_back(std::async(std::launch::async, [this, layer, &entries, &group] {
      std::vector<DecodeInput> part;
      part.reserve(group.size());
      for (size_t i : group) part.push_back(entries[i]);
      return OnOwner<std::vector<DecodeResult>>(
          part[0].sequence_id, [&](AttndClient& c) { return c.Decode(layer, part); });
    }));
  }
  std::vector<DecodeResult> out(entries.size());
  absl::Status first_error;
  std::vector<std::string> applied;
  for (size_t g = 0; g < groups.size(); ++g) {
    absl::StatusOr<std::vector<DecodeResult>> r = running[g].get();
    if (!r.ok()) {
      if (first_error.ok()) {
        first_error = absl::Status(r.status().code(), absl::StrCat("instance \"", owners[g],
                                                                   "\": ", r.status().message()));
      }
      continue;
    }
    applied.push_back(absl::StrCat("\"", owners[g], "\""));
    for (size_t j = 0; j < groups[g].size(); ++j) out[groups[g][j]] = std::move((*r)[j]);
  }
  if (!first_error.ok()) {
    if (applied.empty()) return first_error;
    return absl::Status(first_error.code(),
                        absl::StrCat(first_error.message(), " (the entries of instance",
                                     applied.size() == 1 ? " " : "s ", absl::StrJoin(applied, ", "),
                                     " were applied: all or nothing holds per daemon)"));
  }
  return out;
}

}  // namespace client
}  // namespace attnd
