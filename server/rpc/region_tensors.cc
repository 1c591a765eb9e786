#include "server/rpc/region_tensors.h"

#include <algorithm>
#include <limits>
#include <new>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/dtype.h"
#include "base/status_macros.h"
#include "server/dataplane/shm_guard.h"

namespace attnd {
namespace {

absl::Status Shrank(absl::string_view name, const Region& r) {
  return absl::FailedPreconditionError(absl::StrCat(
      name, ": the shm object of region ", r.id,
      " shrank while attnd was copying it (it was truncated after registration): nothing was "
      "changed; register it again"));
}

// product(shape) * element size, or -1 when it overflows, a dimension is negative or the dtype
// is unknown.
int64_t ShapeBytes(DType dtype, absl::Span<const int64_t> shape) {
  const int64_t element = static_cast<int64_t>(ElementSize(dtype));
  if (element <= 0) return -1;
  int64_t n = element;
  for (int64_t d : shape) {
    if (d < 0 || (d > 0 && n > std::numeric_limits<int64_t>::max() / d)) return -1;
    n *= d;
  }
  return n;
}

}  // namespace

CopyBufferPool& CopyBufferPool::Get() {
  static CopyBufferPool* pool = new CopyBufferPool();
  return *pool;
}

CopyBufferPool::Buffer CopyBufferPool::Take(size_t bytes) {
  {
    MutexLock lock(&mu_);
    // The smallest idle buffer that fits.
    size_t best = idle_.size();
    for (size_t i = 0; i < idle_.size(); ++i) {
      if (idle_[i].capacity >= bytes &&
          (best == idle_.size() || idle_[i].capacity < idle_[best].capacity)) {
        best = i;
      }
    }
    if (best != idle_.size()) {
      Buffer b = std::move(idle_[best]);
      idle_.erase(idle_.begin() + static_cast<std::ptrdiff_t>(best));
      idle_bytes_ -= b.capacity;
      return b;
    }
  }
  Buffer b;
  b.data.reset(new (std::nothrow) char[bytes]);  // default-initialised: no zero fill
  b.capacity = b.data != nullptr ? bytes : 0;
  return b;
}

void CopyBufferPool::Give(Buffer buffer) {
  if (buffer.data == nullptr) return;
  MutexLock lock(&mu_);
  if (idle_bytes_ + buffer.capacity > max_idle_bytes_) return;  // freed
  idle_bytes_ += buffer.capacity;
  buffer.idle_since = absl::Now();
  idle_.push_back(std::move(buffer));
}

void CopyBufferPool::SetMaxIdleBytes(size_t bytes) {
  MutexLock lock(&mu_);
  max_idle_bytes_ = bytes;
  while (idle_bytes_ > max_idle_bytes_ && !idle_.empty()) {
    idle_bytes_ -= idle_.front().capacity;
    idle_.erase(idle_.begin());
  }
}

void CopyBufferPool::TrimIdle(absl::Duration age) {
  std::vector<Buffer> freed;  // freed outside the lock
  const absl::Time cutoff = absl::Now() - age;
  MutexLock lock(&mu_);
  for (auto it = idle_.begin(); it != idle_.end();) {
    if (it->idle_since < cutoff) {
      idle_bytes_ -= it->capacity;
      freed.push_back(std::move(*it));
      it = idle_.erase(it);
    } else {
      ++it;
    }
  }
}

size_t CopyBufferPool::idle_bytes() const {
  MutexLock lock(&mu_);
  return idle_bytes_;
}

RegionTensors::~RegionTensors() {
  for (CopyBufferPool::Buffer& b : copies_) CopyBufferPool::Get().Give(std::move(b));
}

absl::Status RegionTensors::CheckSize(absl::string_view name, uint64_t bytes) const {
  if (max_tensor_bytes_ <= 0 || bytes <= static_cast<uint64_t>(max_tensor_bytes_)) {
    return absl::OkStatus();
  }
  return absl::ResourceExhaustedError(
      absl::StrCat(name, ": ", bytes, " bytes is larger than one tensor may be (",
                   max_tensor_bytes_, " bytes, --max-message-bytes): send a smaller request"));
}

absl::StatusOr<char*> RegionTensors::Copy(absl::string_view name, uint64_t bytes) {
  const int64_t n = static_cast<int64_t>(std::max<uint64_t>(bytes, 1));
  if (budget_ != nullptr && !budget_->TryTake(n, /*alone_may_exceed=*/false)) {
    return absl::ResourceExhaustedError(absl::StrCat(
        name, ": attnd would copy ", n,
        " bytes of shared memory for this request, but its requests "
        "already hold ",
        budget_->used(), " of the ", budget_->limit(),
        " bytes --max-inflight-request-bytes allows: retry later, or send smaller requests"));
  }
  ByteLease lease(budget_, budget_ != nullptr ? n : 0);
  CopyBufferPool::Buffer buffer = CopyBufferPool::Get().Take(static_cast<size_t>(n));
  if (buffer.data == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat(
        name, ": attnd cannot allocate ", n, " bytes to copy the region's tensor: retry later"));
  }
  copies_.push_back(std::move(buffer));
  copy_bytes_.push_back(std::move(lease));
  return copies_.back().data.get();
}

RegionTensors::Span RegionTensors::SpanOf(const Region& r, uint64_t offset, uint64_t bytes) {
  Span s;
  if (r.kind == RegionKind::kCudaIpc) {
    s.object_a = 1;  // one device address space: the absolute address is the identity
    s.begin = reinterpret_cast<uint64_t>(r.base) + offset;
  } else {
    s.object_a = r.dev + 2;
    s.object_b = r.ino;
    s.begin = r.object_offset + offset;
  }
  s.end = s.begin + bytes;
  return s;
}

