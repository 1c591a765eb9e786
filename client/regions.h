// Zero-copy data plane, the client side (docs/regions.md): POSIX shm buffers, registered regions
// and the shared-memory ring (proto/attnd/v1/shm_ring.h, its frames proto/attnd/v1/ring_frame.h).
//
//   auto buf = ShmBuffer::CreateFor(client, bytes);            // a fresh shm object, mapped
//   auto region = RegisteredRegion::Shm(client, **buf);        // RegisterRegion; unregisters on
//   exit in.q = TensorRef::In(region->id(), offset, DType::kBf16, {T, 5, Hq, D});
//
//   auto ring = RingClient::Open(client);                      // OpenRing; CloseRing on exit
//   auto out = (*ring)->Decode(layer, entries);                // one round trip through the ring
//
// Thread safety: a ShmBuffer is plain memory; a RingClient carries one request at a time (use it
// from one thread at a time, like a Session).
#ifndef ATTND_CLIENT_REGIONS_H_
#define ATTND_CLIENT_REGIONS_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "attnd/v1/attention.pb.h"
#include "attnd/v1/ring_frame.h"
#include "attnd/v1/shm_ring.h"
#include "client/attnd_client.h"
#include "client/cuda_buffer.h"

namespace attnd {
namespace client {

// A POSIX shared-memory object this process created (shm_open O_CREAT|O_EXCL under a random name
// "<prefix><32 hex>"), sized and mapped read-write. The destructor unlinks the name and unmaps it
// (attnd keeps its own mapping of a registered object until the region is unregistered).
// attnd registers only names under the caller's prefix (GetServerInfo's
// regions.shm_name_prefix: "/attnd-", or "/attnd-<tenant>." with authentication).
// The prefix of a server without authentication (and of one too old to give its own).
inline constexpr absl::string_view kDefaultShmPrefix = "/attnd-";

class ShmBuffer {
 public:
  // `bytes` > 0; the mapping is zero-filled. `prefix`: "/" then [A-Za-z0-9._-], as the server
  // gives it; the default is the one of a server without authentication.
  static absl::StatusOr<std::unique_ptr<ShmBuffer>> Create(
      size_t bytes, absl::string_view prefix = kDefaultShmPrefix);
  // Named for the caller of `client` (one GetServerInfo for the prefix).
  static absl::StatusOr<std::unique_ptr<ShmBuffer>> CreateFor(AttndClient& client, size_t bytes);
  ~ShmBuffer();
  ShmBuffer(const ShmBuffer&) = delete;
  ShmBuffer& operator=(const ShmBuffer&) = delete;

  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& name() const { return name_; }  // for shm_open, with its leading "/"
  int fd() const { return fd_; }  // open until the destructor (tests truncate through it)

 private:
  ShmBuffer(std::string name, int fd, uint8_t* data, size_t size)
      : name_(std::move(name)), fd_(fd), data_(data), size_(size) {}
  std::string name_;
  int fd_;
  uint8_t* data_;
  size_t size_;
};

// A region registered with attnd; the destructor unregisters it (errors are dropped: the server
// reclaims idle regions anyway). Movable. The AttndClient must outlive it.
class RegisteredRegion {
 public:
  // All of `buffer` (offset 0), or [offset, offset + bytes) with bytes > 0.
  static absl::StatusOr<RegisteredRegion> Shm(AttndClient& client, const ShmBuffer& buffer,
                                              uint64_t offset = 0, uint64_t bytes = 0);
  // `handle`: the 64 bytes of a cudaIpcMemHandle_t.
  static absl::StatusOr<RegisteredRegion> CudaIpc(AttndClient& client, const std::string& handle,
                                                  uint64_t bytes);

  RegisteredRegion(RegisteredRegion&& other) noexcept { *this = std::move(other); }
  RegisteredRegion& operator=(RegisteredRegion&& other) noexcept;
  ~RegisteredRegion();

  const std::string& id() const { return id_; }
  uint64_t size() const { return size_; }
  // A tensor at `offset` in this region.
  TensorRef Tensor(uint64_t offset, DType dtype, std::vector<int64_t> shape) const {
    return TensorRef::In(id_, offset, dtype, std::move(shape));
  }
  v1::RegionRef Ref(uint64_t offset, uint64_t bytes) const;
  // Unregisters now and returns the server's answer (the destructor then does nothing).
  absl::Status Unregister();
  // Forgets the region without unregistering it.
  std::string Release();

