#include "server/dataplane/ring.h"

#include <algorithm>
#include <cstring>
#include <deque>
#include <limits>
#include <new>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "attnd/v1/ring_frame.h"
#include "attnd/v1/shm_ring.h"
#include "base/catch_all.h"
#include "base/status_macros.h"
#include "server/dataplane/shm_guard.h"
#include "spdlog/spdlog.h"

namespace attnd {
namespace {

// How long one futex wait lasts before the thread looks at its stop flag again.
constexpr int64_t kSleepSliceUs = 100000;

// How long a ring waits with no request before it frees its copy buffer (the next request then
// allocates one again): an active client keeps it, an idle one holds no request bytes.
constexpr int64_t kKeepBufferNs = int64_t{1000} * 1000 * 1000;
// Device-ordered steps of one ring that may wait for its client's stream at once.
constexpr size_t kMaxPendingGates = 4096;
// How long a closing ring waits for its client's stream to reach the last step it armed.
constexpr absl::Duration kGateCloseGrace = absl::Milliseconds(100);

struct WaitArgs {
  ring::Header* header;
  uint32_t last;
  int64_t spin_ns;
  bool may_sleep;      // false: return (got false) once the spin is over
  int64_t give_up_ns;  // > 0: return (got false) after this long without a request
  const std::atomic<bool>* stop;
  uint32_t seq;  // out
  bool got;      // out
};

// Spins, then sleeps on the futex, until request_seq moves past `last`, stop is set or give_up_ns
// passed. Guarded: touches only the client's header and plain values.
void WaitForRequest(void* p) {
  auto* a = static_cast<WaitArgs*>(p);
  ring::Header* h = a->header;
  const int64_t now = absl::GetCurrentTimeNanos();
  const int64_t spin_until = now + a->spin_ns;
  const int64_t give_up = a->give_up_ns > 0 ? now + a->give_up_ns : 0;
  a->got = false;
  while (!a->stop->load(std::memory_order_relaxed)) {
    if (give_up != 0 && absl::GetCurrentTimeNanos() >= give_up) return;
    const uint32_t seq = h->request_seq.load(std::memory_order_acquire);
    if (seq != a->last) {
      a->seq = seq;
      a->got = true;
      return;
    }
    if (absl::GetCurrentTimeNanos() < spin_until) continue;
    if (!a->may_sleep) return;
    h->server_sleeping.store(1, std::memory_order_seq_cst);
    if (h->request_seq.load(std::memory_order_seq_cst) == a->last &&
        !a->stop->load(std::memory_order_relaxed)) {
      ring::FutexWait(&h->request_seq, a->last, kSleepSliceUs);
    }
    h->server_sleeping.store(0, std::memory_order_relaxed);
  }
}

void ReadLength(void* p) {
  auto* a = static_cast<std::pair<const char*, uint64_t>*>(p);
  std::memcpy(&a->second, a->first, sizeof(a->second));
}

struct ReadArgs {
  const char* from;
  char* to;
  uint64_t n;
};

void ReadBytes(void* p) {
  auto* a = static_cast<ReadArgs*>(p);
  std::memcpy(a->to, a->from, a->n);
}

struct WriteArgs {
  char* half;
  const std::string* message;
};

void WriteResponse(void* p) {
  auto* a = static_cast<WriteArgs*>(p);
  const uint64_t n = a->message->size();
  std::memcpy(a->half, &n, sizeof(n));
  std::memcpy(a->half + ring::kLengthBytes, a->message->data(), n);
}

// A version 2 answer: the head (header, lengths, message) and o's bytes from the ring's output
// buffer, the one copy of the output into the half.
struct WriteFrameArgs {
  char* half;
  const std::string* head;
  const char* output;
  uint64_t output_offset;
  uint64_t output_bytes;
};

void WriteFrameResponse(void* p) {
  auto* a = static_cast<WriteFrameArgs*>(p);
  const uint64_t n = a->output_bytes > 0 ? a->output_offset + a->output_bytes : a->head->size();
  std::memcpy(a->half, &n, sizeof(n));
  std::memcpy(a->half + ring::kLengthBytes, a->head->data(), a->head->size());
  if (a->output_bytes > 0) {
    std::memcpy(a->half + ring::kLengthBytes + a->output_offset, a->output, a->output_bytes);
  }
}

// Requests up to seq are answered: response_seq, then the client's doorbell if it sleeps.
struct PublishArgs {
  ring::Header* header;
  uint32_t seq;
};

void PublishResponse(void* p) {
  auto* a = static_cast<PublishArgs*>(p);
  a->header->response_seq.store(a->seq, std::memory_order_seq_cst);
  if (a->header->client_sleeping.load(std::memory_order_seq_cst) != 0) {
    ring::FutexWake(&a->header->response_seq);
  }
}

void MarkClosed(void* p) {
  auto* h = static_cast<ring::Header*>(p);
  h->closed.store(1, std::memory_order_seq_cst);
  ring::FutexWake(&h->response_seq);
  ring::FutexWake(&h->request_seq);
}

struct HeaderArgs {
  const ring::Header* header;
  uint64_t magic = 0;
  uint32_t version = 0;
  uint32_t slots = 0;
  uint64_t half_bytes = 0;
  uint32_t request_seq = 0, response_seq = 0;
};

void ReadHeader(void* p) {
  auto* a = static_cast<HeaderArgs*>(p);
  a->magic = a->header->magic;
  a->version = a->header->version;
  a->slots = a->header->slots;
  a->half_bytes = a->header->half_bytes;
  a->request_seq = a->header->request_seq.load();
  a->response_seq = a->header->response_seq.load();
}

void WakeServer(void* p) { ring::FutexWake(&static_cast<ring::Header*>(p)->request_seq); }

}  // namespace

// One open ring and its thread. A ring has one slot or several (its header's `slots`): each
// slot's objects (the request's copy, its parse, its answer) belong to the request in that slot,
// and the thread takes a request into a slot only once the slot's previous request is answered
// and published. Answers are published in the order the requests were posted, whichever thread
// completes them.
class RingServer::Ring {
 public:
  Ring(RingServer* server, std::string tenant, RegionLease lease, uint64_t half, uint32_t version,
       uint32_t slots, RingEvents events, std::optional<DeviceMemoryOpener::Gate> gate)
      : server_(server),
        version_(version),
        slot_count_(ring::SlotCount(slots)),
        events_(events),
        gate_(gate),
        gate_armed_(gate ? gate->value : 0),
        tenant_(std::move(tenant)),
        lease_(std::move(lease)),
        header_(reinterpret_cast<ring::Header*>(lease_->base)),
        capacity_(ring::Capacity(half)),
        slots_(new Slot[slot_count_]),
        last_active_us_(absl::ToUnixMicros(absl::Now())) {
    for (uint32_t i = 0; i < slot_count_; ++i) {
      Slot* slot = &slots_[i];
      slot->request_half = lease_->base + ring::RequestOffset(half, i);
      slot->response_half = lease_->base + ring::ResponseOffset(half, i);
      slot->answer.output_buffer = [this, slot](uint64_t bytes, uint64_t num_lengths) {
        return OutputBuffer(slot, bytes, num_lengths);
      };
    }
  }