absl::StatusOr<const Region*> RegionTensors::Lease(absl::string_view name,
                                                   const v1::RegionRef& ref) {
  if (registry_ == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat(name, ": this server takes no tensor regions; send the bytes inline"));
  }
  for (const RegionLease& lease : leases_) {
    if (lease->id == ref.region_id()) return lease.get();
  }
  absl::StatusOr<RegionLease> lease = registry_->Acquire(tenant_, ref.region_id());
  if (!lease.ok()) {
    return absl::Status(lease.status().code(), absl::StrCat(name, ": ", lease.status().message()));
  }
  leases_.push_back(*std::move(lease));
  return leases_.back().get();
}

absl::StatusOr<RequestTensor> RegionTensors::Input(absl::string_view name, const v1::Tensor& t) {
  RequestTensor claimed;
  claimed.dtype = static_cast<DType>(t.dtype());
  claimed.shape = absl::MakeConstSpan(t.shape().data(), t.shape().size());
  claimed.bytes = t.data();
  return Input(name, claimed, t.has_region() ? &t.region() : nullptr);
}

absl::StatusOr<RequestTensor> RegionTensors::Input(absl::string_view name,
                                                   const RequestTensor& claimed,
                                                   const v1::RegionRef* ref_or_null) {
  RequestTensor r = claimed;
  if (ref_or_null == nullptr) return r;
  r.bytes = absl::string_view();
  if (!claimed.bytes.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, " carries both data (", claimed.bytes.size(),
                     " bytes) and a region reference: send one or the other"));
  }
  const v1::RegionRef& ref = *ref_or_null;
  if (!IsKnownDType(r.dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, ": dtype must be bf16, fp16 or fp32, got wire value ", static_cast<int>(r.dtype)));
  }
  const int64_t need = ShapeBytes(r.dtype, r.shape);
  if (need < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, ": shape [", absl::StrJoin(r.shape, ", "),
        "] has a negative dimension or more bytes than 2^63; every dimension must be >= 0"));
  }
  if (ref.byte_size() != static_cast<uint64_t>(need)) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": region byte_size ", ref.byte_size(),
                                                   " but its shape and dtype need ", need,
                                                   " bytes"));
  }
  ATTND_RETURN_IF_ERROR(CheckSize(name, ref.byte_size()));
  ATTND_ASSIGN_OR_RETURN(const Region* region, Lease(name, ref));
  const uint64_t element = ElementSize(r.dtype);
  if (absl::Status s = CheckRange(*region, ref.offset(), ref.byte_size(), element, ref.byte_size());
      !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": ", s.message()));
  }
  inputs_.push_back(SpanOf(*region, ref.offset(), ref.byte_size()));
  const char* at = region->base + ref.offset();
  if (region->kind == RegionKind::kCudaIpc) {
    r.bytes = absl::string_view(at, ref.byte_size());
    r.on_device = true;
    return r;
  }
  if (absl::Status s = CheckStillMapped(*region); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat(name, ": ", s.message()));
  }
  ATTND_ASSIGN_OR_RETURN(char* copy, Copy(name, ref.byte_size()));
  if (!GuardedCopy(copy, at, ref.byte_size())) return Shrank(name, *region);
  r.bytes = absl::string_view(copy, ref.byte_size());
  return r;
}

absl::Status RegionTensors::Output(absl::string_view name, const v1::RegionRef& ref,
                                   uint64_t element_size, uint64_t bytes, OutputBufferFn* fn,
                                   bool* on_device) {
  ATTND_RETURN_IF_ERROR(CheckSize(name, bytes));
  ATTND_ASSIGN_OR_RETURN(const Region* region, Lease(name, ref));
  if (absl::Status s = CheckRange(*region, ref.offset(), ref.byte_size(), element_size, bytes);
      !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": ", s.message()));
  }
  const Span out = SpanOf(*region, ref.offset(), ref.byte_size());
  for (const Span& in : inputs_) {
    if (in.object_a == out.object_a && in.object_b == out.object_b && in.begin < out.end &&
        out.begin < in.end) {
      return absl::InvalidArgumentError(absl::StrCat(
          name, ": the output range [", ref.offset(), ", ", ref.offset() + ref.byte_size(),
          ") of region ", region->id, " overlaps an input of this request"));
    }
  }
  inputs_.push_back(out);  // two outputs must not overlap either
  char* at = region->base + ref.offset();
  if (region->kind == RegionKind::kCudaIpc) {
    *on_device = true;
    *fn = [at](int64_t) -> void* { return at; };
    return absl::OkStatus();
  }
  if (absl::Status s = CheckStillMapped(*region); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat(name, ": ", s.message()));
  }
  *on_device = false;
  ATTND_ASSIGN_OR_RETURN(char* buffer, Copy(name, bytes));
  staged_.push_back(Staged{region, ref.offset(), buffer, bytes});
  // The runtime asks for exactly `bytes` (checked above against the model's output shape).
  *fn = [buffer, bytes](int64_t n) -> void* {
    return static_cast<uint64_t>(n) == bytes ? buffer : nullptr;
  };
  return absl::OkStatus();
}

absl::Status RegionTensors::CopyOutputs() {
  for (const Staged& s : staged_) {
    // Only a client that truncates its own object while its request runs gets here; this runs
    // before the runtime commits (PrefillCall::before_commit), so the call changes nothing.
    if (CheckStillMapped(*s.region).ok() &&
        GuardedCopy(s.region->base + s.offset, s.buffer, s.bytes)) {
      continue;
    }
    return absl::FailedPreconditionError(absl::StrCat(
        "the shm object of output region ", s.region->id,
        " shrank while the request ran, so the output could not be written; nothing was changed"));
  }
  staged_.clear();
  return absl::OkStatus();
}

}  // namespace attnd
