#include "client/regions.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <random>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "base/status_macros.h"

namespace attnd {
namespace client {
namespace {

std::string RandomShmName(absl::string_view prefix) {
  std::random_device rd;
  std::string name(prefix);
  for (int i = 0; i < 4; ++i) absl::StrAppend(&name, absl::StrFormat("%08x", rd()));
  return name;
}

// The server's shm name prefix for the caller; an older server says nothing: its names are the
// unauthenticated ones.
absl::string_view ShmPrefixOf(const v1::GetServerInfoResponse& info) {
  const std::string& prefix = info.regions().shm_name_prefix();
  return prefix.empty() ? kDefaultShmPrefix : absl::string_view(prefix);
}

absl::Status Errno(absl::string_view what, int err) {
  return absl::InternalError(absl::StrCat(what, ": ", std::strerror(err)));
}

}  // namespace

// ---- ShmBuffer ----

absl::StatusOr<std::unique_ptr<ShmBuffer>> ShmBuffer::Create(size_t bytes,
                                                             absl::string_view prefix) {
  if (bytes == 0) return absl::InvalidArgumentError("a shm buffer needs at least one byte");
  bool name_ok = !prefix.empty() && prefix[0] == '/' && prefix.size() <= 200;
  for (size_t i = 1; name_ok && i < prefix.size(); ++i) {
    const char c = prefix[i];
    name_ok = absl::ascii_isalnum(c) || c == '.' || c == '_' || c == '-';
  }
  if (!name_ok) {
    return absl::InvalidArgumentError(
        absl::StrCat("shm name prefix \"", absl::CHexEscape(prefix.substr(0, 64)),
                     "\" is not \"/\" followed by at most 199 of [A-Za-z0-9._-]"));
  }
  std::string name;
  int fd = -1;
  for (int attempt = 0; attempt < 8 && fd < 0; ++attempt) {
    name = RandomShmName(prefix);
    fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    if (fd < 0 && errno != EEXIST) return Errno(absl::StrCat("shm_open ", name), errno);
  }
  if (fd < 0) return absl::InternalError("shm_open: no free name after 8 attempts");
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    const int err = errno;
    close(fd);
    shm_unlink(name.c_str());
    return Errno(absl::StrCat("ftruncate ", name, " to ", bytes, " bytes"), err);
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    const int err = errno;
    close(fd);
    shm_unlink(name.c_str());
    return Errno(absl::StrCat("mmap ", name), err);
  }
  return std::unique_ptr<ShmBuffer>(new ShmBuffer(name, fd, static_cast<uint8_t*>(p), bytes));
}

ShmBuffer::~ShmBuffer() {
  shm_unlink(name_.c_str());
  munmap(data_, size_);
  close(fd_);
}

// ---- RegisteredRegion ----

absl::StatusOr<RegisteredRegion> RegisteredRegion::Shm(AttndClient& client, const ShmBuffer& buffer,
                                                       uint64_t offset, uint64_t bytes) {
  if (bytes == 0) {
    if (offset > buffer.size()) return absl::InvalidArgumentError("offset past the buffer's end");
    bytes = buffer.size() - offset;
  }
  ATTND_ASSIGN_OR_RETURN(std::string id, client.RegisterShm(buffer.name(), offset, bytes));
  return RegisteredRegion(&client, std::move(id), bytes);
}

absl::StatusOr<RegisteredRegion> RegisteredRegion::CudaIpc(AttndClient& client,
                                                           const std::string& handle,
                                                           uint64_t bytes) {
  ATTND_ASSIGN_OR_RETURN(std::string id, client.RegisterCudaIpc(handle, bytes));
  return RegisteredRegion(&client, std::move(id), bytes);
}

RegisteredRegion& RegisteredRegion::operator=(RegisteredRegion&& other) noexcept {
  if (this != &other) {
    if (client_ != nullptr && !id_.empty()) client_->UnregisterRegion(id_).IgnoreError();
    client_ = other.client_;
    id_ = std::move(other.id_);
    size_ = other.size_;
    other.client_ = nullptr;
    other.id_.clear();
  }
  return *this;
}

RegisteredRegion::~RegisteredRegion() {
  if (client_ != nullptr && !id_.empty()) client_->UnregisterRegion(id_).IgnoreError();
}

v1::RegionRef RegisteredRegion::Ref(uint64_t offset, uint64_t bytes) const {
  v1::RegionRef r;
  r.set_region_id(id_);
  r.set_offset(offset);
  r.set_byte_size(bytes);
  return r;
}

absl::Status RegisteredRegion::Unregister() {
  if (client_ == nullptr || id_.empty()) return absl::FailedPreconditionError("not registered");
  absl::Status s = client_->UnregisterRegion(id_);
  client_ = nullptr;
  id_.clear();
  return s;
}

std::string RegisteredRegion::Release() {
  client_ = nullptr;
  return std::exchange(id_, std::string());
}

absl::StatusOr<std::unique_ptr<ShmBuffer>> ShmBuffer::CreateFor(AttndClient& client, size_t bytes) {
  ATTND_ASSIGN_OR_RETURN(v1::GetServerInfoResponse info, client.Info());
  if (!info.has_regions()) {
    return absl::FailedPreconditionError("the server takes no tensor regions or rings");
  }
  return Create(bytes, ShmPrefixOf(info));
}

// ---- RingClient ----

absl::StatusOr<std::unique_ptr<RingClient>> RingClient::Layout(const RingOptions& options,
                                                               absl::string_view prefix) {
  if (options.half_bytes <= ring::kLengthBytes || options.half_bytes % 4096 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ring half_bytes must be a positive multiple of 4096, got ", options.half_bytes));
  }
  ATTND_ASSIGN_OR_RETURN(std::unique_ptr<ShmBuffer> buffer,
                         ShmBuffer::Create(ring::kHeaderBytes + 2 * options.half_bytes, prefix));
  // The mapping is zero-filled: every sequence word starts at 0 and nothing is in flight.
  ring::Header* h = reinterpret_cast<ring::Header*>(buffer->data());
  h->magic = ring::kMagic;
  h->version = ring::kVersion;
  h->reserved = 0;
  h->half_bytes = options.half_bytes;
  std::atomic_thread_fence(std::memory_order_seq_cst);
  return std::unique_ptr<RingClient>(new RingClient(std::move(buffer), options));
}

absl::StatusOr<std::unique_ptr<RingClient>> RingClient::CreateUnopened(const RingOptions& options) {
  return Layout(options, kDefaultShmPrefix);
}

absl::StatusOr<std::unique_ptr<RingClient>> RingClient::Open(AttndClient& client,
                                                             const RingOptions& options) {
  ATTND_ASSIGN_OR_RETURN(v1::GetServerInfoResponse info, client.Info());
  ATTND_ASSIGN_OR_RETURN(std::unique_ptr<RingClient> ring, Layout(options, ShmPrefixOf(info)));
  ATTND_ASSIGN_OR_RETURN(v1::OpenRingResponse opened,
                         client.OpenRing(ring->buffer_->name(), ring->buffer_->size()));
  ring->client_ = &client;
  ring->ring_id_ = opened.ring_id();
  return ring;
}

RingClient::~RingClient() { Close().IgnoreError(); }

absl::Status RingClient::Close() {
  if (client_ == nullptr || ring_id_.empty()) return absl::OkStatus();
  absl::Status s = client_->CloseRing(ring_id_);
  client_ = nullptr;
  return s;
}

absl::Status RingClient::WaitResponse(uint32_t want, absl::Time deadline, bool count) {
  ring::Header* h = header();
  auto answered = [&] { return h->response_seq.load(std::memory_order_acquire) == want; };
  if (answered()) {
    if (count) ++stats_.answered_spinning;
    return absl::OkStatus();
  }
  const absl::Time spin_end = absl::Now() + options_.spin;
  for (int i = 0;; ++i) {
    if (answered()) {
      if (count) ++stats_.answered_spinning;
      return absl::OkStatus();
    }
    if (h->closed.load(std::memory_order_acquire) != 0) break;
    // Reading the clock costs more than a load: look at it every 64 spins.
    if ((i & 63) == 63 && absl::Now() >= spin_end) break;
  }
  // Sleep: announce it, then re-check (the server sets response_seq before it reads
  // client_sleeping, so one of the two sides sees the other).
  h->client_sleeping.store(1, std::memory_order_seq_cst);
  absl::Status result = absl::OkStatus();
  while (true) {
    const uint32_t seen = h->response_seq.load(std::memory_order_seq_cst);
    if (seen == want) {
      if (count) ++stats_.answered_sleeping;
      break;
    }
    if (h->closed.load(std::memory_order_acquire) != 0) {
      result = absl::UnavailableError("the ring was closed by the server");
      break;
    }
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      result = absl::DeadlineExceededError(
          absl::StrCat("no answer in the ring within ", absl::FormatDuration(options_.timeout)));
      break;
    }
    const int64_t us = std::max<int64_t>(
        1, absl::ToInt64Microseconds(std::min(options_.sleep_slice, deadline - now)));
    ring::FutexWait(&h->response_seq, seen, us);
  }
  h->client_sleeping.store(0, std::memory_order_relaxed);
  if (result.ok() || !absl::IsUnavailable(result)) return result;
  // Closed, but the answer may have landed just before: prefer it.
  if (answered()) return absl::OkStatus();
  return result;
}

