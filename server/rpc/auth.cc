#include "server/rpc/auth.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>
#include <sstream>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace attnd {
namespace {

constexpr size_t kMinTokenLength = 16;
constexpr size_t kMaxTokenLength = 512;
constexpr size_t kMaxTenantLength = 64;

bool IsValidTenant(absl::string_view tenant) {
  if (tenant.empty() || tenant.size() > kMaxTenantLength) return false;
  for (char c : tenant) {
    if (!absl::ascii_isalnum(c) && c != '.' && c != '_' && c != '-') return false;
  }
  return true;
}

// Printable ASCII without space: what can travel in an HTTP/2 header value after "Bearer ".
bool IsValidTokenChars(absl::string_view token) {
  for (char c : token) {
    if (c <= ' ' || c > '~') return false;
  }
  return true;
}

}  // namespace

TokenStore::Digest TokenStore::Sha256(absl::string_view data) {
  Digest digest{};
  unsigned int len = 0;
  // EVP_Digest with SHA-256 cannot fail for in-memory input short of allocation failure; a zero
  // digest then matches no stored token (stored digests come from real hashes).
  EVP_Digest(data.data(), data.size(), digest.data(), &len, EVP_sha256(), nullptr);
  return digest;
}

absl::StatusOr<TokenStore> TokenStore::Parse(absl::string_view contents, absl::string_view source) {
  TokenStore store;
  absl::flat_hash_set<std::string> seen_digests;
  int line_number = 0;
  for (absl::string_view line : absl::StrSplit(contents, '\n')) {
    ++line_number;
    absl::ConsumeSuffix(&line, "\r");
    absl::string_view stripped = absl::StripAsciiWhitespace(line);
    if (stripped.empty() || stripped[0] == '#') continue;
    const std::string where = absl::StrCat(source, ":", line_number, ": ");
    std::vector<absl::string_view> fields =
        absl::StrSplit(stripped, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    if (fields.size() != 2) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, "expected 'TENANT TOKEN' (2 fields), found ", fields.size(), " fields"));
    }
    const absl::string_view tenant = fields[0];
    const absl::string_view token = fields[1];
    if (!IsValidTenant(tenant)) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, "tenant '", tenant, "' must be 1-64 characters of [A-Za-z0-9._-]"));
    }
    if (token.size() < kMinTokenLength || token.size() > kMaxTokenLength) {
      return absl::InvalidArgumentError(absl::StrCat(where, "token for tenant '", tenant, "' has ",
                                                     token.size(), " characters; need ",
                                                     kMinTokenLength, "-", kMaxTokenLength));
    }
    if (!IsValidTokenChars(token)) {
      return absl::InvalidArgumentError(absl::StrCat(where, "token for tenant '", tenant,
                                                     "' must be printable ASCII without spaces"));
    }
    Entry entry{std::string(tenant), Sha256(token)};
    if (!seen_digests.insert(std::string(entry.digest.begin(), entry.digest.end())).second) {
      return absl::InvalidArgumentError(absl::StrCat(where, "duplicate token (tenant '", tenant,
                                                     "'); every token must be unique"));
    }
    store.entries_.push_back(std::move(entry));
  }
  if (store.entries_.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": no tokens (expected lines of 'TENANT TOKEN')"));
  }
  return store;
}

absl::StatusOr<TokenStore> TokenStore::LoadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    const int err = errno;
    const std::string message =
        absl::StrCat("cannot read token file ", path, ": ", std::strerror(err));
    if (err == ENOENT) return absl::NotFoundError(message);
    if (err == EACCES) return absl::PermissionDeniedError(message);
    return absl::InvalidArgumentError(message);
  }
  std::stringstream buffer;
  buffer << in.rdbuf();
  return Parse(buffer.str(), path);
}

bool TokenStore::HasTenant(absl::string_view tenant) const {
  for (const Entry& e : entries_) {
    if (e.tenant == tenant) return true;
  }
  return false;
}

