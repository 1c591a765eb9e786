// One request's view of its tensors when they live in registered regions (docs/regions.md): turns
// a v1::Tensor's RegionRef into a RequestTensor, and an output RegionRef into the buffer the
// engine writes. Holds a lease on every region it touched (so none is unregistered mid-request)
// and the private copies of shm bytes, until it is destroyed.
//   system shm: inputs are copied out of the mapping (guarded against SIGBUS), outputs are staged
//               in private memory and copied in by CopyOutputs; engines never see shm memory.
//   CUDA IPC:   the tensor is the device address; the CUDA engine copies device-to-device.
#ifndef ATTND_SERVER_RPC_REGION_TENSORS_H_
#define ATTND_SERVER_RPC_REGION_TENSORS_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "attnd/v1/attention.pb.h"
#include "base/byte_budget.h"
#include "base/mutex.h"
#include "server/dataplane/regions.h"
#include "server/runtime/runtime.h"

namespace attnd {

// Large host buffers for shm copies, reused across requests: a fresh allocation of tens of MB is
// a fresh mmap whose every page faults and is zeroed by the kernel, which cost more than the copy
// (docs/BENCHMARKS.md, "Data plane": most of a large shm prefill was page faults). Keeps at
// most max_idle_bytes of idle buffers, and none longer than TrimIdle's age. Thread-safe.
class CopyBufferPool {
 public:
  static constexpr size_t kDefaultMaxIdleBytes = size_t{512} << 20;
  struct Buffer {
    std::unique_ptr<char[]> data;
    size_t capacity = 0;
    absl::Time idle_since;
  };
  static CopyBufferPool& Get();
  // capacity >= bytes, contents undefined; data is null when the memory cannot be had.
  Buffer Take(size_t bytes);
  void Give(Buffer buffer);
  // The most idle bytes kept (the server sets it from --max-inflight-request-bytes).
  void SetMaxIdleBytes(size_t bytes);
  // Frees the buffers idle since before now - age (the server's housekeeping calls it).
  void TrimIdle(absl::Duration age);
  size_t idle_bytes() const;

 private:
  mutable Mutex mu_;
  std::vector<Buffer> idle_ ABSL_GUARDED_BY(mu_);
  size_t idle_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  size_t max_idle_bytes_ ABSL_GUARDED_BY(mu_) = kDefaultMaxIdleBytes;
};

class RegionTensors {
 public:
  // `registry` null: the server takes no regions, and any RegionRef is FAILED_PRECONDITION.
  // Private copies of shm bytes (inputs, staged outputs) are request bytes: each is taken from
  // `budget` (may be null: none) before it is allocated and given back when this object ends, and
  // no tensor may be larger than `max_tensor_bytes` (0: no cap), the largest a message could carry.
  RegionTensors(RegionRegistry* registry, absl::string_view tenant, ByteBudget* budget = nullptr,
                int64_t max_tensor_bytes = 0)
      : registry_(registry),
        tenant_(tenant),
        budget_(budget),
        max_tensor_bytes_(max_tensor_bytes) {}
  ~RegionTensors();
  RegionTensors(const RegionTensors&) = delete;
  RegionTensors& operator=(const RegionTensors&) = delete;

  // The tensor as the runtime takes it: inline bytes (no copy), or its region's bytes. `name`
  // ("q", "entries[2].k") prefixes errors. The RequestTensor points into `t` or into this object.
  // A reference is checked (dtype, shape, byte_size, the size cap, the budget) before any region
  // memory is read or any copy allocated: INVALID_ARGUMENT or RESOURCE_EXHAUSTED.
  absl::StatusOr<RequestTensor> Input(absl::string_view name, const v1::Tensor& t);
  // The same for a tensor given as its claims (dtype, shape, inline bytes) and, when it lives in a
  // region, the reference (null: inline). The shape must outlive the result.
  absl::StatusOr<RequestTensor> Input(absl::string_view name, const RequestTensor& claimed,
                                      const v1::RegionRef* ref);

  // Where the engine writes an output of `bytes` bytes of `element_size`-byte elements into
  // `ref`: sets *fn (and *on_device). Checks the range and that it overlaps no input seen so far
  // (call it after the Inputs of the same request).
  absl::Status Output(absl::string_view name, const v1::RegionRef& ref, uint64_t element_size,
                      uint64_t bytes, OutputBufferFn* fn, bool* on_device);

  // After the engine succeeded: copies the staged shm outputs into their regions.
  // FAILED_PRECONDITION when an object shrank meanwhile.
  absl::Status CopyOutputs();

  // Ends the requests' use of its regions (UnregisterRegion stops answering FAILED_PRECONDITION).
  // Call before the reply is sent: a client may unregister as soon as it has the reply.
  void ReleaseLeases() { leases_.clear(); }

 private:
  // Memory identity: two regions over one shm object (or one CUDA allocation) share memory.
  struct Span {
    uint64_t object_a = 0, object_b = 0;  // (st_dev, st_ino), or (device address space, 0)
    uint64_t begin = 0, end = 0;          // absolute within the object
  };
  absl::StatusOr<const Region*> Lease(absl::string_view name, const v1::RegionRef& ref);
  static Span SpanOf(const Region& r, uint64_t offset, uint64_t bytes);

  RegionRegistry* const registry_;
  const std::string tenant_;
  ByteBudget* const budget_;
  const int64_t max_tensor_bytes_;
  std::vector<RegionLease> leases_;
  std::vector<CopyBufferPool::Buffer> copies_;  // from the pool, given back at the end
  std::vector<ByteLease> copy_bytes_;           // their bytes in the budget
  // A private buffer of `bytes` for `name`, taken from the budget: RESOURCE_EXHAUSTED when the
  // budget or the memory cannot hold it.
  absl::StatusOr<char*> Copy(absl::string_view name, uint64_t bytes);
  absl::Status CheckSize(absl::string_view name, uint64_t bytes) const;
  std::vector<Span> inputs_;
  struct Staged {
    const Region* region;
    uint64_t offset;
    char* buffer;
    uint64_t bytes;
  };
  std::vector<Staged> staged_;
};

}  // namespace attnd

#endif  // ATTND_SERVER_RPC_REGION_TENSORS_H_
