// The bytes of a PrefillRequest written by hand into one reusable buffer (issue #15): building the
// v1::PrefillRequest copies every tensor into the message and gRPC's serializer copies it again,
// both into fresh memory that large allocations fault in on every call. Here each tensor is copied
// once, into a buffer that the request's slice owns and gives back for the next call.
#ifndef ATTND_CLIENT_PREFILL_WIRE_H_
#define ATTND_CLIENT_PREFILL_WIRE_H_

#include <cstddef>
#include <memory>
#include <optional>
#include <string>

#include "attnd/v1/attention.pb.h"
#include "base/mutex.h"
#include "client/host_tensor.h"
#include "grpcpp/support/byte_buffer.h"

namespace attnd {
namespace client {

// Thread-safe. Keeps the largest block given back (one), for the next request. Held by a
// shared_ptr: slices made from it keep it alive.
class SendBuffers : public std::enable_shared_from_this<SendBuffers> {
 public:
  ~SendBuffers();
  // A slice of exactly `bytes` bytes (contents undefined) at *data, backed by the idle block when
  // it is large enough (and not more than twice as large plus 2 MiB), else by a new one.
  grpc::Slice Get(size_t bytes, char** data);
  int64_t allocations() const;

 private:
  friend void GiveBackSendBuffer(void* owner);
  void Put(char* data, size_t capacity);
  mutable Mutex mu_;
  char* idle_ ABSL_GUARDED_BY(mu_) = nullptr;
  size_t idle_capacity_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t allocations_ ABSL_GUARDED_BY(mu_) = 0;
};

// Byte for byte what v1::PrefillRequest::SerializeAsString gives for the request AttndClient
// builds from the same arguments (q, k, v always present; q_layout left out when it is
// Q_LAYOUT_VARIANTS).
grpc::ByteBuffer EncodePrefillRequest(SendBuffers* buffers, const std::string& sequence_id,
                                      int32_t layer, const HostTensor& q, const HostTensor& k,
                                      const HostTensor& v, std::optional<int64_t> prompt_len,
                                      v1::QLayout q_layout);

}  // namespace client
}  // namespace attnd

#endif  // ATTND_CLIENT_PREFILL_WIRE_H_
