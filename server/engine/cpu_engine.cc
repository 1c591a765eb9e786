#include "server/engine/cpu_engine.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "base/dtype.h"
#include "base/status_macros.h"
#include "kernels/dca_cpu.h"
#include "kernels/dual_chunk_rotary.h"
#include "kernels/paged_kv.h"
#include "kernels/sparse_prefill_cpu.h"

namespace attnd {
namespace {

constexpr size_t kPoolAlignment = 64;  // a cache line: kernels read whole rows

std::string CpuModelName() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line)) {
    absl::string_view rest(line);
    if (absl::ConsumePrefix(&rest, "model name")) {
      const size_t colon = rest.find(':');
      if (colon != absl::string_view::npos) {
        return std::string(absl::StripAsciiWhitespace(rest.substr(colon + 1)));
      }
    }
  }
  return "unknown CPU";
}

std::vector<float> InvFreqOrEmpty(const DcaGeometry& g) {
  if (!CheckRotaryGeometry(g).ok()) return {};
  return RotaryInvFreq(g.rope_theta, g.rotary_dim);
}

// The first `rows` rows of a host view as dense fp32 (views of a shard have a row pitch).
void RowsToFloat(const TensorView& view, int64_t rows, float* dst) {
  const int64_t row = RowBytes(view) / ElementSize(view.dtype), pitch = RowPitch(view);
  const char* src = static_cast<const char*>(view.data);
  if (pitch == RowBytes(view)) {
    ConvertToFloat(src, view.dtype, rows * row, dst);
    return;
  }
  for (int64_t r = 0; r < rows; ++r)
    ConvertToFloat(src + r * pitch, view.dtype, row, dst + r * row);
}

}  // namespace

int64_t DefaultCpuPoolBytes() {
  constexpr int64_t kCap = int64_t{4} << 30;
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page_size = sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page_size <= 0) return kCap;
  return std::min<int64_t>(kCap, static_cast<int64_t>(pages) * page_size / 4);
}

absl::StatusOr<std::unique_ptr<CpuEngine>> CpuEngine::Create(const CpuEngineOptions& options) {
  const DcaGeometry& g = options.geometry;
  const KvLayout& layout = options.layout;
  if (g.num_q_heads <= 0 || g.num_kv_heads <= 0 || g.head_dim <= 0 ||
      g.num_q_heads % g.num_kv_heads != 0 || g.chunk_len <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cpu engine: invalid geometry (q heads ", g.num_q_heads, ", kv heads ",
                     g.num_kv_heads, ", head_dim ", g.head_dim, ", chunk_len ", g.chunk_len, ")"));
  }
  if (layout.num_kv_heads != g.num_kv_heads || layout.head_dim != g.head_dim) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cpu engine: KV layout [", layout.num_kv_heads, " kv heads, head_dim ", layout.head_dim,
        "] does not match the model [", g.num_kv_heads, ", ", g.head_dim, "]"));
  }
  if (layout.kv_dtype != DType::kFp32 && layout.kv_dtype != DType::kBf16) {
    return absl::InvalidArgumentError(absl::StrCat("cpu engine: KV dtype ",
                                                   DTypeName(layout.kv_dtype),
                                                   " is not supported; use fp32 or bf16"));
  }
  if (layout.num_layers <= 0 || layout.page_size <= 0 || layout.num_pages <= 0) {
    return absl::InvalidArgumentError("cpu engine: the KV layout has no layers, pages or slots");
  }
  if (const SparseAttentionConfig* sp = options.sparse.get();
      sp != nullptr && (sp->num_layers != layout.num_layers || sp->num_q_heads != g.num_q_heads ||
                        sp->budgets.size() != static_cast<size_t>(sp->num_layers) *
                                                  static_cast<size_t>(sp->num_q_heads) ||
                        sp->last_q < 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("cpu engine: the sparse attention config (", sp->num_layers, " layers x ",
                     sp->num_q_heads, " heads, last_q ", sp->last_q, ") does not match the model (",
                     layout.num_layers, " layers x ", g.num_q_heads, " q heads)"));
  }
  const size_t bytes = static_cast<size_t>(layout.pool_bytes());
  const size_t rounded = (bytes + kPoolAlignment - 1) / kPoolAlignment * kPoolAlignment;
  void* pool = std::aligned_alloc(kPoolAlignment, rounded);
  if (pool == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cpu engine: cannot allocate a KV pool of ", bytes, " bytes"));
  }
  return std::unique_ptr<CpuEngine>(new CpuEngine(options, pool));
}