  ~Ring() {
    Stop();
    if (gate_) {
      // No decode step may wait on the word after this; a gate whose client never completed keeps
      // its slot (its stream may still write the word one day). A client that closes right after
      // its last frame may still be running up to it: it gets a moment.
      const absl::Time give_up = absl::Now() + kGateCloseGrace;
      while (!gate_forced_ && GateWord() < gate_armed_ && absl::Now() < give_up) {
        absl::SleepFor(absl::Microseconds(200));
      }
      const bool stuck = gate_forced_ || GateWord() < gate_armed_;
      ForceGate();
      server_->events_->DestroyGate(*gate_, stuck);
    }
    // Destroying an event with work still to record it is allowed: CUDA frees it afterwards.
    if (events_.ready != nullptr) server_->events_->DestroyIpcEvent(events_.ready);
    if (events_.done != nullptr) server_->events_->DestroyIpcEvent(events_.done);
  }

  const std::string& id() const { return lease_->id; }
  const std::string& tenant() const { return tenant_; }
  uint64_t capacity() const { return capacity_; }
  bool idle_since(int64_t cutoff_us) const {
    return broken_.load() || (inflight_.load() == 0 && last_active_us_.load() < cutoff_us);
  }

  void Start(uint32_t first_seq) {
    taken_ = first_seq;
    published_.store(first_seq);
    thread_ = std::thread([this] {
      Serve();
      // Requests in flight are answered on other threads, which touch this ring until they
      // publish: the thread ends after them.
      WaitInflightBelow(1, /*spin=*/false);
    });
  }

  // Waits for the requests in flight, stops the thread, tells the client.
  void Stop() {
    if (!thread_.joinable()) return;
    stop_.store(true);
    RunGuarded(WakeServer, header_);
    thread_.join();
    RunGuarded(MarkClosed, header_);
  }

 private:
  // A slot's request in flight and what it needs until its answer is published.
  struct Slot;

  void Serve() {
    const int64_t spin_ns = absl::ToInt64Nanoseconds(server_->options_.spin);
    while (true) {
      // With every slot in flight the next request has nowhere to go: wait for an answer.
      if (slot_count_ > 1) WaitInflightBelow(slot_count_, /*spin=*/true);
      // Spinning is rationed (RingOptions::max_spinning*): the turn is held for the spin only,
      // and without one the thread sleeps at once.
      int64_t give_up_ns = HoldsBuffers() ? kKeepBufferNs : 0;
      if (const int64_t gate_ns = GateDeadlineNs(); gate_ns > 0) {
        give_up_ns = give_up_ns > 0 ? std::min(give_up_ns, gate_ns) : gate_ns;
      }
      WaitArgs wait{header_, taken_, 0, true, give_up_ns, &stop_, 0, false};
      bool readable = true;
      if (spin_ns > 0 && server_->BeginSpin(tenant_)) {
        WaitArgs spin = wait;
        spin.spin_ns = spin_ns;
        spin.may_sleep = false;
        readable = RunGuarded(WaitForRequest, &spin);
        server_->EndSpin(tenant_);
        wait.got = spin.got;
        wait.seq = spin.seq;
      }
      if (readable && !wait.got && !stop_.load()) readable = RunGuarded(WaitForRequest, &wait);
      if (!readable) return Broken("reading its header");
      if (stop_.load()) return AnswerPostedAtStop();
      if (!wait.got) {  // idle: hold no copy buffer
        if (GateOverdue()) return GateStuck();
        FreeBuffers();
        continue;
      }
      // One slot: a client that bumped request_seq by more than one is answered once, for the
      // latest. Several: each request in turn, and no more unanswered than there are slots.
      uint32_t seq = wait.seq;
      if (slot_count_ > 1) {
        const uint32_t unanswered = wait.seq - published_.load();
        if (unanswered > slot_count_) return Overrun(unanswered);
        seq = taken_ + 1;
      }
      taken_ = seq;
      last_active_us_.store(absl::ToUnixMicros(absl::Now()));
      // A decode the client posted another of the same layer behind runs with it where they fit
      // (one batch).
      ServeOne(SlotOf(seq), seq, seq != wait.seq ? PeekDecodeLayer(seq + 1) : std::nullopt);
      if (slot_count_ == 1) WaitInflightBelow(1, /*spin=*/true);
      if (broken_.load()) return;
      last_active_us_.store(absl::ToUnixMicros(absl::Now()));
    }
  }