 private:
  RegisteredRegion(AttndClient* client, std::string id, uint64_t size)
      : client_(client), id_(std::move(id)), size_(size) {}
  AttndClient* client_ = nullptr;
  std::string id_;
  uint64_t size_ = 0;
};

struct RingOptions {
  // What the ring's halves carry (its header's version): 2, binary frames
  // (proto/attnd/v1/ring_frame.h; each tensor copied once on each side, a decode batch as one
  // packed q, k and v); 1, serialized SessionRequest / SessionResponse, for servers without
  // version 2 and for tests. Other values are written as given (tests of OpenRing's refusal).
  uint32_t version = ring::v2::kVersion;
  // Each half's size: the largest request (and response) is half_bytes - 8 bytes. Decode requests
  // with inline bytes are small; prefills with inline bytes need T * (5 Hq + 2 Hkv) * D * dtype.
  uint64_t half_bytes = 8ull << 20;
  // Requests in flight at once (version 2 only, not with device_events): 1, or a power of two up
  // to ring::kMaxSlots (GetServerInfo().regions.max_ring_slots). The object then holds that many
  // pairs of halves; SubmitDecode posts without waiting, AwaitDecode collects in order.
  uint32_t slots = 1;
  // After writing a request, spin this long on response_seq before sleeping on its futex.
  absl::Duration spin = absl::Microseconds(50);
  // One futex wait's timeout: the sleeping client re-checks `closed` and the deadline this often.
  absl::Duration sleep_slice = absl::Milliseconds(10);
  // Per round trip (waiting for the ring to be free, and for the answer); DEADLINE_EXCEEDED past
  // it.
  absl::Duration timeout = absl::Seconds(60);
  // A device-ordered ring (version 2, attnd's CUDA backend on one GPU; docs/regions.md): a request
  // whose q, k, v and output are all region references (which must then be CUDA IPC regions) is
  // ordered with `cuda_stream` on `cuda_device` by the ring's events instead of the host: the
  // stream records "ready" before the request is sent and waits for attnd's "done" after the
  // answer, which comes once attnd has queued the work. The caller must have queued the inputs'
  // writes on that stream (null: the legacy default stream, which cudaMemcpy uses).
  bool device_events = false;
  int cuda_device = 0;
  void* cuda_stream = nullptr;  // a cudaStream_t
};

// Counters of how round trips were answered, for tests and the bench.
struct RingStats {
  int64_t round_trips = 0;
  int64_t answered_spinning = 0;  // the response arrived while the client spun
  int64_t answered_sleeping = 0;  // ... after it set client_sleeping
  int64_t server_wakes = 0;       // FutexWake calls on request_seq (server_sleeping was set)
  int64_t device_ordered = 0;     // requests ordered on the device (RingOptions::device_events)
};

// A shared-memory ring: Prefill and Decode requests through shared memory, answered in order, one
// at a time or (RingOptions::slots) several decodes in flight (docs/regions.md, "Rings"), as
// version 2 frames or (RingOptions::version 1) SessionRequests.
class RingClient {
 public:
  // Creates the shm object, lays out the header and opens it with OpenRing. The AttndClient must
  // outlive the ring (the destructor calls CloseRing).
  static absl::StatusOr<std::unique_ptr<RingClient>> Open(AttndClient& client,
                                                          const RingOptions& options = {});
  // The layout alone, without OpenRing: for tests that play the server's side themselves.
  static absl::StatusOr<std::unique_ptr<RingClient>> CreateUnopened(
      const RingOptions& options = {});
  ~RingClient();
  RingClient(const RingClient&) = delete;
  RingClient& operator=(const RingClient&) = delete;

  // Sends `request` and waits for its response. The transport's errors are the status:
  // UNAVAILABLE once the server closed the ring, DEADLINE_EXCEEDED past options.timeout,
  // RESOURCE_EXHAUSTED for a request larger than the ring's half, INTERNAL for a malformed answer
  // or one whose tag is not the request's. The request's own outcome is the response's code.
  // A version 1 ring's: FAILED_PRECONDITION on a version 2 ring.
  absl::StatusOr<v1::SessionResponse> RoundTrip(const v1::SessionRequest& request);

  // As Session's: a non-OK response code becomes the status. On a version 2 ring a decode batch
  // travels packed: every entry has one q_layout, and each of q, k, v (and the output region) is
  // inline in every entry, of one dtype and shape, or a reference in every entry, the entries'
  // references back to back in one region (entry i at the first one's offset + i * its size);
  // INVALID_ARGUMENT otherwise, before anything is sent. Tensors have at most 4 dimensions.
  absl::StatusOr<PrefillResult> Prefill(const PrefillInput& input);
  absl::StatusOr<PrefillResult> Prefill(const std::string& sequence_id, int32_t layer,
                                        const HostTensor& q, const HostTensor& k,
                                        const HostTensor& v,
                                        std::optional<int64_t> prompt_len = std::nullopt,
                                        v1::QLayout q_layout = v1::Q_LAYOUT_VARIANTS);
  absl::StatusOr<std::vector<DecodeResult>> Decode(int32_t layer,
                                                   const std::vector<DecodeInput>& entries);

