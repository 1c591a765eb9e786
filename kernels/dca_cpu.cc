// Dense DCA on the CPU. Grid mapping: one work item = (kv head, block of consecutive query rows,
// key split). An item holds the queries of every q head of its GQA group, so each key/value row of
// that kv head is read once per group and then reused from L1 by all group heads and rows. Keys
// are walked a tile at a time (at most kTileKeys, never crossing a page), so page lookups happen
// once per tile, not per element. When there are too few items to keep the pool busy (decode,
// short prefill chunks over long contexts) the key range is split and the partial softmax states
// are merged by log-sum-exp in a second pass.

#include "kernels/dca_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "kernels/dtype.h"

namespace attnd {
namespace {

constexpr int kTileKeys = 32;       // keys per tile: a K+V tile of D=128 fp32 is 32 KiB (L1-sized).
constexpr int kTargetVectors = 64;  // query vectors (rows x group heads) per prefill block.
constexpr int64_t kMinKeysPerSplit = 512;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Four fp32 lanes: SSE2, which every x86-64 has, so no -march flag is needed. GCC vector
// extensions keep the accumulators in registers (auto-vectorized reductions at -O2 spill them).
// The vector paths need head_dim % 8 == 0 (every model we serve); others take the scalar tails.
typedef float V4 __attribute__((vector_size(16)));
inline V4 Load(const float* p) {
  V4 v;
  std::memcpy(&v, p, sizeof(v));  // unaligned load
  return v;
}
inline void Store(float* p, V4 v) { std::memcpy(p, &v, sizeof(v)); }
inline float Sum(V4 v) { return (v[0] + v[2]) + (v[1] + v[3]); }

// NOTE: the lane-wise partial sums change the summation order against a sequential loop; the
// error stays at fp32 rounding level (tests bound it against an fp64 reference).
inline float Dot(const float* a, const float* b, int n) {
  if (n % 8 != 0) {
    float s = 0.f;
    for (int d = 0; d < n; ++d) s += a[d] * b[d];
    return s;
  }
  V4 s0 = {0.f, 0.f, 0.f, 0.f}, s1 = s0;
  for (int d = 0; d < n; d += 8) {
    s0 += Load(a + d) * Load(b + d);
    s1 += Load(a + d + 4) * Load(b + d + 4);
  }
  return Sum(s0 + s1);
}

// out[j] = q . k[j * stride] for j < 4: four keys share each load of q and give eight
// independent accumulator chains.
inline void Dot4(const float* q, const float* k, int64_t stride, int n, float* out) {
  if (n % 8 != 0) {
    for (int j = 0; j < 4; ++j) out[j] = Dot(q, k + j * stride, n);
    return;
  }
  const float* k0 = k;
  const float* k1 = k + stride;
  const float* k2 = k + 2 * stride;
  const float* k3 = k + 3 * stride;
  const V4 zero = {0.f, 0.f, 0.f, 0.f};
  V4 a0 = zero, b0 = zero, a1 = zero, b1 = zero, a2 = zero, b2 = zero, a3 = zero, b3 = zero;
  for (int d = 0; d < n; d += 8) {
    const V4 qa = Load(q + d), qb = Load(q + d + 4);
    a0 += qa * Load(k0 + d);
    b0 += qb * Load(k0 + d + 4);
    a1 += qa * Load(k1 + d);
    b1 += qb * Load(k1 + d + 4);
    a2 += qa * Load(k2 + d);
    b2 += qb * Load(k2 + d + 4);
    a3 += qa * Load(k3 + d);
    b3 += qb * Load(k3 + d + 4);
  }
  out[0] = Sum(a0 + b0);
  out[1] = Sum(a1 + b1);
  out[2] = Sum(a2 + b2);
  out[3] = Sum(a3 + b3);
}

// y += alpha * x
inline void Axpy(float alpha, const float* x, float* y, int n) {
  if (n % 8 != 0) {
    for (int d = 0; d < n; ++d) y[d] += alpha * x[d];
    return;
  }
  for (int d = 0; d < n; d += 4) Store(y + d, Load(y + d) + alpha * Load(x + d));
}

// y += sum_j p[j] * x[j * stride] for j < 4: one load and store of y per four value rows.
inline void Axpy4(const float* p, const float* x, int64_t stride, float* y, int n) {
  if (n % 8 != 0) {
    for (int j = 0; j < 4; ++j) Axpy(p[j], x + j * stride, y, n);
    return;
  }
  const float* x0 = x;
  const float* x1 = x + stride;
  const float* x2 = x + 2 * stride;
  const float* x3 = x + 3 * stride;
  const float p0 = p[0], p1 = p[1], p2 = p[2], p3 = p[3];
  for (int d = 0; d < n; d += 4) {
    const V4 t = (p0 * Load(x0 + d) + p1 * Load(x1 + d)) + (p2 * Load(x2 + d) + p3 * Load(x3 + d));
    Store(y + d, Load(y + d) + t);
  }
}

// x[i] = exp(x[i]) for i < n rounded up to a multiple of 4, for x[i] <= 0 (softmax arguments
// after subtracting the running max). Four lanes at a time instead of one libm call per score.
// NOTE: range reduction x = k ln2 + r with ln2 split in two (exact k ln2_hi), then a degree-6
// polynomial for e^r on |r| <= ln2/2 (the classic Cephes expf coefficients): relative error about
// 2e-7. Inputs below -87 (e^-87 ~ 1.6e-38, nothing against the row max's e^0 = 1) are clamped
// there, which keeps 2^k a normal number.
inline void ExpNonPositive(float* x, int n) {
  typedef int32_t V4i __attribute__((vector_size(16)));
  const V4 lo = {-87.f, -87.f, -87.f, -87.f};
  const V4 zero = {0.f, 0.f, 0.f, 0.f};
  const V4 log2e = {1.44269504088896341f, 1.44269504088896341f, 1.44269504088896341f,
                    1.44269504088896341f};
  const V4 round_magic = {12582912.f, 12582912.f, 12582912.f, 12582912.f};  // 1.5 * 2^23
  for (int i = 0; i < n; i += 4) {
    V4 v = Load(x + i);
    v = v < lo ? lo : v;      // also maps -inf to -87
    v = v > zero ? zero : v;  // stale lanes past n: keeps 2^k in range (no int overflow)
    const V4 k = (v * log2e + round_magic) - round_magic;  // round to nearest
    V4 r = v - k * 0.693359375f;
    r = r - k * -2.12194440e-4f;
    V4 p = 1.9875691500e-4f * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.f;
    const V4i bits = (__builtin_convertvector(k, V4i) + 127) << 23;  // 2^k
    V4 two_k;
    std::memcpy(&two_k, &bits, sizeof(two_k));
    Store(x + i, p * two_k);
  }
}

// y *= alpha
inline void ScaleInPlace(float alpha, float* y, int n) {
  for (int d = 0; d < n; ++d) y[d] *= alpha;
}

// The query variant of a key for a row whose chunk starts at prev (DCA.md: intra, succ, inter).
inline int VariantOf(int64_t key, int64_t prev, int64_t cl) {
  return key >= prev ? kIntra : (key >= prev - cl ? kSucc : kInter);
}

// KV element <-> fp32 for one row.
inline void LoadRow(const float* src, int n, float* dst) { std::copy(src, src + n, dst); }
inline void LoadRow(const uint16_t* src, int n, float* dst) {
  for (int i = 0; i < n; ++i) dst[i] = Bf16ToFloat(src[i]);
}
inline void StoreRow(const float* src, float scale, int n, float* dst) {
  for (int i = 0; i < n; ++i) dst[i] = src[i] * scale;
}
inline void StoreRow(const float* src, float scale, int n, uint16_t* dst) {
  for (int i = 0; i < n; ++i) dst[i] = FloatToBf16(src[i] * scale);
}

// fp32 rows of one tile of keys/values of one kv head. fp32 KV is read in place (row stride
// num_kv_heads * head_dim inside the page); bf16 KV is converted once per tile into scratch, which
// every query vector of the item then reuses.
struct Tile {
  const float* k = nullptr;
  const float* v = nullptr;
  int64_t stride = 0;
};

inline Tile LoadTile(const PagedKv<float>& kv, int32_t kv_head, int64_t begin, int64_t /*end*/,
                     std::vector<float>* /*scratch*/) {
  return Tile{kv.Key(begin, kv_head), kv.Value(begin, kv_head),
              static_cast<int64_t>(kv.num_kv_heads) * kv.head_dim};
}

inline Tile LoadTile(const PagedKv<uint16_t>& kv, int32_t kv_head, int64_t begin, int64_t end,
                     std::vector<float>* scratch) {
  const int d = kv.head_dim;
  const int64_t n = end - begin;
  const int64_t src_stride = static_cast<int64_t>(kv.num_kv_heads) * d;
  float* k = scratch->data();
  float* v = k + kTileKeys * d;
  const uint16_t* ks = kv.Key(begin, kv_head);
  const uint16_t* vs = kv.Value(begin, kv_head);
  for (int64_t j = 0; j < n; ++j) {
    LoadRow(ks + j * src_stride, d, k + j * d);
    LoadRow(vs + j * src_stride, d, v + j * d);
  }
  return Tile{k, v, d};
}

// A block of consecutive query rows of one sequence and one kv head: rows r = 0..num_rows-1 are
// at positions first_pos + r and see keys [0, first_pos + r]. Query vector of row r, group head
// gi, variant v: q + r * q_row_stride + v * q_variant_stride + (kv_head * group + gi) * head_dim.
template <typename KvT>
struct RowBlock {
  const PagedKv<KvT>* kv = nullptr;
  int32_t kv_head = 0;
  int64_t first_pos = 0;
  int32_t num_rows = 0;
  const float* q = nullptr;
  int64_t q_row_stride = 0;
  int64_t q_variant_stride = 0;
  float q_scale = 1.f;   // folded into the copied queries: softmax scale (and decode's s(L))
  float* out = nullptr;  // row r, group head gi: out + r * out_row_stride + (kv_head*group+gi)*D
  int64_t out_row_stride = 0;
  int32_t num_splits = 1;

