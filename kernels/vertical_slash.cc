#include "kernels/vertical_slash.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

#include "base/dtype.h"
#include "base/fp8.h"
#include "base/int8_kv.h"
#include "kernels/kv_rows_cpu.h"
#include "kernels/simd_math.h"

namespace attnd {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// Appends the converter's key blocks for the key range [start, end): blocks of 64 from start,
// while they begin before min(end, kv_len); nothing if the range starts at or past kv_len.
void EmitRange(int64_t start, int64_t end, int64_t kv_len, std::vector<int64_t>* blocks) {
  if (start >= kv_len) return;
  end = std::min(end, kv_len);
  for (int64_t b = start; b < end; b += kVsBlock) blocks->push_back(b);
}

// The converter for row block m. Walks the offsets (descending, i.e. diagonal bands in ascending
// key order) and the columns (ascending) together, like a merge: a band 64 keys wide ending at
// `base - d` (base = off + end of the row block; ends clamped below at 64) either extends the
// range being built by one block (its end is within 64 of the range's end) or closes it and
// starts a new one; a column is taken when it lies left of the range being built and dropped when
// it lies inside it. NOTE: this reproduces convert_vertical_slash_indexes exactly, quirks
// included: the first usable slash is found by skipping bands that end at or left of key 0 (the
// last one is kept if it ends exactly at 0, and then covers [0, 64)); non-causal stages stop at
// the first offset below the row block's start (its band lies right of every key) and keep the
// trailing column; causal stages drop the columns right of the last range (future keys).
VsRowBlock ConvertRowBlock(int64_t m, int64_t q_len, int64_t kv_len, bool causal,
                           absl::Span<const int64_t> columns, absl::Span<const int64_t> offsets) {
  VsRowBlock out;
  const int64_t start_m = m * kVsBlock;
  const int64_t end_m = start_m + kVsBlock;
  const int64_t off = causal ? kv_len - q_len : kv_len;  // virtual position of row 0
  const int64_t base = off + end_m;
  // Where a range with no slash sits: right of every key the block may see.
  const int64_t empty_start = causal ? base : kv_len;

  size_t si = 0;
  int64_t d = offsets[si++];
  while (d >= base && si < offsets.size()) d = offsets[si++];
  int64_t range_start, range_end;
  if (d <= base) {
    range_end = std::max(base - d, kVsBlock);
    range_start = range_end - kVsBlock;
  } else {
    range_start = empty_start;
    range_end = empty_start + kVsBlock;
  }

  size_t vi = 0;
  int64_t v = columns[vi++];
  const int64_t v_done = base + kVsBlock;  // the value v takes once every column is read
  bool slash_finished = false;
  for (;;) {
    if (v < range_end) {
      if (v < range_start) out.columns.push_back(v);
      v = vi < columns.size() ? columns[vi++] : v_done;
      continue;
    }
    const bool more_slashes = si < offsets.size() && (causal || offsets[si] >= start_m);
    if (more_slashes) {
      const int64_t band_end = std::max(base - offsets[si++], kVsBlock);
      if (band_end > range_end + kVsBlock) {
        EmitRange(range_start, range_end, kv_len, &out.block_starts);
        range_start = band_end - kVsBlock;
        range_end = band_end;
      } else if (band_end > range_end) {
        range_end += kVsBlock;
      }
      continue;
    }
    const bool columns_read = vi == columns.size();
    if (columns_read || (causal && v > range_start)) {
      // The last column was read but lies right of the range: a non-causal stage keeps it.
      if (columns_read && !causal && v < kv_len) out.columns.push_back(v);
      EmitRange(range_start, range_end, kv_len, &out.block_starts);
      break;
    }
    // Non-causal only (for a causal stage v >= range_end > range_start above): columns remain
    // right of the last band; close the range and take them all as columns.
    if (slash_finished) break;  // unreachable for columns < kv_len; keeps the loop finite
    EmitRange(range_start, range_end, kv_len, &out.block_starts);
    range_start = empty_start;
    range_end = empty_start + kVsBlock;
    slash_finished = true;
  }
  return out;
}

// Key row `pos` of kv head `h` as fp32: in place for fp32 KV, converted into buf for bf16 and
// dequantised into it for fp8 and int8 (kernels/kv_rows_cpu.h).
inline const float* KeyRow(const PagedKv<float>& kv, int64_t pos, int32_t h, float* /*buf*/) {
  return kv.Key(pos, h);
}
template <typename KvT>
const float* KeyRow(const PagedKv<KvT>& kv, int64_t pos, int32_t h, float* buf) {
  kv_rows::LoadKey(kv, pos, h, buf);
  return buf;
}

}  // namespace