  // A decode posted without waiting for its answer (a version 2 ring; the entries as Decode's,
  // copied into the ring before it returns): up to RingOptions::slots at once, collected with
  // AwaitDecode in the order submitted. FAILED_PRECONDITION when as many as the ring's slots are
  // uncollected already, or on a version 1 ring. Decode and Prefill may run while decodes are
  // uncollected (a prefill beside a decode step, as continuous batching does): each waits for its
  // own answer, and a submitted decode whose slot it needs is read out first and kept for
  // AwaitDecode.
  absl::Status SubmitDecode(int32_t layer, const std::vector<DecodeInput>& entries);
  // Several micro-batches of one layer at once: all are checked first (nothing is sent when one
  // is refused), then written into their slots and posted together, so attnd takes them as one
  // batch where they fit. At most RingOptions::slots uncollected in all.
  absl::Status SubmitDecodes(int32_t layer,
                             const std::vector<std::vector<DecodeInput>>& micro_batches);
  // The oldest submitted decode's answer, waiting for it unless it was read out already (as
  // Decode's result). FAILED_PRECONDITION when none is submitted.
  absl::StatusOr<std::vector<DecodeResult>> AwaitDecode();
  size_t submitted() const { return pending_.size(); }

  // CloseRing now (the destructor then does nothing); the server sets `closed`.
  absl::Status Close();

  const std::string& ring_id() const { return ring_id_; }
  const ShmBuffer& buffer() const { return *buffer_; }
  ring::Header* header() const { return reinterpret_cast<ring::Header*>(buffer_->data()); }
  uint64_t capacity() const { return ring::Capacity(options_.half_bytes); }
  const RingStats& stats() const { return stats_; }

 private:
  RingClient(std::unique_ptr<ShmBuffer> buffer, const RingOptions& options)
      : buffer_(std::move(buffer)), options_(options) {}
  // INVALID_ARGUMENT for options no server takes.
  static absl::Status CheckOptions(const RingOptions& options);
  static absl::StatusOr<std::unique_ptr<RingClient>> Layout(const RingOptions& options,
                                                            absl::string_view prefix);
  // A frame posted and not yet collected.
  struct Pending {
    uint32_t seq = 0;
    uint64_t tag = 0;
    uint16_t op = 0;
    bool ordered = false;  // on the device: its stream waits for "done" once answered
    absl::Time deadline;
    std::vector<std::optional<v1::RegionRef>> outputs;  // a decode's entries' output regions
    // A submitted decode's answer, read out of its slot before a later request reused it.
    std::optional<absl::StatusOr<std::vector<DecodeResult>>> result;
  };
  uint32_t slot_count() const { return ring::SlotCount(options_.slots); }
  // Waits until response_seq has reached `want` (wrapping); the status says why not.
  absl::Status WaitResponse(uint32_t want, absl::Time deadline, bool count);
  // Writes `size` bytes that `write` puts into the slot of request request_seq + 1 + ahead (after
  // the length field), once that slot's previous request is answered, and with `publish` moves
  // request_seq to it (posting every request written before it too): the request's number.
  template <typename Write>
  absl::StatusOr<uint32_t> Post(uint64_t size, absl::Time deadline, Write&& write,
                                uint32_t ahead = 0, bool publish = true);
  // Request `seq`'s answer: its bytes, in its slot's response half (valid until the slot's next
  // request).
  absl::StatusOr<absl::string_view> Await(uint32_t seq, absl::Time deadline);
  // One round trip: Post, then Await.
  template <typename Write>
  absl::StatusOr<absl::string_view> Exchange(uint64_t size, Write&& write);
  // A version 2 frame posted (Lay, write), ordered on the device where it can be; AwaitFrame
  // collects its answer.
  template <typename Plan>
  absl::StatusOr<Pending> PostFrame(Plan* plan, uint32_t ahead = 0, bool publish = true);
  absl::StatusOr<absl::string_view> AwaitFrame(const Pending& pending);
  // Keeps the entries' output regions in `pending`: a decode answered in place hands them back in
  // its results.
  static void KeepOutputRegions(const std::vector<DecodeInput>& entries, Pending* pending);
  // A decode frame's answer as Decode's result.
  absl::StatusOr<std::vector<DecodeResult>> CollectDecode(Pending& pending);
  // Before request `next` is written: reads out the answer of each submitted decode whose slot it
  // reuses (kept in Pending::result), so that the write never overwrites an uncollected answer.
  void KeepAnswersOfSlot(uint32_t next);
  absl::StatusOr<PrefillResult> PrefillV2(const PrefillInput& input);

  std::unique_ptr<ShmBuffer> buffer_;
  RingOptions options_;
  AttndClient* client_ = nullptr;
  std::string ring_id_;
  std::unique_ptr<RingEvents> events_;  // with RingOptions::device_events
  uint64_t next_tag_ = 1;
  std::string scratch_;          // the serialized request
  std::deque<Pending> pending_;  // submitted decodes, oldest first
  RingStats stats_;
};

}  // namespace client
}  // namespace attnd

#endif  // ATTND_CLIENT_REGIONS_H_
