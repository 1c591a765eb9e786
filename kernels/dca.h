// Dual chunk attention: the constants and small rules every backend shares (docs/DCA.md).
#ifndef ATTND_KERNELS_DCA_H_
#define ATTND_KERNELS_DCA_H_

#include <math.h>

#include <cstdint>

#include "kernels/host_device.h"

namespace attnd {

// The attention geometry of one model, as every kernel needs it.
struct DcaGeometry {
  int32_t num_q_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  int64_t chunk_len = 0;                         // chunk_size - local_size ("cl").
  int64_t original_max_position_embeddings = 0;  // 0 = no length scaling.
  float softmax_scale = 0.f;  // 1/sqrt(head_dim) unless the model says otherwise.
  // The dual-chunk rotary (DCA.md, "Dual-chunk rotary"), for pre-rotary requests. rotary_dim 0:
  // the model's rotary is unknown, and backends refuse pre-rotary requests.
  int64_t chunk_size = 0;  // chunk_len + local_size.
  double rope_theta = 0.0;
  int32_t rotary_dim = 0;  // Even, <= head_dim; dims past it are not rotated.

  int32_t group_size() const { return num_q_heads / num_kv_heads; }  // q heads per kv head.
};

// Number of query variants a prefill token carries: intra, succ, inter, succ_critical,
// inter_critical.
inline constexpr int kNumQueryVariants = 5;
// Query variants decode uses (the first three).
inline constexpr int kNumDecodeVariants = 3;
enum QueryVariant : int {
  kIntra = 0,
  kSucc = 1,
  kInter = 2,
  kSuccCritical = 3,
  kInterCritical = 4
};

// What a request's q and k hold (attention.proto's QLayout; docs/rotary.md). kVariants: the five
// query variants [T, 5, Hq, D] (decode [3 or 5, Hq, D]) and a key rotary-embedded by the caller;
// kPreRotary: q [T, Hq, D] (decode [Hq, D]) and k before the rotary, which the backend applies.
enum class QLayout : int32_t { kVariants = 0, kPreRotary = 1 };

// s(L) = max(1, 0.1 ln(L / orig) + 1) when orig > 0, else 1.
// Host and device (kernels scale keys and scores with it).
ATTND_HOST_DEVICE float LengthScale(int64_t length, int64_t original_max_position_embeddings) {
  if (original_max_position_embeddings <= 0 || length <= original_max_position_embeddings)
    return 1.f;
  const double s = 0.1 * log(static_cast<double>(length) /
                             static_cast<double>(original_max_position_embeddings)) +
                   1.0;
  return static_cast<float>(s < 1.0 ? 1.0 : s);
}

// The query variant that a query at absolute position q_pos uses for a key at k_pos <= q_pos:
// intra inside q's chunk, succ in the chunk before it, inter further back.
// VariantOfKey: the same rule given prev, the start of q's chunk (kernels compute it once per row).
ATTND_HOST_DEVICE int VariantOfKey(int64_t k_pos, int64_t prev, int64_t chunk_len) {
  if (k_pos >= prev) return kIntra;
  if (k_pos >= prev - chunk_len) return kSucc;
  return kInter;
}
inline QueryVariant VariantFor(int64_t q_pos, int64_t k_pos, int64_t chunk_len) {
  return static_cast<QueryVariant>(VariantOfKey(k_pos, (q_pos / chunk_len) * chunk_len, chunk_len));
}

}  // namespace attnd

#endif  // ATTND_KERNELS_DCA_H_
