#include "client/prefill_wire.h"

#include <cstdlib>
#include <cstring>
#include <vector>

namespace attnd {
namespace client {
namespace {

constexpr size_t kSlack = size_t{2} << 20;

size_t VarintSize(uint64_t v) {
  size_t n = 1;
  while (v >= 0x80) {
    v >>= 7;
    ++n;
  }
  return n;
}

char* PutVarint(uint64_t v, char* p) {
  while (v >= 0x80) {
    *p++ = static_cast<char>((v & 0x7f) | 0x80);
    v >>= 7;
  }
  *p++ = static_cast<char>(v);
  return p;
}

// Signed int32/int64/enum values go on the wire as their 64-bit two's complement.
uint64_t Signed(int64_t v) { return static_cast<uint64_t>(v); }

char* PutTag(uint32_t field, uint32_t type, char* p) { return PutVarint(field << 3 | type, p); }

struct TensorSizes {
  uint64_t dtype = 0;
  size_t packed = 0;  // the shape's varints
  size_t body = 0;    // the Tensor message
};

TensorSizes SizeTensor(const HostTensor& t) {
  using T = v1::Tensor;
  TensorSizes s;
  s.dtype = Signed(static_cast<int64_t>(ToProtoDType(t.dtype)));
  if (s.dtype != 0) s.body += VarintSize(T::kDtypeFieldNumber << 3) + VarintSize(s.dtype);
  for (int64_t d : t.shape) s.packed += VarintSize(Signed(d));
  if (!t.shape.empty()) {
    s.body += VarintSize(T::kShapeFieldNumber << 3 | 2) + VarintSize(s.packed) + s.packed;
  }
  if (!t.data.empty()) {
    s.body += VarintSize(T::kDataFieldNumber << 3 | 2) + VarintSize(t.data.size()) + t.data.size();
  }
  return s;
}

size_t FieldSize(uint32_t field, size_t body) {
  return VarintSize(field << 3 | 2) + VarintSize(body) + body;
}

char* PutTensor(uint32_t field, const HostTensor& t, const TensorSizes& s, char* p) {
  using T = v1::Tensor;
  p = PutTag(field, 2, p);
  p = PutVarint(s.body, p);
  if (s.dtype != 0) {
    p = PutTag(T::kDtypeFieldNumber, 0, p);
    p = PutVarint(s.dtype, p);
  }
  if (!t.shape.empty()) {
    p = PutTag(T::kShapeFieldNumber, 2, p);
    p = PutVarint(s.packed, p);
    for (int64_t d : t.shape) p = PutVarint(Signed(d), p);
  }
  if (!t.data.empty()) {
    p = PutTag(T::kDataFieldNumber, 2, p);
    p = PutVarint(t.data.size(), p);
    std::memcpy(p, t.data.data(), t.data.size());
    p += t.data.size();
  }
  return p;
}

struct Owner {
  std::shared_ptr<SendBuffers> buffers;
  char* data;
  size_t capacity;
};

}  // namespace

void GiveBackSendBuffer(void* p) {
  Owner* owner = static_cast<Owner*>(p);
  owner->buffers->Put(owner->data, owner->capacity);
  delete owner;
}

SendBuffers::~SendBuffers() { std::free(idle_); }

grpc::Slice SendBuffers::Get(size_t bytes, char** data) {
  char* block = nullptr;
  size_t capacity = 0;
  {
    MutexLock lock(&mu_);
    if (idle_ != nullptr && idle_capacity_ >= bytes && idle_capacity_ <= 2 * bytes + kSlack) {
      block = idle_;
      capacity = idle_capacity_;
      idle_ = nullptr;
      idle_capacity_ = 0;
    } else {
      ++allocations_;
    }
  }
  if (block == nullptr) {
    capacity = bytes == 0 ? 1 : bytes;
    block = static_cast<char*>(std::malloc(capacity));
    if (block == nullptr) std::abort();
  }
  *data = block;
  return grpc::Slice(block, bytes, &GiveBackSendBuffer,
                     new Owner{shared_from_this(), block, capacity});
}

void SendBuffers::Put(char* data, size_t capacity) {
  {
    MutexLock lock(&mu_);
    if (capacity > idle_capacity_) {
      std::swap(data, idle_);
      idle_capacity_ = capacity;
    }
  }
  std::free(data);  // the smaller of the two
}

int64_t SendBuffers::allocations() const {
  MutexLock lock(&mu_);
  return allocations_;
}

grpc::ByteBuffer EncodePrefillRequest(SendBuffers* buffers, const std::string& sequence_id,
                                      int32_t layer, const HostTensor& q, const HostTensor& k,
                                      const HostTensor& v, std::optional<int64_t> prompt_len,
                                      v1::QLayout q_layout) {
  using P = v1::PrefillRequest;
  const TensorSizes sq = SizeTensor(q), sk = SizeTensor(k), sv = SizeTensor(v);
  size_t size = 0;
  if (!sequence_id.empty()) size += FieldSize(P::kSequenceIdFieldNumber, sequence_id.size());
  if (layer != 0) size += VarintSize(P::kLayerFieldNumber << 3) + VarintSize(Signed(layer));
  size += FieldSize(P::kQFieldNumber, sq.body) + FieldSize(P::kKFieldNumber, sk.body) +
          FieldSize(P::kVFieldNumber, sv.body);
  if (prompt_len.has_value()) {
    size += VarintSize(P::kPromptLenFieldNumber << 3) + VarintSize(Signed(*prompt_len));
  }
  if (q_layout != 0) size += VarintSize(P::kQLayoutFieldNumber << 3) + VarintSize(Signed(q_layout));
  char* start = nullptr;
  grpc::Slice slice = buffers->Get(size, &start);
  char* p = start;
  if (!sequence_id.empty()) {
    p = PutTag(P::kSequenceIdFieldNumber, 2, p);
    p = PutVarint(sequence_id.size(), p);
    std::memcpy(p, sequence_id.data(), sequence_id.size());
    p += sequence_id.size();
  }
  if (layer != 0) {
    p = PutTag(P::kLayerFieldNumber, 0, p);
    p = PutVarint(Signed(layer), p);
  }
  p = PutTensor(P::kQFieldNumber, q, sq, p);
  p = PutTensor(P::kKFieldNumber, k, sk, p);
  p = PutTensor(P::kVFieldNumber, v, sv, p);
  if (prompt_len.has_value()) {
    p = PutTag(P::kPromptLenFieldNumber, 0, p);
    p = PutVarint(Signed(*prompt_len), p);
  }
  if (q_layout != 0) {
    p = PutTag(P::kQLayoutFieldNumber, 0, p);
    p = PutVarint(Signed(q_layout), p);
  }
  if (static_cast<size_t>(p - start) != size) std::abort();  // the sizes above are wrong
  return grpc::ByteBuffer(&slice, 1);
}

}  // namespace client
}  // namespace attnd
