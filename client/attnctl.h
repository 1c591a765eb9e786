// attnctl's subcommands as functions over a connected client, so tests can run them against an
// in-process daemon. main.cc owns the flags and fills these Options structs. Each returns the
// process exit code: 0 success, 1 a failed check (smoke FAIL), 2 an error talking to the server.
#ifndef ATTND_CLIENT_ATTNCTL_H_
#define ATTND_CLIENT_ATTNCTL_H_

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "base/dtype.h"
#include "client/attnd_client.h"

namespace attnd {
namespace client {

// `attnctl info`: GetServerInfo as aligned "key: value" lines.
int RunInfo(AttndClient& client, std::ostream& out, std::ostream& err);

// `attnctl sequences [--tenant T]`: every live sequence (attnd.v1.Admin), one line each: id,
// tenant, pages, min/max tokens over its layers, idle time; then the totals.
int RunSequences(AttndClient& client, const std::string& tenant, std::ostream& out,
                 std::ostream& err);
// `attnctl release ID`: releases any tenant's sequence (attnd.v1.Admin) and says what it freed.
int RunRelease(AttndClient& client, const std::string& sequence_id, std::ostream& out,
               std::ostream& err);

inline constexpr int32_t kDefaultLayers = 0;
inline constexpr int32_t kAllLayers = -1;

struct SmokeOptions {
  DType dtype = DType::kFp32;
  // Layers to run: kDefaultLayers = all, capped (see kSmokeMaxLayers*); kAllLayers = all; n > 0.
  int32_t layers = 0;
  int64_t max_tokens = 0;  // tokens per sequence (prefill + decode); 0 = the default rule
  int64_t decode_steps = 16;
  uint64_t seed = 1;
  // Q_LAYOUT_PRE_ROTARY: send q/k before the rotary; the reference rotates them itself (fp64).
  v1::QLayout q_layout = v1::Q_LAYOUT_VARIANTS;
  // Progress lines on `err` ("smoke: prefill call 2/5 done: tokens 0..1023, 8 layers, 3.1 s"):
  // one per prefill call and one per tenth of the decode steps.
  bool progress = false;
};
// Layer caps when `layers` is 0: the reference is fp64 and single-process, so big models run
// fewer layers by default (every layer exercises the same kernels; the geometry is what matters).
inline constexpr int32_t kSmokeMaxLayersSmallModel = 8;
inline constexpr int32_t kSmokeMaxLayersLargeModel = 1;

// `attnctl smoke`: one sequence prefilled in several chunks spanning at least two DCA chunks
// where the token cap allows, then decode steps; every output checked against the naive fp64
// reference; PASS/FAIL with the max error. Releases what it created.
int RunSmoke(AttndClient& client, const SmokeOptions& options, std::ostream& out,
             std::ostream& err);

struct BenchOptions {
  std::vector<int64_t> contexts = {1024, 4096};
  int64_t prefill_chunk = 1024;
  int64_t decode_steps = 32;
  int32_t batch = 1;  // sequences per decode call
  DType dtype = DType::kBf16;
  int32_t layers = 1;  // 0 = all
  uint64_t seed = 1;
  v1::QLayout q_layout = v1::Q_LAYOUT_VARIANTS;  // pre-rotary: q [T, Hq, D] / [Hq, D] on the wire
  bool progress = true;  // the \r progress line on `err`; off when it is not a terminal
  // How requests travel, one full pass (and one table) each (docs/regions.md):
  //   grpc      unary Prefill / Decode RPCs with the tensors' bytes
  //   session   one Session stream with the bytes
  //   shm       unary RPCs naming q/k/v and o in a registered POSIX shm region
  //   ring      a shared-memory ring (RingClient), bytes inline or (ring_regions) shm references
  //   cuda-ipc  unary RPCs naming device buffers shared with cudaIpcGetMemHandle (CUDA builds)
  //   ring-cuda-ipc  the ring, its requests naming those device buffers (CUDA builds)
  std::vector<std::string> transports = {"grpc"};
  bool ring_regions = false;  // ring: region references instead of inline bytes
  int64_t ring_spin_us = 50;  // ring: how long the client spins before it sleeps
  int32_t ring_version = 2;   // ring: 2, binary frames; 1, SessionRequest protobufs
  int32_t cuda_device = -1;   // cuda-ipc, ring-cuda-ipc: the local device; -1 = the server's (UUID)
  // ring-cuda-ipc: a device-ordered ring (RingOptions::device_events); each decode step is timed
  // until the device has run it.
  bool ring_device_events = false;
  // ring, ring-cuda-ipc: a ring of this many slots (version 2); each decode step's batch goes as
  // that many micro-batches in flight at once (SubmitDecode, then AwaitDecode for each).
  int32_t ring_slots = 1;
};
// The transports RunBench knows.
bool IsBenchTransport(const std::string& name);
// `attnctl bench`: prefill and decode latency/throughput; a progress line on `err` (rewritten
// with \r) and a summary table on `out`. Releases everything it created, also on failure.
int RunBench(AttndClient& client, const BenchOptions& options, std::ostream& out,
             std::ostream& err);

}  // namespace client
}  // namespace attnd

#endif  // ATTND_CLIENT_ATTNCTL_H_
