// Registered tensor regions (docs/regions.md): per-tenant shared memory that requests name by
// (region id, offset, byte size) instead of carrying bytes. System shm objects are mapped here;
// CUDA IPC handles are opened through a DeviceMemoryOpener (the CUDA engine), once per handle.
// Rings (server/dataplane/ring.h) are regions too: they count against the same limits.
#ifndef ATTND_SERVER_DATAPLANE_REGIONS_H_
#define ATTND_SERVER_DATAPLANE_REGIONS_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "base/clock.h"
#include "base/mutex.h"

namespace attnd {

enum class RegionKind { kSystemShm, kCudaIpc, kRing };
const char* RegionKindName(RegionKind kind);  // "system shm", "CUDA IPC", "ring"

// The names of the shm objects (regions and rings) a tenant may register: "/attnd-" and then at
// least one character; with authentication, "/attnd-<tenant>." and then at least one character
// but no '.'. So attnd, which can open whatever its user can, never maps another program's shared
// memory, and no tenant can name another tenant's object (a tenant's names are nobody else's:
// what follows the prefix has no '.', so "/attnd-a.b.x" is tenant "a.b"'s and not "a"'s).
inline constexpr absl::string_view kShmNamePrefix = "/attnd-";
std::string ShmNamePrefix(absl::string_view tenant);

// Opens and closes CUDA IPC handles on the engine's device (CudaEngine implements it). Open
// returns the device address of the handle's allocation and the bytes it spans from there.
class DeviceMemoryOpener {
 public:
  struct Mapping {
    void* device_ptr = nullptr;
    uint64_t bytes = 0;  // the allocation's size from device_ptr
  };
  virtual ~DeviceMemoryOpener() = default;
  // INVALID_ARGUMENT for a handle that does not open here (another host, another GPU, freed).
  virtual absl::StatusOr<Mapping> OpenIpcHandle(absl::string_view handle) = 0;
  virtual void CloseIpcHandle(void* device_ptr) = 0;

  // A CUDA event on the engine's device that another process can open (cudaIpcGetEventHandle),
  // for device-ordered rings (DeviceOrder): attnd creates the events, so it never opens an event
  // handle a client made up.
  struct IpcEvent {
    void* event = nullptr;  // cudaEvent_t
    std::string handle;     // cudaIpcEventHandle_t's bytes
  };
  // FAILED_PRECONDITION where the engine cannot order work by events.
  virtual absl::StatusOr<IpcEvent> CreateIpcEvent() {
    return absl::FailedPreconditionError("this engine has no device events");
  }
  virtual void DestroyIpcEvent(void* /*event*/) {}
  // Whether the work before the event's latest record has run (cudaEventQuery): true, false, or an
  // error for a broken event or device.
  virtual absl::StatusOr<bool> IpcEventDone(void* /*event*/) {
    return absl::FailedPreconditionError("this engine has no device events");
  }

  // A gate lets the engine's decode stream wait for a client's "ready" event without the client
  // being able to hold it up for ever: a 64-bit word in pinned host memory that a stream of the
  // gate's own writes once the event completes (ArmGate), and that the decode stream waits on
  // (DeviceOrder::wait_word). The host can write the word itself (ring.cc does after
  // RingOptions::ready_timeout), which releases the decode stream whatever the client's GPU does.
  // Words only grow: a gate starts at its slot's current value and waits are "word >= value".
  struct Gate {
    int32_t slot = -1;
    void* stream = nullptr;             // the gate's own stream (cudaStream_t)
    uint64_t* word = nullptr;           // host address of the word
    const void* device_word = nullptr;  // the device's address of it
    uint64_t value = 0;                 // the word's value when the gate was made
  };
  // FAILED_PRECONDITION where the device has no stream memory operations: the ring then waits for
  // "ready" on the host.
  virtual absl::StatusOr<Gate> CreateGate() {
    return absl::FailedPreconditionError("this engine has no device gates");
  }
  // Queues on the gate's stream: wait for `ready_event`'s latest record, then write `value`.
  virtual absl::Status ArmGate(const Gate& /*gate*/, void* /*ready_event*/, uint64_t /*value*/) {
    return absl::FailedPreconditionError("this engine has no device gates");
  }
  // Gives the gate back; `stuck`: its stream may never finish (its slot is not reused).
  virtual void DestroyGate(const Gate& /*gate*/, bool /*stuck*/) {}
};

// One registered region. Immutable after registration except the counters.
struct Region {
  std::string id;
  std::string tenant;
  RegionKind kind = RegionKind::kSystemShm;
  // System shm and rings: attnd's mapping of [object_offset, object_offset + bytes) of the object.
  // CUDA IPC: the device address of the region's first byte.
  char* base = nullptr;
  uint64_t bytes = 0;
  // System shm and rings: the open object, to re-check its size (fstat) before each use, and its
  // identity (st_dev, st_ino), so two regions over one object are known to share memory.
  int fd = -1;
  uint64_t object_offset = 0;
  uint64_t dev = 0, ino = 0;
  std::string handle;  // CUDA IPC: the handle's 64 bytes (mappings are shared per handle)