  Slot* SlotOf(uint32_t seq) { return &slots_[ring::SlotOf(seq, slot_count_)]; }
  const Slot* SlotOf(uint32_t seq) const { return &slots_[ring::SlotOf(seq, slot_count_)]; }

  // Marks request `seq` in flight in `slot` and clears what its previous request left there.
  void Take(Slot* slot, uint32_t seq) {
    slot->seq = seq;
    slot->request.Clear();
    slot->response.Clear();
    slot->answer.Clear();
    slot->frame_tag = 0;
    slot->frame_op = 0;
    MutexLock lock(&mu_);
    inflight_.fetch_add(1);
  }

  // Reads request `seq` out of `slot` and runs it; Answer (here or on the thread that completes
  // it) writes its response.
  // The layer of request `seq` if it is a decode frame, read in place before it is taken: a hint
  // only (the client may still be writing it; what runs is what is copied out later).
  std::optional<int32_t> PeekDecodeLayer(uint32_t seq) {
    const Slot* slot = SlotOf(seq);
    constexpr size_t kStart = offsetof(ring::v2::RequestHeader, layer) + sizeof(int32_t);
    std::pair<const char*, uint64_t> length{slot->request_half, 0};
    if (!RunGuarded(ReadLength, &length) || length.second < kStart || length.second > capacity_) {
      return std::nullopt;
    }
    char start[kStart];
    ReadArgs read{slot->request_half + ring::kLengthBytes, start, kStart};
    if (!RunGuarded(ReadBytes, &read)) return std::nullopt;
    uint16_t op;
    int32_t layer;
    std::memcpy(&op, start + offsetof(ring::v2::RequestHeader, op), sizeof(op));
    std::memcpy(&layer, start + offsetof(ring::v2::RequestHeader, layer), sizeof(layer));
    if (op != ring::v2::kDecode) return std::nullopt;
    return layer;
  }

  // next_decode_layer: the layer of the decode the client posted right behind this request.
  void ServeOne(Slot* slot, uint32_t seq, std::optional<int32_t> next_decode_layer) {
    Take(slot, seq);
    std::pair<const char*, uint64_t> length{slot->request_half, 0};
    if (!RunGuarded(ReadLength, &length)) {
      Broken("reading a request");
      return AnswerBroken(slot);
    }
    const uint64_t n = length.second;
    if (version_ == ring::v2::kVersion && !ReadFrameStart(slot, n)) {
      Broken("reading a request");
      return AnswerBroken(slot);
    }
    if (n > capacity_) {
      return Answer(slot,
                    absl::InvalidArgumentError(absl::StrCat(
                        "the request's length field says ", n,
                        " bytes, more than the ring's request half holds (", capacity_, ")")));
    }
    const int64_t max = server_->max_request_bytes_;
    if (max > 0 && n > static_cast<uint64_t>(max)) {
      return Answer(slot, absl::ResourceExhaustedError(absl::StrCat("the request is ", n,
                                                                    " bytes, more than "
                                                                    "--max-message-bytes (",
                                                                    max, ") allows one request")));
    }
    if (absl::Status s = Grow(&slot->in, n, "to copy the ring's request"); !s.ok()) {
      return Answer(slot, std::move(s));
    }
    // Nothing to copy for 0 bytes (the buffer may not exist: memcpy's pointers must not be null).
    ReadArgs read{slot->request_half + ring::kLengthBytes, slot->in.data.get(), n};
    if (n > 0 && !RunGuarded(ReadBytes, &read)) {
      Broken("reading a request");
      return AnswerBroken(slot);
    }
    if (version_ == ring::v2::kVersion) {
      return ServeFrame(slot, absl::string_view(slot->in.data.get(), n), next_decode_layer);
    }
    if (!slot->request.ParseFromArray(slot->in.data.get(), static_cast<int>(n))) {
      return Answer(slot, absl::InvalidArgumentError(
                              "cannot parse attnd.v1.SessionRequest from the ring's request half"));
    }
    slot->response.set_tag(slot->request.tag());
    absl::Status s = CatchAll("the ring's request", [&] {
      return server_->handler_(slot->request, tenant_, &slot->response,
                               [this, slot](absl::Status st) { Answer(slot, std::move(st)); });
    });
    if (!s.ok()) Answer(slot, std::move(s));
  }

  // A version 2 frame's tag and op, read in place: a frame refused before it is copied (too
  // long, no memory) is still answered with them. False when the object shrank.
  bool ReadFrameStart(Slot* slot, uint64_t n) {
    char start[16];
    const uint64_t readable = std::min<uint64_t>({n, sizeof(start), capacity_});
    ReadArgs read{slot->request_half + ring::kLengthBytes, start, readable};
    if (readable > 0 && !RunGuarded(ReadBytes, &read)) return false;
    slot->frame_tag = FrameTag(absl::string_view(start, readable));
    if (readable >= 8) {
      std::memcpy(&slot->frame_op, start + offsetof(ring::v2::RequestHeader, op),
                  sizeof(slot->frame_op));
    }
    return true;
  }