int64_t TokenStore::num_tenants() const {
  absl::flat_hash_set<absl::string_view> tenants;
  for (const Entry& e : entries_) tenants.insert(e.tenant);
  return static_cast<int64_t>(tenants.size());
}

std::optional<std::string> TokenStore::Authenticate(absl::string_view token) const {
  const Digest digest = Sha256(token);
  size_t match = entries_.size();
  for (size_t i = 0; i < entries_.size(); ++i) {
    // Every entry is compared; the result is folded in without branching on secret data.
    const size_t equal = static_cast<size_t>(
        CRYPTO_memcmp(digest.data(), entries_[i].digest.data(), digest.size()) == 0);
    match = equal * i + (1 - equal) * match;
  }
  if (match == entries_.size()) return std::nullopt;
  return entries_[match].tenant;
}

namespace {

// The tenant of the call whose `authorization` values are [first, last): exactly one value,
// "Bearer <token>" (scheme case-insensitive) with a token of `store`. `reason` gets "missing",
// "malformed" or "invalid" on failure.
template <typename Iterator>
absl::StatusOr<std::string> Authenticate(const TokenStore& store, Iterator first, Iterator last,
                                         absl::string_view* reason) {
  if (first == last) {
    *reason = "missing";
    return absl::UnauthenticatedError(
        "missing credentials: send 'authorization: Bearer <token>' metadata");
  }
  constexpr char kMalformed[] = "malformed authorization metadata: expected 'Bearer <token>'";
  if (std::next(first) != last) {
    *reason = "malformed";
    return absl::UnauthenticatedError(kMalformed);
  }
  const absl::string_view value(first->second.data(), first->second.size());
  constexpr absl::string_view kScheme = "bearer ";
  if (value.size() <= kScheme.size() ||
      !absl::EqualsIgnoreCase(value.substr(0, kScheme.size()), kScheme)) {
    *reason = "malformed";
    return absl::UnauthenticatedError(kMalformed);
  }
  std::optional<std::string> tenant =
      store.Authenticate(absl::StripAsciiWhitespace(value.substr(kScheme.size())));
  if (!tenant) {
    *reason = "invalid";
    return absl::UnauthenticatedError("invalid bearer token");
  }
  return *std::move(tenant);
}

}  // namespace

TokenAuthProcessor::TokenAuthProcessor(std::shared_ptr<const TokenStore> store,
                                       TokenAuthOptions options)
    : store_(std::move(store)), options_(std::move(options)) {}

grpc::Status TokenAuthProcessor::Process(const InputMetadata& auth_metadata,
                                         grpc::AuthContext* /*context*/,
                                         OutputMetadata* /*consumed_auth_metadata*/,
                                         OutputMetadata* /*response_metadata*/) {
  auto path = auth_metadata.find(":path");
  if (path != auth_metadata.end()) {
    const absl::string_view method(path->second.data(), path->second.size());
    for (const std::string& prefix : options_.open_path_prefixes) {
      if (absl::StartsWith(method, prefix)) return grpc::Status::OK;
    }
  }
  // Only a check: the auth context is the connection's (see auth.h), and the token stays in the
  // call's metadata for TenantOf.
  auto range = auth_metadata.equal_range("authorization");
  absl::string_view reason;
  absl::StatusOr<std::string> tenant = Authenticate(*store_, range.first, range.second, &reason);
  if (tenant.ok()) return grpc::Status::OK;
  if (options_.on_failure) options_.on_failure(reason);
  return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, std::string(tenant.status().message()));
}

absl::StatusOr<std::string> TenantOf(const TokenStore* store,
                                     const grpc::ServerContextBase& context) {
  if (store == nullptr) return std::string();
  const auto& metadata = context.client_metadata();
  auto range = metadata.equal_range("authorization");
  absl::string_view reason;
  return Authenticate(*store, range.first, range.second, &reason);
}

}  // namespace attnd
