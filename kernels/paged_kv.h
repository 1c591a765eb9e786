// One layer's paged K/V, as the kernels see it. The only place that does page stride arithmetic;
// shared by prefill, decode and (later) block-sparse code on the CPU and the GPU.
#ifndef ATTND_KERNELS_PAGED_KV_H_
#define ATTND_KERNELS_PAGED_KV_H_

#include <cstdint>
#include <type_traits>

#include "kernels/host_device.h"

namespace attnd {

// A position's page-table index and slot for one page size, with a shift and a mask when the page
// size is a power of two (the deployed 16) and a division otherwise. 32-bit positions, as the
// kernels use (positions < 2^31). The one place that splits a position into page and slot.
struct PageIndexer {
  uint32_t size = 1;
  uint32_t shift = 0;
  bool pow2 = true;

  PageIndexer() = default;
  ATTND_HOST_DEVICE explicit PageIndexer(int32_t page_size)
      : size(static_cast<uint32_t>(page_size)), pow2((size & (size - 1)) == 0) {
#if defined(__CUDA_ARCH__)
    shift = static_cast<uint32_t>(__ffs(static_cast<int>(size)) - 1);
#else
    shift = static_cast<uint32_t>(__builtin_ctz(size == 0 ? 1 : size));
#endif
  }
  ATTND_HOST_DEVICE uint32_t Page(uint32_t pos) const { return pow2 ? pos >> shift : pos / size; }
  ATTND_HOST_DEVICE uint32_t Slot(uint32_t pos) const {
    return pow2 ? pos & (size - 1) : pos % size;
  }
};

// Index of a token's row in a pool of [num_pages, page_size, ...] rows: slot `slot` of page `page`
// (a page id from a page table and PageIndexer::Slot of the position). A kernel that has loaded the
// page id ahead, or that holds one row's page, multiplies this by its row stride (num_kv_heads *
// head_dim elements, or num_kv_heads scales).
ATTND_HOST_DEVICE int64_t PagedTokenIndex(int64_t page, int64_t slot, int64_t page_size) {
  return page * page_size + slot;
}

// Layout of one layer in the pool: K and V each [num_pages, page_size, num_kv_heads, head_dim],
// row-major; a sequence's token at position p lives in page page_table[p / page_size], slot
// p % page_size. An fp8 or int8 pool (T = Fp8E4m3 or Int8Kv: base/fp8.h, base/int8_kv.h) also has
// a scale per token and kv head in k_scale / v_scale, [num_pages, page_size, num_kv_heads] fp32:
// the row of Key(p, h) reads back as its codes' values times KeyScale(p, h). Trivially copyable:
// pass it by value to kernels.
template <typename T>
struct PagedKv {
  T* k = nullptr;                       // [num_pages, page_size, num_kv_heads, head_dim]
  T* v = nullptr;                       // [num_pages, page_size, num_kv_heads, head_dim]
  const int32_t* page_table = nullptr;  // [ceil(capacity / page_size)] page ids of this sequence
  int32_t page_size = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  float* k_scale = nullptr;  // [num_pages, page_size, num_kv_heads]; fp8 and int8, else null
  float* v_scale = nullptr;  // [num_pages, page_size, num_kv_heads]; fp8 and int8, else null

  ATTND_HOST_DEVICE int64_t Offset(int64_t pos, int32_t kv_head) const {
    const int64_t page = page_table[pos / page_size];
    return ((page * page_size + pos % page_size) * num_kv_heads + kv_head) * head_dim;
  }
  // Offset with 32-bit index math (positions < 2^31, as in the kernels) and a 64-bit final product
  // (pools can exceed 2^31 elements): the kernels' form of Offset.
  ATTND_HOST_DEVICE int64_t Offset32(int32_t pos, int32_t kv_head) const {
    const uint32_t ps = static_cast<uint32_t>(page_size);
    const uint32_t upos = static_cast<uint32_t>(pos);
    const int64_t page = page_table[upos / ps];
    return ((page * page_size + static_cast<int64_t>(upos % ps)) * num_kv_heads + kv_head) *
           head_dim;
  }
  // Pointer to head_dim elements: the key of token `pos`, kv head `kv_head`.
  ATTND_HOST_DEVICE T* Key(int64_t pos, int32_t kv_head) const { return k + Offset(pos, kv_head); }
  ATTND_HOST_DEVICE T* Value(int64_t pos, int32_t kv_head) const {
    return v + Offset(pos, kv_head);
  }
  // Index of token `pos`, kv head `kv_head` in the scale regions (Offset / head_dim).
  ATTND_HOST_DEVICE int64_t ScaleOffset(int64_t pos, int32_t kv_head) const {
    const int64_t page = page_table[pos / page_size];
    return (page * page_size + pos % page_size) * num_kv_heads + kv_head;
  }
  // The scale of that token's key (value) row; fp8 and int8 pools only.
  ATTND_HOST_DEVICE float* KeyScale(int64_t pos, int32_t kv_head) const {
    return k_scale + ScaleOffset(pos, kv_head);
  }
  ATTND_HOST_DEVICE float* ValueScale(int64_t pos, int32_t kv_head) const {
    return v_scale + ScaleOffset(pos, kv_head);
  }
};

static_assert(std::is_trivially_copyable<PagedKv<float>>::value,
              "PagedKv must be trivially copyable");

}  // namespace attnd

#endif  // ATTND_KERNELS_PAGED_KV_H_
