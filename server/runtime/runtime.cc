#include "server/runtime/runtime.h"

#include <algorithm>
#include <limits>
#include <numeric>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "base/status_macros.h"
#include "kernels/dca.h"
#include "kernels/dual_chunk_rotary.h"

namespace attnd {
namespace {

std::string ShapeString(absl::Span<const int64_t> shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// Names a dtype as it arrived, including values that are not a DType (wire values 0, 4, ...).
std::string DTypeString(DType t) {
  if (IsKnownDType(t)) return std::string(DTypeName(t));
  const int raw = static_cast<int>(t);
  if (IsKvDType(t)) return absl::StrCat(DTypeName(t), " (", raw, ", a KV cache dtype only)");
  return raw == 0 ? "unspecified (0)" : absl::StrCat("unknown (", raw, ")");
}

absl::Status CheckDType(absl::string_view prefix, absl::string_view name, DType t) {
  if (IsKnownDType(t)) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(prefix, name, " dtype must be bf16, fp16 or fp32, got ", DTypeString(t)));
}

absl::Status CheckSameDType(absl::string_view prefix, const RequestTensor& q,
                            const RequestTensor& k, const RequestTensor& v) {
  if (q.dtype == k.dtype && q.dtype == v.dtype) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(prefix, "q, k and v must share one dtype, got q ",
                                                 DTypeString(q.dtype), ", k ", DTypeString(k.dtype),
                                                 ", v ", DTypeString(v.dtype)));
}

// The byte count must match the (already validated, all positive) shape. Compares without
// overflowing: a shape may claim 2^62 tokens.
absl::Status CheckBytes(absl::string_view prefix, absl::string_view name, const RequestTensor& t) {
  const int64_t max = std::numeric_limits<int64_t>::max();
  int64_t need = static_cast<int64_t>(ElementSize(t.dtype));
  bool overflow = false;
  for (int64_t d : t.shape) {
    if (need > max / d) {
      overflow = true;
      break;
    }
    need *= d;
  }
  if (!overflow && static_cast<int64_t>(t.bytes.size()) == need) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(prefix, name, " holds ", t.bytes.size(), " bytes of data, but shape ",
                   ShapeString(t.shape), " of ", DTypeString(t.dtype), " needs ",
                   overflow ? std::string("more than 2^63") : absl::StrCat(need)));
}

TensorView ToView(const RequestTensor& t) {
  TensorView view;
  view.dtype = t.dtype;
  view.data = t.bytes.data();
  view.on_device = t.on_device;
  view.shape.assign(t.shape.begin(), t.shape.end());
  return view;
}

// A known layout, and for pre-rotary requests a model whose rotary the engine can apply.
absl::Status CheckQLayout(QLayout layout, const DcaGeometry& g) {
  if (layout == QLayout::kVariants) return absl::OkStatus();
  if (layout != QLayout::kPreRotary) {
    return absl::InvalidArgumentError(
        absl::StrCat("q_layout ", static_cast<int32_t>(layout),
                     " is not Q_LAYOUT_VARIANTS (0) or Q_LAYOUT_PRE_ROTARY (1)"));
  }
  if (absl::Status s = CheckRotaryGeometry(g); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("q_layout pre_rotary: ", s.message()));
  }
  return absl::OkStatus();
}

absl::Status NotFound(absl::string_view prefix, absl::string_view id) {
  // Same text as the sequence table's, so a released sequence and an unknown one look alike.
  return absl::NotFoundError(absl::StrCat(prefix, "sequence ", id, " not found"));
}

absl::Status WithPrefix(absl::string_view prefix, const absl::Status& s) {
  if (prefix.empty() || s.ok()) return s;
  return absl::Status(s.code(), absl::StrCat(prefix, s.message()));
}

}  // namespace