absl::StatusOr<v1::SessionResponse> RingClient::RoundTrip(const v1::SessionRequest& request) {
  ring::Header* h = header();
  const absl::Time deadline = absl::Now() + options_.timeout;
  if (h->closed.load(std::memory_order_acquire) != 0) {
    return absl::UnavailableError("the ring was closed by the server");
  }
  const size_t size = request.ByteSizeLong();
  if (size > capacity()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("request of ", size, " bytes exceeds the ring's ", capacity(), "-byte half"));
  }
  // 1. Nothing in flight: a request abandoned past its deadline must be answered first.
  const uint32_t seq = h->request_seq.load(std::memory_order_relaxed);
  ATTND_RETURN_IF_ERROR(WaitResponse(seq, deadline, /*count=*/false));
  // 2. The request, its length first.
  uint8_t* half = buffer_->data() + ring::RequestOffset();
  const uint64_t length = size;
  std::memcpy(half, &length, sizeof(length));
  if (!request.SerializeToArray(half + ring::kLengthBytes, static_cast<int>(size))) {
    return absl::InternalError("serializing the request failed");
  }
  const uint32_t next = seq + 1;  // wraps at 2^32
  h->request_seq.store(next, std::memory_order_seq_cst);
  if (h->server_sleeping.load(std::memory_order_seq_cst) != 0) {
    ring::FutexWake(&h->request_seq);
    ++stats_.server_wakes;
  }
  ++stats_.round_trips;
  // 3. The answer.
  ATTND_RETURN_IF_ERROR(WaitResponse(next, deadline, /*count=*/true));
  const uint8_t* out = buffer_->data() + ring::ResponseOffset(options_.half_bytes);
  uint64_t out_length;
  std::memcpy(&out_length, out, sizeof(out_length));
  if (out_length > capacity()) {
    return absl::InternalError(absl::StrCat("the ring's response claims ", out_length,
                                            " bytes; the half holds ", capacity()));
  }
  v1::SessionResponse response;
  if (!response.ParseFromArray(out + ring::kLengthBytes, static_cast<int>(out_length))) {
    return absl::InternalError("malformed SessionResponse in the ring");
  }
  if (response.tag() != request.tag()) {
    return absl::InternalError(
        absl::StrCat("the ring answered tag ", response.tag(), " for request tag ", request.tag()));
  }
  return response;
}