CpuEngine::CpuEngine(const CpuEngineOptions& options, void* pool)
    : geometry_(options.geometry),
      layout_(options.layout),
      sparse_(options.sparse),
      inv_freq_(InvFreqOrEmpty(options.geometry)),
      device_name_(CpuModelName()),
      pool_(static_cast<char*>(pool)),
      compute_(std::make_unique<ThreadPool>(options.compute_threads)) {}

CpuEngine::~CpuEngine() {
  compute_.reset();  // no kernel may run while the pool goes away
  std::free(pool_);
}

template <typename KvT>
PagedKv<KvT> CpuEngine::LayerView(int32_t layer, const int32_t* page_table) const {
  PagedKv<KvT> kv;
  kv.k = reinterpret_cast<KvT*>(pool_ + layout_.k_offset(layer));
  kv.v = reinterpret_cast<KvT*>(pool_ + layout_.v_offset(layer));
  kv.page_table = page_table;
  kv.page_size = layout_.page_size;
  kv.num_kv_heads = layout_.num_kv_heads;
  kv.head_dim = layout_.head_dim;
  return kv;
}

absl::Status CpuEngine::CheckPages(int32_t layer, const int32_t* page_table, int64_t num_pages,
                                   int64_t length) const {
  // The kernels index the pool without bounds checks, so a bad table must never reach them.
  if (layer < 0 || layer >= layout_.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("engine: layer ", layer, " is not in [0, ", layout_.num_layers, ")"));
  }
  if (num_pages * layout_.page_size < length || (num_pages > 0 && page_table == nullptr)) {
    return absl::InvalidArgumentError(
        absl::StrCat("engine: ", num_pages, " pages do not cover ", length, " tokens"));
  }
  for (int64_t i = 0; i < num_pages; ++i) {
    if (page_table[i] < 0 || page_table[i] >= layout_.num_pages) {
      return absl::InvalidArgumentError(
          absl::StrCat("engine: page id ", page_table[i], " is not in the pool"));
    }
  }
  return absl::OkStatus();
}

absl::Status CpuEngine::CheckLayout(QLayout layout) const {
  if (layout == QLayout::kVariants) return absl::OkStatus();
  if (layout == QLayout::kPreRotary && !inv_freq_.empty()) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("engine: q layout ", static_cast<int32_t>(layout),
                   layout == QLayout::kPreRotary ? " needs a model with a rotary" : " is unknown"));
}

namespace {

absl::Status NoDeviceMemory() {
  return absl::InvalidArgumentError(
      "the CPU backend reads and writes host memory only: device (CUDA IPC) tensors need "
      "the cuda backend");
}

}  // namespace

absl::Status CpuEngine::Prefill(const PrefillJob& job) {
  if (job.q.on_device || job.k.on_device || job.v.on_device || job.out_on_device) {
    return NoDeviceMemory();
  }
  return layout_.kv_dtype == DType::kFp32 ? PrefillTyped<float>(job) : PrefillTyped<uint16_t>(job);
}

absl::StatusOr<DecodeStats> CpuEngine::Decode(const DecodeJob& job) {
  for (const DecodeJob::Entry& e : job.entries) {
    if (e.q.on_device || e.k.on_device || e.v.on_device || e.out_on_device) return NoDeviceMemory();
  }
  ATTND_RETURN_IF_ERROR(layout_.kv_dtype == DType::kFp32 ? DecodeTyped<float>(job)
                                                         : DecodeTyped<uint16_t>(job));
  DecodeStats stats;
  stats.eager_launches = 1;
  return stats;
}

