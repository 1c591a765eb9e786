// Vertical-slash sparse prefill, the index side (docs/DCA.md "Vertical-slash sparse
// prefill", steps 1-3): per piece of the prefill loop and per q head,
//   1. EstimateVerticalSlash: score the piece's last n queries against keys [0, end) and pick the
//      top vertical columns and slash diagonals (absolute indices),
//   2. MapToStages: split them into the intra / succ / inter stages' lists, with the fallbacks,
//   3. ConvertVerticalSlash: the 64x64 converter, one list of key blocks + columns per 64 query
//      rows of a stage.
// The attention over those lists is kernels/sparse_prefill_cpu.h. Plain structs in, plain structs
// out, so each step is testable on its own and a GPU path can reuse the planning.
#ifndef ATTND_KERNELS_VERTICAL_SLASH_H_
#define ATTND_KERNELS_VERTICAL_SLASH_H_

#include <array>
#include <cstdint>
#include <vector>

#include "absl/types/span.h"
#include "kernels/dca.h"
#include "kernels/dca_cpu.h"
#include "kernels/paged_kv.h"

namespace attnd {

// Rows per query block and keys per key block of the converter (BLOCK_M == BLOCK_N == 64).
inline constexpr int64_t kVsBlock = 64;
// Absolute key columns 0..29 always get a vertical score of +inf.
inline constexpr int64_t kVsForcedVerticals = 30;
// The 100 largest diagonal anchors (nearest diagonals) always get a slash score of +inf.
inline constexpr int64_t kVsForcedSlashes = 100;

// One q head's budget in one layer, as the kernels use it: the sparse config's
// (vertical_size, slash_size) with vertical_size 30 already read as 130
// (server/config/sparse_config.h). Both >= 1.
struct VsBudget {
  int64_t vertical = 0;
  int64_t slash = 0;
};

// One piece of the prefill loop: new tokens at positions [begin, end), all inside the chunk that
// starts at prev (prev <= begin < end <= prev + chunk_len).
struct VsPiece {
  int64_t prev = 0;
  int64_t begin = 0;
  int64_t end = 0;
};

// The pieces of a prefill of num_tokens tokens starting at `start` (DCA.md "Dense prefill").
std::vector<VsPiece> SplitIntoPieces(int64_t start, int64_t num_tokens, int64_t chunk_len);

// Step 1's result for one head and one piece: absolute key indices of the chosen verticals and
// the chosen slash anchors t (the diagonal through (last row, key t)), each sorted ascending.
// Top-k ties (equal scores, e.g. the forced +inf ones) are broken deterministically: verticals
// prefer the smaller key index, slashes the larger anchor (the nearer diagonal), so a slash budget
// below 100 still keeps the main diagonal.
struct VsSelection {
  std::vector<int64_t> vertical;  // min(budget.vertical, end) entries
  std::vector<int64_t> slash;     // min(budget.slash, end) entries
};

// The top-k rule above over explicit scores (exposed for tests): indices of the k largest
// scores, sorted ascending. prefer_larger_index selects the tie rule (slash: true).
std::vector<int64_t> TopKIndices(absl::Span<const double> scores, int64_t k,
                                 bool prefer_larger_index);

// Step 1 for q head `head` (DCA.md step 1). params.q holds the call's queries
// [num_tokens, 5, Hq, D] for positions params.start..; the piece's rows must be among them and
// keys [0, piece.end) must be in kv (length-scaled). Logits use params.softmax_scale.
template <typename KvT>
VsSelection EstimateVerticalSlash(const DcaGeometry& geometry, const PagedKv<KvT>& kv,
                                  const CpuPrefillParams& params, const VsPiece& piece,
                                  int32_t head, int64_t last_q, const VsBudget& budget);

enum VsStageId : int { kVsIntraStage = 0, kVsSuccStage = 1, kVsInterStage = 2 };
inline constexpr int kVsNumStages = 3;

// One stage's inputs to the converter, relative to the stage: its keys are the absolute keys
// [kv_begin, kv_begin + kv_len), its query rows the piece's rows 0..q_len-1.
struct VsStageLists {
  bool present = false;  // succ needs prev >= cl, inter prev >= 2 cl
  bool causal = false;   // intra only
  int64_t kv_begin = 0;
  int64_t kv_len = 0;
  int64_t q_len = 0;
  std::vector<int64_t> columns;  // ascending, in [0, kv_len)
  std::vector<int64_t> offsets;  // diagonal offsets, descending
};

// Step 2 (DCA.md step 2), with VsFallbackIndices(L) as the fallback for an empty column list of
// any stage and an empty offset list of succ / inter. (An empty intra offset list cannot happen
// with slash budget >= 1, since the main diagonal is always chosen; it gets the same fallback.)
std::array<VsStageLists, kVsNumStages> MapToStages(const VsSelection& selection,
                                                   const VsPiece& piece, int64_t chunk_len);

// The fallback list for a stage of L keys: i * floor(L / 5) for i < 5 (0..L-1 when L < 5), what
// the reference's arange(0, L, max(1, L/5)) with an int32 dtype yields, as docs/DCA.md says; the
// golden case follows the reference (see the NOTE in the .cc).
std::vector<int64_t> VsFallbackIndices(int64_t num_keys);

// What the converter gives one 64-row query block of a stage: key blocks (the block starting at b
// covers stage keys [b, b + 64) clipped to kv_len; starts ascending, not necessarily 64-aligned)
// and single key columns (ascending, never inside a block).
struct VsRowBlock {
  std::vector<int64_t> block_starts;
  std::vector<int64_t> columns;
};

// Step 3: the 64x64 vertical-slash index converter of vLLM / SGLang
// (convert_vertical_slash_indexes, one head), for query rows [0, q_len) over kv_len keys.
// columns ascending, offsets descending, both non-empty, columns in [0, kv_len) (MapToStages
// guarantees all of it; otherwise the result is empty). Returns ceil(q_len / 64) row blocks.
std::vector<VsRowBlock> ConvertVerticalSlash(int64_t q_len, int64_t kv_len, bool causal,
                                             absl::Span<const int64_t> columns,
                                             absl::Span<const int64_t> offsets);

}  // namespace attnd

#endif  // ATTND_KERNELS_VERTICAL_SLASH_H_
