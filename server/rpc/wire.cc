#include "server/rpc/wire.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "absl/time/clock.h"
#include "attnd/v1/attention.pb.h"

namespace attnd {
namespace wire {
namespace {

constexpr size_t kGranule = size_t{64} << 10;
constexpr size_t kSlack = size_t{2} << 20;

enum WireType : uint32_t { kVarint = 0, kLen = 2 };

// Reads protobuf's wire format across the slices of one message.
class Reader {
 public:
  explicit Reader(const std::vector<grpc::Slice>& slices) : slices_(slices) {
    for (const grpc::Slice& s : slices) size_ += s.size();
    Settle();
  }

  size_t pos() const { return pos_; }
  size_t size() const { return size_; }

  bool Byte(uint8_t* b) {
    if (pos_ >= size_) return false;
    *b = slices_[i_].begin()[off_];
    Advance(1);
    return true;
  }

  // protobuf's varint: at most 10 bytes; a 10th byte above 1 would overflow 64 bits (not simple).
  // Tags and lengths protobuf reads as 32-bit: at most 5 bytes there (`max_bytes`).
  bool Varint(uint64_t* v, int max_bytes = 10) {
    uint64_t result = 0;
    for (int i = 0; i < max_bytes; ++i) {
      uint8_t b;
      if (!Byte(&b)) return false;
      if (i == 9 && b > 1) return false;
      result |= static_cast<uint64_t>(b & 0x7f) << (7 * i);
      if ((b & 0x80) == 0) {
        *v = result;
        return true;
      }
    }
    return false;
  }

  // The next n bytes in place when they lie in one slice.
  bool View(size_t n, absl::string_view* out) {
    if (n > size_ - pos_) return false;
    if (n == 0) {
      *out = absl::string_view();
      return true;
    }
    if (slices_[i_].size() - off_ < n) return false;
    *out = absl::string_view(reinterpret_cast<const char*>(slices_[i_].begin()) + off_, n);
    Advance(n);
    return true;
  }

  bool Copy(size_t n, char* dst) {
    if (n > size_ - pos_) return false;
    while (n > 0) {
      const size_t take = std::min(n, slices_[i_].size() - off_);
      std::memcpy(dst, slices_[i_].begin() + off_, take);
      dst += take;
      n -= take;
      Advance(take);
    }
    return true;
  }

 private:
  void Advance(size_t n) {
    pos_ += n;
    off_ += n;
    Settle();
  }
  // Moves past exhausted (and empty) slices.
  void Settle() {
    while (i_ < slices_.size() && off_ >= slices_[i_].size()) {
      off_ -= slices_[i_].size();
      ++i_;
    }
  }

