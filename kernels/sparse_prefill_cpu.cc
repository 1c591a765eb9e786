#include "kernels/sparse_prefill_cpu.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/dtype.h"
#include "kernels/sparse_math.h"

namespace attnd {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int64_t kTile = 64;  // keys scored per online-softmax update

inline void LoadRow(const float* src, int n, float* dst) { std::copy(src, src + n, dst); }
inline void LoadRow(const uint16_t* src, int n, float* dst) {
  for (int i = 0; i < n; ++i) dst[i] = Bf16ToFloat(src[i]);
}

// The stage-relative keys a row block sees (before the causal limit): its key blocks clipped to
// kv_len plus its columns, ascending. Blocks and columns never overlap (converter invariant).
std::vector<int64_t> KeySet(const VsRowBlock& rb, int64_t kv_len) {
  std::vector<int64_t> keys(rb.columns.begin(), rb.columns.end());
  for (int64_t b : rb.block_starts) {
    for (int64_t k = b; k < std::min(b + kVsBlock, kv_len); ++k) keys.push_back(k);
  }
  std::sort(keys.begin(), keys.end());
  keys.erase(std::unique(keys.begin(), keys.end()), keys.end());
  return keys;
}

}  // namespace

template <typename KvT>
std::vector<VsHeadPlan> PlanVerticalSlashPiece(const DcaGeometry& geometry, const PagedKv<KvT>& kv,
                                               const CpuPrefillParams& params,
                                               const VsPiece& piece,
                                               absl::Span<const VsBudget> budgets, int64_t last_q,
                                               ThreadPool* pool) {
  std::vector<VsHeadPlan> plans(geometry.num_q_heads);
  pool->ParallelFor(geometry.num_q_heads, [&](int64_t h) {
    VsHeadPlan& plan = plans[h];
    plan.selection = EstimateVerticalSlash<KvT>(geometry, kv, params, piece,
                                                static_cast<int32_t>(h), last_q, budgets[h]);
    plan.stages = MapToStages(plan.selection, piece, geometry.chunk_len);
    for (int s = 0; s < kVsNumStages; ++s) {
      const VsStageLists& st = plan.stages[s];
      if (!st.present) continue;
      plan.row_blocks[s] = ConvertVerticalSlash(st.q_len, st.kv_len, st.causal, st.columns,
                                                st.offsets);
    }
  });
  return plans;
}