  mutable std::atomic<int64_t> users{0};         // requests holding a RegionLease
  mutable std::atomic<int64_t> last_used_us{0};  // when the last lease ended (Clock, unix us)
};

// Keeps a region mapped and marked in use (UnregisterRegion answers FAILED_PRECONDITION) for as
// long as it lives. Movable.
class RegionLease {
 public:
  RegionLease() = default;
  RegionLease(std::shared_ptr<Region> region, const Clock* clock);
  RegionLease(RegionLease&& other) noexcept;
  RegionLease& operator=(RegionLease&& other) noexcept;
  ~RegionLease();
  const Region* get() const { return region_.get(); }
  const Region* operator->() const { return region_.get(); }
  explicit operator bool() const { return region_ != nullptr; }

 private:
  void Reset();
  std::shared_ptr<Region> region_;
  const Clock* clock_ = nullptr;
};

struct RegionRegistryOptions {
  int64_t max_regions_per_tenant = 64;               // regions and rings; 0 = unlimited
  int64_t max_bytes_per_tenant = int64_t{64} << 30;  // mapped bytes; 0 = unlimited
  absl::Duration idle_timeout = absl::Seconds(300);  // 0 = never reclaim
};

// The cudaIpcMemHandle_t in `handle`: the 64 bytes themselves, or the payload of torch's versioned
// shareable handle (version 2, type 'c': 66 bytes). INVALID_ARGUMENT for any other length and for
// torch's expandable-segment form (type 'e'), which CUDA IPC cannot open, with what to do instead.
absl::StatusOr<absl::string_view> CudaIpcMemHandle(absl::string_view handle);

// Thread-safe.
class RegionRegistry {
 public:
  // `opener` may be null (no CUDA IPC: RegisterCudaIpc answers FAILED_PRECONDITION). `clock`
  // (for idle times) must outlive the registry.
  RegionRegistry(const RegionRegistryOptions& options, DeviceMemoryOpener* opener,
                 const Clock* clock);
  // Unmaps and closes everything (no lease may outlive the registry).
  ~RegionRegistry();

  const RegionRegistryOptions& options() const { return options_; }
  bool cuda_ipc() const { return opener_ != nullptr; }

  // shm_open(name) read-write, check offset (a multiple of the page size) + bytes <= its size, map
  // that range. INVALID_ARGUMENT: a bad name or one outside the tenant's names (ShmNamePrefix), a
  // missing object, one smaller than claimed, a zero size; RESOURCE_EXHAUSTED: the tenant's count
  // or bytes. kind is kSystemShm or kRing.
  absl::StatusOr<std::shared_ptr<const Region>> RegisterShm(absl::string_view tenant,
                                                            absl::string_view name, uint64_t offset,
                                                            uint64_t bytes, RegionKind kind);
  // handle: a cudaIpcMemHandle_t (64 bytes), or torch's shareable handle of cudaMalloc memory
  // (CudaIpcMemHandle). bytes must fit in the handle's allocation.
  absl::StatusOr<std::shared_ptr<const Region>> RegisterCudaIpc(absl::string_view tenant,
                                                                absl::string_view handle,
                                                                uint64_t bytes);
  // NOT_FOUND (unknown, another tenant's, or the other kind: `ring` says which is meant),
  // FAILED_PRECONDITION while leased.
  absl::Status Unregister(absl::string_view tenant, absl::string_view id, bool ring);

  // A lease on `tenant`'s region `id` (not a ring). INVALID_ARGUMENT for a malformed id, NOT_FOUND
  // as Unregister.
  absl::StatusOr<RegionLease> Acquire(absl::string_view tenant, absl::string_view id);

  // A lease on `tenant`'s ring `id`, for the ring's server thread. NOT_FOUND as Unregister.
  absl::StatusOr<RegionLease> AcquireRing(absl::string_view tenant, absl::string_view id);

  // Unregisters every region (not ring: the ring server reclaims those) that no lease has used
  // since before now - idle_timeout, and returns them (already unmapped).
  std::vector<std::shared_ptr<const Region>> ReclaimIdle();

  struct TenantUsage {
    int64_t regions = 0;
    int64_t bytes = 0;
  };
  TenantUsage Usage(absl::string_view tenant) const;
  int64_t total_regions() const;

 private:
  absl::StatusOr<std::shared_ptr<const Region>> Add(std::shared_ptr<Region> region);
  void Release(Region* region);  // unmap / close

  const RegionRegistryOptions options_;
  DeviceMemoryOpener* const opener_;
  const Clock* const clock_;
  mutable Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<Region>> regions_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, TenantUsage> usage_ ABSL_GUARDED_BY(mu_);
  // CUDA IPC mappings by handle, shared by the regions that name one handle.
  struct IpcMapping {
    DeviceMemoryOpener::Mapping mapping;
    int64_t regions = 0;
  };
  absl::flat_hash_map<std::string, IpcMapping> ipc_ ABSL_GUARDED_BY(mu_);
};

// Byte range checks for a RegionRef against a region: INVALID_ARGUMENT naming what was wrong
// (past the end, misaligned for `element_size`, a byte size other than `expected_bytes`).
absl::Status CheckRange(const Region& region, uint64_t offset, uint64_t byte_size,
                        uint64_t element_size, uint64_t expected_bytes);

// System shm and rings: FAILED_PRECONDITION when the object is now smaller than the region (it
// was truncated after registration).
absl::Status CheckStillMapped(const Region& region);

}  // namespace attnd

#endif  // ATTND_SERVER_DATAPLANE_REGIONS_H_
