// Dense DCA on the CPU. Grid mapping: one work item = (kv head, block of consecutive query rows,
// key split). An item holds the queries of every q head of its GQA group, so each key/value row of
// that kv head is read once per group and then reused from L1 by all group heads and rows. Keys
// are walked a tile at a time (at most kTileKeys, never crossing a page), so page lookups happen
// once per tile, not per element. When there are too few items to keep the pool busy (decode,
// short prefill chunks over long contexts) the key range is split and the partial softmax states
// are merged by log-sum-exp in a second pass. Inside a tile, group heads go two at a time against
// four keys at a time (register blocking), on 4-lane SSE2 or, where the CPU has it, 8-lane
// AVX2+FMA (see "SIMD" below).

#include "kernels/dca_cpu.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "base/dtype.h"
#include "base/fp8.h"
#include "base/int8_kv.h"
#include "kernels/kv_rows_cpu.h"
#include "kernels/simd_math.h"

namespace attnd {
namespace {

constexpr int kTileKeys = 32;       // keys per tile: a K+V tile of D=128 fp32 is 32 KiB (L1-sized).
constexpr int kTargetVectors = 64;  // query vectors (rows x group heads) per prefill block.
constexpr int64_t kMinKeysPerSplit = 512;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// SIMD. Binaries are built for baseline x86-64 (no -march), where SSE2 is guaranteed; AVX2+FMA
// is chosen at run time when the CPU has it. The math is written once over GCC vector extensions
// (kernels/simd_math.h, shared with the sparse kernels) and instantiated per width. The helpers
// are always_inline so that, inlined into the target("avx2,fma") entry points below, they are
// compiled for AVX2; nothing shared with other translation units is ever compiled with AVX2.
// The vector paths here need head_dim % (2 * lanes) == 0; the dispatcher only picks a width that
// divides it.
// -Wpsabi warns that passing 32-byte vectors by value has a different ABI with and without AVX;
// these helpers are always inlined, so no such call exists. (Not popped: GCC reports it where
// the templates are instantiated, at the end of the file.)
#pragma GCC diagnostic ignored "-Wpsabi"
#define ATTND_INLINE __attribute__((always_inline)) inline

using Sse2 = simd_math::V4;
using Avx2 = simd_math::V8;
using simd_math::Axpy;
using simd_math::Axpy4;
using simd_math::Dot;
using simd_math::Dot4;
using simd_math::ExpNonPositive;
using simd_math::Load;
using simd_math::Store;
using simd_math::Sum4;

// Two query vectors of a GQA group against the same four keys: each key load feeds two FMAs and
// each q load four, with eight independent accumulators. out0[j] = q0 . k_j, out1[j] = q1 . k_j.
template <typename S>
ATTND_INLINE void Dot4x2(const float* q0, const float* q1, const float* k, int64_t stride, int n,
                         float* out0, float* out1) {
  constexpr int L = S::kLanes;
  if (n % (2 * L) != 0) {
    Dot4<S>(q0, k, stride, n, out0);
    Dot4<S>(q1, k, stride, n, out1);
    return;
  }
  const float* k0 = k;
  const float* k1 = k + stride;
  const float* k2 = k + 2 * stride;
  const float* k3 = k + 3 * stride;
  typename S::F a0 = {}, a1 = {}, a2 = {}, a3 = {}, b0 = {}, b1 = {}, b2 = {}, b3 = {};
  for (int d = 0; d < n; d += L) {
    const typename S::F x = Load<S>(q0 + d), y = Load<S>(q1 + d);
    const typename S::F c0 = Load<S>(k0 + d), c1 = Load<S>(k1 + d);
    a0 += x * c0;
    b0 += y * c0;
    a1 += x * c1;
    b1 += y * c1;
    const typename S::F c2 = Load<S>(k2 + d), c3 = Load<S>(k3 + d);
    a2 += x * c2;
    b2 += y * c2;
    a3 += x * c3;
    b3 += y * c3;
  }
  Sum4<S>(a0, a1, a2, a3, out0);
  Sum4<S>(b0, b1, b2, b3, out1);
}

// y0 += sum_j p0[j] x_j and y1 += sum_j p1[j] x_j over four value rows x_j = x + j * stride:
// each value load feeds both accumulators.
template <typename S>
ATTND_INLINE void Axpy4x2(const float* p0, const float* p1, const float* x, int64_t stride,
                          float* y0, float* y1, int n) {
  constexpr int L = S::kLanes;
  if (n % L != 0) {
    Axpy4<S>(p0, x, stride, y0, n);
    Axpy4<S>(p1, x, stride, y1, n);
    return;
  }
  const float* x0 = x;
  const float* x1 = x + stride;
  const float* x2 = x + 2 * stride;
  const float* x3 = x + 3 * stride;
  for (int d = 0; d < n; d += L) {
    const typename S::F v0 = Load<S>(x0 + d), v1 = Load<S>(x1 + d);
    const typename S::F v2 = Load<S>(x2 + d), v3 = Load<S>(x3 + d);
    Store<S>(y0 + d, Load<S>(y0 + d) + ((p0[0] * v0 + p0[1] * v1) + (p0[2] * v2 + p0[3] * v3)));
    Store<S>(y1 + d, Load<S>(y1 + d) + ((p1[0] * v0 + p1[1] * v1) + (p1[2] * v2 + p1[3] * v3)));
  }
}

// y *= alpha
template <typename S>
ATTND_INLINE void ScaleInPlace(float alpha, float* y, int n) {
  if (n % S::kLanes != 0) {
    for (int d = 0; d < n; ++d) y[d] *= alpha;
    return;
  }
  for (int d = 0; d < n; d += S::kLanes) Store<S>(y + d, Load<S>(y + d) * alpha);
}

// The query variant of a key for a row whose chunk starts at prev (DCA.md: intra, succ, inter).
inline int VariantOf(int64_t key, int64_t prev, int64_t cl) {
  return key >= prev ? kIntra : (key >= prev - cl ? kSucc : kInter);
}

// fp32 rows of one tile of keys/values of one kv head. fp32 KV is read in place (row stride
// num_kv_heads * head_dim inside the page); bf16, fp8 and int8 KV are converted once per tile into
// scratch (kernels/kv_rows_cpu.h: fp8 and int8 dequantised with each row's scale), which every
// query vector of the item then reuses.
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

template <typename KvT>
Tile LoadTile(const PagedKv<KvT>& kv, int32_t kv_head, int64_t begin, int64_t end,
              std::vector<float>* scratch) {
  const int d = kv.head_dim;
  float* k = scratch->data();
  float* v = k + kTileKeys * d;
  for (int64_t j = 0; j < end - begin; ++j) {
    kv_rows::LoadKey(kv, begin + j, kv_head, k + j * d);
    kv_rows::LoadValue(kv, begin + j, kv_head, v + j * d);
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

// One tile of one query vector's online softmax: folds the tile's scores[0, n) into the running
// max *m and sum *l, rescales acc when the max grows, and turns scores into the unnormalized
// weights exp(score - max) that the caller accumulates into acc.
template <typename S>
ATTND_INLINE void OnlineSoftmaxStep(float* scores, int n, float* m, float* l, float* acc, int d) {
  float tile_max = kNegInf;
  for (int j = 0; j < n; ++j) tile_max = std::max(tile_max, scores[j]);
  const float m_old = *m;
  const float m_new = std::max(m_old, tile_max);
  if (m_new > m_old && m_old != kNegInf) {
    const float correction = std::exp(m_old - m_new);
    *l *= correction;
    ScaleInPlace<S>(correction, acc, d);
  }
  *m = m_new;
  for (int j = 0; j < n; ++j) scores[j] -= m_new;
  ExpNonPositive<S>(scores, n);  // the lanes past n hold leftovers and are never read
  float sum = 0.f;
  for (int j = 0; j < n; ++j) sum += scores[j];
  *l += sum;
}

// Runs the fused online softmax of a block over keys [key_begin, key_end): each key uses the
// query variant DCA assigns it relative to the row's chunk (intra / succ / inter), which is the
// piece loop of DCA.md with the log-sum-exp merge folded into one softmax.
template <typename S, typename KvT>
ATTND_INLINE void AttendKeys(const DcaGeometry& geo, const RowBlock<KvT>& b, int64_t key_begin,
                             int64_t key_end, SoftmaxState* st) {
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
  // ExpNonPositive may run past n, up to a lane multiple: keep the spare lanes initialized.
  float scores[kTileKeys] = {};
  float scores2[kTileKeys] = {};
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
      const auto variant = [&](int j) { return VariantOf(t0 + j, prev, cl); };
      const auto key = [&](int j) { return tile.k + j * tile.stride; };
      const auto value = [&](int j) { return tile.v + j * tile.stride; };
      int gi = 0;
      // Pairs of group heads: same row, so the same keys and variants.
      for (; gi + 2 <= g; gi += 2) {
        const int vec = r * g + gi;
        const float* q0 = q.data() + static_cast<size_t>(vec) * kNumDecodeVariants * d;
        const float* q1 = q0 + kNumDecodeVariants * d;
        // Variants only change at prev - cl and prev, so four keys whose first and last share a
        // variant all do.
        int j = 0;
        for (; j + 4 <= n; j += 4) {
          const int vf = variant(j);
          if (vf == variant(j + 3)) {
            Dot4x2<S>(q0 + vf * d, q1 + vf * d, key(j), tile.stride, d, scores + j, scores2 + j);
            continue;
          }
          for (int u = j; u < j + 4; ++u) {
            scores[u] = Dot<S>(q0 + variant(u) * d, key(u), d);
            scores2[u] = Dot<S>(q1 + variant(u) * d, key(u), d);
          }
        }
        for (; j < n; ++j) {
          scores[j] = Dot<S>(q0 + variant(j) * d, key(j), d);
          scores2[j] = Dot<S>(q1 + variant(j) * d, key(j), d);
        }
        float* acc0 = st->acc.data() + static_cast<size_t>(vec) * d;
        float* acc1 = acc0 + d;
        OnlineSoftmaxStep<S>(scores, n, &st->m[vec], &st->l[vec], acc0, d);
        OnlineSoftmaxStep<S>(scores2, n, &st->m[vec + 1], &st->l[vec + 1], acc1, d);
        for (j = 0; j + 4 <= n; j += 4) {
          Axpy4x2<S>(scores + j, scores2 + j, value(j), tile.stride, acc0, acc1, d);
        }
        for (; j < n; ++j) {
          Axpy<S>(scores[j], value(j), acc0, d);
          Axpy<S>(scores2[j], value(j), acc1, d);
        }
      }
      // The odd head out (and every head when the group is 1).
      for (; gi < g; ++gi) {
        const int vec = r * g + gi;
        const float* qv = q.data() + static_cast<size_t>(vec) * kNumDecodeVariants * d;
        int j = 0;
        for (; j + 4 <= n; j += 4) {
          const int vf = variant(j);
          if (vf == variant(j + 3)) {
            Dot4<S>(qv + vf * d, key(j), tile.stride, d, scores + j);
            continue;
          }
          for (int u = j; u < j + 4; ++u) scores[u] = Dot<S>(qv + variant(u) * d, key(u), d);
        }
        for (; j < n; ++j) scores[j] = Dot<S>(qv + variant(j) * d, key(j), d);
        float* acc = st->acc.data() + static_cast<size_t>(vec) * d;
        OnlineSoftmaxStep<S>(scores, n, &st->m[vec], &st->l[vec], acc, d);
        for (j = 0; j + 4 <= n; j += 4) Axpy4<S>(scores + j, value(j), tile.stride, acc, d);
        for (; j < n; ++j) Axpy<S>(scores[j], value(j), acc, d);
      }
    }
    t0 = t1;
  }
}

// The entry points that fix the width. Only these carry a target attribute; everything they
// inline is compiled for it.
template <typename KvT>
void AttendKeysSse2(const DcaGeometry& geo, const RowBlock<KvT>& b, int64_t key_begin,
                    int64_t key_end, SoftmaxState* st) {
  AttendKeys<Sse2>(geo, b, key_begin, key_end, st);
}
__attribute__((target("avx2,fma"))) void AttendKeysAvx2(const DcaGeometry& geo,
                                                        const RowBlock<float>& b, int64_t key_begin,
                                                        int64_t key_end, SoftmaxState* st) {
  AttendKeys<Avx2>(geo, b, key_begin, key_end, st);
}
__attribute__((target("avx2,fma"))) void AttendKeysAvx2(const DcaGeometry& geo,
                                                        const RowBlock<uint16_t>& b,
                                                        int64_t key_begin, int64_t key_end,
                                                        SoftmaxState* st) {
  AttendKeys<Avx2>(geo, b, key_begin, key_end, st);
}
__attribute__((target("avx2,fma"))) void AttendKeysAvx2(const DcaGeometry& geo,
                                                        const RowBlock<Fp8E4m3>& b,
                                                        int64_t key_begin, int64_t key_end,
                                                        SoftmaxState* st) {
  AttendKeys<Avx2>(geo, b, key_begin, key_end, st);
}
__attribute__((target("avx2,fma"))) void AttendKeysAvx2(const DcaGeometry& geo,
                                                        const RowBlock<Int8Kv>& b,
                                                        int64_t key_begin, int64_t key_end,
                                                        SoftmaxState* st) {
  AttendKeys<Avx2>(geo, b, key_begin, key_end, st);
}

static_assert(kTileKeys % Avx2::kLanes == 0, "ExpNonPositive runs on whole vectors of scores");

std::atomic<int> g_simd{static_cast<int>(CpuSimd::kAuto)};

bool CpuHasAvx2Fma() {
  // libgcc's check includes the OS saving YMM state (XGETBV), not just the CPUID bits.
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }();
  return has;
}

bool UseAvx2(int head_dim) {
  const CpuSimd simd = static_cast<CpuSimd>(g_simd.load(std::memory_order_relaxed));
  return simd != CpuSimd::kSse2 && CpuHasAvx2Fma() && head_dim % (2 * Avx2::kLanes) == 0;
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
  const bool avx2 = UseAvx2(d);

  pool->ParallelFor(n_items, [&](int64_t item) {
    const int64_t bi =
        std::upper_bound(first_item.begin(), first_item.end(), item) - first_item.begin() - 1;
    const RowBlock<KvT>& b = (*blocks)[bi];
    const int split = static_cast<int>(item - first_item[bi]);
    const int64_t keys = b.key_end();
    SoftmaxState st;
    st.Reset(b.num_rows * g, d);
    const int64_t key_begin = b.num_splits == 1 ? 0 : SplitBound(keys, b.num_splits, split);
    const int64_t key_end = b.num_splits == 1 ? keys : SplitBound(keys, b.num_splits, split + 1);
    if (avx2) {
      AttendKeysAvx2(geo, b, key_begin, key_end, &st);
    } else {
      AttendKeysSse2(geo, b, key_begin, key_end, &st);
    }
    if (b.num_splits == 1) {
      WriteOutput(geo, b, st);
      return;
    }
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
          ScaleInPlace<Sse2>(c, acc, d);
          Axpy<Sse2>(1.f, acc_s, acc, d);
          st.m[vec] = m_s;
        } else {
          const float c = std::exp(m_s - m_old);
          st.l[vec] += c * p[vectors + vec];
          Axpy<Sse2>(c, acc_s, acc, d);
        }
      }
    }
    WriteOutput(geo, b, st);
  });
}

}  // namespace