absl::StatusOr<PrefillResult> RingClient::Prefill(const PrefillInput& input) {
  v1::SessionRequest request;
  request.set_tag(next_tag_++);
  internal::BuildPrefill(input, request.mutable_prefill());
  ATTND_ASSIGN_OR_RETURN(v1::SessionResponse response, RoundTrip(request));
  if (response.code() != 0) {
    return absl::Status(static_cast<absl::StatusCode>(response.code()), response.message());
  }
  if (!response.has_prefill())
    return absl::InternalError("the ring answered a prefill without one");
  return internal::ParsePrefill(response.prefill());
}

absl::StatusOr<PrefillResult> RingClient::Prefill(const std::string& sequence_id, int32_t layer,
                                                  const HostTensor& q, const HostTensor& k,
                                                  const HostTensor& v,
                                                  std::optional<int64_t> prompt_len,
                                                  v1::QLayout q_layout) {
  PrefillInput in;
  in.sequence_id = sequence_id;
  in.layer = layer;
  in.q = q;
  in.k = k;
  in.v = v;
  in.prompt_len = prompt_len;
  in.q_layout = q_layout;
  return Prefill(in);
}

absl::StatusOr<std::vector<DecodeResult>> RingClient::Decode(
    int32_t layer, const std::vector<DecodeInput>& entries) {
  v1::SessionRequest request;
  request.set_tag(next_tag_++);
  internal::BuildDecode(layer, entries, request.mutable_decode());
  ATTND_ASSIGN_OR_RETURN(v1::SessionResponse response, RoundTrip(request));
  if (response.code() != 0) {
    return absl::Status(static_cast<absl::StatusCode>(response.code()), response.message());
  }
  if (!response.has_decode()) return absl::InternalError("the ring answered a decode without one");
  return internal::ParseDecode(response.decode(), entries.size());
}

}  // namespace client
}  // namespace attnd