absl::StatusOr<std::unique_ptr<Runtime>> Runtime::Create(const ModelConfig& model,
                                                         std::unique_ptr<Engine> engine,
                                                         const RuntimeOptions& options) {
  if (engine == nullptr) return absl::InvalidArgumentError("runtime: no engine");
  const DcaGeometry want = model.geometry();
  const DcaGeometry& have = engine->geometry();
  const KvLayout& layout = engine->layout();
  if (have.num_q_heads != want.num_q_heads || have.num_kv_heads != want.num_kv_heads ||
      have.head_dim != want.head_dim || have.chunk_len != want.chunk_len ||
      layout.num_layers != model.num_layers || layout.num_kv_heads != want.num_kv_heads ||
      layout.head_dim != want.head_dim) {
    return absl::InvalidArgumentError("runtime: the engine's geometry does not match the model");
  }
  if (options.max_sequence_length < 0 || options.max_sequences < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max sequence length and max sequences must be >= 0, got ",
                     options.max_sequence_length, " and ", options.max_sequences));
  }
  if (absl::Status s = CheckInstanceName(options.instance_name); !s.ok()) return s;
  const int64_t max_len =
      options.max_sequence_length > 0 ? options.max_sequence_length : model.max_position_embeddings;
  if (max_len <= 0) {
    return absl::InvalidArgumentError(
        "the model has no max_position_embeddings; set a max sequence length");
  }
  // Unlimited empty sequences would grow without bound (issue #13: 194,900 in 30 s, 91 MB): by
  // default at most one per page, the most that can each hold a token.
  const int64_t max_sequences =
      options.max_sequences > 0 ? options.max_sequences : layout.num_pages;
  return std::unique_ptr<Runtime>(
      new Runtime(model, std::move(engine), options, max_len, max_sequences));
}

Runtime::Runtime(const ModelConfig& model, std::unique_ptr<Engine> engine,
                 const RuntimeOptions& options, int64_t max_sequence_length, int64_t max_sequences)
    : model_(model),
      engine_(std::move(engine)),
      options_(options),
      max_sequence_length_(max_sequence_length),
      max_sequences_(max_sequences),
      allocator_(engine_->layout().num_pages),
      table_(SequenceTableOptions{engine_->layout().num_layers, engine_->layout().page_size,
                                  max_sequences, options.tenant_page_quota,
                                  options.tenant_max_sequences, options.instance_name},
             &allocator_) {}

TenantUsage Runtime::Usage(absl::string_view tenant) const {
  return TenantUsage{table_.TenantSequences(tenant), table_.TenantPages(tenant)};
}

int64_t PrefillTokensPerMessage(const DcaGeometry& g, int64_t max_message_bytes, int64_t q_rows,
                                int64_t element_bytes) {
  constexpr int64_t kFraming = 1024;  // ids, shapes, tags: a few hundred bytes in practice
  const int64_t row = int64_t{g.num_q_heads} * g.head_dim;
  const int64_t request = (q_rows * row + 2 * int64_t{g.num_kv_heads} * g.head_dim) * element_bytes;
  const int64_t response = row * element_bytes;
  const int64_t per_token = std::max(request, response);
  if (per_token <= 0 || max_message_bytes <= kFraming) return 0;
  return (max_message_bytes - kFraming) / per_token;
}