  // A version 2 frame, copied out into the slot's buffer: parsed, then handed to the frame
  // handler.
  void ServeFrame(Slot* slot, absl::string_view bytes, std::optional<int32_t> next_decode_layer) {
    RequestFrame& frame = slot->frame;
    slot->frame_tag = FrameTag(bytes);
    if (absl::Status s = ParseRequestFrame(bytes, &frame); !s.ok()) {
      return Answer(slot, std::move(s));
    }
    frame.more_follow = frame.op == ring::v2::kDecode && next_decode_layer == frame.layer;
    slot->frame_op = frame.op;
    if (frame.device_ordered) {
      if (events_.ready == nullptr) {
        return Answer(slot, absl::InvalidArgumentError(
                                "the frame asks to be ordered on the device (flag kDeviceOrdered), "
                                "but its ring was opened without device_events"));
      }
      // A decode step waits for "ready" on the device, behind the ring's gate; anything else
      // (a prefill: long enough that a host wait costs nothing) on the host.
      absl::Status s = gate_ && frame.op == ring::v2::kDecode ? ArmGate(&frame) : WaitReady();
      if (!s.ok()) return Answer(slot, std::move(s));
      frame.done_event = events_.done;
    }
    if (!server_->frame_handler_) {
      return Answer(slot, absl::UnimplementedError("this server reads no version 2 ring frames"));
    }
    absl::Status s = CatchAll("the ring's request", [&] {
      return server_->frame_handler_(frame, tenant_, &slot->answer, [this, slot](absl::Status st) {
        Answer(slot, std::move(st));
      });
    });
    if (!s.ok()) Answer(slot, std::move(s));
  }

  // Waits on the host until the client's stream has passed its latest "ready" record (its inputs
  // are written). Never on attnd's own streams: a client whose GPU work never finishes would hold
  // up every tenant's steps queued behind it. Spins a little (the inputs are usually written by
  // the time the frame is read), then sleeps in short slices; bounded by ready_timeout.
  absl::Status WaitReady() {
    const absl::Time start = absl::Now();
    for (int i = 0;; ++i) {
      absl::StatusOr<bool> done = server_->events_->IpcEventDone(events_.ready);
      if (!done.ok()) return done.status();
      if (*done) return absl::OkStatus();
      if (stop_.load()) return absl::UnavailableError("the ring is closing");
      const absl::Duration waited = absl::Now() - start;
      if (waited > server_->options_.ready_timeout) {
        return absl::DeadlineExceededError(absl::StrCat(
            "the client's ready event did not complete within ",
            absl::FormatDuration(server_->options_.ready_timeout),
            " (its stream must record it after writing the frame's inputs); nothing ran"));
      }
      if (waited > absl::Microseconds(100)) absl::SleepFor(absl::Microseconds(20));
    }
  }

  // The gate: arms it for this frame (the engine's step waits until the word reaches the value
  // armed). Steps armed and not yet released are remembered with the time they were armed, so the
  // ring can tell when the client's stream has held one up past ready_timeout.
  absl::Status ArmGate(RequestFrame* frame) {
    if (GateOverdue()) {
      GateStuck();
      return absl::DeadlineExceededError(GateStuckMessage());
    }
    if (gate_pending_.size() >= kMaxPendingGates) {
      return absl::UnavailableError(absl::StrCat(
          kMaxPendingGates,
          " device-ordered steps of this ring wait for its ready event already "
          "(the client's stream has not reached them): wait for their outputs, then retry"));
    }
    const uint64_t value = gate_armed_ + 1;
    ATTND_RETURN_IF_ERROR(server_->events_->ArmGate(*gate_, events_.ready, value));
    gate_armed_ = value;
    gate_pending_.push_back({value, absl::GetCurrentTimeNanos()});
    frame->gate_word = gate_->device_word;
    frame->gate_value = value;
    return absl::OkStatus();
  }

  uint64_t GateWord() const { return __atomic_load_n(gate_->word, __ATOMIC_ACQUIRE); }
  void ForceGate() { __atomic_store_n(gate_->word, gate_armed_, __ATOMIC_RELEASE); }
  void ReleasePassedGates() {
    if (gate_pending_.empty()) return;
    const uint64_t word = GateWord();
    while (!gate_pending_.empty() && gate_pending_.front().value <= word) gate_pending_.pop_front();
  }
  // Nanoseconds until the oldest waiting step passes ready_timeout (negative once it has);
  // nullopt: none waits.
  std::optional<int64_t> GateLeftNs() {
    ReleasePassedGates();
    if (gate_pending_.empty()) return std::nullopt;
    return gate_pending_.front().armed_ns +
           absl::ToInt64Nanoseconds(server_->options_.ready_timeout) - absl::GetCurrentTimeNanos();
  }
  // For the idle wait: when to look again (at least 1 ns); 0: no step waits.
  int64_t GateDeadlineNs() {
    const std::optional<int64_t> left = GateLeftNs();
    return left ? std::max<int64_t>(*left, 1) : 0;
  }
  bool GateOverdue() {
    const std::optional<int64_t> left = GateLeftNs();
    return left && *left < 0;
  }
  std::string GateStuckMessage() const {
    return absl::StrCat("the client's ready event did not complete within ",
                        absl::FormatDuration(server_->options_.ready_timeout),
                        " of a device-ordered decode (its stream must record it after writing the "
                        "frame's inputs); attnd released the waiting steps and closed the ring");
  }
  // The client's stream never reached a step's "ready": the word is written from here so that no
  // decode step (of any tenant) waits any longer, and the ring is closed (its outputs since are
  // not to be trusted).
  void GateStuck() {
    ForceGate();
    gate_forced_ = true;
    gate_pending_.clear();
    broken_.store(true);
    server_->RevokeGates(tenant_);
    spdlog::warn("ring {} (tenant \"{}\"): {}; the tenant's later rings wait on the host", id(),
                 tenant_, GateStuckMessage());
  }

