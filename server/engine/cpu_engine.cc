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
#include "base/fp8.h"
#include "base/int8_kv.h"
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
  if (!IsKvDType(layout.kv_dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat("cpu engine: KV dtype ", DTypeName(layout.kv_dtype),
                     " is not supported; use fp32, bf16, fp8 or int8"));
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
      prefill_step_keys_(std::max<int64_t>(1, options.prefill_step_keys)),
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
  if (HasRowScale(layout_.kv_dtype)) {
    kv.k_scale = reinterpret_cast<float*>(pool_ + layout_.k_scale_offset(layer));
    kv.v_scale = reinterpret_cast<float*>(pool_ + layout_.v_scale_offset(layer));
  }
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

absl::StatusOr<std::unique_ptr<PrefillRun>> CpuEngine::StartPrefill(const PrefillJob& job) {
  if (job.q.on_device || job.k.on_device || job.v.on_device || job.out_on_device) {
    return NoDeviceMemory();
  }
  switch (layout_.kv_dtype) {
    case DType::kFp32:
      return StartTyped<float>(job);
    case DType::kFp8E4m3:
      return StartTyped<Fp8E4m3>(job);
    case DType::kInt8:
      return StartTyped<Int8Kv>(job);
    default:  // Create admits fp32, bf16, fp8 and int8 only
      return StartTyped<uint16_t>(job);
  }
}

absl::Status CpuEngine::Prefill(const PrefillJob& job) {
  ATTND_ASSIGN_OR_RETURN(const std::unique_ptr<PrefillRun> run, StartPrefill(job));
  while (!run->done()) ATTND_RETURN_IF_ERROR(run->Step());
  return absl::OkStatus();
}

absl::StatusOr<DecodeStats> CpuEngine::Decode(const DecodeJob& job) {
  for (const DecodeJob::Entry& e : job.entries) {
    if (e.q.on_device || e.k.on_device || e.v.on_device || e.out_on_device) return NoDeviceMemory();
  }
  switch (layout_.kv_dtype) {
    case DType::kFp32:
      ATTND_RETURN_IF_ERROR(DecodeTyped<float>(job));
      break;
    case DType::kFp8E4m3:
      ATTND_RETURN_IF_ERROR(DecodeTyped<Fp8E4m3>(job));
      break;
    case DType::kInt8:
      ATTND_RETURN_IF_ERROR(DecodeTyped<Int8Kv>(job));
      break;
    default:  // Create admits fp32, bf16, fp8 and int8 only
      ATTND_RETURN_IF_ERROR(DecodeTyped<uint16_t>(job));
  }
  DecodeStats stats;
  stats.eager_launches = 1;
  return stats;
}

// A prefill as steps: the first converts the call's tensors to fp32 and appends its K/V, the
// others attend consecutive query rows (one step for a sparse prefill, whose estimate reads the
// last queries of each piece). The kernels keep one online softmax per row, so a row's output does
// not depend on which rows share its step.
template <typename KvT>
class CpuEngine::Run : public PrefillRun {
 public:
  Run(const CpuEngine* engine, const PrefillJob& job) : e_(engine), job_(job) {}

  absl::Status Check() const {
    const DcaGeometry& g = e_->geometry_;
    const int64_t hq = g.num_q_heads, hkv = g.num_kv_heads, d = g.head_dim;
    const int64_t t = job_.num_tokens;
    // Only what the kernels could not survive (engine.h, EngineJobKey): prompt_len >= start + t
    // is the runtime's check; it only scales keys and picks the sparse path, never indexes memory.
    if (t < 1 || job_.start < 0 || job_.out == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("engine: bad prefill range (start ",
                                                     job_.start, ", tokens ", t, ", prompt_len ",
                                                     job_.prompt_len, ")"));
    }
    ATTND_RETURN_IF_ERROR(
        e_->CheckPages(job_.layer, job_.page_table, job_.num_pages, job_.start + t));
    ATTND_RETURN_IF_ERROR(e_->CheckLayout(job_.q_layout));
    const bool pre_rotary = job_.q_layout == QLayout::kPreRotary;
    const int64_t q_in_n = (pre_rotary ? 1 : kNumQueryVariants) * t * hq * d;
    ATTND_RETURN_IF_ERROR(CheckElements("q", job_.q, q_in_n));
    ATTND_RETURN_IF_ERROR(CheckElements("k", job_.k, t * hkv * d));
    return CheckElements("v", job_.v, t * hkv * d);
  }

  bool done() const override { return next_row_ >= job_.num_tokens; }

  absl::Status Step() override {
    if (done()) return absl::FailedPreconditionError("the prefill run is done");
    if (!staged_) {
      Stage();
      return absl::OkStatus();
    }
    const DcaGeometry& g = e_->geometry_;
    const int64_t t = job_.num_tokens, row = int64_t{g.num_q_heads} * g.head_dim;
    const bool sparse = e_->sparse_ != nullptr && e_->sparse_->UseSparse(job_.prompt_len);
    // Rows whose keys add up to about step_keys keys per row of a 128-row tile; every row of the
    // call sees at most start + t keys.
    const int64_t per_step =
        sparse ? t : std::max<int64_t>(1, e_->prefill_step_keys_ * 128 / (job_.start + t));
    const int64_t first = next_row_, rows = std::min(per_step, t - first);
    CpuPrefillParams prefill;
    prefill.q = q_.data() + first * kNumQueryVariants * row;
    prefill.out = out_.data() + first * row;
    prefill.start = job_.start + first;
    prefill.num_tokens = rows;
    prefill.softmax_scale = g.softmax_scale * scale_;
    const PagedKv<KvT> kv = e_->LayerView<KvT>(job_.layer, job_.page_table);
    // DCA.md: sparse when the config exists and the prompt (as for scaling) exceeds the threshold.
    if (sparse) {
      DcaSparsePrefillCpu<KvT>(g, kv, prefill, e_->sparse_->layer(job_.layer), e_->sparse_->last_q,
                               e_->compute_.get());
    } else {
      DcaPrefillCpu<KvT>(g, kv, prefill, e_->compute_.get());
    }
    const int64_t out_pitch = job_.out_row_pitch;
    char* out = static_cast<char*>(job_.out);
    if (out_pitch == 0 || out_pitch == row * ElementSize(job_.out_dtype)) {
      ConvertFromFloat(prefill.out, rows * row, job_.out_dtype,
                       out + first * row * ElementSize(job_.out_dtype));
    } else {
      for (int64_t i = 0; i < rows; ++i) {
        ConvertFromFloat(prefill.out + i * row, row, job_.out_dtype, out + (first + i) * out_pitch);
      }
    }
    next_row_ = first + rows;
    return absl::OkStatus();
  }

 private:
  void Stage() {
    const DcaGeometry& g = e_->geometry_;
    const int64_t hq = g.num_q_heads, hkv = g.num_kv_heads, d = g.head_dim;
    const int64_t t = job_.num_tokens;
    const int64_t q_n = t * kNumQueryVariants * hq * d, kv_n = t * hkv * d;
    q_.resize(q_n);
    out_.resize(t * hq * d);
    std::vector<float> k(kv_n), v(kv_n);
    RowsToFloat(job_.k, t, k.data());
    RowsToFloat(job_.v, t, v.data());
    if (job_.q_layout == QLayout::kPreRotary) {
      // The five variants and the rotated key, in fp32, before anything else.
      std::vector<float> raw(t * hq * d);
      RowsToFloat(job_.q, t, raw.data());
      CpuRotaryParams rotary;
      rotary.q = raw.data();
      rotary.k = k.data();
      rotary.q_variants = q_.data();
      rotary.num_variants = kNumQueryVariants;
      rotary.start = job_.start;
      rotary.num_tokens = t;
      DualChunkRotaryCpu(g, e_->inv_freq_, rotary, e_->compute_.get());
    } else {
      RowsToFloat(job_.q, t * kNumQueryVariants, q_.data());
    }
    scale_ = LengthScale(job_.prompt_len, g.original_max_position_embeddings);
    CpuAppendParams append;
    append.k = k.data();
    append.v = v.data();
    append.start = job_.start;
    append.num_tokens = t;
    append.key_scale = scale_;
    AppendKvCpu<KvT>(e_->LayerView<KvT>(job_.layer, job_.page_table), append, e_->compute_.get());
    staged_ = true;
  }

  const CpuEngine* const e_;
  const PrefillJob& job_;
  bool staged_ = false;
  float scale_ = 1.f;
  int64_t next_row_ = 0;
  std::vector<float> q_, out_;
};

template <typename KvT>
absl::StatusOr<std::unique_ptr<PrefillRun>> CpuEngine::StartTyped(const PrefillJob& job) const {
  auto run = std::make_unique<Run<KvT>>(this, job);
  ATTND_RETURN_IF_ERROR(run->Check());
  return std::unique_ptr<PrefillRun>(std::move(run));
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
