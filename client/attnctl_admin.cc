// attnctl sequences / release: the operator's view of attnd.v1.Admin.
#include <string>

#include "absl/strings/str_format.h"
#include "client/attnctl.h"

namespace attnd {
namespace client {
namespace {

std::string Idle(double seconds) {
  if (seconds < 60) return absl::StrFormat("%.1fs", seconds);
  if (seconds < 3600) return absl::StrFormat("%.1fm", seconds / 60);
  return absl::StrFormat("%.1fh", seconds / 3600);
}

// PERMISSION_DENIED carries the server's explanation (which tenant is needed); say what to do.
void Explain(const absl::Status& s, absl::string_view what, std::ostream& err) {
  err << "attnctl: " << what << ": " << s << "\n";
  if (s.code() == absl::StatusCode::kPermissionDenied) {
    err << "attnctl: the Admin service needs the --admin-tenant's token (--token-file or "
           "$ATTND_TOKEN), or, with tokens off, a call from the daemon's own host\n";
  }
}

}  // namespace

int RunSequences(AttndClient& client, const std::string& tenant, std::ostream& out,
                 std::ostream& err) {
  absl::StatusOr<v1::AdminListSequencesResponse> list = client.ListSequences(tenant);
  if (!list.ok()) {
    Explain(list.status(), "sequences", err);
    return 2;
  }
  out << absl::StrFormat("%-32s  %-16s  %7s  %8s  %8s  %7s\n", "SEQUENCE", "TENANT", "PAGES",
                         "MIN_LEN", "MAX_LEN", "IDLE");
  int64_t pages = 0;
  for (const v1::AdminSequence& s : list->sequences()) {
    out << absl::StrFormat("%-32s  %-16s  %7d  %8d  %8d  %7s\n", s.sequence_id(),
                           s.tenant().empty() ? "-" : s.tenant(), s.pages(), s.min_length(),
                           s.max_length(), Idle(s.idle_seconds()));
    pages += s.pages();
  }
  out << absl::StrFormat("%d sequences holding %d pages; %d of %d pages free\n",
                         list->sequences_size(), pages, list->pages_free(), list->pages_total());
  return 0;
}

int RunRelease(AttndClient& client, const std::string& sequence_id, std::ostream& out,
               std::ostream& err) {
  absl::StatusOr<v1::AdminReleaseSequenceResponse> released = client.AdminRelease(sequence_id);
  if (!released.ok()) {
    Explain(released.status(), "release", err);
    return 2;
  }
  out << "released " << sequence_id << " of tenant "
      << (released->tenant().empty() ? "-" : released->tenant()) << ": " << released->pages_freed()
      << " pages freed\n";
  return 0;
}

}  // namespace client
}  // namespace attnd
