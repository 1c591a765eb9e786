#include "kernels/sparse_prefill_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "base/fp8.h"
#include "base/int8_kv.h"
#include "kernels/kv_rows_cpu.h"
#include "kernels/simd_math.h"

namespace attnd {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int64_t kTile = 32;  // keys per tile: K+V of D=128 in fp32 is 32 KiB (L1-sized)

// The stage-relative keys a row block sees (before the causal limit): its key blocks clipped to
// kv_len plus its columns, ascending. Blocks and columns never overlap (converter invariant).
void KeySet(const VsRowBlock& rb, int64_t kv_len, std::vector<int64_t>* keys) {
  keys->assign(rb.columns.begin(), rb.columns.end());
  for (int64_t b : rb.block_starts) {
    for (int64_t k = b; k < std::min(b + kVsBlock, kv_len); ++k) keys->push_back(k);
  }
  std::sort(keys->begin(), keys->end());
  keys->erase(std::unique(keys->begin(), keys->end()), keys->end());
}

// Per-thread scratch reused across work items (a fresh key list per item costs allocations).
struct Scratch {
  std::vector<int64_t> keys;
  std::vector<float> k, v;
};
Scratch& ThreadScratch() {
  thread_local Scratch scratch;
  return scratch;
}

}  // namespace

template <typename KvT>
std::vector<VsHeadPlan> PlanVerticalSlashPiece(const DcaGeometry& geometry, const PagedKv<KvT>& kv,
                                               const CpuPrefillParams& params, const VsPiece& piece,
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
      plan.row_blocks[s] =
          ConvertVerticalSlash(st.q_len, st.kv_len, st.causal, st.columns, st.offsets);
    }
  });
  return plans;
}

