#include "server/dataplane/regions.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "kvcache/sequence_table.h"

namespace attnd {
namespace {

constexpr size_t kMaxShmNameChars = 255;
constexpr size_t kIpcHandleBytes = 64;  // sizeof(cudaIpcMemHandle_t)
constexpr size_t kMaxEchoedChars = 64;
// torch's shareable handle (untyped_storage()._share_cuda_()[1] of newer torch, 2.11 for one): a
// version byte, a type byte, then the type's payload. Type 'c' (memory from cudaMalloc) carries a
// cudaIpcMemHandle_t; type 'e' (an expandable segment) carries a header and one exported allocation
// handle per segment, which cudaIpcOpenMemHandle cannot open.
constexpr char kTorchHandleVersion = 2;
constexpr char kTorchCudaMalloc = 'c';
constexpr char kTorchExpandableSegment = 'e';

int64_t NowUs(const Clock* clock) { return absl::ToUnixMicros(clock->Now()); }

std::string Echo(absl::string_view s) {
  return absl::StrCat("\"", absl::CHexEscape(s.substr(0, kMaxEchoedChars)),
                      s.size() > kMaxEchoedChars ? "...\"" : "\"");
}

// shm_open's portable names: one leading '/', then [A-Za-z0-9._-] (no '/': no directories, no
// "..", nothing outside /dev/shm).
absl::Status CheckShmName(absl::string_view name) {
  bool ok = name.size() >= 2 && name.size() <= kMaxShmNameChars && name[0] == '/';
  for (size_t i = 1; ok && i < name.size(); ++i) {
    const char c = name[i];
    ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
         c == '_' || c == '-';
  }
  if (ok && (name == "/." || name == "/..")) ok = false;
  if (ok) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "shm name ", Echo(name), " is not a POSIX shm object name: expected \"/\" followed by 1 to ",
      kMaxShmNameChars - 1, " of [A-Za-z0-9._-]"));
}

// A caller maps only objects in its own part of the "/attnd-" namespace (ShmNamePrefix).
absl::Status CheckShmOwner(absl::string_view tenant, absl::string_view name) {
  const std::string prefix = ShmNamePrefix(tenant);
  const absl::string_view rest =
      absl::StartsWith(name, prefix) ? name.substr(prefix.size()) : absl::string_view();
  if (!rest.empty() && (tenant.empty() || rest.find('.') == absl::string_view::npos)) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "shm name ", Echo(name), " is not one of this caller's: attnd maps only objects named \"",
      prefix, "\" followed by one or more characters", tenant.empty() ? "" : ", none of them '.'",
      " (GetServerInfo's regions.shm_name_prefix; the client libraries name their objects so), so "
      "that no caller can make it read or write another tenant's or another program's shared "
      "memory"));
}

absl::Status NotFound(absl::string_view what, absl::string_view id) {
  // One message for unknown, unregistered, reclaimed and another tenant's: no probing.
  return absl::NotFoundError(absl::StrCat(what, " ", Echo(id), " not found"));
}

absl::Status CheckId(absl::string_view what, absl::string_view id) {
  if (SequenceTable::IsWellFormedId(id)) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(what,
                                                 " id must be 32 lowercase hex characters, got ",
                                                 Echo(id), " (", id.size(), " characters)"));
}

}  // namespace

std::string ShmNamePrefix(absl::string_view tenant) {
  return tenant.empty() ? std::string(kShmNamePrefix) : absl::StrCat(kShmNamePrefix, tenant, ".");
}

const char* RegionKindName(RegionKind kind) {
  switch (kind) {
    case RegionKind::kSystemShm:
      return "system shm";
    case RegionKind::kCudaIpc:
      return "CUDA IPC";
    case RegionKind::kRing:
      return "ring";
  }
  return "unknown";
}

RegionLease::RegionLease(std::shared_ptr<Region> region, const Clock* clock)
    : region_(std::move(region)), clock_(clock) {
  region_->users.fetch_add(1);
}

RegionLease::RegionLease(RegionLease&& other) noexcept
    : region_(std::move(other.region_)), clock_(other.clock_) {}

RegionLease& RegionLease::operator=(RegionLease&& other) noexcept {
  if (this != &other) {
    Reset();
    region_ = std::move(other.region_);
    clock_ = other.clock_;
  }
  return *this;
}

RegionLease::~RegionLease() { Reset(); }

void RegionLease::Reset() {
  if (region_ == nullptr) return;
  region_->last_used_us.store(NowUs(clock_));
  region_->users.fetch_sub(1);
  region_.reset();
}

RegionRegistry::RegionRegistry(const RegionRegistryOptions& options, DeviceMemoryOpener* opener,
                               const Clock* clock)
    : options_(options), opener_(opener), clock_(clock) {}

