// Exact vertical-slash sparse prefill on the CPU (docs/DCA.md "Vertical-slash sparse
// prefill"): per piece of the prefill loop, per q head, estimate + map + convert
// (kernels/vertical_slash.h), then block-sparse attention of every query row over its row block's
// key blocks and columns in each stage (intra also causal), the stages merged by log-sum-exp.
// fp32 arithmetic; K/V read through PagedKv (fp32, bf16, fp8 or int8 storage,
// kernels/kv_rows_cpu.h).
#ifndef ATTND_KERNELS_SPARSE_PREFILL_CPU_H_
#define ATTND_KERNELS_SPARSE_PREFILL_CPU_H_

#include <array>
#include <cstdint>
#include <vector>

#include "absl/types/span.h"
#include "base/thread_pool.h"
#include "kernels/dca.h"
#include "kernels/dca_cpu.h"
#include "kernels/paged_kv.h"
#include "kernels/vertical_slash.h"

namespace attnd {

// Everything the attention step needs for one q head and one piece.
struct VsHeadPlan {
  VsSelection selection;
  std::array<VsStageLists, kVsNumStages> stages;
  std::array<std::vector<VsRowBlock>, kVsNumStages> row_blocks;  // empty for an absent stage
};

// Steps 1-3 for every q head of one piece (heads spread over the pool). budgets: [num_q_heads].
template <typename KvT>
std::vector<VsHeadPlan> PlanVerticalSlashPiece(const DcaGeometry& geometry, const PagedKv<KvT>& kv,
                                               const CpuPrefillParams& params, const VsPiece& piece,
                                               absl::Span<const VsBudget> budgets, int64_t last_q,
                                               ThreadPool* pool);

// Step 4 for one piece from its plan: writes params.out rows of positions [piece.begin,
// piece.end). A row that sees no key at all (impossible with the plans above) gets zeros.
// Grid mapping: one work item = (q head, 64-row block of the piece); an item gathers the fp32
// K/V rows of its block's key set once per stage and reuses them for its 64 rows.
template <typename KvT>
void AttendVerticalSlashPiece(const DcaGeometry& geometry, const PagedKv<KvT>& kv,
                              const CpuPrefillParams& params, const VsPiece& piece,
                              absl::Span<const VsHeadPlan> plans, ThreadPool* pool);

// The whole sparse prefill: same inputs and outputs as DcaPrefillCpu (kernels/dca_cpu.h), plus
// the layer's per-q-head budgets [num_q_heads] and the estimation's last_q (>= 1). K/V of the new
// tokens must already be appended.
template <typename KvT>
void DcaSparsePrefillCpu(const DcaGeometry& geometry, const PagedKv<KvT>& kv,
                         const CpuPrefillParams& params, absl::Span<const VsBudget> budgets,
                         int64_t last_q, ThreadPool* pool);

}  // namespace attnd

#endif  // ATTND_KERNELS_SPARSE_PREFILL_CPU_H_
