#include "server/rpc/tls.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "base/status_macros.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/server_builder.h"
#include "grpcpp/server_posix.h"

namespace attnd {
namespace {

struct BioDeleter {
  void operator()(BIO* b) const { BIO_free(b); }
};
struct X509Deleter {
  void operator()(X509* x) const { X509_free(x); }
};
struct PkeyDeleter {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};
using BioPtr = std::unique_ptr<BIO, BioDeleter>;
using X509Ptr = std::unique_ptr<X509, X509Deleter>;
using PkeyPtr = std::unique_ptr<EVP_PKEY, PkeyDeleter>;

absl::StatusOr<std::string> ReadFile(absl::string_view flag, const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    const int err = errno;
    const std::string message =
        absl::StrCat("cannot read ", flag, " ", path, ": ", std::strerror(err));
    if (err == ENOENT) return absl::NotFoundError(message);
    if (err == EACCES) return absl::PermissionDeniedError(message);
    return absl::InvalidArgumentError(message);
  }
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

BioPtr MemBio(const std::string& pem) {
  return BioPtr(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
}

// The first certificate of a PEM file (the leaf of a chain); checks it has not expired.
absl::StatusOr<X509Ptr> ParseCertificate(absl::string_view flag, const std::string& path,
                                         const std::string& pem) {
  BioPtr bio = MemBio(pem);
  X509Ptr cert(PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr));
  ERR_clear_error();
  if (cert == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, " ", path, ": no PEM certificate (-----BEGIN CERTIFICATE-----) found"));
  }
  if (X509_cmp_current_time(X509_get0_notAfter(cert.get())) < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, " ", path, ": the certificate has expired"));
  }
  return cert;
}

absl::StatusOr<PkeyPtr> ParseKey(absl::string_view flag, const std::string& path,
                                 const std::string& pem) {
  BioPtr bio = MemBio(pem);
  // A null password callback with an encrypted key fails instead of prompting on the terminal.
  PkeyPtr key(PEM_read_bio_PrivateKey(
      bio.get(), nullptr, [](char*, int, int, void*) { return 0; }, nullptr));
  ERR_clear_error();
  if (key == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, " ", path, ": no unencrypted PEM private key found"));
  }
  return key;
}

struct CertAndKey {
  std::string cert_pem;
  std::string key_pem;
};

absl::StatusOr<CertAndKey> LoadCertAndKey(absl::string_view cert_flag, const std::string& cert_file,
                                          absl::string_view key_flag, const std::string& key_file) {
  CertAndKey out;
  ATTND_ASSIGN_OR_RETURN(out.cert_pem, ReadFile(cert_flag, cert_file));
  ATTND_ASSIGN_OR_RETURN(out.key_pem, ReadFile(key_flag, key_file));
  ATTND_ASSIGN_OR_RETURN(X509Ptr cert, ParseCertificate(cert_flag, cert_file, out.cert_pem));
  ATTND_ASSIGN_OR_RETURN(PkeyPtr key, ParseKey(key_flag, key_file, out.key_pem));
  const int match = X509_check_private_key(cert.get(), key.get());
  ERR_clear_error();
  if (match != 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        key_flag, " ", key_file, " does not match the certificate in ", cert_flag, " ", cert_file));
  }
  return out;
}

absl::StatusOr<std::string> LoadCaBundle(absl::string_view flag, const std::string& path) {
  ATTND_ASSIGN_OR_RETURN(std::string pem, ReadFile(flag, path));
  BioPtr bio = MemBio(pem);
  X509Ptr first(PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr));
  ERR_clear_error();
  if (first == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, " ", path, ": no PEM certificate (-----BEGIN CERTIFICATE-----) found"));
  }
  return pem;
}

}  // namespace

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeSslServerCredentials(
    const TlsOptions& options) {
  if (options.cert_file.empty() || options.key_file.empty()) {
    return absl::InvalidArgumentError(
        "TlsOptions::cert_file and TlsOptions::key_file must be given together (got only " +
        std::string(options.cert_file.empty() ? "TlsOptions::key_file" : "TlsOptions::cert_file") +
        ")");
  }
  ATTND_ASSIGN_OR_RETURN(CertAndKey pair, LoadCertAndKey("TlsOptions::cert_file", options.cert_file,
                                                         "TlsOptions::key_file", options.key_file));
  grpc::SslServerCredentialsOptions ssl;
  ssl.pem_key_cert_pairs.push_back({pair.key_pem, pair.cert_pem});
  if (!options.client_ca_file.empty()) {
    ATTND_ASSIGN_OR_RETURN(ssl.pem_root_certs,
                           LoadCaBundle("TlsOptions::client_ca_file", options.client_ca_file));
    ssl.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  } else {
    ssl.client_certificate_request = GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE;
  }
  return grpc::SslServerCredentials(ssl);
}

