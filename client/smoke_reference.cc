#include "client/smoke_reference.h"

#include <algorithm>
#include <set>
#include <thread>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/testing/naive_dca.h"

namespace attnd {
namespace client {

SmokeReference::SmokeReference(const DcaGeometry& geometry, int num_layers, int threads)
    : geometry_(geometry),
      threads_(threads > 0 ? threads : std::max(1u, std::thread::hardware_concurrency())),
      keys_(num_layers),
      values_(num_layers) {}

int64_t SmokeReference::length(int layer) const {
  return static_cast<int64_t>(keys_[layer].size()) /
         (int64_t{geometry_.num_kv_heads} * geometry_.head_dim);
}

absl::StatusOr<std::vector<float>> SmokeReference::Prefill(int layer, absl::Span<const float> q,
                                                           absl::Span<const float> k,
                                                           absl::Span<const float> v,
                                                           int64_t prompt_len,
                                                           absl::Span<const int64_t> rows) {
  if (layer < 0 || layer >= static_cast<int>(keys_.size())) {
    return absl::InvalidArgumentError(absl::StrCat("reference: no layer ", layer));
  }
  const int64_t hq = geometry_.num_q_heads, d = geometry_.head_dim;
  const int64_t kv_row = int64_t{geometry_.num_kv_heads} * d;
  const int64_t t = static_cast<int64_t>(k.size()) / kv_row;
  if (t == 0 || static_cast<int64_t>(k.size()) != t * kv_row ||
      static_cast<int64_t>(v.size()) != t * kv_row ||
      static_cast<int64_t>(q.size()) != t * 5 * hq * d) {
    return absl::InvalidArgumentError("reference: prefill sizes do not match");
  }
  const int64_t start = length(layer);
  if (prompt_len < start + t) {
    return absl::InvalidArgumentError("reference: prompt_len below the new length");
  }
  for (int64_t r : rows) {
    if (r < 0 || r >= t) return absl::InvalidArgumentError("reference: row out of range");
  }
  // DCA.md "Length scaling", prefill: keys cached as s(L) k, softmax scale times s(L).
  const double s = naive::LengthScaleF64(prompt_len, geometry_.original_max_position_embeddings);
  for (int64_t i = 0; i < t * kv_row; ++i) {
    keys_[layer].push_back(s * static_cast<double>(k[i]));
    values_[layer].push_back(static_cast<double>(v[i]));
  }
  std::vector<float> out(rows.size() * hq * d);
  const std::vector<double>& keys = keys_[layer];
  const std::vector<double>& values = values_[layer];
  // Rows cost in proportion to their position: deal them round-robin so threads finish together.
  auto work = [&](size_t first) {
    for (size_t i = first; i < rows.size(); i += threads_) {
      const int64_t n = rows[i];
      std::vector<double> q3(q.begin() + n * 5 * hq * d, q.begin() + (n * 5 + 3) * hq * d);
      const std::vector<double> o =
          naive::Attend(geometry_, start + n, q3, keys, values, geometry_.softmax_scale * s);
      std::copy(o.begin(), o.end(), out.begin() + i * hq * d);
    }
  };
  std::vector<std::thread> pool;
  for (int i = 1; i < threads_ && static_cast<size_t>(i) < rows.size(); ++i) {
    pool.emplace_back(work, i);
  }
  work(0);
  for (std::thread& th : pool) th.join();
  return out;
}

absl::StatusOr<std::vector<float>> SmokeReference::Decode(int layer, absl::Span<const float> q,
                                                          absl::Span<const float> k,
                                                          absl::Span<const float> v) {
  if (layer < 0 || layer >= static_cast<int>(keys_.size())) {
    return absl::InvalidArgumentError(absl::StrCat("reference: no layer ", layer));
  }
  const int64_t hq = geometry_.num_q_heads, d = geometry_.head_dim;
  const int64_t kv_row = int64_t{geometry_.num_kv_heads} * d;
  if ((q.size() != static_cast<size_t>(3 * hq * d) &&
       q.size() != static_cast<size_t>(5 * hq * d)) ||
      static_cast<int64_t>(k.size()) != kv_row || static_cast<int64_t>(v.size()) != kv_row) {
    return absl::InvalidArgumentError("reference: decode sizes do not match one token");
  }
  // DCA.md "Length scaling", decode: L includes the new token; key and the three query variants
  // times s(L); the softmax scale unscaled.
  const int64_t length_after = length(layer) + 1;
  const double s = naive::LengthScaleF64(length_after, geometry_.original_max_position_embeddings);
  for (int64_t i = 0; i < kv_row; ++i) {
    keys_[layer].push_back(s * static_cast<double>(k[i]));
    values_[layer].push_back(static_cast<double>(v[i]));
  }
  std::vector<double> q3(3 * hq * d);
  for (int64_t i = 0; i < 3 * hq * d; ++i) q3[i] = s * static_cast<double>(q[i]);
  const std::vector<double> o = naive::Attend(geometry_, length_after - 1, q3, keys_[layer],
                                              values_[layer], geometry_.softmax_scale);
  return std::vector<float>(o.begin(), o.end());
}

std::vector<int64_t> RowsToCheck(const DcaGeometry& geometry, int64_t start, int64_t t,
                                 double budget) {
  const double per_key = 2.0 * geometry.num_q_heads * geometry.head_dim;
  // Sum over rows of (position + 1) keys.
  const double all = per_key * (static_cast<double>(t) * start + 0.5 * t * (t + 1));
  std::vector<int64_t> rows;
  if (all <= budget) {
    for (int64_t i = 0; i < t; ++i) rows.push_back(i);
    return rows;
  }
  std::set<int64_t> pick = {0, t - 1};
  const int64_t cl = geometry.chunk_len;
  for (int64_t b = (start / cl + 1) * cl; b < start + t; b += cl) {
    for (int64_t p : {b - 1, b, b + 1}) {
      if (p >= start && p < start + t) pick.insert(p - start);
    }
  }
  // Rows cost about (start + t) keys each, the latest ones most.
  const double per_row = per_key * static_cast<double>(start + t);
  const int64_t want = std::max<int64_t>(8, static_cast<int64_t>(budget / per_row));
  const int64_t stride = std::max<int64_t>(1, t / want);
  for (int64_t i = stride / 2; i < t; i += stride) pick.insert(i);
  return std::vector<int64_t>(pick.begin(), pick.end());
}

}  // namespace client
}  // namespace attnd