bool SetCpuSimd(CpuSimd simd) {
  if (simd == CpuSimd::kAvx2 && !CpuHasAvx2Fma()) return false;
  g_simd.store(static_cast<int>(simd), std::memory_order_relaxed);
  return true;
}

const char* CpuSimdName(int head_dim) { return UseAvx2(head_dim) ? "avx2" : "sse2"; }

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
      kv_rows::StoreToken(kv, params.start + t, params.k + t * row, params.v + t * row,
                          params.key_scale);
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
template void AppendKvCpu<Fp8E4m3>(const PagedKv<Fp8E4m3>&, const CpuAppendParams&, ThreadPool*);
template void DcaPrefillCpu<Fp8E4m3>(const DcaGeometry&, const PagedKv<Fp8E4m3>&,
                                     const CpuPrefillParams&, ThreadPool*);
template void DcaDecodeCpu<Fp8E4m3>(const DcaGeometry&, absl::Span<const CpuDecodeItem<Fp8E4m3>>,
                                    ThreadPool*);
template void AppendKvCpu<Int8Kv>(const PagedKv<Int8Kv>&, const CpuAppendParams&, ThreadPool*);
template void DcaPrefillCpu<Int8Kv>(const DcaGeometry&, const PagedKv<Int8Kv>&,
                                    const CpuPrefillParams&, ThreadPool*);
template void DcaDecodeCpu<Int8Kv>(const DcaGeometry&, absl::Span<const CpuDecodeItem<Int8Kv>>,
                                   ThreadPool*);

}  // namespace attnd
