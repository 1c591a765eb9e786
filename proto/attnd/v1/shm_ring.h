// The layout of a shared-memory ring (OpenRing in attention.proto; docs/regions.md, "Rings"): the
// part of attnd's API that is not a protobuf message. A client creates a POSIX shm object of
// kHeaderBytes + 2 * slots * half_bytes bytes, writes the header's first fields, and opens it
// with OpenRing. Then, with one slot (the default), one request at a time:
//
//   client: waits until response_seq == request_seq (nothing in flight), writes a serialized
//           attnd.v1.SessionRequest into the request half (its length first), then
//           request_seq += 1 (release; one aligned 32-bit store: attnd reads the word while the
//           client writes it) and, if server_sleeping, futex-wakes request_seq.
//   attnd:  sees request_seq change (it spins a while after each request, then sleeps on the
//           futex), copies the request out, runs it (decodes join the cross-client batcher),
//           writes the serialized attnd.v1.SessionResponse into the response half, sets
//           response_seq = request_seq (release) and, if client_sleeping, futex-wakes response_seq.
//   client: spins on response_seq, or sets client_sleeping and futex-waits on it.
//
// With `slots` S > 1 (a power of two up to kMaxSlots; version 2 frames only, no device events),
// up to S requests are in flight at once: request n (the value request_seq takes when the client
// posts it) lives in slot n % S, whose request half and response half it uses; the client may post
// request n once n - response_seq <= S (unsigned, wrapping), and attnd answers in the order
// posted: response_seq = n says requests up to n are answered, request n's in slot n % S's
// response half, which stays as written until the client posts request n + S. A client that posts
// more than S unanswered requests breaks the protocol: attnd closes the ring. (With one slot a
// client that bumps request_seq by more than one is answered once, for the latest.)
//
// attnd sets `closed` (and wakes both words) when the ring is closed, reclaimed or the server
// stops. The sequence words wrap at 2^32. Every field is little-endian (the host's order: the ring
// never leaves the host). The futexes are process-shared (FUTEX_WAIT / FUTEX_WAKE without
// FUTEX_PRIVATE_FLAG).
#ifndef ATTND_PROTO_ATTND_V1_SHM_RING_H_
#define ATTND_PROTO_ATTND_V1_SHM_RING_H_

#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace attnd::ring {

inline constexpr uint64_t kMagic = 0x31474e52444e5441ull;  // "ATNDRNG1" read as little-endian
inline constexpr uint32_t kVersion = 1;
// The most requests one ring may hold in flight (Header::slots).
inline constexpr uint32_t kMaxSlots = 16;
inline constexpr size_t kHeaderBytes = 4096;  // the halves start at page boundaries
// A half starts with the message's length as a uint64, then the message.
inline constexpr size_t kLengthBytes = 8;

struct Header {
  // Written by the client before OpenRing; attnd checks them and never writes them.
  uint64_t magic;
  uint32_t version;
  // Requests in flight at once: 0 or 1 (one), else a power of two up to kMaxSlots.
  uint32_t slots;
  // Each half's size: kHeaderBytes + 2 * max(slots, 1) * half_bytes == the object's size.
  uint64_t half_bytes;
  // One cache line per word the two sides write, so they do not share lines.
  alignas(64) std::atomic<uint32_t> request_seq;      // the client's: requests written
  alignas(64) std::atomic<uint32_t> response_seq;     // attnd's: requests answered
  alignas(64) std::atomic<uint32_t> server_sleeping;  // attnd's: 1 while it futex-waits
  alignas(64) std::atomic<uint32_t> client_sleeping;  // the client's: 1 while it futex-waits
  alignas(64) std::atomic<uint32_t> closed;  // attnd's: 1 once the ring serves nothing more
};
static_assert(sizeof(Header) <= kHeaderBytes);
static_assert(std::atomic<uint32_t>::is_always_lock_free);
static_assert(offsetof(Header, request_seq) == 64);
static_assert(offsetof(Header, response_seq) == 128);
static_assert(offsetof(Header, server_sleeping) == 192);
static_assert(offsetof(Header, client_sleeping) == 256);
static_assert(offsetof(Header, closed) == 320);

// Slot s's halves: its request half, then its response half.
inline constexpr size_t RequestOffset(uint64_t half_bytes = 0, uint32_t slot = 0) {
  return kHeaderBytes + 2 * uint64_t{slot} * half_bytes;
}
inline constexpr size_t ResponseOffset(uint64_t half_bytes, uint32_t slot = 0) {
  return RequestOffset(half_bytes, slot) + half_bytes;
}
// How many slots a header's `slots` field means, and the slot request `seq` uses.
inline constexpr uint32_t SlotCount(uint32_t slots) { return slots > 1 ? slots : 1; }
inline constexpr uint32_t SlotOf(uint32_t seq, uint32_t slots) {
  return seq & (SlotCount(slots) - 1);
}
inline constexpr bool ValidSlots(uint32_t slots) {
  return slots <= kMaxSlots && (slots & (slots - 1)) == 0;
}
// The largest message a half holds.
inline constexpr uint64_t Capacity(uint64_t half_bytes) {
  return half_bytes > kLengthBytes ? half_bytes - kLengthBytes : 0;
}

// Waits while *word == expected, at most timeout_us (a spurious or early return is fine: callers
// loop). Process-shared.
inline void FutexWait(std::atomic<uint32_t>* word, uint32_t expected, int64_t timeout_us) {
  timespec ts;
  ts.tv_sec = static_cast<time_t>(timeout_us / 1000000);
  ts.tv_nsec = static_cast<long>((timeout_us % 1000000) * 1000);  // NOLINT(runtime/int)
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

// Wakes every waiter on `word`.
inline void FutexWake(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

}  // namespace attnd::ring

#endif  // ATTND_PROTO_ATTND_V1_SHM_RING_H_
