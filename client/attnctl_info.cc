#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/attnctl.h"

namespace attnd {
namespace client {
namespace {

std::string DTypeString(v1::DType dtype) {
  switch (dtype) {
    case v1::DTYPE_BF16:
      return "bf16";
    case v1::DTYPE_FP16:
      return "fp16";
    case v1::DTYPE_FP32:
      return "fp32";
    case v1::DTYPE_FP8_E4M3:
      return "fp8_e4m3 (fp32 scale per token and kv head)";
    case v1::DTYPE_INT8:
      return "int8 (fp32 scale per token and kv head)";
    default:
      return v1::DType_Name(dtype);
  }
}

// 1536 -> "1.5 KiB"; keeps the exact byte count beside it for scripts.
std::string Bytes(int64_t n) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double x = static_cast<double>(n);
  int u = 0;
  while (x >= 1024 && u < 4) {
    x /= 1024;
    ++u;
  }
  if (u == 0) return absl::StrCat(n, " B");
  return absl::StrFormat("%d (%.1f %s)", n, x, units[u]);
}

}  // namespace

int RunInfo(AttndClient& client, std::ostream& out, std::ostream& err) {
  absl::StatusOr<v1::GetServerInfoResponse> info = client.Info();
  if (!info.ok()) {
    err << "attnctl info: " << info.status() << "\n";
    return 2;
  }
  const v1::ModelInfo& m = info->model();
  const v1::DcaConfig& d = info->dca();
  const v1::KvCacheInfo& kv = info->kv_cache();
  const v1::Limits& l = info->limits();
  const int64_t tokens_in_pool = kv.pages_total() * kv.page_size();
  std::vector<std::pair<std::string, std::string>> lines = {
      {"version", info->version()},
      {"backend", info->backend()},
      {"device", info->device()},
      {"model", m.name()},
      {"layers", absl::StrCat(m.num_layers())},
      {"q heads", absl::StrCat(m.num_q_heads())},
      {"kv heads", absl::StrCat(m.num_kv_heads())},
      {"head dim", absl::StrCat(m.head_dim())},
      {"kv dtype", DTypeString(m.kv_dtype())},
      {"max position embeddings", absl::StrCat(m.max_position_embeddings())},
      {"softmax scale", absl::StrFormat("%.6g", m.softmax_scale())},
      {"dca chunk size", absl::StrCat(d.chunk_size())},
      {"dca local size", absl::StrCat(d.local_size())},
      {"dca chunk len", absl::StrCat(d.chunk_len())},
      {"dca original max positions", d.original_max_position_embeddings() == 0
                                         ? std::string("0 (no length scaling)")
                                         : absl::StrCat(d.original_max_position_embeddings())},
      {"sparse attention", d.sparse_attention_enabled()
                               ? absl::StrCat("on (threshold ", d.sparse_attention_threshold(),
                                              ", last_q ", d.sparse_attention_last_q(), ")")
                               : std::string("off")},
      {"page size", absl::StrCat(kv.page_size(), " tokens")},
      {"pages", absl::StrCat(kv.pages_free(), " free of ", kv.pages_total(), " (", tokens_in_pool,
                             " tokens)")},
      {"bytes per page", Bytes(kv.bytes_per_page())},
      // Scales included (fp8, int8): what one token of the whole model costs the pool.
      {"bytes per token",
       kv.page_size() > 0 ? Bytes(kv.bytes_per_page() / kv.page_size()) : std::string("-")},
      {"pool bytes", Bytes(kv.pool_bytes())},
      {"live sequences", absl::StrCat(info->live_sequences())},
      {"max message bytes", Bytes(l.max_message_bytes())},
      {"max sequence length", absl::StrCat(l.max_sequence_length())},
      {"max sequences",
       l.max_sequences() == 0 ? std::string("unlimited") : absl::StrCat(l.max_sequences())},
  };
  // A sharded engine (docs/sharding.md): where each slice of the heads and its pool lives.
  if (info->devices_size() > 1) {
    for (int i = 0; i < info->devices_size(); ++i) {
      const v1::DeviceShard& s = info->devices(i);
      lines.emplace_back(
          absl::StrCat("shard ", i),
          absl::StrCat(s.device(), " (", s.device_name(), "): kv heads ", s.first_kv_head(), "-",
                       s.first_kv_head() + s.num_kv_heads() - 1, ", q heads ", s.first_q_head(),
                       "-", s.first_q_head() + s.num_q_heads() - 1, ", pool ",
                       Bytes(s.pool_bytes()), ", used ", Bytes(s.bytes_used())));
    }
  }
  // Same-host GPU clients (docs/operations.md): whether their device-ordered rings are fast.
  if (info->regions().device_ordered_rings()) {
    lines.emplace_back("device-ordered rings",
                       info->regions().cuda_mps()
                           ? std::string("yes, under CUDA MPS")
                           : std::string("yes; not under CUDA MPS: each ordered step waits for a "
                                         "GPU time slice between processes (docs/operations.md)"));
  }
  if (!info->instance().name().empty()) {  // a fleet member (docs/fleet.md)
    const std::string& at = info->instance().advertise_address();
    lines.emplace_back("instance", at.empty() ? info->instance().name()
                                              : absl::StrCat(info->instance().name(), " at ", at));
  }
  size_t width = 0;
  for (const auto& [key, value] : lines) width = std::max(width, key.size());
  for (const auto& [key, value] : lines) {
    out << key << ":" << std::string(width - key.size() + 1, ' ') << value << "\n";
  }
  return 0;
}

}  // namespace client
}  // namespace attnd
