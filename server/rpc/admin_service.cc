#include "server/rpc/admin_service.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "server/rpc/listener.h"
#include "server/rpc/status.h"

namespace attnd {
bool IsLoopbackPeer(absl::string_view peer) {
  if (absl::StartsWith(peer, "unix:")) return true;
  if (absl::ConsumePrefix(&peer, "ipv4:")) return absl::StartsWith(peer, "127.");
  if (absl::ConsumePrefix(&peer, "ipv6:")) {
    return absl::StartsWith(peer, "[::1]") || absl::StartsWith(peer, "[::ffff:127.");
  }
  return false;
}

absl::Status AdminAccess(const TokenStore* tokens, absl::string_view admin_tenant,
                         absl::string_view tenant, absl::string_view peer) {
  if (tokens == nullptr) {
    if (IsLoopbackPeer(peer)) return absl::OkStatus();
    return absl::PermissionDeniedError(absl::StrCat(
        "attnd.v1.Admin: with tokens off (no --auth-token-file) only loopback callers may use it; "
        "this call came from ",
        peer, " (run attnctl on the daemon's host, or turn tokens on and set --admin-tenant)"));
  }
  if (admin_tenant.empty()) {
    return absl::PermissionDeniedError(
        "attnd.v1.Admin is off: start attnd with --admin-tenant NAME (a tenant of "
        "--auth-token-file) and call it with that tenant's token");
  }
  if (tenant != admin_tenant) {
    // The admin tenant's name is not told to other tenants: it is half of what an attacker needs.
    return absl::PermissionDeniedError(absl::StrCat(
        "attnd.v1.Admin is for the tenant named by --admin-tenant; this call is tenant \"",
        absl::CHexEscape(tenant), "\""));
  }
  return absl::OkStatus();
}

AdminService::AdminService(Runtime* runtime, WorkQueue* work_queue,
                           std::shared_ptr<const TokenStore> tokens, std::string admin_tenant)
    : runtime_(runtime),
      work_queue_(work_queue),
      tokens_(std::move(tokens)),
      admin_tenant_(std::move(admin_tenant)) {}

absl::Status AdminService::Check(grpc::CallbackServerContext* context) const {
  absl::StatusOr<std::string> tenant = TenantOf(tokens_.get(), *context);
  if (!tenant.ok()) return tenant.status();
  // Connections attnd accepted itself show as "fd:N" in peer(): the loopback check needs the
  // address.
  return AdminAccess(tokens_.get(), admin_tenant_, *tenant, PeerAddress(context->peer()));
}

grpc::ServerUnaryReactor* AdminService::ListSequences(grpc::CallbackServerContext* context,
                                                      const v1::AdminListSequencesRequest* request,
                                                      v1::AdminListSequencesResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (absl::Status s = Check(context); !s.ok()) {
    reactor->Finish(ToGrpcStatus(s));
    return reactor;
  }
  absl::Status submitted = work_queue_->Submit([this, request, response, reactor] {
    std::vector<SequenceTable::Listing> listings =
        runtime_->ListSequences(request->tenant(), /*all_tenants=*/request->tenant().empty());
    std::sort(listings.begin(), listings.end(),
              [](const SequenceTable::Listing& a, const SequenceTable::Listing& b) {
                return a.id < b.id;
              });
    const absl::Time now = absl::Now();
    for (const SequenceTable::Listing& l : listings) {
      v1::AdminSequence* out = response->add_sequences();
      out->set_sequence_id(l.id);
      out->set_tenant(l.tenant);
      out->set_pages(l.pages);
      for (int64_t n : l.layer_lengths) out->add_layer_lengths(n);
      if (!l.layer_lengths.empty()) {
        out->set_min_length(*std::min_element(l.layer_lengths.begin(), l.layer_lengths.end()));
        out->set_max_length(*std::max_element(l.layer_lengths.begin(), l.layer_lengths.end()));
      }
      out->set_idle_seconds(
          l.last_used == absl::InfinitePast() ? 0.0 : absl::ToDoubleSeconds(now - l.last_used));
    }
    const ServerInfo info = runtime_->Info();
    response->set_pages_total(info.kv_cache.pages_total);
    response->set_pages_free(info.kv_cache.pages_free);
    reactor->Finish(grpc::Status::OK);
  });
  if (!submitted.ok()) reactor->Finish(ToGrpcStatus(submitted));
  return reactor;
}

grpc::ServerUnaryReactor* AdminService::ReleaseSequence(
    grpc::CallbackServerContext* context, const v1::AdminReleaseSequenceRequest* request,
    v1::AdminReleaseSequenceResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (absl::Status s = Check(context); !s.ok()) {
    reactor->Finish(ToGrpcStatus(s));
    return reactor;
  }
  absl::Status submitted = work_queue_->Submit([this, request, response, reactor] {
    const std::string& id = request->sequence_id();
    // Malformed (INVALID_ARGUMENT) or another instance's (FAILED_PRECONDITION naming it).
    if (absl::Status s = runtime_->CheckSequenceId(id); !s.ok()) {
      reactor->Finish(ToGrpcStatus(s));
      return;
    }
    // The owner, so that the table's per-tenant check passes; the id is a capability no tenant
    // could guess, and only the admin gets here.
    std::string owner;
    bool found = false;
    for (const SequenceTable::Listing& l : runtime_->ListSequences("", /*all_tenants=*/true)) {
      if (l.id == id) {
        owner = l.tenant;
        found = true;
        break;
      }
    }
    if (!found) {
      reactor->Finish(ToGrpcStatus(absl::NotFoundError(
          absl::StrCat("sequence ", id, " not found (never created, released, or reclaimed)"))));
      return;
    }
    absl::StatusOr<int64_t> freed = runtime_->ReleaseSequence(id, owner);
    if (!freed.ok()) {
      reactor->Finish(ToGrpcStatus(freed.status()));
      return;
    }
    response->set_pages_freed(*freed);
    response->set_tenant(owner);
    reactor->Finish(grpc::Status::OK);
  });
  if (!submitted.ok()) reactor->Finish(ToGrpcStatus(submitted));
  return reactor;
}

}  // namespace attnd