template <typename KvT>
absl::Status CpuEngine::PrefillTyped(const PrefillJob& job) {
  const int64_t hq = geometry_.num_q_heads, hkv = geometry_.num_kv_heads, d = geometry_.head_dim;
  const int64_t t = job.num_tokens;
  // Only what the kernels could not survive (engine.h, EngineJobKey): prompt_len >= start + t is
  // the runtime's check; it only scales keys and picks the sparse path, never indexes memory.
  if (t < 1 || job.start < 0 || job.out == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("engine: bad prefill range (start ", job.start,
                                                   ", tokens ", t, ", prompt_len ", job.prompt_len,
                                                   ")"));
  }
  if (absl::Status s = CheckPages(job.layer, job.page_table, job.num_pages, job.start + t);
      !s.ok()) {
    return s;
  }
  const bool pre_rotary = job.q_layout == QLayout::kPreRotary;
  if (absl::Status s = CheckLayout(job.q_layout); !s.ok()) return s;
  const int64_t q_n = t * kNumQueryVariants * hq * d, kv_n = t * hkv * d, out_n = t * hq * d;
  const int64_t q_in_n = pre_rotary ? t * hq * d : q_n;
  for (const auto& [name, view, n] :
       {std::make_tuple("q", &job.q, q_in_n), std::make_tuple("k", &job.k, kv_n),
        std::make_tuple("v", &job.v, kv_n)}) {
    if (absl::Status s = CheckElements(name, *view, n); !s.ok()) return s;
  }
  std::vector<float> q(q_n), k(kv_n), v(kv_n), out(out_n);
  RowsToFloat(job.k, t, k.data());
  RowsToFloat(job.v, t, v.data());
  if (pre_rotary) {  // the five variants and the rotated key, in fp32, before anything else
    std::vector<float> raw(q_in_n);
    RowsToFloat(job.q, t, raw.data());
    CpuRotaryParams rotary;
    rotary.q = raw.data();
    rotary.k = k.data();
    rotary.q_variants = q.data();
    rotary.num_variants = kNumQueryVariants;
    rotary.start = job.start;
    rotary.num_tokens = t;
    DualChunkRotaryCpu(geometry_, inv_freq_, rotary, compute_.get());
  } else {
    RowsToFloat(job.q, t * kNumQueryVariants, q.data());
  }

  const float s = LengthScale(job.prompt_len, geometry_.original_max_position_embeddings);
  const PagedKv<KvT> kv = LayerView<KvT>(job.layer, job.page_table);
  CpuAppendParams append;
  append.k = k.data();
  append.v = v.data();
  append.start = job.start;
  append.num_tokens = t;
  append.key_scale = s;
  AppendKvCpu<KvT>(kv, append, compute_.get());

  CpuPrefillParams prefill;
  prefill.q = q.data();
  prefill.out = out.data();
  prefill.start = job.start;
  prefill.num_tokens = t;
  prefill.softmax_scale = geometry_.softmax_scale * s;
  // DCA.md: sparse when the config exists and the prompt (as for scaling) exceeds the threshold.
  if (sparse_ != nullptr && sparse_->UseSparse(job.prompt_len)) {
    DcaSparsePrefillCpu<KvT>(geometry_, kv, prefill, sparse_->layer(job.layer), sparse_->last_q,
                             compute_.get());
  } else {
    DcaPrefillCpu<KvT>(geometry_, kv, prefill, compute_.get());
  }

  const int64_t out_row = hq * d, out_pitch = job.out_row_pitch;
  if (out_pitch == 0 || out_pitch == out_row * ElementSize(job.out_dtype)) {
    ConvertFromFloat(out.data(), out_n, job.out_dtype, job.out);
  } else {
    for (int64_t i = 0; i < t; ++i) {
      ConvertFromFloat(out.data() + i * out_row, out_row, job.out_dtype,
                       static_cast<char*>(job.out) + i * out_pitch);
    }
  }
  return absl::OkStatus();
}