std::vector<VsPiece> SplitIntoPieces(int64_t start, int64_t num_tokens, int64_t chunk_len) {
  std::vector<VsPiece> pieces;
  const int64_t length = start + num_tokens;
  for (int64_t begin = start; begin < length;) {
    VsPiece p;
    p.prev = (begin / chunk_len) * chunk_len;
    p.begin = begin;
    p.end = std::min(p.prev + chunk_len, length);
    pieces.push_back(p);
    begin = p.end;
  }
  return pieces;
}

std::vector<int64_t> TopKIndices(absl::Span<const double> scores, int64_t k,
                                 bool prefer_larger_index) {
  const int64_t n = static_cast<int64_t>(scores.size());
  k = std::max<int64_t>(0, std::min(k, n));
  std::vector<int64_t> idx(n);
  std::iota(idx.begin(), idx.end(), 0);
  auto better = [&](int64_t a, int64_t b) {
    if (scores[a] != scores[b]) return scores[a] > scores[b];
    return prefer_larger_index ? a > b : a < b;
  };
  std::nth_element(idx.begin(), idx.begin() + k, idx.end(), better);
  idx.resize(k);
  std::sort(idx.begin(), idx.end());
  return idx;
}

namespace {

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"  // always-inlined helpers; no 32-byte by-value calls

// The fp32 logits of one estimation row at position pos against keys [0, pos] (later keys are
// the causal corner, probability 0), exponentiated relative to the row max; returns their sum.
// q holds the row's three estimation queries, pre-scaled: intra, succ_critical, inter_critical.
template <typename S, typename KvT>
ATTND_SIMD_INLINE double RowProbabilities(const PagedKv<KvT>& kv, int32_t kv_head, const float* q,
                                          int64_t pos, int64_t prev, int64_t cl, float* logits,
                                          float* key_buf) {
  using namespace simd_math;
  const int d = kv.head_dim;
  const int64_t stride = static_cast<int64_t>(kv.num_kv_heads) * d;
  float max_logit = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j <= pos;) {
    const int s = j >= prev ? 0 : (j >= prev - cl ? 1 : 2);
    const float* qs = q + s * d;
    // Keys that share a page and a query variant are 4-blocked (fp32 KV is read in place).
    const int64_t variant_end = s == 0 ? pos + 1 : (s == 1 ? prev : prev - cl);
    const int64_t page_end = (j / kv.page_size + 1) * kv.page_size;
    const int64_t run_end = std::min({variant_end, page_end, pos + 1});
    if constexpr (std::is_same<KvT, float>::value) {
      const float* k = kv.Key(j, kv_head);
      int64_t u = j;
      for (; u + 4 <= run_end; u += 4) Dot4<S>(qs, k + (u - j) * stride, stride, d, logits + u);
      for (; u < run_end; ++u) logits[u] = Dot<S>(qs, k + (u - j) * stride, d);
    } else {
      for (int64_t u = j; u < run_end; ++u) {
        logits[u] = Dot<S>(qs, KeyRow(kv, u, kv_head, key_buf), d);
      }
    }
    for (int64_t u = j; u < run_end; ++u) max_logit = std::max(max_logit, logits[u]);
    j = run_end;
  }
  for (int64_t j = 0; j <= pos; ++j) logits[j] -= max_logit;
  ExpNonPositive<S>(logits, static_cast<int>(pos + 1));
  double sum = 0;
  for (int64_t j = 0; j <= pos; ++j) sum += logits[j];
  return sum;
}

