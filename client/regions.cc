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

absl::Status RingClient::CheckOptions(const RingOptions& options) {
  if (options.half_bytes <= ring::kLengthBytes || options.half_bytes % 4096 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ring half_bytes must be a positive multiple of 4096, got ", options.half_bytes));
  }
  if (options.slots == 0 || !ring::ValidSlots(options.slots)) {
    return absl::InvalidArgumentError(absl::StrCat("ring slots must be a power of two from 1 to ",
                                                   ring::kMaxSlots, ", got ", options.slots));
  }
  if (options.slots > 1 && options.version != ring::v2::kVersion) {
    return absl::InvalidArgumentError(absl::StrCat("a ring of ", options.slots,
                                                   " slots needs version ", ring::v2::kVersion,
                                                   " frames (RingOptions::version)"));
  }
  if (options.slots > 1 && options.device_events) {
    return absl::InvalidArgumentError(
        "a device-ordered ring holds one request at a time: open one ring per micro-batch, or "
        "leave device_events off to use slots");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<RingClient>> RingClient::Layout(const RingOptions& options,
                                                               absl::string_view prefix) {
  ATTND_RETURN_IF_ERROR(CheckOptions(options));
  ATTND_ASSIGN_OR_RETURN(
      std::unique_ptr<ShmBuffer> buffer,
      ShmBuffer::Create(ring::kHeaderBytes + 2 * uint64_t{options.slots} * options.half_bytes,
                        prefix));
  // The mapping is zero-filled: every sequence word starts at 0 and nothing is in flight.
  ring::Header* h = reinterpret_cast<ring::Header*>(buffer->data());
  h->magic = ring::kMagic;
  h->version = options.version;
  h->slots = options.slots;
  h->half_bytes = options.half_bytes;
  std::atomic_thread_fence(std::memory_order_seq_cst);
  return std::unique_ptr<RingClient>(new RingClient(std::move(buffer), options));
}

absl::StatusOr<std::unique_ptr<RingClient>> RingClient::CreateUnopened(const RingOptions& options) {
  return Layout(options, kDefaultShmPrefix);
}

absl::StatusOr<std::unique_ptr<RingClient>> RingClient::Open(AttndClient& client,
                                                             const RingOptions& options) {
  ATTND_RETURN_IF_ERROR(CheckOptions(options));
  ATTND_ASSIGN_OR_RETURN(v1::GetServerInfoResponse info, client.Info());
  if (options.slots > 1 && options.slots > static_cast<uint32_t>(info.regions().max_ring_slots())) {
    return absl::FailedPreconditionError(
        absl::StrCat("this attnd holds at most ", std::max(info.regions().max_ring_slots(), 1),
                     " request(s) in flight per ring (GetServerInfo().regions.max_ring_slots); "
                     "RingOptions::slots "
                     "is ",
                     options.slots));
  }
  ATTND_ASSIGN_OR_RETURN(std::unique_ptr<RingClient> ring, Layout(options, ShmPrefixOf(info)));
  ATTND_ASSIGN_OR_RETURN(
      v1::OpenRingResponse opened,
      client.OpenRing(ring->buffer_->name(), ring->buffer_->size(), options.device_events));
  ring->client_ = &client;
  ring->ring_id_ = opened.ring_id();
  if (options.device_events) {
    ATTND_ASSIGN_OR_RETURN(
        ring->events_,
        RingEvents::Open(opened.ready_event(), opened.done_event(), options.cuda_device));
  }
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
  // Reached, with the words wrapping at 2^32: at most 2^31 behind.
  const auto reached = [want](uint32_t seen) { return static_cast<int32_t>(seen - want) >= 0; };
  auto answered = [&] { return reached(h->response_seq.load(std::memory_order_acquire)); };
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
    if (reached(seen)) {
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

template <typename Write>
absl::StatusOr<uint32_t> RingClient::Post(uint64_t size, absl::Time deadline, Write&& write,
                                          uint32_t ahead, bool publish) {
  ring::Header* h = header();
  if (h->closed.load(std::memory_order_acquire) != 0) {
    return absl::UnavailableError("the ring was closed by the server");
  }
  if (size > capacity()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("request of ", size, " bytes exceeds the ring's ", capacity(), "-byte half"));
  }
  // 1. Room: the slot's previous request answered (one abandoned past its deadline too), and
  // read out if it is a submitted decode (its answer's half is the next one's).
  const uint32_t next = h->request_seq.load(std::memory_order_relaxed) + 1 + ahead;  // wraps
  KeepAnswersOfSlot(next);
  ATTND_RETURN_IF_ERROR(WaitResponse(next - slot_count(), deadline, /*count=*/false));
  // 2. The request, its length first.
  uint8_t* half = buffer_->data() +
                  ring::RequestOffset(options_.half_bytes, ring::SlotOf(next, options_.slots));
  const uint64_t length = size;
  std::memcpy(half, &length, sizeof(length));
  ATTND_RETURN_IF_ERROR(write(half + ring::kLengthBytes));
  ++stats_.round_trips;
  if (!publish) return next;
  h->request_seq.store(next, std::memory_order_seq_cst);
  if (h->server_sleeping.load(std::memory_order_seq_cst) != 0) {
    ring::FutexWake(&h->request_seq);
    ++stats_.server_wakes;
  }
  return next;
}

absl::StatusOr<absl::string_view> RingClient::Await(uint32_t seq, absl::Time deadline) {
  ATTND_RETURN_IF_ERROR(WaitResponse(seq, deadline, /*count=*/true));
  const uint8_t* out = buffer_->data() +
                       ring::ResponseOffset(options_.half_bytes, ring::SlotOf(seq, options_.slots));
  uint64_t out_length;
  std::memcpy(&out_length, out, sizeof(out_length));
  if (out_length > capacity()) {
    return absl::InternalError(absl::StrCat("the ring's response claims ", out_length,
                                            " bytes; the half holds ", capacity()));
  }
  return absl::string_view(reinterpret_cast<const char*>(out + ring::kLengthBytes), out_length);
}

template <typename Write>
absl::StatusOr<absl::string_view> RingClient::Exchange(uint64_t size, Write&& write) {
  const absl::Time deadline = absl::Now() + options_.timeout;
  ATTND_ASSIGN_OR_RETURN(uint32_t seq, Post(size, deadline, std::forward<Write>(write)));
  return Await(seq, deadline);
}

void RingClient::KeepAnswersOfSlot(uint32_t next) {
  for (Pending& p : pending_) {
    // Posted at least a ring's worth of slots before `next` (wrapping): in next's slot or older.
    if (p.result.has_value() ||
        static_cast<int32_t>(next - p.seq) < static_cast<int32_t>(slot_count()))
      continue;
    p.result = CollectDecode(p);
  }
}

absl::StatusOr<v1::SessionResponse> RingClient::RoundTrip(const v1::SessionRequest& request) {
  if (options_.version == ring::v2::kVersion) {
    return absl::FailedPreconditionError(
        "RoundTrip sends a SessionRequest, which a version 1 ring carries; this ring carries "
        "version 2 frames (RingOptions::version)");
  }
  const size_t size = request.ByteSizeLong();
  ATTND_ASSIGN_OR_RETURN(absl::string_view bytes, Exchange(size, [&](uint8_t* at) {
                           if (!request.SerializeToArray(at, static_cast<int>(size))) {
                             return absl::InternalError("serializing the request failed");
                           }
                           return absl::OkStatus();
                         }));
  v1::SessionResponse response;
  if (!response.ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) {
    return absl::InternalError("malformed SessionResponse in the ring");
  }
  if (response.tag() != request.tag()) {
    return absl::InternalError(
        absl::StrCat("the ring answered tag ", response.tag(), " for request tag ", request.tag()));
  }
  return response;
}

// ---- Version 2 frames (proto/attnd/v1/ring_frame.h) ----

namespace {

namespace v2 = ring::v2;

// One tensor of a frame being built: its descriptor and, inline, the pieces of its bytes (one per
// entry of a decode batch), written back to back.
struct FrameTensorSpec {
  v2::Tensor t{};
  std::string region_id;
  std::vector<const std::string*> parts;
  uint64_t inline_bytes = 0;
};

absl::Status SetShape(absl::string_view name, std::optional<int64_t> batch,
                      const std::vector<int64_t>& dims, v2::Tensor* t) {
  const size_t rank = dims.size() + (batch.has_value() ? 1 : 0);
  if (rank > static_cast<size_t>(v2::kMaxRank)) {
    return absl::InvalidArgumentError(absl::StrCat(name, " has ", rank,
                                                   " dimensions; a version 2 ring frame carries "
                                                   "at most ",
                                                   v2::kMaxRank));
  }
  t->rank = static_cast<uint16_t>(rank);
  size_t i = 0;
  if (batch.has_value()) t->shape[i++] = *batch;
  for (int64_t d : dims) t->shape[i++] = d;
  return absl::OkStatus();
}

void SetRegion(const v1::RegionRef& ref, uint64_t bytes, FrameTensorSpec* spec) {
  spec->t.where = v2::kRegion;
  spec->region_id = ref.region_id();
  spec->t.offset = ref.offset();
  spec->t.bytes = bytes;
}

absl::Status FromArg(absl::string_view name, const TensorArg& arg, FrameTensorSpec* spec) {
  if (arg.ref.has_value()) {
    spec->t.dtype = static_cast<int32_t>(ToProtoDType(arg.ref->dtype));
    SetRegion(arg.ref->region, arg.ref->region.byte_size(), spec);
    return SetShape(name, std::nullopt, arg.ref->shape, &spec->t);
  }
  spec->t.where = v2::kInline;
  if (arg.host == nullptr) return absl::OkStatus();  // an empty tensor: the server says what lacks
  spec->t.dtype = static_cast<int32_t>(ToProtoDType(arg.host->dtype));
  spec->parts = {&arg.host->data};
  spec->inline_bytes = arg.host->data.size();
  return SetShape(name, std::nullopt, arg.host->shape, &spec->t);
}

absl::Status Unpackable(absl::string_view what, size_t i) {
  return absl::InvalidArgumentError(
      absl::StrCat("a version 2 ring frame carries a decode batch packed: ", what, "; entry ", i,
                   " differs from entry 0 (or use a version 1 ring: RingOptions::version = 1)"));
}

// Each entry's `name` tensor (host bytes or a reference) as one packed tensor [B, ...].
template <typename Host, typename Ref>
absl::Status Pack(absl::string_view name, const std::vector<DecodeInput>& entries, Host host,
                  Ref ref, FrameTensorSpec* spec) {
  const int64_t b = static_cast<int64_t>(entries.size());
  if (b == 0) {
    spec->t.where = v2::kInline;
    return absl::OkStatus();
  }
  const bool refs = ref(entries[0]).has_value();
  for (size_t i = 1; i < entries.size(); ++i) {
    if (ref(entries[i]).has_value() != refs) {
      return Unpackable(absl::StrCat(name, " inline in every entry or a reference in every one"),
                        i);
    }
  }
  if (refs) {
    const TensorRef& r0 = *ref(entries[0]);
    for (size_t i = 1; i < entries.size(); ++i) {
      const TensorRef& r = *ref(entries[i]);
      if (r.region.region_id() != r0.region.region_id() || r.dtype != r0.dtype ||
          r.shape != r0.shape || r.region.byte_size() != r0.region.byte_size() ||
          r.region.offset() != r0.region.offset() + i * r0.region.byte_size()) {
        return Unpackable(
            absl::StrCat(name, " references of one dtype and shape, back to back in one region"),
            i);
      }
    }
    spec->t.dtype = static_cast<int32_t>(ToProtoDType(r0.dtype));
    SetRegion(r0.region, static_cast<uint64_t>(b) * r0.region.byte_size(), spec);
    return SetShape(name, b, r0.shape, &spec->t);
  }
  const HostTensor& h0 = host(entries[0]);
  spec->t.where = v2::kInline;
  for (size_t i = 0; i < entries.size(); ++i) {
    const HostTensor& h = host(entries[i]);
    if (h.dtype != h0.dtype || h.shape != h0.shape) {
      return Unpackable(absl::StrCat(name, " of one dtype and shape in every entry"), i);
    }
    spec->parts.push_back(&h.data);
    spec->inline_bytes += h.data.size();
  }
  spec->t.dtype = static_cast<int32_t>(ToProtoDType(h0.dtype));
  return SetShape(name, b, h0.shape, &spec->t);
}

// A request frame's layout: the header, the ids' table, the ids, the region ids, then each inline
// tensor at a 64-byte offset.
struct FramePlan {
  v2::RequestHeader header{};
  std::vector<const std::string*> ids;
  FrameTensorSpec tensors[4];  // q, k, v, o
  std::vector<uint32_t> id_at;
  uint64_t size = 0;

  absl::Status Lay() {
    uint64_t at = sizeof(v2::RequestHeader);
    header.ids_offset = at;
    at += ids.size() * sizeof(v2::StrRef);
    id_at.clear();
    for (const std::string* id : ids) {
      id_at.push_back(static_cast<uint32_t>(at));
      at += id->size();
    }
    for (FrameTensorSpec& t : tensors) {
      if (t.t.where != v2::kRegion) continue;
      t.t.region_id = {static_cast<uint32_t>(at), static_cast<uint32_t>(t.region_id.size())};
      at += t.region_id.size();
    }
    if (at > UINT32_MAX) {
      return absl::InvalidArgumentError("the frame's ids take more than 4 GiB");
    }
    for (FrameTensorSpec& t : tensors) {
      if (t.t.where != v2::kInline) continue;
      at = v2::AlignUp(at, v2::kTensorAlign);
      t.t.offset = at;
      t.t.bytes = t.inline_bytes;
      at += t.inline_bytes;
    }
    header.q = tensors[0].t;
    header.k = tensors[1].t;
    header.v = tensors[2].t;
    header.o = tensors[3].t;
    size = at;
    return absl::OkStatus();
  }

  // Into the request half: the one copy of each inline tensor.
  void Write(uint8_t* f) const {
    std::memcpy(f, &header, sizeof(header));
    for (size_t i = 0; i < ids.size(); ++i) {
      const v2::StrRef ref{id_at[i], static_cast<uint32_t>(ids[i]->size())};
      std::memcpy(f + header.ids_offset + i * sizeof(ref), &ref, sizeof(ref));
      std::memcpy(f + id_at[i], ids[i]->data(), ids[i]->size());
    }
    for (const FrameTensorSpec& t : tensors) {
      if (t.t.where == v2::kRegion) {
        std::memcpy(f + t.t.region_id.offset, t.region_id.data(), t.region_id.size());
      }
      if (t.t.where != v2::kInline) continue;
      uint8_t* at = f + t.t.offset;
      for (const std::string* part : t.parts) {
        std::memcpy(at, part->data(), part->size());
        at += part->size();
      }
    }
  }
};

// A response frame's parts, every range checked against the frame.
struct FrameReply {
  v2::ResponseHeader header;
  std::vector<int64_t> lengths;
  absl::string_view o;
};

absl::StatusOr<FrameReply> ReadReply(absl::string_view frame, uint64_t tag, uint16_t op) {
  FrameReply r;
  v2::ResponseHeader& h = r.header;
  const auto inside = [&](uint64_t offset, uint64_t bytes) {
    return offset <= frame.size() && bytes <= frame.size() - offset;
  };
  if (frame.size() < sizeof(h)) {
    return absl::InternalError(
        absl::StrCat("the ring's response frame has ", frame.size(), " bytes, less than a header"));
  }
  std::memcpy(&h, frame.data(), sizeof(h));
  if (h.magic != v2::kResponseMagic || h.tag != tag) {
    return absl::InternalError(absl::StrCat("the ring answered magic 0x", absl::Hex(h.magic),
                                            " tag ", h.tag, " for request tag ", tag));
  }
  if (h.code != 0) {
    if (!inside(h.message_offset, h.message_bytes)) {
      return absl::InternalError("the ring's response frame's message lies outside it");
    }
    return absl::Status(static_cast<absl::StatusCode>(h.code),
                        frame.substr(h.message_offset, h.message_bytes));
  }
  if (h.op != op || h.rank > v2::kMaxRank || h.num_lengths > v2::kMaxSequences ||
      !inside(h.lengths_offset, uint64_t{h.num_lengths} * 8) || !inside(h.o_offset, h.o_bytes)) {
    return absl::InternalError("malformed response frame in the ring");
  }
  r.lengths.resize(h.num_lengths);
  if (h.num_lengths > 0) {
    std::memcpy(r.lengths.data(), frame.data() + h.lengths_offset, r.lengths.size() * 8);
  }
  r.o = frame.substr(h.o_offset, h.o_bytes);
  return r;
}

absl::StatusOr<DType> ReplyDType(const v2::ResponseHeader& h) {
  const DType dtype = static_cast<DType>(h.dtype);
  if (!IsKnownDType(dtype)) {
    return absl::InternalError(absl::StrCat("the ring answered an output of dtype ", h.dtype));
  }
  return dtype;
}

}  // namespace

template <typename Plan>
absl::StatusOr<RingClient::Pending> RingClient::PostFrame(Plan* plan, uint32_t ahead,
                                                          bool publish) {
  // Ordered on the device when every tensor is a region reference (CUDA IPC regions, as
  // RingOptions::device_events requires): the stream's inputs are marked written by "ready"
  // instead of a host synchronisation, and its later work waits for attnd's "done".
  Pending pending;
  pending.ordered = events_ != nullptr;
  for (const FrameTensorSpec& t : plan->tensors) {
    pending.ordered = pending.ordered && t.t.where == v2::kRegion;
  }
  if (pending.ordered) plan->header.flags |= v2::kDeviceOrdered;
  ATTND_RETURN_IF_ERROR(plan->Lay());
  if (pending.ordered) ATTND_RETURN_IF_ERROR(events_->RecordReady(options_.cuda_stream));
  pending.deadline = absl::Now() + options_.timeout;
  pending.tag = plan->header.tag;
  pending.op = plan->header.op;
  ATTND_ASSIGN_OR_RETURN(pending.seq, Post(
                                          plan->size, pending.deadline,
                                          [plan](uint8_t* at) {
                                            plan->Write(at);
                                            return absl::OkStatus();
                                          },
                                          ahead, publish));
  return pending;
}

absl::StatusOr<absl::string_view> RingClient::AwaitFrame(const Pending& pending) {
  ATTND_ASSIGN_OR_RETURN(absl::string_view bytes, Await(pending.seq, pending.deadline));
  if (pending.ordered) {
    // Whatever the answer, attnd's stream has passed "ready": waiting for "done" (its latest
    // record) costs nothing when the request failed before queuing anything.
    ATTND_RETURN_IF_ERROR(events_->WaitDone(options_.cuda_stream));
    ++stats_.device_ordered;
  }
  return bytes;
}

absl::StatusOr<PrefillResult> RingClient::PrefillV2(const PrefillInput& input) {
  FramePlan plan;
  v2::RequestHeader& h = plan.header;
  h.magic = v2::kRequestMagic;
  h.op = v2::kPrefill;
  h.q_layout = static_cast<uint16_t>(input.q_layout);
  h.tag = next_tag_++;
  h.layer = input.layer;
  h.num_sequences = 1;
  if (input.prompt_len.has_value()) {
    h.flags = v2::kHasPromptLen;
    h.prompt_len = *input.prompt_len;
  }
  plan.ids = {&input.sequence_id};
  ATTND_RETURN_IF_ERROR(FromArg("q", input.q, &plan.tensors[0]));
  ATTND_RETURN_IF_ERROR(FromArg("k", input.k, &plan.tensors[1]));
  ATTND_RETURN_IF_ERROR(FromArg("v", input.v, &plan.tensors[2]));
  if (input.output_region.has_value()) {
    SetRegion(*input.output_region, input.output_region->byte_size(), &plan.tensors[3]);
  }
  ATTND_ASSIGN_OR_RETURN(Pending pending, PostFrame(&plan));
  ATTND_ASSIGN_OR_RETURN(absl::string_view bytes, AwaitFrame(pending));
  ATTND_ASSIGN_OR_RETURN(FrameReply reply, ReadReply(bytes, h.tag, h.op));
  ATTND_ASSIGN_OR_RETURN(DType dtype, ReplyDType(reply.header));
  if (reply.lengths.size() != 1) {
    return absl::InternalError(
        absl::StrCat("the ring answered a prefill with ", reply.lengths.size(), " lengths"));
  }
  PrefillResult result;
  result.o.dtype = dtype;
  result.o.shape.assign(reply.header.shape, reply.header.shape + reply.header.rank);
  if ((reply.header.flags & v2::kOutputInRegion) != 0) {
    result.o_region = input.output_region;
  } else {
    result.o.data.assign(reply.o.data(), reply.o.size());  // the one copy out of the ring
    ATTND_RETURN_IF_ERROR(result.o.Validate());
  }
  result.length = reply.lengths[0];
  return result;
}

namespace {

// A decode batch's frame, its entries packed (RingClient::Decode says how they must look).
absl::Status PlanDecodeFrame(int32_t layer, const std::vector<DecodeInput>& entries, uint64_t tag,
                             FramePlan* plan) {
  v2::RequestHeader& h = plan->header;
  const v1::QLayout layout = entries.empty() ? v1::Q_LAYOUT_VARIANTS : entries[0].q_layout;
  for (size_t i = 1; i < entries.size(); ++i) {
    if (entries[i].q_layout != layout) return Unpackable("one q_layout for every entry", i);
  }
  h.magic = v2::kRequestMagic;
  h.op = v2::kDecode;
  h.q_layout = static_cast<uint16_t>(layout);
  h.tag = tag;
  h.layer = layer;
  h.num_sequences = static_cast<uint32_t>(entries.size());
  for (const DecodeInput& e : entries) plan->ids.push_back(&e.sequence_id);
  ATTND_RETURN_IF_ERROR(Pack(
      "q", entries, [](const DecodeInput& e) -> const HostTensor& { return e.q; },
      [](const DecodeInput& e) -> const std::optional<TensorRef>& { return e.q_ref; },
      &plan->tensors[0]));
  ATTND_RETURN_IF_ERROR(Pack(
      "k", entries, [](const DecodeInput& e) -> const HostTensor& { return e.k; },
      [](const DecodeInput& e) -> const std::optional<TensorRef>& { return e.k_ref; },
      &plan->tensors[1]));
  ATTND_RETURN_IF_ERROR(Pack(
      "v", entries, [](const DecodeInput& e) -> const HostTensor& { return e.v; },
      [](const DecodeInput& e) -> const std::optional<TensorRef>& { return e.v_ref; },
      &plan->tensors[2]));
  const bool out_region = !entries.empty() && entries[0].output_region.has_value();
  if (out_region) {
    const v1::RegionRef& o0 = *entries[0].output_region;
    for (size_t i = 1; i < entries.size(); ++i) {
      const std::optional<v1::RegionRef>& o = entries[i].output_region;
      if (!o.has_value() || o->region_id() != o0.region_id() || o->byte_size() != o0.byte_size() ||
          o->offset() != o0.offset() + i * o0.byte_size()) {
        return Unpackable("output regions in every entry, back to back in one region", i);
      }
    }
    SetRegion(o0, entries.size() * o0.byte_size(), &plan->tensors[3]);
  } else {
    for (size_t i = 1; i < entries.size(); ++i) {
      if (entries[i].output_region.has_value()) {
        return Unpackable("output regions in every entry or in none", i);
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

void RingClient::KeepOutputRegions(const std::vector<DecodeInput>& entries, Pending* pending) {
  pending->outputs.reserve(entries.size());
  for (const DecodeInput& e : entries) pending->outputs.push_back(e.output_region);
}

absl::Status RingClient::SubmitDecode(int32_t layer, const std::vector<DecodeInput>& entries) {
  return SubmitDecodes(layer, {entries});
}

absl::Status RingClient::SubmitDecodes(int32_t layer,
                                       const std::vector<std::vector<DecodeInput>>& micro_batches) {
  if (options_.version != ring::v2::kVersion) {
    return absl::FailedPreconditionError(absl::StrCat(
        "SubmitDecode needs a version ", ring::v2::kVersion, " ring (RingOptions::version)"));
  }
  if (pending_.size() + micro_batches.size() > slot_count()) {
    return absl::FailedPreconditionError(
        absl::StrCat(pending_.size(), " submitted decode(s) are uncollected; ",
                     micro_batches.size(), " more would pass the ring's ", slot_count(),
                     " slots (RingOptions::slots): collect the oldest with AwaitDecode first"));
  }
  std::vector<FramePlan> plans(micro_batches.size());
  for (size_t i = 0; i < plans.size(); ++i) {
    ATTND_RETURN_IF_ERROR(PlanDecodeFrame(layer, micro_batches[i], next_tag_ + i, &plans[i]));
  }
  next_tag_ += plans.size();
  for (size_t i = 0; i < plans.size(); ++i) {
    // Posted together: the last one moves request_seq past them all, so a failure before it
    // leaves none of them posted.
    absl::StatusOr<Pending> pending = PostFrame(&plans[i], static_cast<uint32_t>(i),
                                                /*publish=*/i + 1 == plans.size());
    if (!pending.ok()) {
      pending_.resize(pending_.size() - i);
      return pending.status();
    }
    KeepOutputRegions(micro_batches[i], &*pending);
    pending_.push_back(*std::move(pending));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<DecodeResult>> RingClient::AwaitDecode() {
  if (pending_.empty()) return absl::FailedPreconditionError("no decode is submitted");
  Pending pending = std::move(pending_.front());
  pending_.pop_front();
  if (pending.result.has_value()) return *std::move(pending.result);
  return CollectDecode(pending);
}

absl::StatusOr<std::vector<DecodeResult>> RingClient::CollectDecode(Pending& pending) {
  ATTND_ASSIGN_OR_RETURN(absl::string_view bytes, AwaitFrame(pending));
  ATTND_ASSIGN_OR_RETURN(FrameReply reply, ReadReply(bytes, pending.tag, pending.op));
  ATTND_ASSIGN_OR_RETURN(DType dtype, ReplyDType(reply.header));
  const v2::ResponseHeader& rh = reply.header;
  const size_t b = pending.outputs.size();
  // o is [B, Hq, D]: row i is entry i's.
  if (reply.lengths.size() != b || rh.rank != 3 || rh.shape[0] != static_cast<int64_t>(b) ||
      rh.shape[1] < 0 || rh.shape[2] < 0) {
    return absl::InternalError(absl::StrCat("the ring answered ", reply.lengths.size(),
                                            " decode outputs for ", b, " entries"));
  }
  const uint64_t row =
      static_cast<uint64_t>(rh.shape[1]) * static_cast<uint64_t>(rh.shape[2]) * ElementSize(dtype);
  const bool in_region = (rh.flags & v2::kOutputInRegion) != 0;
  if (!in_region && reply.o.size() != row * b) {
    return absl::InternalError(absl::StrCat("the ring answered ", reply.o.size(),
                                            " output bytes for ", b, " rows of ", row));
  }
  std::vector<DecodeResult> results(b);
  for (size_t i = 0; i < b; ++i) {
    DecodeResult& r = results[i];
    r.o.dtype = dtype;
    r.o.shape = {rh.shape[1], rh.shape[2]};
    if (in_region) {
      r.o_region = std::move(pending.outputs[i]);
    } else {
      r.o.data.assign(reply.o.data() + i * row, row);  // the one copy out of the ring
    }
    r.length = reply.lengths[i];
  }
  return results;
}

absl::StatusOr<PrefillResult> RingClient::Prefill(const PrefillInput& input) {
  if (options_.version == ring::v2::kVersion) return PrefillV2(input);
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
  if (options_.version == ring::v2::kVersion) {
    FramePlan plan;
    ATTND_RETURN_IF_ERROR(PlanDecodeFrame(layer, entries, next_tag_++, &plan));
    ATTND_ASSIGN_OR_RETURN(Pending pending, PostFrame(&plan));
    KeepOutputRegions(entries, &pending);
    return CollectDecode(pending);
  }
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