  int64_t key_end() const { return first_pos + num_rows; }
};

// The softmax state of num_rows x group query vectors: running max, running sum, unnormalized
// output. Laid out [vector][D] with vector = row * group + gi.
struct SoftmaxState {
  std::vector<float> m, l, acc;
  void Reset(int vectors, int d) {
    m.assign(vectors, kNegInf);
    l.assign(vectors, 0.f);
    acc.assign(static_cast<size_t>(vectors) * d, 0.f);
  }
};

// Runs the fused online softmax of a block over keys [key_begin, key_end): each key uses the
// query variant DCA assigns it relative to the row's chunk (intra / succ / inter), which is the
// piece loop of DCA.md with the log-sum-exp merge folded into one softmax.
template <typename KvT>
void AttendKeys(const DcaGeometry& geo, const RowBlock<KvT>& b, int64_t key_begin, int64_t key_end,
                SoftmaxState* st) {
  const int g = geo.group_size();
  const int d = geo.head_dim;
  const int64_t cl = geo.chunk_len;
  const PagedKv<KvT>& kv = *b.kv;
  const int vectors = b.num_rows * g;

  // Private copy of the queries, [row][gi][variant][D], pre-multiplied by the softmax scale so
  // the inner loop is a plain dot product.
  std::vector<float> q(static_cast<size_t>(vectors) * kNumDecodeVariants * d);
  for (int r = 0; r < b.num_rows; ++r) {
    for (int gi = 0; gi < g; ++gi) {
      const int64_t head = static_cast<int64_t>(b.kv_head) * g + gi;
      for (int v = 0; v < kNumDecodeVariants; ++v) {
        const float* src = b.q + r * b.q_row_stride + v * b.q_variant_stride + head * d;
        float* dst = q.data() + ((static_cast<size_t>(r) * g + gi) * kNumDecodeVariants + v) * d;
        for (int i = 0; i < d; ++i) dst[i] = src[i] * b.q_scale;
      }
    }
  }

  std::vector<float> scratch(std::is_same<KvT, float>::value ? 0 : 2 * kTileKeys * d);
  float scores[kTileKeys] = {};  // kTileKeys % 4 == 0: ExpNonPositive may run past n
  const int64_t last = std::min(key_end, b.key_end());
  for (int64_t t0 = key_begin; t0 < last;) {
    const int64_t page_end = (t0 / kv.page_size + 1) * kv.page_size;
    const int64_t t1 = std::min({t0 + kTileKeys, page_end, last});
    const Tile tile = LoadTile(kv, b.kv_head, t0, t1, &scratch);
    // Rows before the tile's first key see none of it (causal); start at the first that does.
    const int r_begin = static_cast<int>(std::max<int64_t>(0, t0 - b.first_pos));
    for (int r = r_begin; r < b.num_rows; ++r) {
      const int64_t pos = b.first_pos + r;
      const int64_t end = std::min(t1, pos + 1);
      const int n = static_cast<int>(end - t0);
      const int64_t prev = (pos / cl) * cl;  // first key of the row's own chunk
      for (int gi = 0; gi < g; ++gi) {
        const int vec = r * g + gi;
        const float* qv = q.data() + static_cast<size_t>(vec) * kNumDecodeVariants * d;
        // Variants only change at prev - cl and prev, so four keys whose first and last share a
        // variant all do.
        int j = 0;
        for (; j + 4 <= n; j += 4) {
          const int v_first = VariantOf(t0 + j, prev, cl);
          if (v_first == VariantOf(t0 + j + 3, prev, cl)) {
            Dot4(qv + v_first * d, tile.k + j * tile.stride, tile.stride, d, scores + j);
          } else {
            for (int u = j; u < j + 4; ++u) {
              scores[u] = Dot(qv + VariantOf(t0 + u, prev, cl) * d, tile.k + u * tile.stride, d);
            }
          }
        }
        for (; j < n; ++j) {
          scores[j] = Dot(qv + VariantOf(t0 + j, prev, cl) * d, tile.k + j * tile.stride, d);
        }
        float tile_max = kNegInf;
        for (j = 0; j < n; ++j) tile_max = std::max(tile_max, scores[j]);
        float* acc = st->acc.data() + static_cast<size_t>(vec) * d;
        const float m_old = st->m[vec];
        const float m_new = std::max(m_old, tile_max);
        if (m_new > m_old && m_old != kNegInf) {
          const float correction = std::exp(m_old - m_new);
          st->l[vec] *= correction;
          ScaleInPlace(correction, acc, d);
        }
        st->m[vec] = m_new;
        for (j = 0; j < n; ++j) scores[j] -= m_new;
        ExpNonPositive(scores, n);  // the lanes past n hold leftovers and are never read
        float sum = 0.f;
        for (j = 0; j < n; ++j) sum += scores[j];
        for (j = 0; j + 4 <= n; j += 4) {
          Axpy4(scores + j, tile.v + j * tile.stride, tile.stride, acc, d);
        }
        for (; j < n; ++j) Axpy(scores[j], tile.v + j * tile.stride, acc, d);
        st->l[vec] += sum;
      }
    }
    t0 = t1;
  }
}

template <typename KvT>
void WriteOutput(const DcaGeometry& geo, const RowBlock<KvT>& b, const SoftmaxState& st) {
  const int g = geo.group_size();
  const int d = geo.head_dim;
  for (int r = 0; r < b.num_rows; ++r) {
    for (int gi = 0; gi < g; ++gi) {
      const int vec = r * g + gi;
      float* out = b.out + r * b.out_row_stride + (static_cast<int64_t>(b.kv_head) * g + gi) * d;
      // Every row sees at least its own key, so l > 0.
      const float inv = 1.f / st.l[vec];
      const float* acc = st.acc.data() + static_cast<size_t>(vec) * d;
      for (int i = 0; i < d; ++i) out[i] = acc[i] * inv;
    }
  }
}

// Splits [0, keys) into n ranges aligned to kTileKeys (so tiles keep their full size).
inline int64_t SplitBound(int64_t keys, int n, int i) {
  const int64_t tiles = (keys + kTileKeys - 1) / kTileKeys;
  return std::min(keys, (tiles * i / n) * kTileKeys);
}

// Plans key splits so that there are at least ~2 items per thread, then runs every
// (block, split) item and merges split partials by log-sum-exp.
template <typename KvT>
void RunBlocks(const DcaGeometry& geo, std::vector<RowBlock<KvT>>* blocks, ThreadPool* pool) {
  const int64_t want_items = 2 * static_cast<int64_t>(pool->num_threads());
  const int64_t n_blocks = static_cast<int64_t>(blocks->size());
  if (n_blocks == 0) return;
  std::vector<int64_t> first_item(n_blocks + 1, 0);
  for (int64_t i = 0; i < n_blocks; ++i) {
    RowBlock<KvT>& b = (*blocks)[i];
    int64_t splits = 1;
    if (n_blocks < want_items) {
      splits = (want_items + n_blocks - 1) / n_blocks;
      splits = std::min<int64_t>(splits, std::max<int64_t>(1, b.key_end() / kMinKeysPerSplit));
    }
    b.num_splits = static_cast<int32_t>(splits);
    first_item[i + 1] = first_item[i] + splits;
  }
  const int64_t n_items = first_item[n_blocks];

  const int g = geo.group_size();
  const int d = geo.head_dim;
  // Partial states of split blocks: per item, [vectors] m, [vectors] l, [vectors][D] acc.
  std::vector<int64_t> partial_offset(n_items + 1, 0);
  for (int64_t i = 0; i < n_blocks; ++i) {
    const RowBlock<KvT>& b = (*blocks)[i];
    const int64_t per_item = b.num_splits > 1 ? static_cast<int64_t>(b.num_rows) * g * (d + 2) : 0;
    for (int64_t s = first_item[i]; s < first_item[i + 1]; ++s) {
      partial_offset[s + 1] = partial_offset[s] + per_item;
    }
  }
  std::vector<float> partials(partial_offset[n_items]);

  pool->ParallelFor(n_items, [&](int64_t item) {
    const int64_t bi =
        std::upper_bound(first_item.begin(), first_item.end(), item) - first_item.begin() - 1;
    const RowBlock<KvT>& b = (*blocks)[bi];
    const int split = static_cast<int>(item - first_item[bi]);
    const int64_t keys = b.key_end();
    SoftmaxState st;
    st.Reset(b.num_rows * g, d);
    if (b.num_splits == 1) {
      AttendKeys(geo, b, 0, keys, &st);
      WriteOutput(geo, b, st);
      return;
    }
    AttendKeys(geo, b, SplitBound(keys, b.num_splits, split),
               SplitBound(keys, b.num_splits, split + 1), &st);
    float* p = partials.data() + partial_offset[item];
    const size_t vectors = st.m.size();
    std::copy(st.m.begin(), st.m.end(), p);
    std::copy(st.l.begin(), st.l.end(), p + vectors);
    std::copy(st.acc.begin(), st.acc.end(), p + 2 * vectors);
  });

  // Merge: out = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s. A split that saw no key of a
  // row has m = -inf and contributes exactly zero.
  std::vector<int64_t> split_blocks;
  for (int64_t i = 0; i < n_blocks; ++i) {
    if ((*blocks)[i].num_splits > 1) split_blocks.push_back(i);
  }
  pool->ParallelFor(static_cast<int64_t>(split_blocks.size()), [&](int64_t k) {
    const int64_t bi = split_blocks[k];
    const RowBlock<KvT>& b = (*blocks)[bi];
    const int vectors = b.num_rows * g;
    SoftmaxState st;
    st.Reset(vectors, d);
    for (int64_t item = first_item[bi]; item < first_item[bi + 1]; ++item) {
      const float* p = partials.data() + partial_offset[item];
      for (int vec = 0; vec < vectors; ++vec) {
        const float m_s = p[vec];
        if (m_s == kNegInf) continue;
        const float* acc_s = p + 2 * vectors + static_cast<size_t>(vec) * d;
        float* acc = st.acc.data() + static_cast<size_t>(vec) * d;
        const float m_old = st.m[vec];
        if (m_s > m_old) {
          const float c = std::exp(m_old - m_s);  // 0 when m_old is -inf
          st.l[vec] = st.l[vec] * c + p[vectors + vec];
          ScaleInPlace(c, acc, d);
          Axpy(1.f, acc_s, acc, d);
          st.m[vec] = m_s;
        } else {
          const float c = std::exp(m_s - m_old);
          st.l[vec] += c * p[vectors + vec];
          Axpy(c, acc_s, acc, d);
        }
      }
    }
    WriteOutput(geo, b, st);
  });
}

}  // namespace

template <typename KvT>
void AppendKvCpu(const PagedKv<KvT>& kv, const CpuAppendParams& params, ThreadPool* pool) {
  // One token's heads are contiguous in its slot ([num_kv_heads, head_dim]); blocks of tokens
  // keep the parallel overhead small for this memory-bound copy.
  const int row = kv.num_kv_heads * kv.head_dim;
  constexpr int64_t kTokensPerItem = 64;
  const int64_t n_items = (params.num_tokens + kTokensPerItem - 1) / kTokensPerItem;
  pool->ParallelFor(n_items, [&](int64_t item) {
    const int64_t t_end = std::min(params.num_tokens, (item + 1) * kTokensPerItem);
    for (int64_t t = item * kTokensPerItem; t < t_end; ++t) {
      const int64_t pos = params.start + t;
      StoreRow(params.k + t * row, params.key_scale, row, kv.Key(pos, 0));
      StoreRow(params.v + t * row, 1.f, row, kv.Value(pos, 0));
    }
  });
}

template <typename KvT>
void DcaPrefillCpu(const DcaGeometry& geometry, const PagedKv<KvT>& kv,
                   const CpuPrefillParams& params, ThreadPool* pool) {
  if (params.num_tokens <= 0) return;
  const int g = geometry.group_size();
  const int64_t hq = geometry.num_q_heads;
  const int64_t d = geometry.head_dim;
  // Rows per block: enough query vectors to reuse each K/V tile many times, but small blocks when
  // that would leave threads idle (key splitting then covers the rest).
  int64_t rows = std::max<int64_t>(1, kTargetVectors / g);
  const int64_t want_items = 2 * static_cast<int64_t>(pool->num_threads());
  while (rows > 1 && geometry.num_kv_heads * ((params.num_tokens + rows - 1) / rows) < want_items) {
    rows /= 2;
  }
  const int64_t n_row_blocks = (params.num_tokens + rows - 1) / rows;
  std::vector<RowBlock<KvT>> blocks;
  blocks.reserve(n_row_blocks * geometry.num_kv_heads);
  // Last rows first: they see the most keys, so scheduling them early balances the threads.
  for (int64_t rb = n_row_blocks - 1; rb >= 0; --rb) {
    const int64_t t0 = rb * rows;
    const int64_t nr = std::min(rows, params.num_tokens - t0);
    for (int32_t h = 0; h < geometry.num_kv_heads; ++h) {
      RowBlock<KvT> b;
      b.kv = &kv;
      b.kv_head = h;
      b.first_pos = params.start + t0;
      b.num_rows = static_cast<int32_t>(nr);
      b.q = params.q + t0 * kNumQueryVariants * hq * d;
      b.q_row_stride = kNumQueryVariants * hq * d;
      b.q_variant_stride = hq * d;
      b.q_scale = params.softmax_scale;
      b.out = params.out + t0 * hq * d;
      b.out_row_stride = hq * d;
      blocks.push_back(b);
    }
  }
  RunBlocks(geometry, &blocks, pool);
}

template <typename KvT>
void DcaDecodeCpu(const DcaGeometry& geometry, absl::Span<const CpuDecodeItem<KvT>> items,
                  ThreadPool* pool) {
  const int64_t hq = geometry.num_q_heads;
  const int64_t d = geometry.head_dim;
  std::vector<RowBlock<KvT>> blocks;
  blocks.reserve(items.size() * geometry.num_kv_heads);
  for (const CpuDecodeItem<KvT>& item : items) {
    for (int32_t h = 0; h < geometry.num_kv_heads; ++h) {
      RowBlock<KvT> b;
      b.kv = &item.kv;
      b.kv_head = h;
      b.first_pos = item.length - 1;
      b.num_rows = 1;
      b.q = item.q;
      b.q_row_stride = 0;
      b.q_variant_stride = hq * d;
      b.q_scale = item.q_scale * geometry.softmax_scale;
      b.out = item.out;
      b.out_row_stride = 0;
      blocks.push_back(b);
    }
  }
  // Longest contexts first, for load balance.
  std::stable_sort(
      blocks.begin(), blocks.end(),
      [](const RowBlock<KvT>& a, const RowBlock<KvT>& b) { return a.first_pos > b.first_pos; });
  RunBlocks(geometry, &blocks, pool);
}

template void AppendKvCpu<float>(const PagedKv<float>&, const CpuAppendParams&, ThreadPool*);
template void AppendKvCpu<uint16_t>(const PagedKv<uint16_t>&, const CpuAppendParams&, ThreadPool*);
template void DcaPrefillCpu<float>(const DcaGeometry&, const PagedKv<float>&,
                                   const CpuPrefillParams&, ThreadPool*);
template void DcaPrefillCpu<uint16_t>(const DcaGeometry&, const PagedKv<uint16_t>&,
                                      const CpuPrefillParams&, ThreadPool*);
template void DcaDecodeCpu<float>(const DcaGeometry&, absl::Span<const CpuDecodeItem<float>>,
                                  ThreadPool*);
template void DcaDecodeCpu<uint16_t>(const DcaGeometry&, absl::Span<const CpuDecodeItem<uint16_t>>,
                                     ThreadPool*);

}  // namespace attnd
