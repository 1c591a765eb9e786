#include "client/cuda_buffer.h"

#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace attnd {
namespace client {
namespace {

absl::Status Check(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return absl::OkStatus();
  // No device (or no driver) is the caller's environment, not a bug: FAILED_PRECONDITION.
  const absl::StatusCode code = (err == cudaErrorNoDevice || err == cudaErrorInsufficientDriver)
                                    ? absl::StatusCode::kFailedPrecondition
                                    : absl::StatusCode::kInternal;
  return absl::Status(code, absl::StrCat(what, ": ", cudaGetErrorString(err)));
}

}  // namespace

bool ClientBuiltWithCuda() { return true; }

absl::StatusOr<std::unique_ptr<DeviceBuffer>> DeviceBuffer::Create(size_t bytes, int device) {
  if (bytes == 0) return absl::InvalidArgumentError("a device buffer needs at least one byte");
  absl::Status s = Check(cudaSetDevice(device), "cudaSetDevice");
  if (!s.ok()) return s;
  void* ptr = nullptr;
  s = Check(cudaMalloc(&ptr, bytes), "cudaMalloc");
  if (!s.ok()) return s;
  s = Check(cudaMemset(ptr, 0, bytes), "cudaMemset");
  if (!s.ok()) {
    cudaFree(ptr);
    return s;
  }
  return std::unique_ptr<DeviceBuffer>(new DeviceBuffer(ptr, bytes, device));
}

DeviceBuffer::~DeviceBuffer() {
  cudaSetDevice(device_);
  cudaFree(ptr_);
}

absl::Status DeviceBuffer::Write(size_t offset, const void* src, size_t n) {
  if (offset > size_ || n > size_ - offset) return absl::OutOfRangeError("write past the buffer");
  return Check(cudaMemcpy(static_cast<char*>(ptr_) + offset, src, n, cudaMemcpyHostToDevice),
               "cudaMemcpy to the device");
}

absl::Status DeviceBuffer::Read(size_t offset, void* dst, size_t n) const {
  if (offset > size_ || n > size_ - offset) return absl::OutOfRangeError("read past the buffer");
  return Check(cudaMemcpy(dst, static_cast<const char*>(ptr_) + offset, n, cudaMemcpyDeviceToHost),
               "cudaMemcpy from the device");
}

absl::StatusOr<std::string> DeviceBuffer::IpcHandle() const {
  cudaIpcMemHandle_t handle;
  absl::Status s = Check(cudaIpcGetMemHandle(&handle, ptr_), "cudaIpcGetMemHandle");
  if (!s.ok()) return s;
  return std::string(reinterpret_cast<const char*>(&handle), sizeof(handle));
}

absl::StatusOr<std::string> DeviceBuffer::DeviceUuid(int device) {
  cudaDeviceProp prop;
  absl::Status s = Check(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
  if (!s.ok()) return s;
  const unsigned char* u = reinterpret_cast<const unsigned char*>(prop.uuid.bytes);
  char buf[64];
  std::snprintf(buf, sizeof(buf),
                "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", u[0],
                u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13],
                u[14], u[15]);
  return std::string(buf);
}

absl::StatusOr<std::unique_ptr<RingEvents>> RingEvents::Open(const std::string& ready_handle,
                                                             const std::string& done_handle,
                                                             int device) {
  cudaIpcEventHandle_t handles[2];
  if (ready_handle.size() != sizeof(handles[0]) || done_handle.size() != sizeof(handles[0])) {
    return absl::InternalError(absl::StrCat("attnd sent event handles of ", ready_handle.size(),
                                            " and ", done_handle.size(), " bytes; a ",
                                            "cudaIpcEventHandle_t is ", sizeof(handles[0])));
  }
  std::memcpy(&handles[0], ready_handle.data(), sizeof(handles[0]));
  std::memcpy(&handles[1], done_handle.data(), sizeof(handles[1]));
  ATTND_RETURN_IF_ERROR(Check(cudaSetDevice(device), "cudaSetDevice"));
  cudaEvent_t events[2] = {nullptr, nullptr};
  for (int i = 0; i < 2; ++i) {
    absl::Status s = Check(cudaIpcOpenEventHandle(&events[i], handles[i]),
                           "cudaIpcOpenEventHandle (attnd must run on this host and GPU)");
    if (!s.ok()) {
      if (i == 1) cudaEventDestroy(events[0]);
      return s;
    }
  }
  return std::unique_ptr<RingEvents>(new RingEvents(events[0], events[1], device));
}

RingEvents::~RingEvents() {
  cudaSetDevice(device_);
  cudaEventDestroy(static_cast<cudaEvent_t>(ready_));
  cudaEventDestroy(static_cast<cudaEvent_t>(done_));
}

absl::Status RingEvents::RecordReady(void* stream) {
  return Check(cudaEventRecord(static_cast<cudaEvent_t>(ready_), static_cast<cudaStream_t>(stream)),
               "recording the ring's ready event");
}

absl::Status RingEvents::WaitDone(void* stream) {
  return Check(
      cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), static_cast<cudaEvent_t>(done_), 0),
      "waiting for the ring's done event");
}

absl::Status RingEvents::Synchronize(void* stream, int device) {
  ATTND_RETURN_IF_ERROR(Check(cudaSetDevice(device), "cudaSetDevice"));
  return Check(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)), "cudaStreamSynchronize");
}

}  // namespace client
}  // namespace attnd