  const std::vector<grpc::Slice>& slices_;
  size_t size_ = 0;
  size_t pos_ = 0;
  size_t i_ = 0;
  size_t off_ = 0;
};

// A length-delimited field's length, which must fit before `end` (the enclosing message's end).
bool ReadLength(Reader* r, size_t end, size_t* n) {
  uint64_t v;
  // The tag or the length itself may have run past `end` (a tag cut by a short sub-message).
  // protobuf refuses lengths of more than 5 bytes or past 2^31 - 17 (its ReadSize).
  if (!r->Varint(&v, 5) || v > 0x7fffffffu - 16 || r->pos() > end || v > end - r->pos()) {
    return false;
  }
  *n = static_cast<size_t>(v);
  return true;
}

bool ParseTensor(Reader* r, size_t n, BufferPool* pool, WireTensor* t) {
  using T = v1::Tensor;
  const size_t end = r->pos() + n;
  uint32_t seen = 0;
  while (r->pos() < end) {
    uint64_t tag;
    if (!r->Varint(&tag, 5) || tag > 0xffffffffu) return false;
    const uint32_t field = static_cast<uint32_t>(tag >> 3);
    const uint32_t type = static_cast<uint32_t>(tag & 7);
    if (field == 0 || field >= 32 || (seen & (1u << field)) != 0) return false;
    seen |= 1u << field;
    if (field == T::kDtypeFieldNumber && type == kVarint) {
      uint64_t v;
      if (!r->Varint(&v)) return false;
      t->dtype = static_cast<int32_t>(v);
    } else if (field == T::kShapeFieldNumber && type == kLen) {
      size_t m;
      if (!ReadLength(r, end, &m)) return false;
      const size_t shape_end = r->pos() + m;
      while (r->pos() < shape_end) {
        uint64_t v;
        if (!r->Varint(&v)) return false;
        t->shape.push_back(static_cast<int64_t>(v));
      }
      if (r->pos() != shape_end) return false;
    } else if (field == T::kDataFieldNumber && type == kLen) {
      size_t m;
      if (!ReadLength(r, end, &m)) return false;
      if (!r->View(m, &t->bytes)) {
        t->owned = pool->Get(m);
        if (!r->Copy(m, t->owned.data())) return false;
        t->bytes = absl::string_view(t->owned.data(), m);
      }
    } else {
      return false;  // an unknown field or another wire type: protobuf's job
    }
  }
  return r->pos() == end;
}

void PutVarint(uint64_t v, std::string* out) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}

size_t VarintSize(uint64_t v) {
  size_t n = 1;
  while (v >= 0x80) {
    v >>= 7;
    ++n;
  }
  return n;
}

void PutTag(uint32_t field, uint32_t type, std::string* out) { PutVarint(field << 3 | type, out); }

struct SliceOwner {
  std::shared_ptr<BufferPool> pool;
  char* data;
  size_t capacity;
};

}  // namespace

void DestroyPooledSlice(void* p) {
  SliceOwner* owner = static_cast<SliceOwner*>(p);
  PooledBuffer buffer = owner->pool->Adopt(owner->data, owner->capacity);
  delete owner;
  // `buffer` goes back to the pool here.
}

// ---- BufferPool ----

PooledBuffer& PooledBuffer::operator=(PooledBuffer&& other) noexcept {
  if (this != &other) {
    Reset();
    pool_ = std::exchange(other.pool_, nullptr);
    data_ = std::exchange(other.data_, nullptr);
    capacity_ = std::exchange(other.capacity_, 0);
  }
  return *this;
}

void PooledBuffer::Reset() {
  if (data_ != nullptr) pool_->GiveBack(data_, capacity_);
  pool_ = nullptr;
  data_ = nullptr;
  capacity_ = 0;
}

grpc::Slice PooledBuffer::ToSlice(size_t length) {
  auto* owner = new SliceOwner{pool_->shared_from_this(), data_, capacity_};
  void* data = data_;
  pool_ = nullptr;
  data_ = nullptr;
  capacity_ = 0;
  return grpc::Slice(data, length, &DestroyPooledSlice, owner);
}

BufferPool::BufferPool(int64_t max_idle_bytes) : max_idle_bytes_(max_idle_bytes) {}

BufferPool::~BufferPool() {
  MutexLock lock(&mu_);
  for (auto& [capacity, idle] : idle_) std::free(idle.data);
}

PooledBuffer BufferPool::Get(size_t bytes) {
  PooledBuffer b;
  b.pool_ = this;
  {
    MutexLock lock(&mu_);
    auto it = idle_.lower_bound(bytes);
    if (it != idle_.end() && it->first <= 2 * bytes + kSlack) {
      b.data_ = it->second.data;
      b.capacity_ = it->first;
      idle_bytes_ -= static_cast<int64_t>(it->first);
      idle_.erase(it);
      return b;
    }
    ++allocations_;
  }
  b.capacity_ = std::max<size_t>(kGranule, (bytes + kGranule - 1) / kGranule * kGranule);
  b.data_ = static_cast<char*>(std::malloc(b.capacity_));
  if (b.data_ == nullptr) std::abort();  // as operator new would (no exceptions in attnd)
  return b;
}

PooledBuffer BufferPool::Adopt(char* data, size_t capacity) {
  PooledBuffer b;
  b.pool_ = this;
  b.data_ = data;
  b.capacity_ = capacity;
  return b;
}

void BufferPool::GiveBack(char* data, size_t capacity) {
  {
    MutexLock lock(&mu_);
    if (idle_bytes_ + static_cast<int64_t>(capacity) <= max_idle_bytes_) {
      idle_.emplace(capacity, Idle{data, absl::Now()});
      idle_bytes_ += static_cast<int64_t>(capacity);
      return;
    }
  }
  std::free(data);
}

void BufferPool::TrimIdle(absl::Duration age) {
  std::vector<char*> freed;
  {
    const absl::Time before = absl::Now() - age;
    MutexLock lock(&mu_);
    for (auto it = idle_.begin(); it != idle_.end();) {
      if (it->second.since < before) {
        freed.push_back(it->second.data);
        idle_bytes_ -= static_cast<int64_t>(it->first);
        it = idle_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (char* p : freed) std::free(p);
}

int64_t BufferPool::idle_bytes() const {
  MutexLock lock(&mu_);
  return idle_bytes_;
}

int64_t BufferPool::allocations() const {
  MutexLock lock(&mu_);
  return allocations_;
}

// ---- PrefillRequest ----

bool ParsePrefillRequest(const grpc::ByteBuffer& request, BufferPool* pool,
                         WirePrefillRequest* out) {
  using P = v1::PrefillRequest;
  if (!request.Dump(&out->slices).ok()) return false;
  Reader r(out->slices);
  const size_t end = r.size();
  uint32_t seen = 0;
  while (r.pos() < end) {
    uint64_t tag;
    if (!r.Varint(&tag, 5) || tag > 0xffffffffu) return false;
    const uint32_t field = static_cast<uint32_t>(tag >> 3);
    const uint32_t type = static_cast<uint32_t>(tag & 7);
    if (field == 0 || field >= 32 || (seen & (1u << field)) != 0) return false;
    seen |= 1u << field;
    uint64_t v = 0;
    size_t n = 0;
    if (type == kVarint) {
      if (!r.Varint(&v)) return false;
    } else if (type == kLen) {
      if (!ReadLength(&r, end, &n)) return false;
    } else {
      return false;
    }
    if (field == P::kSequenceIdFieldNumber && type == kLen) {
      out->sequence_id.resize(n);
      if (!r.Copy(n, out->sequence_id.data())) return false;
      // proto3 strings must be UTF-8; ids are hex, so anything but ASCII goes to protobuf.
      for (char c : out->sequence_id) {
        if (static_cast<unsigned char>(c) >= 0x80) return false;
      }
    } else if (field == P::kLayerFieldNumber && type == kVarint) {
      out->layer = static_cast<int32_t>(v);
    } else if ((field == P::kQFieldNumber || field == P::kKFieldNumber ||
                field == P::kVFieldNumber) &&
               type == kLen) {
      WireTensor* t = field == P::kQFieldNumber   ? &out->q
                      : field == P::kKFieldNumber ? &out->k
                                                  : &out->v;
      if (!ParseTensor(&r, n, pool, t)) return false;
    } else if (field == P::kPromptLenFieldNumber && type == kVarint) {
      out->prompt_len = static_cast<int64_t>(v);
    } else if (field == P::kQLayoutFieldNumber && type == kVarint) {
      out->q_layout = static_cast<int32_t>(v);
    } else {
      return false;
    }
  }
  return r.pos() == end;
}

// ---- PrefillResponse ----

void* PrefillReplyWriter::Output(int64_t bytes) {
  out_bytes_ = static_cast<size_t>(bytes);
  out_ = pool_->Get(out_bytes_);
  return out_.data();
}

grpc::ByteBuffer PrefillReplyWriter::Finish(DType dtype, const std::vector<int64_t>& shape,
                                            int64_t length) {
  using R = v1::PrefillResponse;
  using T = v1::Tensor;
  // Tensor {dtype, shape (packed), data}, fields in number order as protobuf writes them; zero
  // scalars and empty fields are left out (proto3).
  std::string tensor_head;
  const uint64_t dtype_value = static_cast<uint64_t>(static_cast<int64_t>(static_cast<int>(dtype)));
  if (dtype_value != 0) {
    PutTag(T::kDtypeFieldNumber, kVarint, &tensor_head);
    PutVarint(dtype_value, &tensor_head);
  }
  if (!shape.empty()) {
    size_t packed = 0;
    for (int64_t d : shape) packed += VarintSize(static_cast<uint64_t>(d));
    PutTag(T::kShapeFieldNumber, kLen, &tensor_head);
    PutVarint(packed, &tensor_head);
    for (int64_t d : shape) PutVarint(static_cast<uint64_t>(d), &tensor_head);
  }
  if (out_bytes_ > 0) {
    PutTag(T::kDataFieldNumber, kLen, &tensor_head);
    PutVarint(out_bytes_, &tensor_head);
  }
  std::string head;
  PutTag(R::kOFieldNumber, kLen, &head);
  PutVarint(tensor_head.size() + out_bytes_, &head);
  head += tensor_head;
  std::vector<grpc::Slice> slices;
  slices.emplace_back(head);
  if (out_bytes_ > 0) slices.push_back(out_.ToSlice(out_bytes_));
  if (length != 0) {
    std::string tail;
    PutTag(R::kLengthFieldNumber, kVarint, &tail);
    PutVarint(static_cast<uint64_t>(length), &tail);
    slices.emplace_back(tail);
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

}  // namespace wire
}  // namespace attnd