bool IsLoopbackAddress(absl::string_view listen) {
  const size_t colon = listen.rfind(':');
  absl::string_view host = colon == absl::string_view::npos ? listen : listen.substr(0, colon);
  if (absl::ConsumePrefix(&host, "[")) absl::ConsumeSuffix(&host, "]");
  if (host == "localhost") return true;
  const std::string h(host);
  in_addr v4;
  if (inet_pton(AF_INET, h.c_str(), &v4) == 1) return (ntohl(v4.s_addr) >> 24) == 127;
  in6_addr v6;
  return inet_pton(AF_INET6, h.c_str(), &v6) == 1 && IN6_IS_ADDR_LOOPBACK(&v6);
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const TlsOptions& tls, std::shared_ptr<grpc::AuthMetadataProcessor> auth,
    absl::string_view listen) {
  if (!tls.enabled() && !tls.client_ca_file.empty()) {
    return absl::InvalidArgumentError(
        "TlsOptions::client_ca_file needs TlsOptions::cert_file and TlsOptions::key_file");
  }
  std::shared_ptr<grpc::ServerCredentials> creds;
  if (tls.enabled()) {
    ATTND_ASSIGN_OR_RETURN(creds, MakeSslServerCredentials(tls));
  } else if (auth == nullptr) {
    return grpc::InsecureServerCredentials();
  } else if (IsLoopbackAddress(listen)) {
    creds = grpc::experimental::LocalServerCredentials(LOCAL_TCP);
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "token auth needs TlsOptions::cert_file/key_file unless the listen address is a loopback "
        "address "
        "(bearer tokens would cross the network in clear text); the listen address is ",
        listen));
  }
  if (auth != nullptr) creds->SetAuthMetadataProcessor(std::move(auth));
  return creds;
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(
    const TlsClientOptions& options) {
  grpc::SslCredentialsOptions ssl;
  if (!options.ca_file.empty()) {
    ATTND_ASSIGN_OR_RETURN(ssl.pem_root_certs,
                           LoadCaBundle("TlsClientOptions::ca_file", options.ca_file));
  }
  if (options.cert_file.empty() != options.key_file.empty()) {
    return absl::InvalidArgumentError(
        "TlsClientOptions::cert_file and TlsClientOptions::key_file must be given together");
  }
  if (!options.cert_file.empty()) {
    ATTND_ASSIGN_OR_RETURN(CertAndKey pair,
                           LoadCertAndKey("TlsClientOptions::cert_file", options.cert_file,
                                          "TlsClientOptions::key_file", options.key_file));
    ssl.pem_cert_chain = std::move(pair.cert_pem);
    ssl.pem_private_key = std::move(pair.key_pem);
  }
  return grpc::SslCredentials(ssl);
}

// ---- HealthOnlyServer ----

absl::StatusOr<std::unique_ptr<HealthOnlyServer>> HealthOnlyServer::Start(
    const std::string& listen, absl::Duration preface_timeout,
    std::function<void(absl::string_view reason)> on_close) {
  std::unique_ptr<HealthOnlyServer> health(new HealthOnlyServer());
  ListenerOptions listener_options;
  listener_options.listen = listen;
  listener_options.max_connections = kMaxConnections;
  listener_options.preface_timeout = preface_timeout;
  listener_options.name = "health-only";
  listener_options.on_close = std::move(on_close);
  absl::StatusOr<std::unique_ptr<Listener>> listener = Listener::Bind(listener_options);
  if (!listener.ok()) {
    return absl::Status(listener.status().code(),
                        absl::StrCat("cannot listen on health address ", listen, ": ",
                                     listener.status().message()));
  }
  health->listener_ = *std::move(listener);
  health->port_ = health->listener_->port();
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  builder.RegisterCallbackGenericService(&health->unimplemented_);
  health->server_ = builder.BuildAndStart();
  if (health->server_ == nullptr) {
    return absl::InternalError(absl::StrCat("cannot start the health-only server on ", listen));
  }
  if (health->server_->GetHealthCheckService() == nullptr) {
    return absl::InternalError("the default gRPC health service is missing");
  }
  health->server_->GetHealthCheckService()->SetServingStatus(false);
  health->listener_->Start(
      [server = health->server_.get()](int fd) { grpc::AddInsecureChannelFromFd(server, fd); });
  return health;
}

HealthOnlyServer::~HealthOnlyServer() { Shutdown(); }

void HealthOnlyServer::SetServing(bool serving) {
  server_->GetHealthCheckService()->SetServingStatus(serving);
}

void HealthOnlyServer::Shutdown() {
  if (listener_ != nullptr) listener_->Stop();
  // grpc::Server::Shutdown is idempotent; the deadline bounds a probe in flight.
  if (server_ != nullptr) {
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  }
}

}  // namespace attnd