RegionRegistry::~RegionRegistry() {
  MutexLock lock(&mu_);
  for (auto& [id, region] : regions_) Release(region.get());
  regions_.clear();
}

void RegionRegistry::Release(Region* region) {
  if (region->kind == RegionKind::kCudaIpc) {
    auto it = ipc_.find(region->handle);
    if (it != ipc_.end() && --it->second.regions == 0) {
      opener_->CloseIpcHandle(it->second.mapping.device_ptr);
      ipc_.erase(it);
    }
  } else {
    // The mapping started at the page boundary at or below object_offset (it is page-aligned).
    if (region->base != nullptr) munmap(region->base, region->bytes);
    if (region->fd >= 0) close(region->fd);
  }
  region->base = nullptr;
  region->fd = -1;
  TenantUsage& u = usage_[region->tenant];
  u.regions -= 1;
  u.bytes -= static_cast<int64_t>(region->bytes);
  if (u.regions == 0) usage_.erase(region->tenant);
}

absl::StatusOr<std::shared_ptr<const Region>> RegionRegistry::Add(std::shared_ptr<Region> region) {
  // Called with the memory mapped; on refusal the caller's cleanup unmaps it.
  MutexLock lock(&mu_);
  TenantUsage& u = usage_[region->tenant];
  if (options_.max_regions_per_tenant > 0 && u.regions >= options_.max_regions_per_tenant) {
    if (u.regions == 0) usage_.erase(region->tenant);
    return absl::ResourceExhaustedError(
        absl::StrCat("this tenant holds ", options_.max_regions_per_tenant,
                     " regions and rings already (RegionRegistryOptions::max_regions_per_tenant): "
                     "unregister one first"));
  }
  if (options_.max_bytes_per_tenant > 0 &&
      u.bytes + static_cast<int64_t>(region->bytes) > options_.max_bytes_per_tenant) {
    const int64_t held = u.bytes;
    if (u.regions == 0) usage_.erase(region->tenant);
    return absl::ResourceExhaustedError(
        absl::StrCat("this tenant has ", held, " bytes of regions and rings registered; ",
                     region->bytes, " more would pass RegionRegistryOptions::max_bytes_per_tenant ",
                     options_.max_bytes_per_tenant));
  }
  absl::StatusOr<std::string> id = NewRandomId();
  if (!id.ok()) {
    if (u.regions == 0) usage_.erase(region->tenant);
    return id.status();
  }
  region->id = *std::move(id);
  region->last_used_us.store(NowUs(clock_));
  u.regions += 1;
  u.bytes += static_cast<int64_t>(region->bytes);
  if (region->kind == RegionKind::kCudaIpc) ipc_[region->handle].regions += 1;
  regions_[region->id] = region;
  return std::shared_ptr<const Region>(region);
}

absl::StatusOr<std::shared_ptr<const Region>> RegionRegistry::RegisterShm(absl::string_view tenant,
                                                                          absl::string_view name,
                                                                          uint64_t offset,
                                                                          uint64_t bytes,
                                                                          RegionKind kind) {
  if (kind != RegionKind::kSystemShm && kind != RegionKind::kRing) {
    return absl::InvalidArgumentError("RegisterShm takes a system shm region or a ring");
  }
  ATTND_RETURN_IF_ERROR(CheckShmName(name));
  ATTND_RETURN_IF_ERROR(CheckShmOwner(tenant, name));
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  if (bytes == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(RegionKindName(kind), " ", Echo(name), ": byte_size must be at least 1"));
  }
  if (offset % page != 0) {
    return absl::InvalidArgumentError(absl::StrCat(RegionKindName(kind), " ", Echo(name),
                                                   ": offset ", offset,
                                                   " is not a multiple of the page size ", page));
  }
  if (offset + bytes < offset) {
    return absl::InvalidArgumentError(
        absl::StrCat("offset ", offset, " + byte_size ", bytes, " overflows"));
  }
  // O_NOFOLLOW: the name is a file in /dev/shm; never follow a link planted there.
  const std::string path(name);
  const int fd = shm_open(path.c_str(), O_RDWR | O_NOFOLLOW | O_CLOEXEC, 0);
  if (fd < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cannot open shm object ", Echo(name), ": ", std::strerror(errno),
        " (create it with shm_open and size it with ftruncate before registering it)"));
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    close(fd);
    return absl::InvalidArgumentError(
        absl::StrCat("shm object ", Echo(name), " is not a regular shared-memory object"));
  }
  // A second name for an object (a hard link in /dev/shm) could bring someone else's object under
  // this caller's prefix.
  if (st.st_nlink != 1) {
    close(fd);
    return absl::InvalidArgumentError(absl::StrCat(
        "shm object ", Echo(name), " has ", st.st_nlink,
        " names (hard links): attnd maps only an object under one name, the one it was created "
        "with"));
  }
  if (static_cast<uint64_t>(st.st_size) < offset + bytes) {
    close(fd);
    return absl::InvalidArgumentError(absl::StrCat("shm object ", Echo(name), " is ", st.st_size,
                                                   " bytes, smaller than offset ", offset,
                                                   " + byte_size ", bytes, " claimed"));
  }
  void* base =
      mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, static_cast<off_t>(offset));
  if (base == MAP_FAILED) {
    const int err = errno;
    close(fd);
    return absl::InvalidArgumentError(
        absl::StrCat("cannot map shm object ", Echo(name), ": ", std::strerror(err)));
  }
  auto region = std::make_shared<Region>();
  region->tenant = std::string(tenant);
  region->kind = kind;
  region->base = static_cast<char*>(base);
  region->bytes = bytes;
  region->fd = fd;
  region->object_offset = offset;
  region->dev = static_cast<uint64_t>(st.st_dev);
  region->ino = static_cast<uint64_t>(st.st_ino);
  absl::StatusOr<std::shared_ptr<const Region>> added = Add(region);
  if (!added.ok()) {
    munmap(base, bytes);
    close(fd);
  }
  return added;
}