ServerInfo Runtime::Info() const {
  const DcaGeometry g = model_.geometry();
  const KvLayout& layout = engine_->layout();
  ServerInfo info;
  info.version = options_.version;
  info.backend = engine_->backend();
  info.device = engine_->device_name();
  info.model.name = model_.name;
  info.model.num_layers = model_.num_layers;
  info.model.num_q_heads = g.num_q_heads;
  info.model.num_kv_heads = g.num_kv_heads;
  info.model.head_dim = g.head_dim;
  info.model.kv_dtype = layout.kv_dtype;
  info.model.max_position_embeddings = model_.max_position_embeddings;
  info.model.softmax_scale = g.softmax_scale;
  info.model.rope_theta = model_.rope_theta;
  info.model.partial_rotary_factor = model_.partial_rotary_factor;
  info.model.rotary_dim = model_.rotary_dim;
  info.dca.chunk_size = model_.chunk_size;
  info.dca.local_size = model_.local_size;
  info.dca.chunk_len = g.chunk_len;
  info.dca.original_max_position_embeddings = g.original_max_position_embeddings;
  info.dca.sparse_attention_enabled = model_.sparse_attention_enabled;
  info.dca.sparse_attention_threshold = model_.sparse_attention_threshold;
  info.dca.sparse_attention_last_q = model_.sparse_attention_last_q;
  info.kv_cache.page_size = layout.page_size;
  info.kv_cache.pages_total = allocator_.num_total();
  info.kv_cache.pages_free = allocator_.num_free();
  info.kv_cache.bytes_per_page = layout.bytes_per_page();
  info.kv_cache.pool_bytes = layout.pool_bytes();
  info.devices = engine_->shards();
  for (EngineShard& shard : info.devices) {
    shard.bytes_used = (info.kv_cache.pages_total - info.kv_cache.pages_free) *
                       (shard.pool_bytes / std::max<int64_t>(1, info.kv_cache.pages_total));
  }
  info.live_sequences = table_.size();
  info.limits.max_message_bytes = options_.max_message_bytes;
  info.limits.max_sequence_length = max_sequence_length_;
  info.limits.max_sequences = max_sequences_;
  info.limits.tenant_max_sequences = options_.tenant_max_sequences;
  info.limits.tenant_page_quota = options_.tenant_page_quota;
  info.limits.max_prefill_tokens_per_call = PrefillTokensPerMessage(
      g, options_.max_message_bytes, kNumQueryVariants, /*element_bytes=*/4);
  info.instance.name = options_.instance_name;
  info.instance.advertise_address = options_.advertise_address;
  return info;
}

absl::StatusOr<std::string> Runtime::CreateSequence(absl::string_view tenant) {
  absl::StatusOr<std::shared_ptr<Sequence>> seq = table_.Create(tenant);
  if (!seq.ok()) return seq.status();
  return (*seq)->id;
}

absl::StatusOr<int64_t> Runtime::ReleaseSequence(absl::string_view id, absl::string_view tenant) {
  return table_.Release(id, tenant);
}

std::vector<ReclaimedSequence> Runtime::ReclaimIdle(absl::Time cutoff) {
  std::vector<ReclaimedSequence> reclaimed;
  for (const std::string& id : table_.IdleSince(cutoff)) {
    // Re-checked at release: a request may have used (or released) it since IdleSince looked.
    absl::StatusOr<ReclaimedSequence> r = table_.ReleaseIfIdle(id, cutoff);
    if (r.ok()) reclaimed.push_back(*std::move(r));
  }
  return reclaimed;
}

absl::StatusOr<std::vector<int64_t>> Runtime::LayerLengths(absl::string_view id,
                                                           absl::string_view tenant) const {
  absl::StatusOr<std::shared_ptr<Sequence>> seq = table_.Find(id, tenant);
  if (!seq.ok()) return seq.status();
  MutexLock lock(&(*seq)->mu);
  if ((*seq)->released) return NotFound("", id);
  return (*seq)->layer_lengths;
}

absl::Status Runtime::CheckFinite(absl::string_view prefix, absl::string_view name,
                                  const RequestTensor& t) const {
  // Device memory (CUDA IPC regions) is never read on the host.
  if (!options_.check_finite || t.on_device) return absl::OkStatus();
  const int64_t bad =
      FirstNonFinite(t.dtype, t.bytes.data(), t.bytes.size() / ElementSize(t.dtype));
  if (bad < 0) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      prefix, name, " holds a NaN or an infinity (element ", bad,
      "); attnd refuses it, as it would poison the sequence's cache for every later token"));
}

absl::Status Runtime::CheckLayer(int32_t layer) const {
  if (layer >= 0 && layer < model_.num_layers) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("layer ", layer, " is not in [0, ", model_.num_layers, ")"));
}

