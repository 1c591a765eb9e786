// Device memory for the CUDA IPC transport (docs/regions.md): a cudaMalloc'd buffer that can be
// filled from and read back to the host and shared with attnd through cudaIpcGetMemHandle.
// Built from cuda_buffer.cc with a CUDA toolkit and from cuda_buffer_stub.cc without one (then
// Create fails with FAILED_PRECONDITION "built without CUDA").
#ifndef ATTND_CLIENT_CUDA_BUFFER_H_
#define ATTND_CLIENT_CUDA_BUFFER_H_

#include <cstddef>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace attnd {
namespace client {

// True when this build has the CUDA runtime (the toolkit was found at build time).
bool ClientBuiltWithCuda();

class DeviceBuffer {
 public:
  // cudaMalloc(bytes) on `device`, zero-filled.
  static absl::StatusOr<std::unique_ptr<DeviceBuffer>> Create(size_t bytes, int device = 0);
  ~DeviceBuffer();
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  size_t size() const { return size_; }
  void* device_ptr() const { return ptr_; }
  // Host -> device / device -> host copies of [offset, offset + n), synchronous.
  absl::Status Write(size_t offset, const void* src, size_t n);
  absl::Status Read(size_t offset, void* dst, size_t n) const;
  // cudaIpcGetMemHandle of the allocation: the 64 bytes RegisterCudaIpc takes.
  absl::StatusOr<std::string> IpcHandle() const;
  // The device's UUID as "GPU-xxxxxxxx-..." (GetServerInfo.regions.device_uuid's form).
  static absl::StatusOr<std::string> DeviceUuid(int device = 0);

 private:
  DeviceBuffer(void* ptr, size_t size, int device) : ptr_(ptr), size_(size), device_(device) {}
  void* ptr_;
  size_t size_;
  int device_;
};

// The two CUDA events of a device-ordered ring (docs/regions.md, "Device-ordered rings"), opened
// from the IPC handles attnd returned: the client records `ready` on its stream once the inputs are
// written, and makes its stream wait for `done` before it reads the output.
class RingEvents {
 public:
  static absl::StatusOr<std::unique_ptr<RingEvents>> Open(const std::string& ready_handle,
                                                          const std::string& done_handle,
                                                          int device = 0);
  ~RingEvents();
  RingEvents(const RingEvents&) = delete;
  RingEvents& operator=(const RingEvents&) = delete;

  // `stream` is a cudaStream_t (null: the legacy default stream).
  absl::Status RecordReady(void* stream);
  absl::Status WaitDone(void* stream);
  // Waits on the host for everything queued on `stream` (the bench's end of a step).
  static absl::Status Synchronize(void* stream, int device = 0);

 private:
  RingEvents(void* ready, void* done, int device) : ready_(ready), done_(done), device_(device) {}
  void* ready_;  // cudaEvent_t
  void* done_;
  int device_;
};

}  // namespace client
}  // namespace attnd

#endif  // ATTND_CLIENT_CUDA_BUFFER_H_
