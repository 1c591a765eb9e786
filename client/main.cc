// attnctl: a command-line client for attnd.
//   attnctl info                       server, model, DCA config, KV pool and limits
//   attnctl smoke [--dtype ...]        end-to-end numeric check against the naive fp64 reference
//   attnctl bench [--context ...]      prefill / decode latency and throughput
//   attnctl sequences [--tenant T]     every tenant's live sequences (attnd.v1.Admin)
//   attnctl release ID                 release any tenant's sequence (attnd.v1.Admin)
// Flags may be spelled with dashes or underscores (--max-tokens == --max_tokens).
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "client/attnctl.h"
#include "client/attnd_client.h"
#include "client/host_tensor.h"
#include "server/flag_types.h"
#include "version/build_info.h"

ABSL_FLAG(std::string, target, "127.0.0.1:50051", "attnd address, host:port");
ABSL_FLAG(attnd::ByteSize, max_message_bytes, attnd::ByteSize{512ll << 20},
          "largest gRPC message sent or received (bytes, or 512Mi, 1Gi, ...)");
ABSL_FLAG(attnd::FlexDuration, connect_timeout, attnd::FlexDuration{absl::Seconds(10)},
          "how long to wait for the server (10s, 500ms; a bare number is seconds); a refused "
          "connection fails at once");
ABSL_FLAG(std::string, dtype, "",
          "request dtype: bf16 | fp16 | fp32 (default: smoke fp32, bench bf16)");
ABSL_FLAG(int32_t, layers, -1,
          "layers to run; 0 = all (default: smoke all, capped for big models; bench 1)");
ABSL_FLAG(uint64_t, seed, 1, "random seed for the inputs");
ABSL_FLAG(int64_t, max_tokens, 0,
          "smoke: tokens per sequence; 0 = 2.5 DCA chunks, capped at 4096 on the cpu backend");
ABSL_FLAG(int64_t, decode_steps, -1, "decode steps (default: smoke 16, bench 32)");
ABSL_FLAG(std::vector<std::string>, context, std::vector<std::string>({"1024", "4096"}),
          "bench: comma-separated context lengths");
ABSL_FLAG(int64_t, prefill_chunk, 1024, "bench: tokens per prefill call");
ABSL_FLAG(std::string, q_layout, "variants",
          "smoke, bench: variants (the five query variants) | pre_rotary (q/k before the rotary; "
          "attnd applies it)");
ABSL_FLAG(int32_t, batch, 1, "bench: sequences per decode call");
ABSL_FLAG(std::vector<std::string>, transport, std::vector<std::string>({"grpc"}),
          "bench: comma-separated transports, one table each: grpc | session | shm (q/k/v and o "
          "in a registered shm region) | ring (a shared-memory ring) | cuda-ipc (device buffers "
          "shared by CUDA IPC; CUDA builds) | ring-cuda-ipc (the ring, q/k/v and o in those "
          "device buffers)");
ABSL_FLAG(bool, ring_regions, false,
          "bench --transport ring: q/k/v and o in a registered shm region instead of inline bytes");
ABSL_FLAG(
    int64_t, ring_spin_us, 50,
    "bench --transport ring, ring-cuda-ipc: how long the client spins on the answer before it "
    "sleeps");
ABSL_FLAG(int32_t, ring_version, 2,
          "bench --transport ring, ring-cuda-ipc: what the ring carries: 2, binary frames "
          "(proto/attnd/v1/ring_frame.h); 1, serialized SessionRequests (to compare)");
ABSL_FLAG(
    bool, ring_device_events, false,
    "bench --transport ring-cuda-ipc: order each request on the GPU by the ring's CUDA events "
    "instead of host waits (docs/regions.md, \"Device-ordered rings\"); a decode step is "
    "timed until the device has run all its layers");
ABSL_FLAG(int32_t, ring_slots, 1,
          "bench --transport ring, ring-cuda-ipc: a ring of this many slots (1, 2, 4, 8 or 16; "
          "version 2); each decode step's batch goes as that many micro-batches in flight at "
          "once");
ABSL_FLAG(int32_t, cuda_device, -1,
          "bench --transport cuda-ipc, ring-cuda-ipc: the local CUDA device (-1 = the one the "
          "server uses)");
ABSL_FLAG(std::string, token_file, "",
          "file holding the bearer token (attnd --auth-token-file); default: $ATTND_TOKEN if set");
ABSL_FLAG(std::string, tls_ca, "", "PEM CA of the server's certificate; set = TLS");
ABSL_FLAG(std::string, tls_cert, "", "PEM client certificate, for mutual TLS");
ABSL_FLAG(std::string, tls_key, "", "PEM client key, for mutual TLS");
ABSL_FLAG(std::string, tenant, "", "sequences: only this tenant's sequences (default: all)");
ABSL_FLAG(std::string, service, "",
          "health: the service to check (\"\" = the server, or attnd.v1.Attention)");

