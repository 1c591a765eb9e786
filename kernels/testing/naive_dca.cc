#include "kernels/testing/naive_dca.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/testing/naive_fp8.h"
#include "kernels/testing/naive_int8.h"

namespace attnd {
namespace naive {

double LengthScaleF64(int64_t length, int64_t original_max_position_embeddings) {
  if (original_max_position_embeddings <= 0) return 1.0;
  const double s = 0.1 * std::log(static_cast<double>(length) /
                                  static_cast<double>(original_max_position_embeddings)) +
                   1.0;
  return std::max(1.0, s);
}

std::vector<double> Attend(const DcaGeometry& geometry, int64_t p, absl::Span<const double> q,
                           absl::Span<const double> keys, absl::Span<const double> values,
                           double softmax_scale) {
  const int64_t hq = geometry.num_q_heads;
  const int64_t hkv = geometry.num_kv_heads;
  const int64_t d = geometry.head_dim;
  const int64_t cl = geometry.chunk_len;
  const int64_t group = hq / hkv;
  const int64_t prev = (p / cl) * cl;

  // The three stages of DCA.md, as (variant, first key, one past the last key).
  struct Stage {
    int variant;
    int64_t begin;
    int64_t end;
  };
  std::vector<Stage> stages = {{0, prev, p + 1}};
  if (prev >= cl) stages.push_back({1, prev - cl, prev});
  if (prev >= 2 * cl) stages.push_back({2, 0, prev - cl});

  std::vector<double> out(hq * d, 0.0);
  for (int64_t h = 0; h < hq; ++h) {
    const int64_t kvh = h / group;
    std::vector<double> logits;
    std::vector<int64_t> key_of_logit;
    for (const Stage& stage : stages) {
      const double* qv = q.data() + (stage.variant * hq + h) * d;
      for (int64_t j = stage.begin; j < stage.end; ++j) {
        const double* kj = keys.data() + (j * hkv + kvh) * d;
        double dot = 0.0;
        for (int64_t i = 0; i < d; ++i) dot += qv[i] * kj[i];
        logits.push_back(softmax_scale * dot);
        key_of_logit.push_back(j);
      }
    }
    const double max_logit = *std::max_element(logits.begin(), logits.end());
    double denom = 0.0;
    for (double& x : logits) {
      x = std::exp(x - max_logit);
      denom += x;
    }
    for (size_t n = 0; n < logits.size(); ++n) {
      const double* vj = values.data() + (key_of_logit[n] * hkv + kvh) * d;
      for (int64_t i = 0; i < d; ++i) out[h * d + i] += logits[n] / denom * vj[i];
    }
  }
  return out;
}

absl::StatusOr<RotatedInputs> DualChunkRotary(const DcaGeometry& geometry, int64_t start,
                                              absl::Span<const float> q, absl::Span<const float> k,
                                              int num_variants) {
  const int64_t hq = geometry.num_q_heads, hkv = geometry.num_kv_heads, d = geometry.head_dim;
  const int64_t rd = geometry.rotary_dim, cl = geometry.chunk_len, cs = geometry.chunk_size;
  if (rd < 2 || rd % 2 != 0 || rd > d || cs <= cl || geometry.rope_theta <= 0) {
    return absl::InvalidArgumentError("the geometry has no usable rotary");
  }
  const int64_t t = static_cast<int64_t>(q.size()) / (hq * d);
  if (t == 0 || static_cast<int64_t>(q.size()) != t * hq * d ||
      static_cast<int64_t>(k.size()) != t * hkv * d || (num_variants != 3 && num_variants != 5)) {
    return absl::InvalidArgumentError(absl::StrCat("rotary sizes q=", q.size(), " k=", k.size(),
                                                   " variants=", num_variants, " do not match"));
  }
  // Rotates row x (D values) by position `pos` into out, neox style, in fp64.
  auto rotate = [&](const float* x, double pos, float* out) {
    const int64_t half = rd / 2;
    for (int64_t i = 0; i < half; ++i) {
      const double freq = std::pow(geometry.rope_theta, -2.0 * static_cast<double>(i) / rd);
      const double a = pos * freq;
      const double x1 = x[i], x2 = x[i + half];
      out[i] = static_cast<float>(x1 * std::cos(a) - x2 * std::sin(a));
      out[i + half] = static_cast<float>(x2 * std::cos(a) + x1 * std::sin(a));
    }
    for (int64_t i = rd; i < d; ++i) out[i] = x[i];
  };
  RotatedInputs r;
  r.q_variants.resize(t * num_variants * hq * d);
  r.k.resize(t * hkv * d);
  for (int64_t n = 0; n < t; ++n) {
    const int64_t p = start + n;
    const int64_t rel = p % cl;
    // DCA.md: intra r; succ min(r + cl, chunk_size); inter min(2 cl - 1, chunk_size);
    // succ_critical r + cl; inter_critical r + chunk_size; the key r.
    const int64_t positions[5] = {rel, std::min(rel + cl, cs), std::min(2 * cl - 1, cs), rel + cl,
                                  rel + cs};
    for (int v = 0; v < num_variants; ++v) {
      for (int64_t h = 0; h < hq; ++h) {
        rotate(q.data() + (n * hq + h) * d, static_cast<double>(positions[v]),
               r.q_variants.data() + ((n * num_variants + v) * hq + h) * d);
      }
    }
    for (int64_t h = 0; h < hkv; ++h) {
      rotate(k.data() + (n * hkv + h) * d, static_cast<double>(rel),
             r.k.data() + (n * hkv + h) * d);
    }
  }
  return r;
}

NaiveSequence::NaiveSequence(const DcaGeometry& geometry, int num_layers)
    : geometry_(geometry), keys_(std::max(num_layers, 0)), values_(std::max(num_layers, 0)) {}

absl::Status NaiveSequence::CheckLayer(int layer) const {
  if (layer < 0 || layer >= static_cast<int>(keys_.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", layer, " out of range [0, ", keys_.size(), ")"));
  }
  return absl::OkStatus();
}

int64_t NaiveSequence::length(int layer) const {
  if (!CheckLayer(layer).ok()) return 0;
  return static_cast<int64_t>(keys_[layer].size()) /
         (static_cast<int64_t>(geometry_.num_kv_heads) * geometry_.head_dim);
}

void NaiveSequence::Store(int layer, absl::Span<const float> k, absl::Span<const float> v,
                          double s) {
  if (storage_ == KvStorage::kExact) {
    for (size_t i = 0; i < k.size(); ++i) {
      keys_[layer].push_back(s * static_cast<double>(k[i]));
      values_[layer].push_back(static_cast<double>(v[i]));
    }
    return;
  }
  const size_t d = static_cast<size_t>(geometry_.head_dim);
  const float s32 = static_cast<float>(s);
  auto round_trip = [this](absl::Span<const float> x) {
    return storage_ == KvStorage::kInt8 ? Int8RoundTrip(x) : Fp8RoundTrip(x);
  };
  std::vector<float> key(d);
  for (size_t row = 0; row + d <= k.size(); row += d) {  // one token's one kv head
    for (size_t i = 0; i < d; ++i) key[i] = k[row + i] * s32;
    for (double x : round_trip(key)) keys_[layer].push_back(x);
    for (double x : round_trip(v.subspan(row, d))) values_[layer].push_back(x);
  }
}

absl::StatusOr<std::vector<float>> NaiveSequence::Prefill(int layer, absl::Span<const float> q,
                                                          absl::Span<const float> k,
                                                          absl::Span<const float> v,
                                                          int64_t prompt_len) {
  absl::Status status = CheckLayer(layer);
  if (!status.ok()) return status;
  const int64_t hq = geometry_.num_q_heads;
  const int64_t kv_row = static_cast<int64_t>(geometry_.num_kv_heads) * geometry_.head_dim;
  const int64_t d = geometry_.head_dim;
  const int64_t t = static_cast<int64_t>(k.size()) / kv_row;
  if (t == 0 || static_cast<int64_t>(k.size()) != t * kv_row ||
      static_cast<int64_t>(v.size()) != t * kv_row ||
      static_cast<int64_t>(q.size()) != t * 5 * hq * d) {
    return absl::InvalidArgumentError(absl::StrCat("prefill sizes q=", q.size(), " k=", k.size(),
                                                   " v=", v.size(), " do not match T >= 1 tokens"));
  }
  const int64_t start = length(layer);
  if (prompt_len < start + t) {
    return absl::InvalidArgumentError(
        absl::StrCat("prompt_len ", prompt_len, " < length after prefill ", start + t));
  }
  const double s = LengthScaleF64(prompt_len, geometry_.original_max_position_embeddings);
  Store(layer, k, v, s);
  std::vector<float> out(t * hq * d);
  for (int64_t n = 0; n < t; ++n) {
    // The first three of the five variants; the critical ones only feed sparse estimation.
    std::vector<double> q3(q.begin() + n * 5 * hq * d, q.begin() + (n * 5 + 3) * hq * d);
    const std::vector<double> o =
        Attend(geometry_, start + n, q3, keys_[layer], values_[layer], geometry_.softmax_scale * s);
    std::copy(o.begin(), o.end(), out.begin() + n * hq * d);
  }
  return out;
}

absl::StatusOr<std::vector<float>> NaiveSequence::Decode(int layer, absl::Span<const float> q,
                                                         absl::Span<const float> k,
                                                         absl::Span<const float> v) {
  absl::Status status = CheckLayer(layer);
  if (!status.ok()) return status;
  const int64_t hq = geometry_.num_q_heads;
  const int64_t d = geometry_.head_dim;
  const int64_t kv_row = static_cast<int64_t>(geometry_.num_kv_heads) * d;
  const int64_t q_len = static_cast<int64_t>(q.size());
  if ((q_len != 3 * hq * d && q_len != 5 * hq * d) || static_cast<int64_t>(k.size()) != kv_row ||
      static_cast<int64_t>(v.size()) != kv_row) {
    return absl::InvalidArgumentError(absl::StrCat("decode sizes q=", q.size(), " k=", k.size(),
                                                   " v=", v.size(), " do not match one token"));
  }
  const int64_t length_after = length(layer) + 1;
  const double s = LengthScaleF64(length_after, geometry_.original_max_position_embeddings);
  Store(layer, k, v, s);
  std::vector<double> q3(3 * hq * d);
  for (int64_t i = 0; i < 3 * hq * d; ++i) q3[i] = s * static_cast<double>(q[i]);
  const std::vector<double> o = Attend(geometry_, length_after - 1, q3, keys_[layer],
                                       values_[layer], geometry_.softmax_scale);
  return std::vector<float>(o.begin(), o.end());
}

absl::StatusOr<std::vector<float>> NaiveSequence::PrefillPreRotary(int layer,
                                                                   absl::Span<const float> q,
                                                                   absl::Span<const float> k,
                                                                   absl::Span<const float> v,
                                                                   int64_t prompt_len) {
  absl::Status status = CheckLayer(layer);
  if (!status.ok()) return status;
  absl::StatusOr<RotatedInputs> r = DualChunkRotary(geometry_, length(layer), q, k, 5);
  if (!r.ok()) return r.status();
  return Prefill(layer, r->q_variants, r->k, v, prompt_len);
}

absl::StatusOr<std::vector<float>> NaiveSequence::DecodePreRotary(int layer,
                                                                  absl::Span<const float> q,
                                                                  absl::Span<const float> k,
                                                                  absl::Span<const float> v) {
  absl::Status status = CheckLayer(layer);
  if (!status.ok()) return status;
  absl::StatusOr<RotatedInputs> r = DualChunkRotary(geometry_, length(layer), q, k, 3);
  if (!r.ok()) return r.status();
  return Decode(layer, r->q_variants, r->k, v);
}

}  // namespace naive
}  // namespace attnd