absl::StatusOr<absl::string_view> CudaIpcMemHandle(absl::string_view handle) {
  if (handle.size() == kIpcHandleBytes) return handle;
  if (handle.size() >= 2 && handle[0] == kTorchHandleVersion) {
    if (handle[1] == kTorchCudaMalloc && handle.size() == 2 + kIpcHandleBytes) {
      return handle.substr(2);
    }
    if (handle[1] == kTorchExpandableSegment) {
      return absl::InvalidArgumentError(
          "this CUDA IPC handle is torch's for memory in an expandable segment "
          "(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True), which CUDA IPC cannot open: "
          "allocate "
          "the region's buffer with expandable segments off (e.g. "
          "torch.cuda.memory._set_allocator_settings(\"expandable_segments:False\") before "
          "allocating it) or with cudaMalloc");
    }
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "a CUDA IPC handle is a cudaIpcMemHandle_t (", kIpcHandleBytes,
      " bytes) or torch's shareable handle for cudaMalloc memory (", 2 + kIpcHandleBytes,
      " bytes: version 2, type 'c', then the cudaIpcMemHandle_t); got ", handle.size(), " bytes",
      handle.size() >= 2 ? absl::StrCat(" starting ", Echo(handle.substr(0, 2))) : ""));
}

absl::StatusOr<std::shared_ptr<const Region>> RegionRegistry::RegisterCudaIpc(
    absl::string_view tenant, absl::string_view shared_handle, uint64_t bytes) {
  if (opener_ == nullptr) {
    return absl::FailedPreconditionError(
        "this server does not accept CUDA IPC regions (it runs the CPU backend, or was built "
        "without CUDA): use system shm regions or inline bytes");
  }
  // Keyed by the cudaIpcMemHandle_t itself, so both forms of one allocation share one open.
  ATTND_ASSIGN_OR_RETURN(const absl::string_view handle, CudaIpcMemHandle(shared_handle));
  if (bytes == 0) return absl::InvalidArgumentError("byte_size must be at least 1");
  DeviceMemoryOpener::Mapping mapping;
  {
    // Opened once per handle: cudaIpcOpenMemHandle is slow and refuses a second open.
    MutexLock lock(&mu_);
    auto it = ipc_.find(handle);
    if (it != ipc_.end()) {
      mapping = it->second.mapping;
    } else {
      absl::StatusOr<DeviceMemoryOpener::Mapping> opened = opener_->OpenIpcHandle(handle);
      if (!opened.ok()) return opened.status();
      mapping = *opened;
      ipc_[std::string(handle)].mapping = mapping;  // regions 0 until Add counts one
    }
  }
  if (bytes > mapping.bytes) {
    MutexLock lock(&mu_);
    auto it = ipc_.find(handle);
    if (it != ipc_.end() && it->second.regions == 0) {
      opener_->CloseIpcHandle(it->second.mapping.device_ptr);
      ipc_.erase(it);
    }
    return absl::InvalidArgumentError(absl::StrCat("byte_size ", bytes, " is more than the ",
                                                   mapping.bytes,
                                                   " bytes the handle's allocation holds"));
  }
  auto region = std::make_shared<Region>();
  region->tenant = std::string(tenant);
  region->kind = RegionKind::kCudaIpc;
  region->base = static_cast<char*>(mapping.device_ptr);
  region->bytes = bytes;
  region->handle = std::string(handle);
  absl::StatusOr<std::shared_ptr<const Region>> added = Add(region);
  if (!added.ok()) {
    MutexLock lock(&mu_);
    auto it = ipc_.find(handle);
    if (it != ipc_.end() && it->second.regions == 0) {
      opener_->CloseIpcHandle(it->second.mapping.device_ptr);
      ipc_.erase(it);
    }
  }
  return added;
}