  // A private buffer of at least n bytes (contents undefined), taken from the request budget
  // while it is held. Never zero-filled: a ring's half may be large.
  struct Buffer {
    std::unique_ptr<char[]> data;
    uint64_t capacity = 0;
    ByteLease bytes;  // its bytes in the request budget
  };
  absl::Status Grow(Buffer* b, uint64_t n, absl::string_view what) {
    if (n <= b->capacity) return absl::OkStatus();
    Free(b);
    ByteBudget* budget = server_->budget_;
    // A ring's request is a message: alone, it may pass the budget (as a gRPC message may).
    if (budget != nullptr && !budget->TryTake(static_cast<int64_t>(n), /*alone_may_exceed=*/true)) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "attnd is serving ", budget->used(), " bytes of requests already; this one (", n,
          " bytes) would pass --max-inflight-request-bytes ", budget->limit(), ": retry later"));
    }
    ByteLease lease(budget, budget != nullptr ? static_cast<int64_t>(n) : 0);
    b->data.reset(new (std::nothrow) char[n]);
    if (b->data == nullptr) {
      return absl::ResourceExhaustedError(
          absl::StrCat("attnd cannot allocate ", n, " bytes ", what, ": retry later"));
    }
    b->capacity = n;
    b->bytes = std::move(lease);
    return absl::OkStatus();
  }
  static void Free(Buffer* b) {
    b->data.reset();
    b->capacity = 0;
    b->bytes.Reset();
  }

  // Idle: no request for a while, none in flight (answers on other threads may still write a
  // slot's output buffer while one is).
  void FreeBuffers() {
    if (inflight_.load() != 0) return;
    for (uint32_t i = 0; i < slot_count_; ++i) {
      Free(&slots_[i].in);
      Free(&slots_[i].out_buffer);
    }
  }
  bool HoldsBuffers() const {
    for (uint32_t i = 0; i < slot_count_; ++i) {
      if (slots_[i].in.data != nullptr) return true;
    }
    return false;
  }

  // FrameAnswer::output_buffer: where the engine writes a version 2 inline output, checked
  // against the response half before anything runs.
  absl::StatusOr<char*> OutputBuffer(Slot* slot, uint64_t bytes, uint64_t num_lengths) {
    const uint64_t need = ResponseBytes(num_lengths, 0, bytes);
    if (need > capacity_) {
      return absl::ResourceExhaustedError(
          absl::StrCat("the response (", need, " bytes) does not fit the ring's response half (",
                       capacity_, " bytes): open a larger ring, or name an output region"));
    }
    ATTND_RETURN_IF_ERROR(
        Grow(&slot->out_buffer, std::max<uint64_t>(bytes, 1), "for the ring's response"));
    return slot->out_buffer.data.get();
  }

  // The ring's memory shrank under a request: it cannot be answered; the client is told the ring
  // is closed (MarkClosed, by the reclaim that closes a broken ring).
  void AnswerBroken(Slot* slot) { Publish(slot); }

  // Stopping (CloseRing, shutdown, idle reclaim): requests the client posted that this thread has
  // not taken yet are answered UNAVAILABLE rather than left to the client's timeout, after the
  // ones in flight (answers are published in order).
  void AnswerPostedAtStop() {
    WaitInflightBelow(1, /*spin=*/false);
    HeaderArgs header{header_};
    if (!RunGuarded(ReadHeader, &header) || header.request_seq == taken_ || broken_.load()) {
      return FreeBuffers();
    }
    uint32_t last = header.request_seq;
    if (slot_count_ > 1 && last - taken_ > slot_count_) last = taken_ + slot_count_;
    for (uint32_t seq = slot_count_ > 1 ? taken_ + 1 : last;; ++seq) {
      Slot* slot = SlotOf(seq);
      Take(slot, seq);
      std::pair<const char*, uint64_t> length{slot->request_half, 0};
      if (RunGuarded(ReadLength, &length) && length.second <= capacity_ &&
          Grow(&slot->in, length.second, "to copy the ring's request").ok()) {
        ReadArgs read{slot->request_half + ring::kLengthBytes, slot->in.data.get(), length.second};
        if (read.n > 0 && RunGuarded(ReadBytes, &read)) {
          const absl::string_view bytes(slot->in.data.get(), read.n);
          if (version_ == ring::v2::kVersion) {
            slot->frame_tag = FrameTag(bytes);
            if (ParseRequestFrame(bytes, &slot->frame).ok()) slot->frame_op = slot->frame.op;
          } else if (slot->request.ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) {
            slot->response.set_tag(slot->request.tag());
          }
        }
      }
      Answer(slot, absl::UnavailableError("the server is shutting down or closed this ring"));
      if (seq == last) break;
    }
    taken_ = last;
    FreeBuffers();
  }

  // On the thread that completed the request: the response into its slot, then published.
  void Answer(Slot* slot, absl::Status status) {
    if (version_ == ring::v2::kVersion) return AnswerFrame(slot, std::move(status));
    v1::SessionResponse& response = slot->response;
    if (!status.ok()) {
      response.clear_response();
      response.set_code(static_cast<int32_t>(status.code()));
      response.set_message(std::string(status.message()));
    }
    std::string& out = slot->out;
    out.clear();
    response.SerializeToString(&out);
    if (out.size() > capacity_) {
      const size_t bytes = out.size();
      response.clear_response();
      response.set_code(static_cast<int32_t>(absl::StatusCode::kResourceExhausted));
      response.set_message(absl::StrCat(
          "the response (", bytes, " bytes) does not fit the ring's response half (", capacity_,
          " bytes): open a larger ring, or name an "
          "output region"));
      out.clear();
      response.SerializeToString(&out);
    }
    WriteArgs write{slot->response_half, &out};
    if (!RunGuarded(WriteResponse, &write)) broken_.store(true);
    Publish(slot);
  }

  // Answer for a version 2 ring: the response frame, o copied once from the output buffer.
  void AnswerFrame(Slot* slot, absl::Status status) {
    const FrameAnswer& answer = slot->answer;
    std::string head = EncodeResponseHead(slot->frame_tag, slot->frame_op, status, answer);
    const bool inline_output = status.ok() && !answer.output_in_region && answer.output_bytes > 0;
    const uint64_t lengths = status.ok() ? answer.lengths.size() : 0;
    const uint64_t output_offset = inline_output ? ResponseOutputOffset(lengths, 0) : 0;
    const uint64_t bytes = inline_output ? output_offset + answer.output_bytes : head.size();
    if (bytes > capacity_) {  // only an error's long message: OutputBuffer checked the rest
      absl::Status cut(status.code(), status.message().substr(0, capacity_ / 2));
      if (status.ok()) {
        cut = absl::ResourceExhaustedError(
            absl::StrCat("the response (", bytes, " bytes) does not fit the ring's response half (",
                         capacity_, " bytes): open a larger ring, or name an output region"));
      }
      return AnswerFrame(slot, std::move(cut));
    }
    WriteFrameArgs write{slot->response_half, &head, answer.output, output_offset,
                         inline_output ? answer.output_bytes : 0};
    if (!RunGuarded(WriteFrameResponse, &write)) broken_.store(true);
    Publish(slot);
  }

  // The slot's response is written: response_seq moves past every answered request in posting
  // order, and the client's doorbell rings. Under the lock, the signal too: once the ring's
  // thread sees nothing in flight, it may destroy the ring (Close), and this thread must not
  // touch it after unlocking.
  void Publish(Slot* slot) {
    MutexLock lock(&mu_);
    slot->answered = true;
    while (inflight_.load() > 0) {
      Slot* next = SlotOf(published_.load() + 1);
      if (slot_count_ == 1) next = &slots_[0];
      if (!next->answered) break;
      next->answered = false;
      published_.store(next->seq);
      inflight_.fetch_sub(1);
      if (!broken_.load()) {
        PublishArgs publish{header_, next->seq};
        if (!RunGuarded(PublishResponse, &publish)) broken_.store(true);
      }
    }
    answered_.SignalAll();
  }

  // Until fewer than n requests are in flight; with spin, spinning first (rationed) for the
  // answer another thread is about to publish: a sleeping thread wakes tens of microseconds late.
  void WaitInflightBelow(uint32_t n, bool spin) {
    if (spin && inflight_.load() >= n && server_->options_.answer_spin > absl::ZeroDuration() &&
        server_->BeginSpin(tenant_)) {
      const int64_t spin_until =
          absl::GetCurrentTimeNanos() + absl::ToInt64Nanoseconds(server_->options_.answer_spin);
      while (inflight_.load() >= n && absl::GetCurrentTimeNanos() < spin_until) {
      }
      server_->EndSpin(tenant_);
    }
    MutexLock lock(&mu_);
    while (inflight_.load() >= n) answered_.Wait(&mu_);
  }

  void Broken(absl::string_view doing) {
    broken_.store(true);
    spdlog::warn(
        "ring {} (tenant \"{}\"): its shm object shrank while attnd was {}; the ring "
        "is closed",
        id(), tenant_, std::string(doing));
  }

  // The client posted more requests than the ring has slots before their answers: it broke the
  // protocol (proto/attnd/v1/shm_ring.h), and its slots' contents are not to be trusted.
  void Overrun(uint32_t unanswered) {
    broken_.store(true);
    spdlog::warn(
        "ring {} (tenant \"{}\"): the client posted {} unanswered requests into a ring of {} "
        "slots; the ring is closed",
        id(), tenant_, unanswered, slot_count_);
  }

  struct Slot {
    char* request_half = nullptr;
    char* response_half = nullptr;
    uint32_t seq = 0;       // the request in it (request_seq's value when it was posted)
    bool answered = false;  // its response is written, not yet published (guarded by mu_)
    Buffer in;              // the request copied out of the ring
    // Version 1: the parsed request and its response, serialized into out.
    v1::SessionRequest request;
    v1::SessionResponse response;
    std::string out;
    // Version 2: the parsed frame (views into in), its answer and the inline output's buffer.
    RequestFrame frame;
    FrameAnswer answer;
    uint64_t frame_tag = 0;
    uint16_t frame_op = 0;
    Buffer out_buffer;
  };

  RingServer* const server_;
  const uint32_t version_;  // ring::kVersion (protobuf) or ring::v2::kVersion (frames)
  const uint32_t slot_count_;
  const RingEvents events_;  // owned: destroyed with the ring
  // Device-ordered decodes wait behind it on the device; none: on the host. Owned.
  const std::optional<DeviceMemoryOpener::Gate> gate_;
  uint64_t gate_armed_ = 0;  // the last value armed
  struct PendingGate {
    uint64_t value;
    int64_t armed_ns;
  };
  std::deque<PendingGate> gate_pending_;  // armed, the word not there yet; oldest first
  bool gate_forced_ = false;              // attnd opened it: the client's stream is stuck
  const std::string tenant_;
  RegionLease lease_;
  ring::Header* const header_;
  const uint64_t capacity_;
  const std::unique_ptr<Slot[]> slots_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> broken_{false};
  // Requests taken and not yet published (changed under mu_); the last one taken (the ring's
  // thread's own) and the last one published.
  std::atomic<uint32_t> inflight_{0};
  uint32_t taken_ = 0;
  std::atomic<uint32_t> published_{0};
  std::atomic<int64_t> last_active_us_;
  Mutex mu_;
  CondVar answered_;
  std::thread thread_;
};