template <typename KvT>
absl::Status CpuEngine::DecodeTyped(const DecodeJob& job) {
  const int64_t hq = geometry_.num_q_heads, hkv = geometry_.num_kv_heads, d = geometry_.head_dim;
  const int64_t n = static_cast<int64_t>(job.entries.size());
  const int64_t q_n = kNumDecodeVariants * hq * d, kv_n = hkv * d, out_n = hq * d;
  for (const DecodeJob::Entry& e : job.entries) {
    if (e.length < 1 || e.out == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("engine: bad decode length ", e.length));
    }
    if (absl::Status s = CheckPages(job.layer, e.page_table, e.num_pages, e.length); !s.ok()) {
      return s;
    }
    if (absl::Status s = CheckLayout(e.q_layout); !s.ok()) return s;
    if (e.q_layout == QLayout::kPreRotary) {
      if (absl::Status s = CheckElements("q", e.q, hq * d); !s.ok()) return s;
    } else if (e.q.data == nullptr || NumElements(e.q) < q_n) {
      // q may carry 3 or 5 variants; the first three are contiguous at the front.
      return absl::InvalidArgumentError("engine: decode q has fewer than 3 variants");
    }
    if (absl::Status s = CheckElements("k", e.k, kv_n); !s.ok()) return s;
    if (absl::Status s = CheckElements("v", e.v, kv_n); !s.ok()) return s;
  }
  std::vector<float> q(n * q_n), kv_buf(2 * kv_n), out(n * out_n), raw_q;
  std::vector<CpuDecodeItem<KvT>> items(n);
  for (int64_t i = 0; i < n; ++i) {
    const DecodeJob::Entry& e = job.entries[i];
    const float s = LengthScale(e.length, geometry_.original_max_position_embeddings);
    RowsToFloat(e.k, 1, kv_buf.data());
    RowsToFloat(e.v, 1, kv_buf.data() + kv_n);
    if (e.q_layout == QLayout::kPreRotary) {  // intra, succ, inter and the key at L - 1
      raw_q.resize(hq * d);
      RowsToFloat(e.q, 1, raw_q.data());
      CpuRotaryParams rotary;
      rotary.q = raw_q.data();
      rotary.k = kv_buf.data();
      rotary.q_variants = q.data() + i * q_n;
      rotary.num_variants = kNumDecodeVariants;
      rotary.start = e.length - 1;
      rotary.num_tokens = 1;
      DualChunkRotaryCpu(geometry_, inv_freq_, rotary, nullptr);
    } else {
      RowsToFloat(e.q, kNumDecodeVariants, q.data() + i * q_n);
    }
    const PagedKv<KvT> kv = LayerView<KvT>(job.layer, e.page_table);
    CpuAppendParams append;
    append.k = kv_buf.data();
    append.v = kv_buf.data() + kv_n;
    append.start = e.length - 1;
    append.num_tokens = 1;
    append.key_scale = s;
    AppendKvCpu<KvT>(kv, append, compute_.get());

    items[i].kv = kv;
    items[i].q = q.data() + i * q_n;
    items[i].out = out.data() + i * out_n;
    items[i].length = e.length;
    items[i].q_scale = s;
  }
  DcaDecodeCpu<KvT>(geometry_, absl::MakeConstSpan(items), compute_.get());
  for (int64_t i = 0; i < n; ++i) {
    const DecodeJob::Entry& e = job.entries[i];
    ConvertFromFloat(out.data() + i * out_n, out_n, e.out_dtype, e.out);
  }
  return absl::OkStatus();
}

}  // namespace attnd