namespace {

// -Wpsabi: 32-byte vectors passed by value differ in ABI with and without AVX; the helpers are
// always inlined, so no such call exists.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"

// One work item of AttendVerticalSlashPiece: q head h, rows [r0, r0 + rows) of the piece.
// Key tiles outer, rows inner, so a tile of K/V (copied as fp32 into L1-sized scratch) stays in
// cache while every row of the block uses it; one online softmax per row across the three stages
// (the same result as merging the stages' outputs by their log-sum-exp).
template <typename S, typename KvT>
ATTND_SIMD_INLINE void AttendItem(const DcaGeometry& geometry, const PagedKv<KvT>& kv,
                                  const CpuPrefillParams& params, const VsPiece& piece,
                                  const VsHeadPlan& plan, int32_t h, int64_t m) {
  using namespace simd_math;
  const int d = geometry.head_dim;
  const int64_t hq = geometry.num_q_heads;
  const int32_t kv_head = h / geometry.group_size();
  const int64_t nq = piece.end - piece.begin;
  const int64_t r0 = m * kVsBlock;
  const int rows = static_cast<int>(std::min(kVsBlock, nq - r0));
  const int variant_of_stage[kVsNumStages] = {kIntra, kSucc, kInter};

  std::vector<float> mx(rows, kNegInf), l(rows, 0.f);
  std::vector<float> acc(static_cast<size_t>(rows) * d, 0.f);
  std::vector<float> q(static_cast<size_t>(rows) * d);
  std::vector<int64_t> row_keys(rows);
  Scratch& scratch = ThreadScratch();
  std::vector<int64_t>& keys = scratch.keys;
  std::vector<float>& kbuf = scratch.k;
  std::vector<float>& vbuf = scratch.v;
  kbuf.resize(kTile * d);
  vbuf.resize(kTile * d);
  float scores[kTile + 8] = {};  // ExpNonPositive runs on whole vectors (lanes past n unread)
  for (int s = 0; s < kVsNumStages; ++s) {
    const VsStageLists& st = plan.stages[s];
    if (!st.present) continue;
    KeySet(plan.row_blocks[s][m], st.kv_len, &keys);
    if (keys.empty()) continue;
    const int64_t n_keys = static_cast<int64_t>(keys.size());
    const int64_t causal_off = st.kv_len - st.q_len;  // row r sees keys <= causal_off + r
    for (int r = 0; r < rows; ++r) {
      const int64_t row = r0 + r;
      row_keys[r] =
          st.causal ? std::upper_bound(keys.begin(), keys.end(), causal_off + row) - keys.begin()
                    : n_keys;
      const float* src = params.q +
                         (piece.begin + row - params.start) * kNumQueryVariants * hq * d +
                         variant_of_stage[s] * hq * d + static_cast<int64_t>(h) * d;
      for (int e = 0; e < d; ++e) q[static_cast<size_t>(r) * d + e] = src[e] * params.softmax_scale;
    }
    for (int64_t t0 = 0; t0 < n_keys; t0 += kTile) {
      // The tile's K/V rows as contiguous fp32 (an L1-sized copy, read by all the rows below).
      const int64_t t1 = std::min(n_keys, t0 + kTile);
      for (int64_t j = t0; j < t1; ++j) {
        kv_rows::LoadKey(kv, st.kv_begin + keys[j], kv_head, kbuf.data() + (j - t0) * d);
        kv_rows::LoadValue(kv, st.kv_begin + keys[j], kv_head, vbuf.data() + (j - t0) * d);
      }
      const float* kt = kbuf.data();
      const float* vt = vbuf.data();
      for (int r = 0; r < rows; ++r) {
        const int n = static_cast<int>(std::min<int64_t>(kTile, row_keys[r] - t0));
        if (n <= 0) continue;
        const float* qr = q.data() + static_cast<size_t>(r) * d;
        int j = 0;
        for (; j + 4 <= n; j += 4) Dot4<S>(qr, kt + j * d, d, d, scores + j);
        for (; j < n; ++j) scores[j] = Dot<S>(qr, kt + j * d, d);
        float tile_max = kNegInf;
        for (j = 0; j < n; ++j) tile_max = std::max(tile_max, scores[j]);
        float* a = acc.data() + static_cast<size_t>(r) * d;
        const float m_new = std::max(mx[r], tile_max);
        if (m_new > mx[r] && mx[r] != kNegInf) {
          const float c = std::exp(mx[r] - m_new);
          l[r] *= c;
          for (int e = 0; e < d; ++e) a[e] *= c;
        }
        mx[r] = m_new;
        for (j = 0; j < n; ++j) scores[j] -= m_new;
        ExpNonPositive<S>(scores, n);
        float sum = 0.f;
        for (j = 0; j < n; ++j) sum += scores[j];
        for (j = 0; j + 4 <= n; j += 4) Axpy4<S>(scores + j, vt + j * d, d, a, d);
        for (; j < n; ++j) Axpy<S>(scores[j], vt + j * d, a, d);
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
}

template <typename KvT>
void AttendItemV4(const DcaGeometry& g, const PagedKv<KvT>& kv, const CpuPrefillParams& p,
                  const VsPiece& piece, const VsHeadPlan& plan, int32_t h, int64_t m) {
  AttendItem<simd_math::V4>(g, kv, p, piece, plan, h, m);
}
template <typename KvT>
__attribute__((target("avx2,fma"))) void AttendItemV8(const DcaGeometry& g, const PagedKv<KvT>& kv,
                                                      const CpuPrefillParams& p,
                                                      const VsPiece& piece, const VsHeadPlan& plan,
                                                      int32_t h, int64_t m) {
  AttendItem<simd_math::V8>(g, kv, p, piece, plan, h, m);
}
#pragma GCC diagnostic pop

}  // namespace

template <typename KvT>
void AttendVerticalSlashPiece(const DcaGeometry& geometry, const PagedKv<KvT>& kv,
                              const CpuPrefillParams& params, const VsPiece& piece,
                              absl::Span<const VsHeadPlan> plans, ThreadPool* pool) {
  const int64_t nq = piece.end - piece.begin;
  const int64_t row_blocks = (nq + kVsBlock - 1) / kVsBlock;
  // The dense kernels' SIMD choice (kernels/dca_cpu.h SetCpuSimd), so tests can force SSE2.
  const bool avx2 = std::strcmp(CpuSimdName(geometry.head_dim), "avx2") == 0;
  pool->ParallelFor(geometry.num_q_heads * row_blocks, [&](int64_t item) {
    const int32_t h = static_cast<int32_t>(item / row_blocks);
    const int64_t m = item % row_blocks;
    if (avx2) {
      AttendItemV8<KvT>(geometry, kv, params, piece, plans[h], h, m);
    } else {
      AttendItemV4<KvT>(geometry, kv, params, piece, plans[h], h, m);
    }
  });
}

template <typename KvT>
void DcaSparsePrefillCpu(const DcaGeometry& geometry, const PagedKv<KvT>& kv,
                         const CpuPrefillParams& params, absl::Span<const VsBudget> budgets,
                         int64_t last_q, ThreadPool* pool) {
  if (params.num_tokens <= 0) return;
  for (const VsPiece& piece :
       SplitIntoPieces(params.start, params.num_tokens, geometry.chunk_len)) {
    const std::vector<VsHeadPlan> plans =
        PlanVerticalSlashPiece<KvT>(geometry, kv, params, piece, budgets, last_q, pool);
    AttendVerticalSlashPiece<KvT>(geometry, kv, params, piece, plans, pool);
  }
}

#define ATTND_INSTANTIATE_SPARSE(KvT)                                                         \
  template std::vector<VsHeadPlan> PlanVerticalSlashPiece<KvT>(                               \
      const DcaGeometry&, const PagedKv<KvT>&, const CpuPrefillParams&, const VsPiece&,       \
      absl::Span<const VsBudget>, int64_t, ThreadPool*);                                      \
  template void AttendVerticalSlashPiece<KvT>(const DcaGeometry&, const PagedKv<KvT>&,        \
                                              const CpuPrefillParams&, const VsPiece&,        \
                                              absl::Span<const VsHeadPlan>, ThreadPool*);     \
  template void DcaSparsePrefillCpu<KvT>(const DcaGeometry&, const PagedKv<KvT>&,             \
                                         const CpuPrefillParams&, absl::Span<const VsBudget>, \
                                         int64_t, ThreadPool*);
ATTND_INSTANTIATE_SPARSE(float)
ATTND_INSTANTIATE_SPARSE(uint16_t)
ATTND_INSTANTIATE_SPARSE(Fp8E4m3)
ATTND_INSTANTIATE_SPARSE(Int8Kv)
#undef ATTND_INSTANTIATE_SPARSE

}  // namespace attnd