RingServer::RingServer(RegionRegistry* registry, const RingOptions& options)
    : registry_(registry), options_(options) {}

RingServer::~RingServer() { Shutdown(); }

void RingServer::SetHandler(Handler handler) { handler_ = std::move(handler); }

void RingServer::SetFrameHandler(FrameHandler handler) { frame_handler_ = std::move(handler); }

void RingServer::SetDeviceEvents(DeviceMemoryOpener* events) { events_ = events; }

void RingServer::SetRequestBudget(ByteBudget* budget, int64_t max_request_bytes) {
  budget_ = budget;
  max_request_bytes_ = max_request_bytes;
}

bool RingServer::BeginSpin(const std::string& tenant) {
  MutexLock lock(&spin_mu_);
  int& mine = spinning_[tenant];
  if (mine >= options_.max_spinning_per_tenant || spinning_total_ >= options_.max_spinning) {
    if (mine == 0) spinning_.erase(tenant);
    ++spin_stats_.spins_refused;
    return false;
  }
  ++mine;
  ++spinning_total_;
  ++spin_stats_.spins;
  spin_stats_.max_spinning_seen = std::max<int64_t>(spin_stats_.max_spinning_seen, spinning_total_);
  spin_stats_.max_spinning_one_tenant_seen =
      std::max<int64_t>(spin_stats_.max_spinning_one_tenant_seen, mine);
  return true;
}