absl::Status Runtime::CheckPrefillLayout(const PrefillCall& call, int64_t* num_tokens) const {
  const DcaGeometry& g = engine_->geometry();
  for (const auto& [name, t] :
       {std::make_pair("q", &call.q), std::make_pair("k", &call.k), std::make_pair("v", &call.v)}) {
    if (absl::Status s = CheckDType("", name, t->dtype); !s.ok()) return s;
  }
  if (absl::Status s = CheckSameDType("", call.q, call.k, call.v); !s.ok()) return s;
  if (absl::Status s = CheckQLayout(call.q_layout, g); !s.ok()) return s;

  const absl::Span<const int64_t> qs = call.q.shape;
  if (call.q_layout == QLayout::kPreRotary) {
    if (qs.size() != 3 || qs[0] < 1 || qs[1] != g.num_q_heads || qs[2] != g.head_dim) {
      return absl::InvalidArgumentError(absl::StrCat("q must have shape [T, ", g.num_q_heads, ", ",
                                                     g.head_dim,
                                                     "] (T >= 1) for q_layout "
                                                     "pre_rotary, got ",
                                                     ShapeString(qs)));
    }
  } else if (qs.size() != 4 || qs[0] < 1 || qs[1] != kNumQueryVariants || qs[2] != g.num_q_heads ||
             qs[3] != g.head_dim) {
    return absl::InvalidArgumentError(absl::StrCat("q must have shape [T, ", kNumQueryVariants,
                                                   ", ", g.num_q_heads, ", ", g.head_dim,
                                                   "] (T >= 1), got ", ShapeString(qs)));
  }
  const int64_t t = qs[0];
  const std::vector<int64_t> kv_shape = {t, g.num_kv_heads, g.head_dim};
  for (const auto& [name, tensor] : {std::make_pair("k", &call.k), std::make_pair("v", &call.v)}) {
    if (!std::equal(tensor->shape.begin(), tensor->shape.end(), kv_shape.begin(), kv_shape.end())) {
      return absl::InvalidArgumentError(absl::StrCat(name, " must have shape ",
                                                     ShapeString(kv_shape), " (T = ", t,
                                                     " from q), got ", ShapeString(tensor->shape)));
    }
  }
  *num_tokens = t;
  return absl::OkStatus();
}

absl::Status Runtime::CheckPrefillShapes(const PrefillCall& call, int64_t* num_tokens) const {
  ATTND_RETURN_IF_ERROR(CheckPrefillLayout(call, num_tokens));
  if (*num_tokens > max_sequence_length_) {
    return absl::OutOfRangeError(absl::StrCat("a prefill of ", *num_tokens,
                                              " tokens is longer than the maximum sequence length ",
                                              max_sequence_length_));
  }
  return absl::OkStatus();
}

