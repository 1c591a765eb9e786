// A deliberately naive fp64 reference for vertical-slash sparse prefill (docs/DCA.md
// "Vertical-slash sparse prefill"), for the sparse kernel tests. Written from the DCA.md text; it
// never calls production code: full score matrices, full sorts, and a dense boolean mask of the
// visible (row, key) pairs of each stage built from the raw index lists.
#ifndef ATTND_KERNELS_TESTING_NAIVE_SPARSE_H_
#define ATTND_KERNELS_TESTING_NAIVE_SPARSE_H_

#include <cstdint>
#include <vector>

#include "absl/types/span.h"
#include "kernels/dca.h"

namespace attnd {
namespace naive {

struct SparseBudget {
  int64_t vertical = 0;  // as the kernel uses it (30 already read as 130)
  int64_t slash = 0;
};

// Step 1's scores for one head of one piece (positions [begin, end) in the chunk starting at
// prev), with the forced +inf entries. vertical[j], slash[t] for j, t in [0, end).
struct SparseScores {
  std::vector<double> vertical;
  std::vector<double> slash;
};

// q: the call's queries [T, 5, Hq, D] for positions start..start+T-1 (the piece's rows among
// them); keys: cached (length-scaled) keys [>= end, Hkv, D]. logit = softmax_scale * q . k with
// query for keys >= prev, query_succ_critical for [prev - cl, prev), query_inter_critical below.
SparseScores EstimateScores(const DcaGeometry& geometry, absl::Span<const float> q, int64_t start,
                            absl::Span<const double> keys, int64_t prev, int64_t begin, int64_t end,
                            int32_t head, double softmax_scale, int64_t last_q);

// The top-k of step 1: the k highest scores, ties to the smaller index (verticals) or the larger
// index (slashes, prefer_larger_index). Returned ascending.
std::vector<int64_t> TopK(const std::vector<double>& scores, int64_t k, bool prefer_larger_index);

// Step 2 for one stage (0 intra, 1 succ, 2 inter): stage-relative columns (ascending) and
// diagonal offsets (descending), with the fallback. present=false when the stage does not exist.
struct NaiveStage {
  bool present = false;
  bool causal = false;
  int64_t kv_begin = 0;
  int64_t kv_len = 0;
  int64_t q_len = 0;
  std::vector<int64_t> columns;
  std::vector<int64_t> offsets;
};
NaiveStage MapStage(int stage, const std::vector<int64_t>& vertical,
                    const std::vector<int64_t>& slash, int64_t prev, int64_t begin, int64_t end,
                    int64_t chunk_len);

// Step 3 + 4's visibility, as a dense mask [q_len][kv_len] (1 = row sees key), from a stage's
// lists: per 64-row block, each offset's 64-key band (end clamped below at 64), merged into
// ranges as DCA.md says, plus the columns; intra (causal) also limited to keys <= the row's
// position and drops columns right of the last range.
std::vector<uint8_t> StageMask(int64_t q_len, int64_t kv_len, bool causal,
                               const std::vector<int64_t>& columns,
                               const std::vector<int64_t>& offsets);

// The whole sparse prefill of T = q.size() / (5 Hq D) new tokens at positions start.. (their K/V
// among keys/values, which hold [start + T, Hkv, D], keys cached length-scaled). budgets: [Hq].
// Returns [T, Hq, D]: per row one softmax over the union of the stages' visible keys, each stage
// with its query variant (intra, succ, inter). A row with no visible key gets zeros.
std::vector<double> SparsePrefill(const DcaGeometry& geometry, absl::Span<const float> q,
                                  int64_t start, absl::Span<const double> keys,
                                  absl::Span<const double> values, double softmax_scale,
                                  const std::vector<SparseBudget>& budgets, int64_t last_q);

}  // namespace naive
}  // namespace attnd

#endif  // ATTND_KERNELS_TESTING_NAIVE_SPARSE_H_