void RingServer::EndSpin(const std::string& tenant) {
  MutexLock lock(&spin_mu_);
  auto it = spinning_.find(tenant);
  if (it == spinning_.end()) return;
  --spinning_total_;
  if (--it->second == 0) spinning_.erase(it);
}

RingSpinStats RingServer::spin_stats() const {
  MutexLock lock(&spin_mu_);
  return spin_stats_;
}

absl::StatusOr<RingServer::Opened> RingServer::Open(absl::string_view tenant,
                                                    absl::string_view name, uint64_t bytes,
                                                    bool device_events) {
  {
    MutexLock lock(&mu_);
    if (shut_down_) return absl::UnavailableError("the server is shutting down");
  }
  if (bytes < ring::kHeaderBytes + 2 * 4096 || bytes > options_.max_ring_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("a ring's byte_size must be between ",
                                                   ring::kHeaderBytes + 2 * 4096, " and ",
                                                   options_.max_ring_bytes, " bytes, got ", bytes));
  }
  if ((bytes - ring::kHeaderBytes) % 2 != 0) {
    return absl::InvalidArgumentError(absl::StrCat("a ring is its ", ring::kHeaderBytes,
                                                   "-byte header and two equal halves: byte_size ",
                                                   bytes, " leaves an odd remainder"));
  }
  ATTND_ASSIGN_OR_RETURN(std::shared_ptr<const Region> region,
                         registry_->RegisterShm(tenant, name, 0, bytes, RegionKind::kRing));
  absl::StatusOr<RegionLease> lease = registry_->AcquireRing(tenant, region->id);
  if (!lease.ok()) return lease.status();
  // The header's fixed fields, read once (guarded).
  HeaderArgs header{reinterpret_cast<const ring::Header*>(region->base)};
  const bool readable = RunGuarded(ReadHeader, &header);
  absl::Status bad;
  if (!readable) {
    bad = absl::InvalidArgumentError("the ring's shm object shrank during OpenRing");
  } else if (header.magic != ring::kMagic) {
    bad = absl::InvalidArgumentError(absl::StrCat(
        "shm object \"", name, "\" is not an attnd ring: its header needs magic 0x",
        absl::Hex(ring::kMagic), " (proto/attnd/v1/shm_ring.h), got 0x", absl::Hex(header.magic)));
  } else if (header.version != ring::kVersion &&
             (header.version != ring::v2::kVersion || !frame_handler_)) {
    bad = absl::InvalidArgumentError(absl::StrCat(
        "the ring's header says version ", header.version, "; this attnd serves version ",
        ring::kVersion, " (serialized SessionRequest / SessionResponse)",
        frame_handler_ ? absl::StrCat(" and version ", ring::v2::kVersion,
                                      " (binary frames, proto/attnd/v1/ring_frame.h)")
                       : std::string()));
  } else if (!ring::ValidSlots(header.slots)) {
    bad = absl::InvalidArgumentError(absl::StrCat(
        "the ring's header says slots ", header.slots,
        "; a ring holds 0 or 1 (one request at a time) or a power of two up to ", ring::kMaxSlots));
  } else if (header.slots > 1 && header.version != ring::v2::kVersion) {
    bad = absl::InvalidArgumentError(absl::StrCat("a ring of ", header.slots,
                                                  " slots needs version ", ring::v2::kVersion,
                                                  " frames; this one is version ", header.version));
  } else if (header.slots > 1 && device_events) {
    bad = absl::InvalidArgumentError(absl::StrCat(
        "a device-ordered ring holds one request at a time (its one pair of events orders one "
        "frame after another), but its header says slots ",
        header.slots, ": open one ring per micro-batch"));
  } else if (const uint64_t halves = 2 * uint64_t{ring::SlotCount(header.slots)};
             (bytes - ring::kHeaderBytes) % halves != 0 ||
             header.half_bytes != (bytes - ring::kHeaderBytes) / halves) {
    bad = absl::InvalidArgumentError(absl::StrCat("the ring's header says half_bytes ",
                                                  header.half_bytes, " and slots ", header.slots,
                                                  ", so byte_size must be ", ring::kHeaderBytes,
                                                  " + ", halves, " * half_bytes; it is ", bytes));
  } else if (header.half_bytes < 4096) {
    bad = absl::InvalidArgumentError(absl::StrCat(
        "each half of a ring is at least 4096 bytes; its header says ", header.half_bytes));
  } else if (header.request_seq != header.response_seq) {
    bad = absl::InvalidArgumentError(
        "the ring's request_seq and response_seq differ: open a ring with no request in it");
  }
  if (bad.ok() && device_events && header.version != ring::v2::kVersion) {
    bad =
        absl::InvalidArgumentError(absl::StrCat("device_events need a version ", ring::v2::kVersion,
                                                " ring; this one is version ", header.version));
  } else if (bad.ok() && device_events && events_ == nullptr) {
    bad = absl::FailedPreconditionError(
        "device_events need attnd on one CUDA GPU (--device cuda, one shard); this one has no "
        "device events");
  }
  Opened opened;
  RingEvents events;
  if (bad.ok() && device_events) {
    absl::StatusOr<DeviceMemoryOpener::IpcEvent> ready = events_->CreateIpcEvent();
    absl::StatusOr<DeviceMemoryOpener::IpcEvent> done =
        ready.ok() ? events_->CreateIpcEvent() : ready.status();
    if (ready.ok() && done.ok()) {
      events = {ready->event, done->event};
      opened.ready_event = ready->handle;
      opened.done_event = done->handle;
    } else {
      if (ready.ok()) events_->DestroyIpcEvent(ready->event);
      bad = done.status();
    }
  }
  if (!bad.ok()) {
    *lease = RegionLease();
    registry_->Unregister(tenant, region->id, /*ring=*/true).IgnoreError();
    return bad;
  }
  // Without a gate (no stream memory operations, or every slot taken) the ring waits for its
  // client's "ready" on the host: correct, a little slower.
  std::optional<DeviceMemoryOpener::Gate> gate;
  bool revoked = false;
  {
    MutexLock lock(&mu_);
    revoked = gates_revoked_.contains(std::string(tenant));
  }
  if (device_events && !revoked) {
    absl::StatusOr<DeviceMemoryOpener::Gate> made = events_->CreateGate();
    if (made.ok()) {
      gate = *made;
    } else if (made.status().code() != absl::StatusCode::kFailedPrecondition) {
      spdlog::warn("ring for tenant \"{}\": no device gate ({}); it waits on the host",
                   std::string(tenant), made.status().ToString());
    }
  }
  auto ring = std::make_unique<Ring>(this, std::string(tenant), *std::move(lease),
                                     header.half_bytes, header.version, header.slots, events, gate);
  opened.ring_id = ring->id();
  opened.request_capacity = ring->capacity();
  opened.response_capacity = ring->capacity();
  Ring* started = ring.get();
  {
    MutexLock lock(&mu_);
    if (shut_down_) {
      ring.reset();
      registry_->Unregister(tenant, opened.ring_id, /*ring=*/true).IgnoreError();
      return absl::UnavailableError("the server is shutting down");
    }
    rings_[opened.ring_id] = std::move(ring);
    started->Start(header.request_seq);
  }
  return opened;
}