absl::Status RegionRegistry::Unregister(absl::string_view tenant, absl::string_view id, bool ring) {
  const char* what = ring ? "ring" : "region";
  ATTND_RETURN_IF_ERROR(CheckId(what, id));
  MutexLock lock(&mu_);
  auto it = regions_.find(id);
  if (it == regions_.end() || it->second->tenant != tenant ||
      (it->second->kind == RegionKind::kRing) != ring) {
    return NotFound(what, id);
  }
  const int64_t users = it->second->users.load();
  if (users > 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        what, " ", id, " is in use by ", users, " request(s): unregister it after they finish"));
  }
  Release(it->second.get());
  regions_.erase(it);
  return absl::OkStatus();
}

absl::StatusOr<RegionLease> RegionRegistry::Acquire(absl::string_view tenant,
                                                    absl::string_view id) {
  ATTND_RETURN_IF_ERROR(CheckId("region", id));
  MutexLock lock(&mu_);
  auto it = regions_.find(id);
  if (it == regions_.end() || it->second->tenant != tenant ||
      it->second->kind == RegionKind::kRing) {
    return NotFound("region", id);
  }
  return RegionLease(it->second, clock_);
}

absl::StatusOr<RegionLease> RegionRegistry::AcquireRing(absl::string_view tenant,
                                                        absl::string_view id) {
  MutexLock lock(&mu_);
  auto it = regions_.find(id);
  if (it == regions_.end() || it->second->tenant != tenant ||
      it->second->kind != RegionKind::kRing) {
    return NotFound("ring", id);
  }
  return RegionLease(it->second, clock_);
}

std::vector<std::shared_ptr<const Region>> RegionRegistry::ReclaimIdle() {
  std::vector<std::shared_ptr<const Region>> removed;
  if (options_.idle_timeout <= absl::ZeroDuration()) return removed;
  const int64_t cutoff = NowUs(clock_) - absl::ToInt64Microseconds(options_.idle_timeout);
  MutexLock lock(&mu_);
  for (auto it = regions_.begin(); it != regions_.end();) {
    Region* r = it->second.get();
    // Rings are the ring server's to reclaim: their threads hold a lease for their whole life.
    if (r->kind != RegionKind::kRing && r->users.load() == 0 && r->last_used_us.load() < cutoff) {
      removed.push_back(it->second);
      Release(r);
      regions_.erase(it++);
    } else {
      ++it;
    }
  }
  return removed;
}

RegionRegistry::TenantUsage RegionRegistry::Usage(absl::string_view tenant) const {
  MutexLock lock(&mu_);
  auto it = usage_.find(tenant);
  return it == usage_.end() ? TenantUsage{} : it->second;
}

int64_t RegionRegistry::total_regions() const {
  MutexLock lock(&mu_);
  return static_cast<int64_t>(regions_.size());
}

absl::Status CheckRange(const Region& region, uint64_t offset, uint64_t byte_size,
                        uint64_t element_size, uint64_t expected_bytes) {
  if (offset > region.bytes || byte_size > region.bytes - offset) {
    return absl::InvalidArgumentError(
        absl::StrCat("region ", region.id, ": offset ", offset, " + byte_size ", byte_size,
                     " is past the region's end (", region.bytes, " bytes)"));
  }
  if (element_size > 0 && offset % element_size != 0) {
    return absl::InvalidArgumentError(absl::StrCat("region ", region.id, ": offset ", offset,
                                                   " is not a multiple of the element size ",
                                                   element_size));
  }
  if (byte_size != expected_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("region ", region.id, ": byte_size ", byte_size,
                                                   " but the tensor's shape needs ", expected_bytes,
                                                   " bytes"));
  }
  return absl::OkStatus();
}

absl::Status CheckStillMapped(const Region& region) {
  if (region.kind == RegionKind::kCudaIpc) return absl::OkStatus();
  struct stat st;
  if (fstat(region.fd, &st) != 0) {
    return absl::InternalError(absl::StrCat("cannot stat the shm object of region ", region.id,
                                            ": ", std::strerror(errno)));
  }
  if (static_cast<uint64_t>(st.st_size) < region.object_offset + region.bytes) {
    return absl::FailedPreconditionError(
        absl::StrCat("the shm object of ", RegionKindName(region.kind), " ", region.id,
                     " shrank to ", st.st_size, " bytes after registration (the region needs ",
                     region.object_offset + region.bytes, "): register it again"));
  }
  return absl::OkStatus();
}

}  // namespace attnd
