// A deliberately naive fp64 reference for dual chunk attention (docs/DCA.md), used by the
// kernel tests, the cross-package tests and attnctl's in-process smoke check. It never calls the
// production kernels or PagedKv: contiguous arrays, one softmax per query over an explicit list of
// logits, built stage by stage (intra / succ / inter) exactly as DCA.md defines them.
#ifndef ATTND_KERNELS_TESTING_NAIVE_DCA_H_
#define ATTND_KERNELS_TESTING_NAIVE_DCA_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/dca.h"

namespace attnd {
namespace naive {

// s(L) = max(1, 0.1 ln(L / orig) + 1) if orig > 0, else 1; in fp64, written from DCA.md.
double LengthScaleF64(int64_t length, int64_t original_max_position_embeddings);

// Attention of the one query at position p over keys [0, p]:
//   q:      [3, Hq, D]    intra, succ, inter variants (any decode q scaling already applied)
//   keys:   [>= p+1, Hkv, D]  as cached (already length-scaled)
//   values: [>= p+1, Hkv, D]
// Returns [Hq, D]. q head h reads kv head h / (Hq / Hkv). logit = softmax_scale * (q_variant . k)
// with the variant DCA assigns to each key.
std::vector<double> Attend(const DcaGeometry& geometry, int64_t p, absl::Span<const double> q,
                           absl::Span<const double> keys, absl::Span<const double> values,
                           double softmax_scale);

// The dual-chunk rotary of DCA.md ("Dual-chunk rotary"), in fp64 from the contract's formulas
// (exact angles t * theta^(-2i/rd), not the reference's fp32 cache: the two agree to ~1e-5 rad at
// the small positions tests use). geometry.chunk_size, rope_theta and rotary_dim must be set.
struct RotatedInputs {
  std::vector<float> q_variants;  // [T, num_variants, Hq, D]
  std::vector<float> k;           // [T, Hkv, D], rotated, not length-scaled
};
// q: [T, Hq, D] and k: [T, Hkv, D] before the rotary, token n at absolute position start + n.
// num_variants: 5 (prefill) or 3 (decode). INVALID_ARGUMENT on inconsistent sizes or no rotary.
absl::StatusOr<RotatedInputs> DualChunkRotary(const DcaGeometry& geometry, int64_t start,
                                              absl::Span<const float> q, absl::Span<const float> k,
                                              int num_variants);

// One sequence's cached K/V per layer plus the prefill/decode rules of DCA.md ("Length scaling").
// fp32 in and out, fp64 inside. Not thread-safe.
class NaiveSequence {
 public:
  // How the cache holds K/V: exactly (fp64), or as fp8 E4M3 or int8 rows with an fp32 scale per
  // token and kv head, quantised by naive_fp8.h or naive_int8.h, keys after length scaling as
  // fp32(k) * fp32(s(L)) (the kernels' product). Applies to the tokens appended after it is set.
  enum class KvStorage { kExact, kFp8E4m3, kInt8 };

  NaiveSequence(const DcaGeometry& geometry, int num_layers);

  void set_kv_storage(KvStorage storage) { storage_ = storage; }

  // Appends T = k.size() / (Hkv * D) tokens to `layer` and returns their outputs [T, Hq, D].
  //   q: [T, 5, Hq, D]; k, v: [T, Hkv, D] (unscaled); prompt_len: the whole prompt's length, which
  //   sets s for this chunk's keys and its softmax scale (DCA.md: every chunk uses it).
  // INVALID_ARGUMENT on a bad layer, inconsistent sizes, T == 0, or prompt_len < the layer's new
  // length.
  absl::StatusOr<std::vector<float>> Prefill(int layer, absl::Span<const float> q,
                                             absl::Span<const float> k, absl::Span<const float> v,
                                             int64_t prompt_len);

  // Appends one token and returns its output [Hq, D]. q: [3 or 5, Hq, D] (only the first three
  // are used); k, v: [Hkv, D] unscaled. With L = the new length, the key is cached as s(L) k, the
  // query variants are multiplied by s(L), and the softmax scale is the geometry's.
  absl::StatusOr<std::vector<float>> Decode(int layer, absl::Span<const float> q,
                                            absl::Span<const float> k, absl::Span<const float> v);

  // The same for pre-rotary inputs (q [T, Hq, D] / [Hq, D], k before the rotary): DualChunkRotary
  // at the layer's length, then Prefill / Decode.
  absl::StatusOr<std::vector<float>> PrefillPreRotary(int layer, absl::Span<const float> q,
                                                      absl::Span<const float> k,
                                                      absl::Span<const float> v,
                                                      int64_t prompt_len);
  absl::StatusOr<std::vector<float>> DecodePreRotary(int layer, absl::Span<const float> q,
                                                     absl::Span<const float> k,
                                                     absl::Span<const float> v);

  // Tokens cached in `layer` (0 for a bad layer).
  int64_t length(int layer) const;

 private:
  absl::Status CheckLayer(int layer) const;
  // Appends tokens' keys (unscaled, times s) and values to `layer` as storage_ says.
  void Store(int layer, absl::Span<const float> k, absl::Span<const float> v, double s);

  DcaGeometry geometry_;
  KvStorage storage_ = KvStorage::kExact;
  std::vector<std::vector<double>> keys_;    // per layer [length, Hkv, D], length-scaled
  std::vector<std::vector<double>> values_;  // per layer [length, Hkv, D]
};

}  // namespace naive
}  // namespace attnd

#endif  // ATTND_KERNELS_TESTING_NAIVE_DCA_H_