template <typename KvT>
double RowProbabilitiesV4(const PagedKv<KvT>& kv, int32_t kv_head, const float* q, int64_t pos,
                          int64_t prev, int64_t cl, float* logits, float* key_buf) {
  return RowProbabilities<simd_math::V4>(kv, kv_head, q, pos, prev, cl, logits, key_buf);
}
template <typename KvT>
__attribute__((target("avx2,fma"))) double RowProbabilitiesV8(const PagedKv<KvT>& kv,
                                                              int32_t kv_head, const float* q,
                                                              int64_t pos, int64_t prev, int64_t cl,
                                                              float* logits, float* key_buf) {
  return RowProbabilities<simd_math::V8>(kv, kv_head, q, pos, prev, cl, logits, key_buf);
}
#pragma GCC diagnostic pop

}  // namespace

template <typename KvT>
VsSelection EstimateVerticalSlash(const DcaGeometry& geometry, const PagedKv<KvT>& kv,
                                  const CpuPrefillParams& params, const VsPiece& piece,
                                  int32_t head, int64_t last_q, const VsBudget& budget) {
  const int d = geometry.head_dim;
  const int64_t hq = geometry.num_q_heads;
  const int32_t kv_head = head / geometry.group_size();
  const int64_t cl = geometry.chunk_len;
  const int64_t end = piece.end;
  const int64_t n = std::min(piece.end - piece.begin, last_q);
  const float scale = params.softmax_scale;
  // The dense kernels' SIMD choice (kernels/dca_cpu.h SetCpuSimd), so tests can force SSE2.
  const bool avx2 = std::strcmp(CpuSimdName(geometry.head_dim), "avx2") == 0;

  std::vector<double> vertical(end, 0.0), slash(end, 0.0);
  std::vector<float> logits(end + 8), key_buf(d);  // + 8: the exp runs on whole vectors
  std::vector<float> q(3 * static_cast<size_t>(d));
  const int variants[3] = {kIntra, kSuccCritical, kInterCritical};
  for (int64_t i = 0; i < n; ++i) {
    const int64_t pos = end - n + i;
    const float* row = params.q + (pos - params.start) * kNumQueryVariants * hq * d + head * d;
    for (int s = 0; s < 3; ++s) {
      for (int e = 0; e < d; ++e) q[s * d + e] = row[variants[s] * hq * d + e] * scale;
    }
    const double sum = avx2 ? RowProbabilitiesV8<KvT>(kv, kv_head, q.data(), pos, piece.prev, cl,
                                                      logits.data(), key_buf.data())
                            : RowProbabilitiesV4<KvT>(kv, kv_head, q.data(), pos, piece.prev, cl,
                                                      logits.data(), key_buf.data());
    const float inv = static_cast<float>(1.0 / sum);
    // Row i's key j lies on the diagonal anchored at t = j + (n - 1 - i).
    const int64_t shift = n - 1 - i;
    for (int64_t j = 0; j <= pos; ++j) {
      const float p = logits[j] * inv;
      vertical[j] += p;
      slash[j + shift] += p;
    }
  }
  for (int64_t j = 0; j < std::min(end, kVsForcedVerticals); ++j) vertical[j] = kInf;
  for (int64_t t = std::max<int64_t>(0, end - kVsForcedSlashes); t < end; ++t) slash[t] = kInf;

  VsSelection sel;
  sel.vertical = TopKIndices(vertical, budget.vertical, /*prefer_larger_index=*/false);
  sel.slash = TopKIndices(slash, budget.slash, /*prefer_larger_index=*/true);
  return sel;
}

std::vector<int64_t> VsFallbackIndices(int64_t num_keys) {
  // NOTE: the reference's torch.arange(0, L, max(1, L/5), dtype=int32) counts its elements with
  // the float step (always 5 for L >= 5) but computes them with the step truncated to an integer,
  // so the values are i * floor(L/5) (docs/DCA.md), not trunc(i * L/5); the golden case
  // sparse_vs (a succ/inter fallback over 448 keys) only matches the former.
  std::vector<int64_t> out;
  const int64_t step = std::max<int64_t>(1, num_keys / 5);
  for (int64_t i = 0; i < 5 && i * step < num_keys; ++i) out.push_back(i * step);
  return out;
}

