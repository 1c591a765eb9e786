// Bearer-token authentication for attnd: the --auth-token-file loader, a constant-time token store,
// and the grpc::AuthMetadataProcessor that maps a request's token to its tenant.
//
// Token file format (one token per line):
//   # comment lines and blank lines are ignored
//   TENANT TOKEN
// TENANT: 1-64 characters of [A-Za-z0-9._-]. TOKEN: 16-512 printable ASCII characters without
// spaces (e.g. `openssl rand -hex 32`). Fields are separated by spaces or tabs; a line with any
// other number of fields is rejected. A tenant may have several tokens (rotation); a token may
// appear only once. Errors name the file and line, never the token.
//
// Clients send `authorization: Bearer <token>` metadata on every call. The processor is the gate:
// it rejects a call without a valid token before any handler runs, and changes nothing else.
// Handlers then resolve the tenant from the call's own metadata with TenantOf(store, context).
// NOTE: the processor must not write the tenant into its grpc::AuthContext: that context belongs
// to the connection, not the call (properties accumulate, and concurrent calls on one connection
// mutate it at once: tenants got confused and attnd crashed, issue #13). Calls to the paths in
// TokenAuthOptions::open_path_prefixes (by default the standard health service,
// "/grpc.health.v1.Health/") pass without a token, so probes and load balancers keep working;
// they get no tenant.
//
// Wiring: a processor only runs on secure server credentials (TLS, or local credentials on
// loopback): see MakeServerCredentials in server/rpc/tls.h.
#ifndef ATTND_SERVER_RPC_AUTH_H_
#define ATTND_SERVER_RPC_AUTH_H_

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "grpcpp/security/auth_metadata_processor.h"
#include "grpcpp/server_context.h"

namespace attnd {

// Immutable after construction; thread-safe.
class TokenStore {
 public:
  // Parses `contents`; `source` names it in errors ("tokens.txt:3: ...").
  static absl::StatusOr<TokenStore> Parse(absl::string_view contents, absl::string_view source);
  // Reads and parses a token file. NOT_FOUND / PERMISSION_DENIED name the file; an empty file
  // (no tokens at all) is INVALID_ARGUMENT, since it would lock every client out.
  static absl::StatusOr<TokenStore> LoadFile(const std::string& path);

  // The tenant owning `token`, or nullopt. Hashes the token with SHA-256 and compares the digest
  // with every stored digest (CRYPTO_memcmp, no early exit), so the time taken does not depend on
  // which token matched or how much of a token was right.
  std::optional<std::string> Authenticate(absl::string_view token) const;

  size_t size() const { return entries_.size(); }
  // Whether some token belongs to `tenant` (e.g. to check --admin-tenant at start-up).
  bool HasTenant(absl::string_view tenant) const;
  // How many distinct tenants the tokens name.
  int64_t num_tenants() const;

 private:
  using Digest = std::array<uint8_t, 32>;
  struct Entry {
    std::string tenant;
    Digest digest;
  };
  static Digest Sha256(absl::string_view data);

  std::vector<Entry> entries_;
};

struct TokenAuthOptions {
  // Method paths ("/package.Service/Method") starting with one of these need no token.
  std::vector<std::string> open_path_prefixes = {"/grpc.health.v1.Health/"};
  // Called once per rejected call with the reason: "missing", "malformed" or "invalid" (e.g. to
  // count attnd_auth_failures_total). May be null. Must be thread-safe.
  std::function<void(absl::string_view reason)> on_failure;
};

class TokenAuthProcessor final : public grpc::AuthMetadataProcessor {
 public:
  TokenAuthProcessor(std::shared_ptr<const TokenStore> store, TokenAuthOptions options);

  // Hashing a token is cheap and does no I/O: run inline on the transport thread.
  bool IsBlocking() const override { return false; }

  // UNAUTHENTICATED messages:
  //   "missing credentials: send 'authorization: Bearer <token>' metadata"
  //   "malformed authorization metadata: expected 'Bearer <token>'"
  //   "invalid bearer token"
  grpc::Status Process(const InputMetadata& auth_metadata, grpc::AuthContext* context,
                       OutputMetadata* consumed_auth_metadata,
                       OutputMetadata* response_metadata) override;

 private:
  std::shared_ptr<const TokenStore> store_;
  const TokenAuthOptions options_;
};

// The tenant of one call, from that call's own `authorization` metadata: "" when auth is off
// (`store` null). UNAUTHENTICATED (the processor's messages) when the call carries no valid token,
// which a call the processor let through never does. Use it as the `tenant` argument of
// SequenceTable::Create/Find/Release. Thread-safe; reads only the call's metadata.
absl::StatusOr<std::string> TenantOf(const TokenStore* store,
                                     const grpc::ServerContextBase& context);

}  // namespace attnd

#endif  // ATTND_SERVER_RPC_AUTH_H_
