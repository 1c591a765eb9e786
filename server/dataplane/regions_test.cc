#include "server/dataplane/regions.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/dataplane/shm_guard.h"

namespace attnd {
namespace {

using ::testing::HasSubstr;

// A shm object of `bytes` bytes with a unique name among `tenant`'s, unlinked at the end of the
// test.
class ShmObject {
 public:
  explicit ShmObject(size_t bytes, absl::string_view tenant = "t") {
    name_ = absl::StrCat(ShmNamePrefix(tenant), "regions-test-", getpid(), "-", counter_++);
    fd_ = shm_open(name_.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    EXPECT_GE(fd_, 0) << std::strerror(errno);
    EXPECT_EQ(ftruncate(fd_, static_cast<off_t>(bytes)), 0);
  }
  ~ShmObject() {
    close(fd_);
    shm_unlink(name_.c_str());
  }
  const std::string& name() const { return name_; }
  void Truncate(size_t bytes) { ASSERT_EQ(ftruncate(fd_, static_cast<off_t>(bytes)), 0); }
  // A mapping of the whole object as the client sees it.
  char* Map(size_t bytes) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
    EXPECT_NE(p, MAP_FAILED);
    return static_cast<char*>(p);
  }

 private:
  static inline int counter_ = 0;
  std::string name_;
  int fd_ = -1;
};

class FakeOpener : public DeviceMemoryOpener {
 public:
  absl::StatusOr<Mapping> OpenIpcHandle(absl::string_view handle) override {
    if (handle[0] == 'x') return absl::InvalidArgumentError("cudaIpcOpenMemHandle: invalid");
    ++opens;
    opened = std::string(handle);
    Mapping m;
    m.device_ptr = &memory[0];
    m.bytes = sizeof(memory);
    return m;
  }
  void CloseIpcHandle(void* device_ptr) override {
    EXPECT_EQ(device_ptr, &memory[0]);
    ++closes;
  }
  char memory[4096];
  int opens = 0, closes = 0;
  std::string opened;  // the last handle opened
};

constexpr uint64_t kPage = 4096;

TEST(RegionRegistryTest, RegisterAcquireAndUnregister) {
  ManualClock clock;
  RegionRegistry registry({}, nullptr, &clock);
  ShmObject obj(3 * kPage, "alice");
  char* client = obj.Map(3 * kPage);
  std::strcpy(client + kPage + 8, "hello");
  auto region = registry.RegisterShm("alice", obj.name(), kPage, 2 * kPage, RegionKind::kSystemShm);
  ASSERT_TRUE(region.ok()) << region.status();
  EXPECT_EQ((*region)->id.size(), 32u);
  EXPECT_EQ((*region)->bytes, 2 * kPage);
  // The mapping starts at the registered offset: the client's byte kPage + 8 is the region's 8.
  EXPECT_STREQ((*region)->base + 8, "hello");
  EXPECT_EQ(registry.Usage("alice").regions, 1);
  EXPECT_EQ(registry.Usage("alice").bytes, static_cast<int64_t>(2 * kPage));

  absl::StatusOr<RegionLease> lease = registry.Acquire("alice", (*region)->id);
  ASSERT_TRUE(lease.ok()) << lease.status();
  EXPECT_EQ((*lease)->id, (*region)->id);
  // Another tenant sees nothing, with the same answer as for an unknown id.
  EXPECT_EQ(registry.Acquire("bob", (*region)->id).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(registry.Unregister("bob", (*region)->id, false).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(registry.Acquire("alice", std::string(32, 'a')).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(registry.Acquire("alice", "nothex").status().code(),
            absl::StatusCode::kInvalidArgument);
  // In use: refused, and still there.
  absl::Status busy = registry.Unregister("alice", (*region)->id, false);
  EXPECT_EQ(busy.code(), absl::StatusCode::kFailedPrecondition) << busy;
  EXPECT_NE(busy.message().find("in use by 1"), std::string::npos) << busy;
  *lease = RegionLease();
  EXPECT_TRUE(registry.Unregister("alice", (*region)->id, false).ok());
  EXPECT_EQ(registry.Usage("alice").regions, 0);
  EXPECT_EQ(registry.Acquire("alice", (*region)->id).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(registry.Unregister("alice", (*region)->id, false).code(), absl::StatusCode::kNotFound);
  munmap(client, 3 * kPage);
}

TEST(RegionRegistryTest, RejectsBadShmRegistrations) {
  ManualClock clock;
  RegionRegistry registry({}, nullptr, &clock);
  ShmObject obj(kPage);
  auto code = [&](absl::string_view name, uint64_t offset, uint64_t bytes) {
    return registry.RegisterShm("t", name, offset, bytes, RegionKind::kSystemShm).status().code();
  };
  EXPECT_EQ(code("/attnd-no-such-object-xyz", 0, kPage), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code("no-slash", 0, kPage), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code("/../etc/passwd", 0, kPage), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code("/a/b", 0, kPage), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code("/..", 0, kPage), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(obj.name(), 0, 0), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(obj.name(), 0, kPage + 1), absl::StatusCode::kInvalidArgument);  // too small
  EXPECT_EQ(code(obj.name(), 100, 8), absl::StatusCode::kInvalidArgument);        // unaligned
  EXPECT_EQ(code(obj.name(), kPage, ~uint64_t{0}), absl::StatusCode::kInvalidArgument);
  absl::Status small =
      registry.RegisterShm("t", obj.name(), 0, 2 * kPage, RegionKind::kSystemShm).status();
  EXPECT_NE(small.message().find("smaller than"), std::string::npos) << small;
  EXPECT_EQ(registry.total_regions(), 0);
}

// A tenant maps only its own names: never another tenant's object, nor another program's.
TEST(RegionRegistryTest, ATenantRegistersOnlyItsOwnShmNames) {
  ManualClock clock;
  RegionRegistry registry({}, nullptr, &clock);
  EXPECT_EQ(ShmNamePrefix(""), "/attnd-");
  EXPECT_EQ(ShmNamePrefix("a.b"), "/attnd-a.b.");
  ShmObject alices(kPage, "alice"), dotted(kPage, "alice.x"), open(kPage, "");
  auto status = [&](absl::string_view tenant, const std::string& name) {
    return registry.RegisterShm(tenant, name, 0, kPage, RegionKind::kSystemShm).status();
  };
  EXPECT_TRUE(status("alice", alices.name()).ok());
  EXPECT_TRUE(status("alice.x", dotted.name()).ok());
  // Another tenant's object, whether the names share a prefix or not; rings alike.
  absl::Status s = status("bob", alices.name());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("\"/attnd-bob.\""), std::string::npos) << s;
  EXPECT_EQ(status("alice", dotted.name()).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(status("alice.x", alices.name()).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(registry.RegisterShm("bob", alices.name(), 0, kPage, RegionKind::kRing).status().code(),
            absl::StatusCode::kInvalidArgument);
  // Without authentication (tenant ""), any name under "/attnd-", but nothing else.
  EXPECT_TRUE(status("", open.name()).ok());
  EXPECT_TRUE(status("", alices.name()).ok());
  EXPECT_EQ(status("alice", open.name()).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(status("", "/attnd-").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(status("alice", "/attnd-alice.").code(), absl::StatusCode::kInvalidArgument);
  const std::string foreign = absl::StrCat("/regions-test-foreign-", getpid());
  const int fd = shm_open(foreign.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  ASSERT_GE(fd, 0) << std::strerror(errno);
  ASSERT_EQ(ftruncate(fd, kPage), 0);
  s = status("", foreign);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("another program's"), std::string::npos) << s;
  close(fd);
  shm_unlink(foreign.c_str());
  EXPECT_EQ(registry.total_regions(), 4);
  // A hard link in /dev/shm gives an object a second name, under any prefix: refused under both.
  ShmObject linked(kPage, "bob");
  const std::string second = ShmNamePrefix("bob") + "second-name";
  ASSERT_EQ(link(("/dev/shm" + alices.name()).c_str(), ("/dev/shm" + second).c_str()), 0)
      << std::strerror(errno);
  s = status("bob", second);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("hard links"), std::string::npos) << s;
  EXPECT_EQ(status("alice", alices.name()).code(), absl::StatusCode::kInvalidArgument);
  shm_unlink(second.c_str());
  EXPECT_TRUE(status("alice", alices.name()).ok());  // one name again
  EXPECT_TRUE(status("bob", linked.name()).ok());
}

TEST(RegionRegistryTest, TenantLimits) {
  ManualClock clock;
  RegionRegistryOptions options;
  options.max_regions_per_tenant = 2;
  options.max_bytes_per_tenant = 3 * kPage;
  RegionRegistry registry(options, nullptr, &clock);
  ShmObject obj(4 * kPage);
  ASSERT_TRUE(registry.RegisterShm("t", obj.name(), 0, kPage, RegionKind::kSystemShm).ok());
  // Bytes: 1 + 3 pages > 3.
  EXPECT_EQ(
      registry.RegisterShm("t", obj.name(), 0, 3 * kPage, RegionKind::kSystemShm).status().code(),
      absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(registry.RegisterShm("t", obj.name(), 0, kPage, RegionKind::kRing).ok());
  // Count: rings count too.
  EXPECT_EQ(registry.RegisterShm("t", obj.name(), 0, kPage, RegionKind::kSystemShm).status().code(),
            absl::StatusCode::kResourceExhausted);
  // Another tenant has its own budget (and its own objects).
  ShmObject theirs(kPage, "u");
  EXPECT_TRUE(registry.RegisterShm("u", theirs.name(), 0, kPage, RegionKind::kSystemShm).ok());
  EXPECT_EQ(registry.Usage("t").regions, 2);
  EXPECT_EQ(registry.Usage("t").bytes, static_cast<int64_t>(2 * kPage));
}

TEST(RegionRegistryTest, ReclaimsIdleRegionsButNotLeasedOnesOrRings) {
  ManualClock clock;
  RegionRegistryOptions options;
  options.idle_timeout = absl::Seconds(10);
  RegionRegistry registry(options, nullptr, &clock);
  ShmObject obj(kPage);
  auto idle = registry.RegisterShm("t", obj.name(), 0, kPage, RegionKind::kSystemShm);
  auto busy = registry.RegisterShm("t", obj.name(), 0, kPage, RegionKind::kSystemShm);
  auto ring = registry.RegisterShm("t", obj.name(), 0, kPage, RegionKind::kRing);
  ASSERT_TRUE(idle.ok() && busy.ok() && ring.ok());
  absl::StatusOr<RegionLease> lease = registry.Acquire("t", (*busy)->id);
  ASSERT_TRUE(lease.ok());
  clock.Advance(absl::Seconds(5));
  EXPECT_TRUE(registry.ReclaimIdle().empty());
  clock.Advance(absl::Seconds(6));
  std::vector<std::shared_ptr<const Region>> removed = registry.ReclaimIdle();
  ASSERT_EQ(removed.size(), 1u);
  EXPECT_EQ(removed[0]->id, (*idle)->id);
  EXPECT_EQ(registry.Acquire("t", (*idle)->id).status().code(), absl::StatusCode::kNotFound);
  // The busy one's idle time starts when its lease ends.
  *lease = RegionLease();
  clock.Advance(absl::Seconds(9));
  EXPECT_TRUE(registry.ReclaimIdle().empty());
  clock.Advance(absl::Seconds(2));
  EXPECT_EQ(registry.ReclaimIdle().size(), 1u);
  EXPECT_EQ(registry.total_regions(), 1);  // the ring
  EXPECT_TRUE(registry.AcquireRing("t", (*ring)->id).ok());
  EXPECT_EQ(registry.Acquire("t", (*ring)->id).status().code(), absl::StatusCode::kNotFound);
}

TEST(RegionRegistryTest, CheckRange) {
  Region r;
  r.id = "r";
  r.bytes = 1024;
  EXPECT_TRUE(CheckRange(r, 0, 1024, 2, 1024).ok());
  EXPECT_TRUE(CheckRange(r, 512, 512, 4, 512).ok());
  EXPECT_EQ(CheckRange(r, 1, 8, 2, 8).code(), absl::StatusCode::kInvalidArgument);  // misaligned
  EXPECT_EQ(CheckRange(r, 1000, 32, 2, 32).code(), absl::StatusCode::kInvalidArgument);  // past end
  EXPECT_EQ(CheckRange(r, 2048, 0, 2, 0).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CheckRange(r, 8, ~uint64_t{0}, 2, 8).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CheckRange(r, 0, 16, 2, 32).code(), absl::StatusCode::kInvalidArgument);  // size
}

TEST(RegionRegistryTest, TruncationIsDetectedAndASigbusIsCaught) {
  ManualClock clock;
  RegionRegistry registry({}, nullptr, &clock);
  ShmObject obj(4 * kPage);
  auto region = registry.RegisterShm("t", obj.name(), 0, 4 * kPage, RegionKind::kSystemShm);
  ASSERT_TRUE(region.ok());
  std::vector<char> buf(4 * kPage, 1);
  EXPECT_TRUE(CheckStillMapped(**region).ok());
  EXPECT_TRUE(GuardedCopy((*region)->base, buf.data(), buf.size()));
  EXPECT_TRUE(GuardedCopy(buf.data(), (*region)->base, buf.size()));
  obj.Truncate(kPage);
  absl::Status shrank = CheckStillMapped(**region);
  EXPECT_EQ(shrank.code(), absl::StatusCode::kFailedPrecondition) << shrank;
  // The first page is still there; the rest raises SIGBUS, which the guard turns into false.
  EXPECT_TRUE(GuardedCopy(buf.data(), (*region)->base, kPage));
  EXPECT_FALSE(GuardedCopy(buf.data(), (*region)->base, 2 * kPage));
  EXPECT_FALSE(GuardedCopy((*region)->base + 2 * kPage, buf.data(), kPage));
  // And again: the guard is re-armed after a fault.
  EXPECT_FALSE(GuardedCopy(buf.data(), (*region)->base + 3 * kPage, 16));
  EXPECT_TRUE(GuardedCopy(buf.data(), (*region)->base, 16));
}

TEST(RegionRegistryTest, CudaIpcHandlesAreOpenedOncePerHandle) {
  ManualClock clock;
  {
    RegionRegistry no_cuda({}, nullptr, &clock);
    EXPECT_EQ(no_cuda.RegisterCudaIpc("t", std::string(64, 'h'), 16).status().code(),
              absl::StatusCode::kFailedPrecondition);
  }
  FakeOpener opener;
  {
    RegionRegistry registry({}, &opener, &clock);
    EXPECT_EQ(registry.RegisterCudaIpc("t", "short", 16).status().code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(registry.RegisterCudaIpc("t", std::string(64, 'x'), 16).status().code(),
              absl::StatusCode::kInvalidArgument);
    const std::string handle(64, 'h');
    // Larger than the allocation: refused, and the mapping opened for it is closed again.
    EXPECT_EQ(registry.RegisterCudaIpc("t", handle, 8192).status().code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(opener.opens, 1);
    EXPECT_EQ(opener.closes, 1);
    auto a = registry.RegisterCudaIpc("t", handle, 4096);
    auto b = registry.RegisterCudaIpc("t", handle, 1024);
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_EQ(opener.opens, 2);  // one open for both
    EXPECT_EQ((*a)->base, &opener.memory[0]);
    EXPECT_TRUE(CheckStillMapped(**a).ok());
    EXPECT_TRUE(registry.Unregister("t", (*a)->id, false).ok());
    EXPECT_EQ(opener.closes, 1);  // b still maps it
    EXPECT_TRUE(registry.Unregister("t", (*b)->id, false).ok());
    EXPECT_EQ(opener.closes, 2);
    ASSERT_TRUE(registry.RegisterCudaIpc("t", handle, 64).ok());
  }
  EXPECT_EQ(opener.closes, 3);  // the registry's destructor closes what is left
}

// torch's untyped_storage()._share_cuda_()[1] of newer torch (2.11 for one): version 2, type,
// payload.
std::string TorchHandle(char type, absl::string_view payload) {
  return absl::StrCat(std::string(1, '\x02'), std::string(1, type), payload);
}

TEST(RegionRegistryTest, TorchVersionedCudaMallocHandleOpensItsIpcHandle) {
  ManualClock clock;
  FakeOpener opener;
  RegionRegistry registry({}, &opener, &clock);
  std::string ipc(64, 'h');
  ipc[0] = '\x02';  // a raw handle may start with the version byte: 64 bytes is always raw
  ipc[1] = 'c';
  ipc[63] = 'z';
  auto raw = registry.RegisterCudaIpc("t", ipc, 128);
  ASSERT_TRUE(raw.ok()) << raw.status();
  EXPECT_EQ(opener.opened, ipc);
  // The 66-byte form of the same allocation is the same handle: no second open.
  auto torch = registry.RegisterCudaIpc("t", TorchHandle('c', ipc), 256);
  ASSERT_TRUE(torch.ok()) << torch.status();
  EXPECT_EQ(opener.opens, 1);
  EXPECT_EQ((*torch)->base, &opener.memory[0]);
  EXPECT_EQ((*torch)->bytes, 256u);
  ASSERT_TRUE(registry.Unregister("t", (*raw)->id, false).ok());
  ASSERT_TRUE(registry.Unregister("t", (*torch)->id, false).ok());
  EXPECT_EQ(opener.closes, 1);
  const std::string other(64, 'k');
  ASSERT_TRUE(registry.RegisterCudaIpc("t", TorchHandle('c', other), 64).ok());
  EXPECT_EQ(opener.opened, other);
  EXPECT_EQ(opener.opens, 2);
}

TEST(RegionRegistryTest, TorchHandlesCudaIpcCannotOpenAreRefused) {
  ManualClock clock;
  FakeOpener opener;
  RegionRegistry registry({}, &opener, &clock);
  // Expandable segment: a 24-byte header (pid, segment size, handle count), one POSIX fd.
  std::string header(24, '\0');
  header[8] = 0x20;  // segment size 2 MiB (little-endian 0x200000)
  header[16] = 1;    // one handle
  const std::string expandable = TorchHandle('e', header + std::string(4, '\x07'));
  absl::Status s = registry.RegisterCudaIpc("t", expandable, 64).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("expandable segment"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("expandable_segments:False"));
  // The same with a fabric handle (64 bytes after the header).
  s = registry.RegisterCudaIpc("t", TorchHandle('e', header + std::string(64, 'f')), 64).status();
  EXPECT_THAT(std::string(s.message()), HasSubstr("expandable segment"));
  // 66 bytes of another version or type, and a truncated versioned handle.
  for (const std::string& bad :
       {std::string(1, '\x03') + "c" + std::string(64, 'h'), TorchHandle('q', std::string(64, 'h')),
        TorchHandle('c', std::string(63, 'h')), std::string(65, 'h'), std::string(1, '\x02')}) {
    s = registry.RegisterCudaIpc("t", bad, 64).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad.size();
    EXPECT_THAT(std::string(s.message()), HasSubstr("cudaIpcMemHandle_t (64 bytes) or torch's"));
    EXPECT_THAT(std::string(s.message()), HasSubstr(absl::StrCat("got ", bad.size(), " bytes")));
  }
  EXPECT_EQ(opener.opens, 0);  // nothing was opened for any of them
  EXPECT_EQ(registry.total_regions(), 0);
}

}  // namespace
}  // namespace attnd
