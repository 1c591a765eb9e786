// cuda_buffer.h without a CUDA toolkit at build time: every call says so.
#include "client/cuda_buffer.h"

namespace attnd {
namespace client {
namespace {
absl::Status NoCuda() {
  return absl::FailedPreconditionError(
      "built without CUDA: this attnctl has no CUDA runtime (rebuild with a CUDA toolkit for the "
      "cuda-ipc transport)");
}
}  // namespace

bool ClientBuiltWithCuda() { return false; }

absl::StatusOr<std::unique_ptr<DeviceBuffer>> DeviceBuffer::Create(size_t, int) { return NoCuda(); }
DeviceBuffer::~DeviceBuffer() = default;
absl::Status DeviceBuffer::Write(size_t, const void*, size_t) { return NoCuda(); }
absl::Status DeviceBuffer::Read(size_t, void*, size_t) const { return NoCuda(); }
absl::StatusOr<std::string> DeviceBuffer::IpcHandle() const { return NoCuda(); }
absl::StatusOr<std::string> DeviceBuffer::DeviceUuid(int) { return NoCuda(); }

absl::StatusOr<std::unique_ptr<RingEvents>> RingEvents::Open(const std::string&, const std::string&,
                                                             int) {
  return NoCuda();
}
RingEvents::~RingEvents() = default;
absl::Status RingEvents::RecordReady(void*) { return NoCuda(); }
absl::Status RingEvents::WaitDone(void*) { return NoCuda(); }
absl::Status RingEvents::Synchronize(void*, int) { return NoCuda(); }

}  // namespace client
}  // namespace attnd