absl::Status Runtime::CheckPrefillTensors(const PrefillCall& call, int64_t* num_tokens) const {
  if (absl::Status s = CheckPrefillLayout(call, num_tokens); !s.ok()) return s;
  for (const auto& [name, tensor] :
       {std::make_pair("q", &call.q), std::make_pair("k", &call.k), std::make_pair("v", &call.v)}) {
    if (absl::Status s = CheckBytes("", name, *tensor); !s.ok()) return s;
    if (absl::Status s = CheckFinite("", name, *tensor); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status Runtime::CheckDecodeShapes(const DecodeCall::Entry& e) const {
  const DcaGeometry& g = engine_->geometry();
  for (const auto& [name, t] :
       {std::make_pair("q", &e.q), std::make_pair("k", &e.k), std::make_pair("v", &e.v)}) {
    if (absl::Status s = CheckDType("", name, t->dtype); !s.ok()) return s;
  }
  if (absl::Status s = CheckSameDType("", e.q, e.k, e.v); !s.ok()) return s;
  if (absl::Status s = CheckQLayout(e.q_layout, g); !s.ok()) return s;
  const absl::Span<const int64_t> qs = e.q.shape;
  if (e.q_layout == QLayout::kPreRotary) {
    if (qs.size() != 2 || qs[0] != g.num_q_heads || qs[1] != g.head_dim) {
      return absl::InvalidArgumentError(absl::StrCat("q must have shape [", g.num_q_heads, ", ",
                                                     g.head_dim, "] for q_layout pre_rotary, got ",
                                                     ShapeString(qs)));
    }
  } else if (qs.size() != 3 || (qs[0] != kNumDecodeVariants && qs[0] != kNumQueryVariants) ||
             qs[1] != g.num_q_heads || qs[2] != g.head_dim) {
    return absl::InvalidArgumentError(absl::StrCat("q must have shape [", kNumDecodeVariants,
                                                   " or ", kNumQueryVariants, ", ", g.num_q_heads,
                                                   ", ", g.head_dim, "], got ", ShapeString(qs)));
  }
  const std::vector<int64_t> kv_shape = {g.num_kv_heads, g.head_dim};
  for (const auto& [name, tensor] : {std::make_pair("k", &e.k), std::make_pair("v", &e.v)}) {
    if (!std::equal(tensor->shape.begin(), tensor->shape.end(), kv_shape.begin(), kv_shape.end())) {
      return absl::InvalidArgumentError(absl::StrCat(
          name, " must have shape ", ShapeString(kv_shape), ", got ", ShapeString(tensor->shape)));
    }
  }
  return absl::OkStatus();
}

absl::Status Runtime::CheckDecodeEntry(const DecodeCall::Entry& e) const {
  if (absl::Status s = CheckDecodeShapes(e); !s.ok()) return s;
  for (const auto& [name, tensor] :
       {std::make_pair("q", &e.q), std::make_pair("k", &e.k), std::make_pair("v", &e.v)}) {
    if (absl::Status s = CheckBytes("", name, *tensor); !s.ok()) return s;
    if (absl::Status s = CheckFinite("", name, *tensor); !s.ok()) return s;
  }
  return absl::OkStatus();
}

namespace {

// The engine may reject a request it cannot serve (INVALID_ARGUMENT); anything else is a backend
// failure, which the client sees as INTERNAL whatever the engine called it.
absl::Status EngineError(const Engine& engine, const absl::Status& s) {
  if (s.code() == absl::StatusCode::kInvalidArgument) return s;
  return absl::InternalError(
      absl::StrCat("the ", engine.backend(), " backend failed: ", s.message()));
}

// Either the caller's buffer or one owned by `owned`.
void* OutputBuffer(const OutputBufferFn& fn, int64_t bytes, std::string* owned) {
  if (fn) return fn(bytes);
  owned->resize(static_cast<size_t>(bytes));
  return owned->data();
}

}  // namespace

absl::Status Runtime::Misrouted(absl::string_view id) const {
  absl::Status s = table_.CheckId(id);
  // Only a foreign id: a malformed one is reported where it always was, after the tensors.
  return s.code() == absl::StatusCode::kFailedPrecondition ? s : absl::OkStatus();
}

absl::StatusOr<PrefillResult> Runtime::Prefill(const PrefillCall& call) {
  if (absl::Status s = Misrouted(call.sequence_id); !s.ok()) return s;
  if (absl::Status s = CheckLayer(call.layer); !s.ok()) return s;
  int64_t t = 0;
  if (absl::Status s = CheckPrefillTensors(call, &t); !s.ok()) return s;
  absl::StatusOr<std::shared_ptr<Sequence>> found = table_.Find(call.sequence_id, call.tenant);
  if (!found.ok()) return found.status();
  Sequence* seq = found->get();
  const DcaGeometry& g = engine_->geometry();

  MutexLock lock(&seq->mu);
  if (seq->released) return NotFound("", seq->id);
  const int64_t start = seq->layer_lengths[call.layer];
  if (t > max_sequence_length_ - start) {
    return absl::OutOfRangeError(
        absl::StrCat("layer ", call.layer, " of sequence ", seq->id, " holds ", start, " tokens; ",
                     t, " more would pass the maximum sequence length ", max_sequence_length_));
  }
  const int64_t length = start + t;
  const int64_t prompt_len = call.prompt_len.value_or(length);
  if (prompt_len < length) {
    return absl::InvalidArgumentError(absl::StrCat("prompt_len ", prompt_len,
                                                   " is less than the layer's length after this"
                                                   " call (",
                                                   length, ")"));
  }
  if (prompt_len > max_sequence_length_) {
    return absl::OutOfRangeError(absl::StrCat(
        "prompt_len ", prompt_len, " is past the maximum sequence length ", max_sequence_length_));
  }
  const int64_t open_prompt = seq->layer_prompt_lens[call.layer];
  if (open_prompt > start && prompt_len != open_prompt) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layer ", call.layer, " of sequence ", seq->id, " holds ", start,
        " tokens of a prompt sent with prompt_len ", open_prompt,
        "; every chunk of that prompt must carry prompt_len ", open_prompt, ", got ",
        call.prompt_len.has_value() ? absl::StrCat(*call.prompt_len) : std::string("none")));
  }
  // Given back on every return below but the last (PageReservation).
  absl::StatusOr<PageReservation> reserved = table_.Reserve(seq, length);
  if (!reserved.ok()) return reserved.status();

  PrefillResult result;
  result.out_dtype = call.q.dtype;
  result.out_shape = {t, g.num_q_heads, g.head_dim};
  const int64_t out_bytes =
      t * g.num_q_heads * g.head_dim * static_cast<int64_t>(ElementSize(call.q.dtype));
  void* out = OutputBuffer(call.output, out_bytes, &result.out);
  if (out == nullptr) return absl::InternalError("no buffer for the prefill output");

  PrefillJob job{EngineJobKey()};
  job.layer = call.layer;
  job.page_table = seq->pages.data();
  job.num_pages = static_cast<int64_t>(seq->pages.size());
  job.start = start;
  job.num_tokens = t;
  job.prompt_len = prompt_len;
  job.q_layout = call.q_layout;
  job.q = ToView(call.q);
  job.k = ToView(call.k);
  job.v = ToView(call.v);
  job.out = out;
  job.out_dtype = call.q.dtype;
  job.out_on_device = call.output_on_device && call.output;
  job.order = call.order;
  // Declared after the reservation: a run stopped half-way finishes its device work before the
  // pages go back.
  absl::StatusOr<std::unique_ptr<PrefillRun>> run = engine_->StartPrefill(job);
  if (!run.ok()) return EngineError(*engine_, run.status());
  while (!(*run)->done()) {
    if (call.keep_going) ATTND_RETURN_IF_ERROR(call.keep_going());
    const DeviceTurn turn(options_.device_turns.get(), DeviceWork::kPrefill);
    if (absl::Status s = (*run)->Step(); !s.ok()) return EngineError(*engine_, s);
  }
  if (call.before_commit) ATTND_RETURN_IF_ERROR(call.before_commit());
  reserved->Commit();
  seq->layer_lengths[call.layer] = length;
  seq->layer_prompt_lens[call.layer] = prompt_len > length ? prompt_len : 0;
  seq->last_used = absl::Now();
  result.length = length;
  return result;
}