namespace {

constexpr char kUsage[] =
    "attnctl <info|health|smoke|bench|sequences|release ID> [flags]\n"
    "  info   print the server's model, DCA config, KV pool and limits\n"
    "  health grpc.health.v1 Check (--service); exits 0 when SERVING, 1 otherwise (NOT_SERVING,\n"
    "         unknown service, server unreachable); 2 for a usage error\n"
    "  smoke  prefill + decode one sequence and check every output against the naive fp64\n"
    "         reference; exits non-zero on FAIL (--dtype --layers --max-tokens --decode-steps "
    "--seed)\n"
    "  bench  prefill/decode latency and throughput (--context --prefill-chunk --decode-steps\n"
    "         --batch --dtype --layers --transport grpc,session,shm,ring,cuda-ipc,ring-cuda-ipc\n"
    "         --ring-regions --ring-spin-us --ring-version --cuda-device)\n"
    "  sequences  every live sequence: id, tenant, pages, min/max length, idle time (--tenant);\n"
    "             attnd.v1.Admin: attnd's --admin-tenant token, or loopback when tokens are off\n"
    "  release ID  release any tenant's sequence and free its pages (attnd.v1.Admin, as above)\n"
    "  -h, --help  the flags below    --version  attnctl's version and build";

// absl flags are underscore names; accept the dashed spelling the docs use by rewriting the
// name part of "--some-flag[=value]" before parsing.
std::vector<std::string> NormalizeFlagNames(int argc, char** argv) {
  std::vector<std::string> args;
  bool after_double_dash = false;
  for (int i = 0; i < argc; ++i) {
    std::string a = argv[i];
    if (i > 0 && !after_double_dash && a.size() > 2 && a[0] == '-') {
      if (a == "--") {
        after_double_dash = true;
      } else {
        const size_t start = a.find_first_not_of('-');
        const size_t end = std::min(a.find('='), a.size());
        for (size_t j = start; j < end; ++j) {
          if (a[j] == '-') a[j] = '_';
        }
      }
    }
    args.push_back(std::move(a));
  }
  return args;
}

// The bearer token: the first line of `path`, else $ATTND_TOKEN, else none. Kept out of argv so
// it never shows in `ps`.
absl::StatusOr<std::string> ReadToken(const std::string& path) {
  if (path.empty()) {
    const char* env = std::getenv("ATTND_TOKEN");
    return std::string(env ? env : "");
  }
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat(path, " cannot be read"));
  std::string token;
  std::getline(in, token);
  while (!token.empty() && (token.back() == '\r' || token.back() == ' ')) token.pop_back();
  if (token.empty())
    return absl::InvalidArgumentError(absl::StrCat(path, ": the first line is empty"));
  return token;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(kUsage);
  attnd::SetUsageConfig("attnctl", "client/main.cc");
  attnd::ShortHelpToHelp(argc, argv);
  std::vector<std::string> normalized = NormalizeFlagNames(argc, argv);
  std::vector<char*> normalized_argv;
  for (std::string& a : normalized) normalized_argv.push_back(a.data());
  std::vector<char*> positional =
      absl::ParseCommandLine(static_cast<int>(normalized_argv.size()), normalized_argv.data());
  if (positional.size() < 2) {
    std::cerr << kUsage << "\n";
    return 2;
  }
  const std::string command = positional[1];
  if (command != "info" && command != "health" && command != "smoke" && command != "bench" &&
      command != "sequences" && command != "release") {
    std::cerr << "attnctl: unknown command \"" << command << "\"\n" << kUsage << "\n";
    return 2;
  }
  const size_t want_args = command == "release" ? 3 : 2;
  if (positional.size() != want_args) {
    std::cerr << "attnctl: " << command
              << (command == "release" ? " takes one sequence id" : " takes no arguments") << "\n"
              << kUsage << "\n";
    return 2;
  }

