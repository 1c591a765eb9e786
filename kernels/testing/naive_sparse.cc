#include "kernels/testing/naive_sparse.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <set>
#include <vector>

namespace attnd {
namespace naive {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

double Dot(const float* q, const double* k, int d) {
  double s = 0;
  for (int i = 0; i < d; ++i) s += static_cast<double>(q[i]) * k[i];
  return s;
}

}  // namespace

SparseScores EstimateScores(const DcaGeometry& geometry, absl::Span<const float> q, int64_t start,
                            absl::Span<const double> keys, int64_t prev, int64_t begin, int64_t end,
                            int32_t head, double softmax_scale, int64_t last_q) {
  const int d = geometry.head_dim;
  const int64_t hq = geometry.num_q_heads, hkv = geometry.num_kv_heads;
  const int64_t kv_head = head / (hq / hkv);
  const int64_t cl = geometry.chunk_len;
  const int64_t n = std::min(end - begin, last_q);

  // The full n x end score matrix.
  std::vector<std::vector<double>> s(n, std::vector<double>(end));
  for (int64_t i = 0; i < n; ++i) {
    const int64_t pos = end - n + i;
    for (int64_t j = 0; j < end; ++j) {
      int variant = 4;  // query_inter_critical
      if (j >= prev) {
        variant = 0;  // query
      } else if (j >= prev - cl) {
        variant = 3;  // query_succ_critical
      }
      const float* qv = q.data() + ((pos - start) * 5 + variant) * hq * d + head * d;
      s[i][j] = softmax_scale * Dot(qv, keys.data() + (j * hkv + kv_head) * d, d);
    }
    // Causal mask of the n x n bottom-right corner: column end-n+c is visible to row i iff c <= i.
    for (int64_t c = 0; c < n; ++c) {
      if (c > i) s[i][end - n + c] = -kInf;
    }
    double mx = -kInf;
    for (double x : s[i]) mx = std::max(mx, x);
    double sum = 0;
    for (double& x : s[i]) {
      x = std::exp(x - mx);
      sum += x;
    }
    for (double& x : s[i]) x /= sum;
  }
  SparseScores out;
  out.vertical.assign(end, 0.0);
  out.slash.assign(end, 0.0);
  for (int64_t j = 0; j < end; ++j) {
    for (int64_t i = 0; i < n; ++i) out.vertical[j] += s[i][j];
  }
  // slash[t]: the diagonal through (last row, key t) -- row i holds it at key t - (n - 1 - i).
  for (int64_t t = 0; t < end; ++t) {
    for (int64_t i = 0; i < n; ++i) {
      const int64_t key = t - (n - 1 - i);
      if (key >= 0) out.slash[t] += s[i][key];
    }
  }
  for (int64_t j = 0; j < 30 && j < end; ++j) out.vertical[j] = kInf;
  for (int64_t t = end - 1; t >= 0 && t >= end - 100; --t) out.slash[t] = kInf;
  return out;
}

std::vector<int64_t> TopK(const std::vector<double>& scores, int64_t k, bool prefer_larger_index) {
  std::vector<int64_t> idx(scores.size());
  for (size_t i = 0; i < idx.size(); ++i) idx[i] = static_cast<int64_t>(i);
  std::stable_sort(idx.begin(), idx.end(), [&](int64_t a, int64_t b) {
    if (scores[a] != scores[b]) return scores[a] > scores[b];
    return prefer_larger_index ? a > b : a < b;
  });
  idx.resize(std::min<size_t>(idx.size(), static_cast<size_t>(std::max<int64_t>(k, 0))));
  std::sort(idx.begin(), idx.end());
  return idx;
}

NaiveStage MapStage(int stage, const std::vector<int64_t>& vertical,
                    const std::vector<int64_t>& slash, int64_t prev, int64_t begin, int64_t end,
                    int64_t chunk_len) {
  const int64_t p = prev, cl = chunk_len, nq = end - begin;
  NaiveStage st;
  st.q_len = nq;
  std::set<int64_t> cols;
  std::set<int64_t, std::greater<int64_t>> offs;
  if (stage == 0) {
    st.present = true;
    st.causal = true;
    st.kv_begin = p;
    st.kv_len = end - p;
    for (int64_t v : vertical) {
      if (v >= p) cols.insert(v - p);
    }
    for (int64_t t : slash) {
      if (t >= p) offs.insert((end - 1) - t);
    }
  } else if (stage == 1) {
    st.present = p >= cl;
    st.kv_begin = p - cl;
    st.kv_len = cl;
    for (int64_t v : vertical) {
      if (v >= p - cl && v < p) cols.insert(v - (p - cl));
    }
    for (int64_t t : slash) {
      if (t >= p - cl && t < p + nq) offs.insert((p + nq - 1) - t);
    }
  } else {
    st.present = p >= 2 * cl;
    st.kv_begin = 0;
    st.kv_len = p - cl;
    for (int64_t v : vertical) {
      if (v < p - cl) cols.insert(v);
    }
    for (int64_t t : slash) {
      if (t < p - cl + nq) offs.insert((p - cl + nq - 1) - t);
    }
  }
  if (!st.present) return NaiveStage();
  // Fallback: the reference's arange(0, L, max(1, L/5)) with an int32 dtype, whose step is
  // truncated to an integer: i * floor(L/5) for i < 5 (0..L-1 when L < 5), as docs/DCA.md says;
  // the golden case sparse_vs follows the reference.
  std::set<int64_t> fallback;
  const int64_t step = st.kv_len / 5 > 0 ? st.kv_len / 5 : 1;
  for (int64_t x = 0; x < st.kv_len && fallback.size() < 5; x += step) fallback.insert(x);
  if (cols.empty()) cols = fallback;
  if (offs.empty()) offs.insert(fallback.begin(), fallback.end());
  st.columns.assign(cols.begin(), cols.end());
  st.offsets.assign(offs.begin(), offs.end());
  return st;
}

std::vector<uint8_t> StageMask(int64_t q_len, int64_t kv_len, bool causal,
                               const std::vector<int64_t>& columns,
                               const std::vector<int64_t>& offsets) {
  std::vector<uint8_t> mask(static_cast<size_t>(q_len * kv_len), 0);
  const int64_t off = causal ? kv_len - q_len : kv_len;  // row r sits at virtual position off + r
  for (int64_t m = 0; m * 64 < q_len; ++m) {
    const int64_t start_m = 64 * m, end_m = start_m + 64;
    // Band ends (exclusive key end) of the offsets, in ascending key order.
    // A non-causal stage stops at the first offset below the block's first row once a band is in
    // use (its band and all later ones lie right of every key).
    std::vector<int64_t> ends;
    bool in_use = false;
    for (int64_t d : offsets) {  // descending d
      if (!causal && d < start_m && in_use) break;
      ends.push_back(off + end_m - d);
      if (ends.back() > 0) in_use = true;
    }
    // Bands ending at or left of key 0 are dropped; if all do, the nearest one still counts when
    // it ends exactly at 0.
    std::vector<int64_t> used;
    for (size_t i = 0; i < ends.size(); ++i) {
      if (ends[i] > 0) used.push_back(ends[i]);
    }
    if (used.empty() && !ends.empty() && ends.back() == 0) used.push_back(0);
    // Merge: a band ending within 64 of the current range's end extends it by 64.
    std::vector<std::pair<int64_t, int64_t>> ranges;
    for (int64_t e : used) {
      e = std::max<int64_t>(e, 64);
      if (ranges.empty() || e > ranges.back().second + 64) {
        ranges.push_back({e - 64, e});
      } else if (e > ranges.back().second) {
        ranges.back().second += 64;
      }
    }
    // The end of the last range (a range right of every visible key when there is no band).
    const int64_t last_end =
        ranges.empty() ? (causal ? off + end_m + 64 : kv_len + 64) : ranges.back().second;
    for (int64_t r = start_m; r < end_m && r < q_len; ++r) {
      uint8_t* row = mask.data() + r * kv_len;
      for (const auto& range : ranges) {
        for (int64_t k = range.first; k < range.second && k < kv_len; ++k) row[k] = 1;
      }
      for (int64_t c : columns) {
        if (c < 0 || c >= kv_len) continue;
        if (causal && c >= last_end) continue;
        row[c] = 1;
      }
      if (causal) {
        for (int64_t k = off + r + 1; k < kv_len; ++k) row[k] = 0;
      }
    }
  }
  return mask;
}

std::vector<double> SparsePrefill(const DcaGeometry& geometry, absl::Span<const float> q,
                                  int64_t start, absl::Span<const double> keys,
                                  absl::Span<const double> values, double softmax_scale,
                                  const std::vector<SparseBudget>& budgets, int64_t last_q) {
  const int d = geometry.head_dim;
  const int64_t hq = geometry.num_q_heads, hkv = geometry.num_kv_heads;
  const int64_t cl = geometry.chunk_len;
  const int64_t t_count = static_cast<int64_t>(q.size()) / (5 * hq * d);
  const int64_t length = start + t_count;
  std::vector<double> out(static_cast<size_t>(t_count * hq * d), 0.0);
  for (int64_t begin = start; begin < length;) {
    const int64_t prev = (begin / cl) * cl;
    const int64_t end = std::min(prev + cl, length);
    for (int32_t h = 0; h < hq; ++h) {
      const int64_t kv_head = h / (hq / hkv);
      const SparseScores sc =
          EstimateScores(geometry, q, start, keys, prev, begin, end, h, softmax_scale, last_q);
      const std::vector<int64_t> vt = TopK(sc.vertical, budgets[h].vertical, false);
      const std::vector<int64_t> st = TopK(sc.slash, budgets[h].slash, true);
      NaiveStage stages[3];
      std::vector<uint8_t> masks[3];
      for (int s = 0; s < 3; ++s) {
        stages[s] = MapStage(s, vt, st, prev, begin, end, cl);
        if (stages[s].present) {
          masks[s] = StageMask(stages[s].q_len, stages[s].kv_len, stages[s].causal,
                               stages[s].columns, stages[s].offsets);
        }
      }
      for (int64_t r = 0; r < end - begin; ++r) {
        const int64_t pos = begin + r;
        std::vector<double> logits;
        std::vector<int64_t> key_of;
        for (int s = 0; s < 3; ++s) {
          if (!stages[s].present) continue;
          const float* qv = q.data() + ((pos - start) * 5 + s) * hq * d + h * d;
          for (int64_t k = 0; k < stages[s].kv_len; ++k) {
            if (!masks[s][r * stages[s].kv_len + k]) continue;
            const int64_t key = stages[s].kv_begin + k;
            logits.push_back(softmax_scale * Dot(qv, keys.data() + (key * hkv + kv_head) * d, d));
            key_of.push_back(key);
          }
        }
        double* o = out.data() + ((pos - start) * hq + h) * d;
        if (logits.empty()) continue;
        double mx = -kInf;
        for (double x : logits) mx = std::max(mx, x);
        double sum = 0;
        for (double& x : logits) {
          x = std::exp(x - mx);
          sum += x;
        }
        for (size_t j = 0; j < logits.size(); ++j) {
          const double* v = values.data() + (key_of[j] * hkv + kv_head) * d;
          for (int e = 0; e < d; ++e) o[e] += logits[j] / sum * v[e];
        }
      }
    }
    begin = end;
  }
  return out;
}

}  // namespace naive
}  // namespace attnd
