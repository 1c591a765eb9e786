// The bytes path of large Prefill calls (issue #15): the request's tensors are read straight from
// the gRPC message's slices, and the reply is written once, by the engine, into a buffer that the
// reply's ByteBuffer then references, with protobuf's wire format written by hand around it.
//
// Why: protobuf's parser copies every bytes field into a fresh std::string and the response's
// bytes field is resized (zero-filled) before the engine writes it and copied again by Serialize.
// Large fresh allocations are mmap'ed by glibc, so each of those copies also faults in (and the
// kernel zeroes) every page, every call: the parse was most of attnd's CPU during large uploads
// (docs/BENCHMARKS.md, "gRPC bytes path"). Here, a tensor that lies in
// one slice is used in place; one that spans slices (gRPC hands a big message over in slices of
// at most 64 KiB, so large tensors always do) is gathered once into a buffer of a BufferPool,
// whose memory stays faulted in between calls.
//
// The hand parser only takes the simple shape of PrefillRequest (each known field at most once,
// the wire types protobuf writes, packed shapes, ASCII sequence ids); anything else (unknown
// fields, e.g. from a newer proto, repeated or unpacked fields, malformed bytes) makes it answer
// "not simple" and the caller parses with protobuf as before, which also gives malformed input
// its error.
#ifndef ATTND_SERVER_RPC_WIRE_H_
#define ATTND_SERVER_RPC_WIRE_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "base/dtype.h"
#include "base/mutex.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"

namespace attnd {
namespace wire {

class BufferPool;

// A host buffer from a BufferPool (contents undefined), given back to the pool when destroyed.
class PooledBuffer {
 public:
  PooledBuffer() = default;
  PooledBuffer(PooledBuffer&& other) noexcept { *this = std::move(other); }
  PooledBuffer& operator=(PooledBuffer&& other) noexcept;
  PooledBuffer(const PooledBuffer&) = delete;
  PooledBuffer& operator=(const PooledBuffer&) = delete;
  ~PooledBuffer() { Reset(); }

  char* data() const { return data_; }
  size_t capacity() const { return capacity_; }
  void Reset();  // gives the buffer back now

  // The buffer as a grpc::Slice of its first `length` bytes: the slice owns it from here on and
  // gives it back to the pool when gRPC drops the last reference. This PooledBuffer is empty after.
  grpc::Slice ToSlice(size_t length);

 private:
  friend class BufferPool;
  BufferPool* pool_ = nullptr;
  char* data_ = nullptr;
  size_t capacity_ = 0;
};

// Thread-safe. Keeps up to `max_idle_bytes` of given-back buffers for reuse (0: keeps none, every
// Get allocates). Held by a shared_ptr (slices made by PooledBuffer::ToSlice keep it alive); every
// PooledBuffer must be gone before it is destroyed.
class BufferPool : public std::enable_shared_from_this<BufferPool> {
 public:
  explicit BufferPool(int64_t max_idle_bytes);
  ~BufferPool();
  BufferPool(const BufferPool&) = delete;
  BufferPool& operator=(const BufferPool&) = delete;

  // At least `bytes` bytes: the smallest idle buffer that fits (and is at most twice as large
  // plus 2 MiB), else a new one (capacity rounded up to 64 KiB).
  PooledBuffer Get(size_t bytes);

  // Frees idle buffers given back more than `age` ago (attnd calls this every few seconds, so
  // memory returns to the OS after a burst, as with malloc_trim).
  void TrimIdle(absl::Duration age);

  int64_t idle_bytes() const;
  int64_t allocations() const;  // buffers allocated (not reused) so far

 private:
  friend class PooledBuffer;
  friend void DestroyPooledSlice(void* owner);
  struct Idle {
    char* data;
    absl::Time since;
  };
  void GiveBack(char* data, size_t capacity);
  PooledBuffer Adopt(char* data, size_t capacity);  // a buffer of this pool, back from a slice

  const int64_t max_idle_bytes_;
  mutable Mutex mu_;
  std::multimap<size_t, Idle> idle_ ABSL_GUARDED_BY(mu_);  // by capacity
  int64_t idle_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t allocations_ ABSL_GUARDED_BY(mu_) = 0;
};

// One tensor of a hand-parsed request: `bytes` points into the request's slices or into `owned`.
struct WireTensor {
  int32_t dtype = 0;  // the wire value (DType's numbers)
  std::vector<int64_t> shape;
  absl::string_view bytes;
  PooledBuffer owned;  // holds `bytes` when the tensor spanned slices
};

// A PrefillRequest parsed by ParsePrefillRequest. Keeps the request's slices alive.
struct WirePrefillRequest {
  std::string sequence_id;
  int32_t layer = 0;
  WireTensor q, k, v;
  std::optional<int64_t> prompt_len;
  int32_t q_layout = 0;
  std::vector<grpc::Slice> slices;
};

// Parses `request` (the bytes of an attnd.v1.PrefillRequest) into `out`. False: the message is not
// of the simple shape (or not well formed): parse it with protobuf instead; `out` is then
// unspecified. Tensors that span slices are gathered into buffers from `pool`.
bool ParsePrefillRequest(const grpc::ByteBuffer& request, BufferPool* pool,
                         WirePrefillRequest* out);

// The bytes of an attnd.v1.PrefillResponse {o: {dtype, shape, data}, length} whose data the engine
// wrote into Output's buffer; byte for byte what protobuf serializes for the same message.
class PrefillReplyWriter {
 public:
  explicit PrefillReplyWriter(BufferPool* pool) : pool_(pool) {}
  // The buffer for o's `bytes` bytes (an OutputBufferFn); called at most once.
  void* Output(int64_t bytes);
  // The reply: a small header slice, the output buffer itself (no copy) and the length field.
  // Without an Output call, o's data is empty.
  grpc::ByteBuffer Finish(DType dtype, const std::vector<int64_t>& shape, int64_t length);

 private:
  BufferPool* const pool_;
  PooledBuffer out_;
  size_t out_bytes_ = 0;
};

}  // namespace wire
}  // namespace attnd

#endif  // ATTND_SERVER_RPC_WIRE_H_