std::array<VsStageLists, kVsNumStages> MapToStages(const VsSelection& selection,
                                                   const VsPiece& piece, int64_t chunk_len) {
  const int64_t p = piece.prev;
  const int64_t cl = chunk_len;
  const int64_t nq = piece.end - piece.begin;
  std::array<VsStageLists, kVsNumStages> st;

  VsStageLists& intra = st[kVsIntraStage];
  intra.present = true;
  intra.causal = true;
  intra.kv_begin = p;
  intra.kv_len = piece.end - p;
  VsStageLists& succ = st[kVsSuccStage];
  succ.present = p >= cl;
  succ.kv_begin = p - cl;
  succ.kv_len = cl;
  VsStageLists& inter = st[kVsInterStage];
  inter.present = p >= 2 * cl;
  inter.kv_begin = 0;
  inter.kv_len = p - cl;
  for (VsStageLists& s : st) s.q_len = nq;

  // The selection is ascending, so columns come out ascending and offsets (end - 1 - t and the
  // like) descending, as the converter needs them.
  for (int64_t v : selection.vertical) {
    if (v >= p) {
      intra.columns.push_back(v - p);
    } else if (v >= p - cl) {
      if (succ.present) succ.columns.push_back(v - (p - cl));
    } else if (inter.present) {
      inter.columns.push_back(v);
    }
  }
  for (int64_t t : selection.slash) {
    if (t >= p) intra.offsets.push_back(piece.end - 1 - t);
    if (succ.present && t >= p - cl && t < p + nq) succ.offsets.push_back(p + nq - 1 - t);
    if (inter.present && t < p - cl + nq) inter.offsets.push_back(p - cl + nq - 1 - t);
  }
  for (VsStageLists& s : st) {
    if (!s.present) {
      s.kv_len = 0;
      continue;
    }
    if (s.columns.empty()) s.columns = VsFallbackIndices(s.kv_len);
    if (s.offsets.empty()) {
      // Used as diagonal offsets; sorted descending like any offset list.
      s.offsets = VsFallbackIndices(s.kv_len);
      std::reverse(s.offsets.begin(), s.offsets.end());
    }
  }
  return st;
}

std::vector<VsRowBlock> ConvertVerticalSlash(int64_t q_len, int64_t kv_len, bool causal,
                                             absl::Span<const int64_t> columns,
                                             absl::Span<const int64_t> offsets) {
  const int64_t rows = (q_len + kVsBlock - 1) / kVsBlock;
  std::vector<VsRowBlock> out(std::max<int64_t>(rows, 0));
  if (columns.empty() || offsets.empty() || columns.back() >= kv_len || columns.front() < 0) {
    return out;
  }
  for (int64_t m = 0; m < rows; ++m) {
    out[m] = ConvertRowBlock(m, q_len, kv_len, causal, columns, offsets);
  }
  return out;
}

template VsSelection EstimateVerticalSlash<float>(const DcaGeometry&, const PagedKv<float>&,
                                                  const CpuPrefillParams&, const VsPiece&, int32_t,
                                                  int64_t, const VsBudget&);
template VsSelection EstimateVerticalSlash<uint16_t>(const DcaGeometry&, const PagedKv<uint16_t>&,
                                                     const CpuPrefillParams&, const VsPiece&,
                                                     int32_t, int64_t, const VsBudget&);
template VsSelection EstimateVerticalSlash<Fp8E4m3>(const DcaGeometry&, const PagedKv<Fp8E4m3>&,
                                                    const CpuPrefillParams&, const VsPiece&,
                                                    int32_t, int64_t, const VsBudget&);
template VsSelection EstimateVerticalSlash<Int8Kv>(const DcaGeometry&, const PagedKv<Int8Kv>&,
                                                   const CpuPrefillParams&, const VsPiece&, int32_t,
                                                   int64_t, const VsBudget&);

}  // namespace attnd