  attnd::client::ClientOptions client_options;
  client_options.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes).bytes;
  client_options.connect_timeout = absl::GetFlag(FLAGS_connect_timeout).value;
  client_options.tls_ca_file = absl::GetFlag(FLAGS_tls_ca);
  client_options.tls_cert_file = absl::GetFlag(FLAGS_tls_cert);
  client_options.tls_key_file = absl::GetFlag(FLAGS_tls_key);
  absl::StatusOr<std::string> token = ReadToken(absl::GetFlag(FLAGS_token_file));
  if (!token.ok()) {
    std::cerr << "attnctl: --token-file: " << token.status().message() << "\n";
    return 2;
  }
  client_options.token = *token;
  absl::StatusOr<std::unique_ptr<attnd::client::AttndClient>> client =
      attnd::client::AttndClient::Connect(absl::GetFlag(FLAGS_target), client_options);
  if (!client.ok()) {
    std::cerr << "attnctl: " << client.status().message() << "\n";
    return command == "health" ? 1 : 2;  // health: unreachable is "not SERVING", as its usage says
  }
  if (command == "info") return attnd::client::RunInfo(**client, std::cout, std::cerr);
  if (command == "sequences") {
    return attnd::client::RunSequences(**client, absl::GetFlag(FLAGS_tenant), std::cout, std::cerr);
  }
  if (command == "release") {
    return attnd::client::RunRelease(**client, positional[2], std::cout, std::cerr);
  }
  if (command == "health") {
    const std::string service = absl::GetFlag(FLAGS_service);
    absl::StatusOr<bool> serving = (*client)->Healthy(service);
    if (!serving.ok()) {
      std::cerr << "attnctl: health: " << serving.status() << "\n";
      return 1;
    }
    std::cout << (service.empty() ? "server" : service) << ": "
              << (*serving ? "SERVING" : "NOT_SERVING") << "\n";
    return *serving ? 0 : 1;
  }

  const std::string dtype_name = absl::GetFlag(FLAGS_dtype).empty()
                                     ? (command == "smoke" ? "fp32" : "bf16")
                                     : absl::GetFlag(FLAGS_dtype);
  absl::StatusOr<attnd::DType> dtype = attnd::client::ParseDType(dtype_name);
  if (!dtype.ok()) {
    std::cerr << "attnctl: --dtype: " << dtype.status().message() << "\n";
    return 2;
  }
  const int32_t layers = absl::GetFlag(FLAGS_layers);
  const std::string q_layout_name = absl::GetFlag(FLAGS_q_layout);
  if (q_layout_name != "variants" && q_layout_name != "pre_rotary") {
    std::cerr << "attnctl: --q-layout must be variants or pre_rotary, got \"" << q_layout_name
              << "\"\n";
    return 2;
  }
  const attnd::v1::QLayout q_layout =
      q_layout_name == "pre_rotary" ? attnd::v1::Q_LAYOUT_PRE_ROTARY : attnd::v1::Q_LAYOUT_VARIANTS;
  const int64_t decode_steps = absl::GetFlag(FLAGS_decode_steps);

  if (command == "smoke") {
    attnd::client::SmokeOptions options;
    options.dtype = *dtype;
    options.layers = layers < 0    ? attnd::client::kDefaultLayers
                     : layers == 0 ? attnd::client::kAllLayers
                                   : layers;
    options.max_tokens = absl::GetFlag(FLAGS_max_tokens);
    if (decode_steps >= 0) options.decode_steps = decode_steps;
    options.seed = absl::GetFlag(FLAGS_seed);
    options.q_layout = q_layout;
    options.progress = true;  // to stderr: stdout stays the report
    return attnd::client::RunSmoke(**client, options, std::cout, std::cerr);
  }

  attnd::client::BenchOptions options;
  options.dtype = *dtype;
  options.layers = layers < 0 ? 1 : layers;
  if (decode_steps >= 0) options.decode_steps = decode_steps;
  options.prefill_chunk = absl::GetFlag(FLAGS_prefill_chunk);
  options.batch = absl::GetFlag(FLAGS_batch);
  options.seed = absl::GetFlag(FLAGS_seed);
  options.q_layout = q_layout;
  options.progress = isatty(STDERR_FILENO) != 0;
  options.transports = absl::GetFlag(FLAGS_transport);
  options.ring_regions = absl::GetFlag(FLAGS_ring_regions);
  options.ring_spin_us = absl::GetFlag(FLAGS_ring_spin_us);
  options.ring_version = absl::GetFlag(FLAGS_ring_version);
  options.ring_device_events = absl::GetFlag(FLAGS_ring_device_events);
  options.ring_slots = absl::GetFlag(FLAGS_ring_slots);
  options.cuda_device = absl::GetFlag(FLAGS_cuda_device);
  options.contexts.clear();
  for (const std::string& c : absl::GetFlag(FLAGS_context)) {
    int64_t n = 0;
    if (!absl::SimpleAtoi(c, &n) || n < 1) {
      std::cerr << "attnctl: --context: \"" << c << "\" is not a positive integer\n";
      return 2;
    }
    options.contexts.push_back(n);
  }
  return attnd::client::RunBench(**client, options, std::cout, std::cerr);
}