void RingServer::RevokeGates(const std::string& tenant) {
  MutexLock lock(&mu_);
  gates_revoked_.insert(tenant);
}

absl::Status RingServer::CloseRing(std::unique_ptr<Ring> ring) {
  const std::string id = ring->id(), tenant = ring->tenant();
  ring.reset();  // stops the thread, drops the lease
  return registry_->Unregister(tenant, id, /*ring=*/true);
}

absl::Status RingServer::Close(absl::string_view tenant, absl::string_view id) {
  std::unique_ptr<Ring> ring;
  {
    MutexLock lock(&mu_);
    auto it = rings_.find(id);
    if (it == rings_.end() || it->second->tenant() != tenant) {
      return absl::NotFoundError(absl::StrCat("ring \"", id.substr(0, 64), "\" not found"));
    }
    ring = std::move(it->second);
    rings_.erase(it);
  }
  return CloseRing(std::move(ring));
}

int RingServer::ReclaimIdle() {
  std::vector<std::unique_ptr<Ring>> idle;
  {
    const int64_t cutoff = options_.idle_timeout > absl::ZeroDuration()
                               ? absl::ToUnixMicros(absl::Now() - options_.idle_timeout)
                               : std::numeric_limits<int64_t>::min();
    MutexLock lock(&mu_);
    for (auto it = rings_.begin(); it != rings_.end();) {
      if (it->second->idle_since(cutoff)) {
        idle.push_back(std::move(it->second));
        rings_.erase(it++);
      } else {
        ++it;
      }
    }
  }
  for (auto& ring : idle) {
    spdlog::info("ring {} of tenant \"{}\" closed: idle or broken", ring->id(), ring->tenant());
    CloseRing(std::move(ring)).IgnoreError();
  }
  return static_cast<int>(idle.size());
}

void RingServer::Shutdown() {
  absl::flat_hash_map<std::string, std::unique_ptr<Ring>> rings;
  {
    MutexLock lock(&mu_);
    shut_down_ = true;
    rings.swap(rings_);
  }
  for (auto& [id, ring] : rings) CloseRing(std::move(ring)).IgnoreError();
}

int64_t RingServer::open_rings() const {
  MutexLock lock(&mu_);
  return static_cast<int64_t>(rings_.size());
}

}  // namespace attnd