absl::StatusOr<DecodeResult> Runtime::Decode(const DecodeCall& call)
    ABSL_NO_THREAD_SAFETY_ANALYSIS {
  // (The analysis cannot follow a variable number of held locks: `locks` below holds them.)
  const size_t n = call.entries.size();
  for (size_t i = 0; i < n; ++i) {
    if (absl::Status s = Misrouted(call.entries[i].sequence_id); !s.ok()) {
      return WithPrefix(absl::StrCat("entries[", i, "]: "), s);
    }
  }
  if (absl::Status s = CheckLayer(call.layer); !s.ok()) return s;
  if (n == 0) return absl::InvalidArgumentError("a decode needs at least one entry");
  for (size_t i = 0; i < n; ++i) {
    if (absl::Status s = CheckDecodeEntry(call.entries[i]); !s.ok()) {
      return WithPrefix(absl::StrCat("entries[", i, "]: "), s);
    }
  }
  std::vector<std::shared_ptr<Sequence>> seqs(n);
  for (size_t i = 0; i < n; ++i) {
    absl::StatusOr<std::shared_ptr<Sequence>> found =
        table_.Find(call.entries[i].sequence_id, call.tenant);
    if (!found.ok()) return WithPrefix(absl::StrCat("entries[", i, "]: "), found.status());
    seqs[i] = *std::move(found);
  }
  if (const auto repeat = SequenceLockSet::FirstRepeat(seqs)) {
    const auto [a, b] = *repeat;
    return absl::InvalidArgumentError(absl::StrCat("entries[", a, "] and entries[", b,
                                                   "] name the same sequence ", seqs[a]->id,
                                                   "; a decode takes each sequence once"));
  }
  const SequenceLockSet locks(seqs);  // in id order; released last, after the reservations

  const DcaGeometry& g = engine_->geometry();
  for (size_t i = 0; i < n; ++i) {
    const Sequence& seq = *seqs[i];
    const std::string prefix = absl::StrCat("entries[", i, "]: ");
    if (seq.released) return NotFound(prefix, seq.id);
    const int64_t len = seq.layer_lengths[call.layer];
    if (len == 0) {
      return absl::FailedPreconditionError(
          absl::StrCat(prefix, "layer ", call.layer, " of sequence ", seq.id,
                       " holds no tokens; prefill it before decoding"));
    }
    if (len >= max_sequence_length_) {
      return absl::OutOfRangeError(absl::StrCat(prefix, "layer ", call.layer, " of sequence ",
                                                seq.id,
                                                " already holds the maximum sequence"
                                                " length of ",
                                                max_sequence_length_, " tokens"));
    }
  }
  // All given back on every return below but the last (PageReservation).
  std::vector<PageReservation> reserved;
  reserved.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    Sequence* seq = seqs[i].get();
    absl::StatusOr<PageReservation> r = table_.Reserve(seq, seq->layer_lengths[call.layer] + 1);
    if (!r.ok()) return WithPrefix(absl::StrCat("entries[", i, "]: "), r.status());
    reserved.push_back(*std::move(r));
  }

  DecodeResult result;
  result.outputs.resize(n);
  DecodeJob job{EngineJobKey()};
  job.layer = call.layer;
  job.entries.resize(n);
  for (size_t i = 0; i < n; ++i) {
    const DecodeCall::Entry& e = call.entries[i];
    Sequence* seq = seqs[i].get();
    DecodeResult::Output& o = result.outputs[i];
    o.out_dtype = e.q.dtype;
    o.out_shape = {g.num_q_heads, g.head_dim};
    o.length = seq->layer_lengths[call.layer] + 1;
    const int64_t out_bytes =
        int64_t{g.num_q_heads} * g.head_dim * static_cast<int64_t>(ElementSize(e.q.dtype));
    DecodeJob::Entry& je = job.entries[i];
    je.page_table = seq->pages.data();
    je.num_pages = static_cast<int64_t>(seq->pages.size());
    je.length = o.length;
    je.q_layout = e.q_layout;
    je.q = ToView(e.q);
    je.k = ToView(e.k);
    je.v = ToView(e.v);
    je.out = OutputBuffer(e.output, out_bytes, &o.out);
    je.out_dtype = e.q.dtype;
    je.out_on_device = e.output_on_device && e.output;
    je.order = e.order;
    if (je.out == nullptr) {
      return absl::InternalError(absl::StrCat("entries[", i, "]: no buffer for the output"));
    }
  }
  absl::StatusOr<DecodeStats> stats = [&] {
    const DeviceTurn turn(options_.device_turns.get(), DeviceWork::kDecode);
    return engine_->Decode(job);
  }();
  if (!stats.ok()) return EngineError(*engine_, stats.status());
  result.stats = *stats;
  if (call.before_commit) ATTND_RETURN_IF_ERROR(call.before_commit());
  const absl::Time now = absl::Now();
  for (size_t i = 0; i < n; ++i) {
    reserved[i].Commit();
    seqs[i]->layer_lengths[call.layer] = result.outputs[i].length;
    seqs[i]->last_used = now;
  }
  return result;
}

}  // namespace attnd