template <typename KvT>
void AttendVerticalSlashPiece(const DcaGeometry& geometry, const PagedKv<KvT>& kv,
                              const CpuPrefillParams& params, const VsPiece& piece,
                              absl::Span<const VsHeadPlan> plans, ThreadPool* pool) {
  const int d = geometry.head_dim;
  const int64_t hq = geometry.num_q_heads;
  const int g = geometry.group_size();
  const int64_t nq = piece.end - piece.begin;
  const int64_t row_blocks = (nq + kVsBlock - 1) / kVsBlock;
  const float scale = params.softmax_scale;
  const int variant_of_stage[kVsNumStages] = {kIntra, kSucc, kInter};

  pool->ParallelFor(hq * row_blocks, [&](int64_t item) {
    const int32_t h = static_cast<int32_t>(item / row_blocks);
    const int64_t m = item % row_blocks;
    const int32_t kv_head = h / g;
    const VsHeadPlan& plan = plans[h];
    const int64_t r0 = m * kVsBlock;
    const int rows = static_cast<int>(std::min(kVsBlock, nq - r0));

    // One online softmax per row across the three stages: the same result as merging the
    // stages' outputs by their log-sum-exp.
    std::vector<float> mx(rows, kNegInf), l(rows, 0.f);
    std::vector<float> acc(static_cast<size_t>(rows) * d, 0.f);
    std::vector<float> q(d), kbuf, vbuf, scores(kTile);
    for (int s = 0; s < kVsNumStages; ++s) {
      const VsStageLists& st = plan.stages[s];
      if (!st.present) continue;
      const std::vector<int64_t> keys = KeySet(plan.row_blocks[s][m], st.kv_len);
      if (keys.empty()) continue;
      kbuf.resize(keys.size() * d);
      vbuf.resize(keys.size() * d);
      for (size_t j = 0; j < keys.size(); ++j) {
        LoadRow(kv.Key(st.kv_begin + keys[j], kv_head), d, kbuf.data() + j * d);
        LoadRow(kv.Value(st.kv_begin + keys[j], kv_head), d, vbuf.data() + j * d);
      }
      const int64_t causal_off = st.kv_len - st.q_len;  // row r sees keys <= causal_off + r
      for (int r = 0; r < rows; ++r) {
        const int64_t row = r0 + r;
        const int64_t n_keys =
            st.causal ? std::upper_bound(keys.begin(), keys.end(), causal_off + row) - keys.begin()
                      : static_cast<int64_t>(keys.size());
        if (n_keys == 0) continue;
        const float* src = params.q + (piece.begin + row - params.start) * kNumQueryVariants * hq * d +
                           variant_of_stage[s] * hq * d + static_cast<int64_t>(h) * d;
        for (int e = 0; e < d; ++e) q[e] = src[e] * scale;
        float* a = acc.data() + static_cast<size_t>(r) * d;
        for (int64_t t0 = 0; t0 < n_keys; t0 += kTile) {
          const int n = static_cast<int>(std::min(kTile, n_keys - t0));
          float tile_max = kNegInf;
          for (int j = 0; j < n; ++j) {
            scores[j] = DotF32(q.data(), kbuf.data() + (t0 + j) * d, d);
            tile_max = std::max(tile_max, scores[j]);
          }
          const float m_new = std::max(mx[r], tile_max);
          if (m_new > mx[r] && mx[r] != kNegInf) {
            const float c = std::exp(mx[r] - m_new);
            l[r] *= c;
            for (int e = 0; e < d; ++e) a[e] *= c;
          }
          mx[r] = m_new;
          float sum = 0.f;
          for (int j = 0; j < n; ++j) {
            const float p = std::exp(scores[j] - m_new);
            sum += p;
            AxpyF32(p, vbuf.data() + (t0 + j) * d, a, d);
          }
          l[r] += sum;
        }
      }
    }
    for (int r = 0; r < rows; ++r) {
      float* out =
          params.out + (piece.begin + r0 + r - params.start) * hq * d + static_cast<int64_t>(h) * d;
      // A row with no visible key contributes nothing: zeros, never 0/0.
      const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
      const float* a = acc.data() + static_cast<size_t>(r) * d;
      for (int e = 0; e < d; ++e) out[e] = a[e] * inv;
    }
  });
}

template <typename KvT>
void DcaSparsePrefillCpu(const DcaGeometry& geometry, const PagedKv<KvT>& kv,
                         const CpuPrefillParams& params, absl::Span<const VsBudget> budgets,
                         int64_t last_q, ThreadPool* pool) {
  if (params.num_tokens <= 0) return;
  for (const VsPiece& piece : SplitIntoPieces(params.start, params.num_tokens, geometry.chunk_len)) {
    const std::vector<VsHeadPlan> plans =
        PlanVerticalSlashPiece<KvT>(geometry, kv, params, piece, budgets, last_q, pool);
    AttendVerticalSlashPiece<KvT>(geometry, kv, params, piece, plans, pool);
  }
}

#define ATTND_INSTANTIATE_SPARSE(KvT)                                                             \
  template std::vector<VsHeadPlan> PlanVerticalSlashPiece<KvT>(                                   \
      const DcaGeometry&, const PagedKv<KvT>&, const CpuPrefillParams&, const VsPiece&,           \
      absl::Span<const VsBudget>, int64_t, ThreadPool*);                                          \
  template void AttendVerticalSlashPiece<KvT>(const DcaGeometry&, const PagedKv<KvT>&,            \
                                              const CpuPrefillParams&, const VsPiece&,            \
                                              absl::Span<const VsHeadPlan>, ThreadPool*);         \
  template void DcaSparsePrefillCpu<KvT>(const DcaGeometry&, const PagedKv<KvT>&,                 \
                                         const CpuPrefillParams&, absl::Span<const VsBudget>,     \
                                         int64_t, ThreadPool*);
ATTND_INSTANTIATE_SPARSE(float)
ATTND_INSTANTIATE_SPARSE(uint16_t)
#undef ATTND_INSTANTIATE_SPARSE

}  // namespace attnd
