// attnctl smoke's reference: one sequence's cached K/V per layer (fp64) with DCA.md's prefill and
// decode rules, whose outputs come from the naive fp64 reference (kernels/testing/naive_dca.h,
// naive::Attend). Unlike naive::NaiveSequence it computes only the prefill rows asked for, on
// several threads, so a smoke test of a 7B-geometry model stays in seconds on a CPU: a full fp64
// check of 4096 tokens x 28 heads is minutes. smoke_reference_test pins it to NaiveSequence.
#ifndef ATTND_CLIENT_SMOKE_REFERENCE_H_
#define ATTND_CLIENT_SMOKE_REFERENCE_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/dca.h"

namespace attnd {
namespace client {

class SmokeReference {
 public:
  // `threads` computes rows in parallel (0 = hardware concurrency).
  SmokeReference(const DcaGeometry& geometry, int num_layers, int threads = 0);

  // Appends T tokens (q [T, 5, Hq, D], k/v [T, Hkv, D], unscaled) to `layer` and returns the
  // outputs [rows.size(), Hq, D] of the listed rows (indices into the T new tokens, ascending).
  absl::StatusOr<std::vector<float>> Prefill(int layer, absl::Span<const float> q,
                                             absl::Span<const float> k, absl::Span<const float> v,
                                             int64_t prompt_len, absl::Span<const int64_t> rows);
  // Appends one token (q [3 or 5, Hq, D]) and returns its output [Hq, D].
  absl::StatusOr<std::vector<float>> Decode(int layer, absl::Span<const float> q,
                                            absl::Span<const float> k, absl::Span<const float> v);

  int64_t length(int layer) const;

 private:
  DcaGeometry geometry_;
  int threads_;
  std::vector<std::vector<double>> keys_;    // per layer [length, Hkv, D], length-scaled
  std::vector<std::vector<double>> values_;  // per layer [length, Hkv, D]
};

// Which of a prefill call's T rows (new tokens at positions start..start+T-1) to check: all of
// them when the fp64 work fits `budget` multiply-adds, else the first and last rows, the rows on
// either side of every DCA chunk boundary in the call, and an even stride over the rest.
std::vector<int64_t> RowsToCheck(const DcaGeometry& geometry, int64_t start, int64_t t,
                                 double budget);

}  // namespace client
}  // namespace attnd

#endif  // ATTND_CLIENT_SMOKE_REFERENCE_H_
