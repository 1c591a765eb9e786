// A bounded loopback load generator for attnd (script/soak drives it; docs/RELIABILITY.md).
// For --seconds it runs, concurrently:
//   --clients   full sequences: create -> chunked prefill over all layers -> decode x N -> release
//   --abandoners sequences created, partly prefilled and left behind for the idle reaper
//                (attnd --sequence-idle-timeout)
//   --hammers   clients that fill the pool until it refuses (RESOURCE_EXHAUSTED), then let go
// Pass criteria (exit 0 only if all hold):
//   - no RPC fails except RESOURCE_EXHAUSTED on CreateSequence/Prefill/Decode (the pool is full
//     on purpose; the client then releases its sequence and starts over);
//   - at the end, after waiting for idle reclaim: pages_free == pages_total and live_sequences ==
//   0;
//   - with --attnd_pid: attnd's VmRSS (from /proc) is flat after warm-up: the last third's max RSS
//     <= the middle third's max * (1 + --rss_tolerance) + --rss_slack_mib.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/attnd_client.h"

ABSL_FLAG(std::string, target, "", "attnd address, host:port (loopback)");
ABSL_FLAG(double, seconds, 60, "how long to generate load");
ABSL_FLAG(int, clients, 4, "full-sequence clients");
ABSL_FLAG(int, abandoners, 1, "clients that leave sequences for the idle reaper");
ABSL_FLAG(int, hammers, 1, "clients that fill the pool until RESOURCE_EXHAUSTED");
ABSL_FLAG(int, prompt, 256, "prompt tokens per sequence");
ABSL_FLAG(int, chunk, 64, "prefill chunk tokens");
ABSL_FLAG(int, decode_steps, 8, "decode steps per sequence (each over all layers)");
ABSL_FLAG(double, reclaim_wait_s, 20, "most seconds to wait at the end for idle reclaim");
ABSL_FLAG(int, attnd_pid, 0, "attnd's pid, to sample its VmRSS; 0 = no RSS check");
ABSL_FLAG(double, rss_tolerance, 0.10, "allowed RSS growth of the last third over the middle");
ABSL_FLAG(double, rss_slack_mib, 16, "allowed absolute RSS growth, MiB");
ABSL_FLAG(bool, probe, false, "only check that --target answers GetServerInfo, exit 0 if so");

namespace attnd {
namespace {

using client::AttndClient;
using client::HostTensor;

struct Geometry {
  int layers, hq, hkv, d;
};

struct Counters {
  std::atomic<int64_t> rpcs{0}, exhausted{0}, failed{0}, prefill_tokens{0}, decode_tokens{0};
  std::atomic<int64_t> completed{0}, abandoned{0}, hammer_rounds{0};
  std::mutex mu;
  std::map<std::string, int64_t> failures;  // "rpc: code message" -> count

  // True when the status is OK; RESOURCE_EXHAUSTED is counted and allowed where `may_exhaust`.
  bool Note(const char* rpc, const absl::Status& s, bool may_exhaust) {
    rpcs.fetch_add(1);
    if (s.ok()) return true;
    if (may_exhaust && s.code() == absl::StatusCode::kResourceExhausted) {
      exhausted.fetch_add(1);
      return false;
    }
    failed.fetch_add(1);
    std::lock_guard<std::mutex> lock(mu);
    ++failures[absl::StrCat(rpc, ": ", s.ToString())];
    return false;
  }
};

HostTensor Random(std::mt19937* rng, std::vector<int64_t> shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  std::vector<float> v(n);
  for (float& x : v) x = dist(*rng);
  return HostTensor::FromFloats(DType::kBf16, std::move(shape), v);
}

// Prefills `tokens` tokens into every layer in chunks; false on the first failure.
bool Prefill(AttndClient* c, const Geometry& g, const std::string& id, int tokens, int chunk,
             std::mt19937* rng, Counters* n) {
  for (int start = 0; start < tokens; start += chunk) {
    const int t = std::min(chunk, tokens - start);
    for (int layer = 0; layer < g.layers; ++layer) {
      auto r = c->Prefill(id, layer, Random(rng, {t, 5, g.hq, g.d}), Random(rng, {t, g.hkv, g.d}),
                          Random(rng, {t, g.hkv, g.d}), tokens);
      if (!n->Note("Prefill", r.status(), true)) return false;
      n->prefill_tokens.fetch_add(t);
    }
  }
  return true;
}

bool DecodeSteps(AttndClient* c, const Geometry& g, const std::string& id, int steps,
                 std::mt19937* rng, Counters* n) {
  for (int s = 0; s < steps; ++s) {
    for (int layer = 0; layer < g.layers; ++layer) {
      client::DecodeInput in{id, Random(rng, {3, g.hq, g.d}), Random(rng, {g.hkv, g.d}),
                             Random(rng, {g.hkv, g.d})};
      auto r = c->Decode(layer, {in});
      if (!n->Note("Decode", r.status(), true)) return false;
    }
    n->decode_tokens.fetch_add(1);
  }
  return true;
}

void Release(AttndClient* c, const std::string& id, Counters* n) {
  n->Note("ReleaseSequence", c->Release(id).status(), false);
}

int64_t VmRssKib(int pid) {
  std::ifstream f(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::atoll(line.c_str() + 6);
  }
  return -1;
}

int Main() {
  const std::string target = absl::GetFlag(FLAGS_target);
  if (target.empty()) {
    std::fprintf(stderr, "loadgen: --target is required\n");
    return 2;
  }
  client::ClientOptions options;
  options.rpc_timeout = absl::Seconds(60);
  auto main_client = AttndClient::Connect(target, options);
  if (!main_client.ok()) {
    std::fprintf(stderr, "loadgen: %s\n", main_client.status().ToString().c_str());
    return 1;
  }
  auto info = (*main_client)->Info();
  if (!info.ok()) {
    std::fprintf(stderr, "loadgen: GetServerInfo: %s\n", info.status().ToString().c_str());
    return 1;
  }
  if (absl::GetFlag(FLAGS_probe)) return 0;
  const Geometry g{info->model().num_layers(), info->model().num_q_heads(),
                   info->model().num_kv_heads(), info->model().head_dim()};
  const int64_t pages_total = info->kv_cache().pages_total();
  std::printf(
      "loadgen: %s, model %s (%d layers), %lld pages of %d tokens; %d clients, %d "
      "abandoners, %d hammers, %.0f s, prompt %d in chunks of %d, %d decode steps\n",
      target.c_str(), info->model().name().c_str(), g.layers, static_cast<long long>(pages_total),
      info->kv_cache().page_size(), absl::GetFlag(FLAGS_clients), absl::GetFlag(FLAGS_abandoners),
      absl::GetFlag(FLAGS_hammers), absl::GetFlag(FLAGS_seconds), absl::GetFlag(FLAGS_prompt),
      absl::GetFlag(FLAGS_chunk), absl::GetFlag(FLAGS_decode_steps));

  Counters n;
  const absl::Time start = absl::Now();
  const absl::Time end = start + absl::Seconds(absl::GetFlag(FLAGS_seconds));
  const int prompt = absl::GetFlag(FLAGS_prompt), chunk = absl::GetFlag(FLAGS_chunk);
  const int steps = absl::GetFlag(FLAGS_decode_steps);
  std::vector<std::thread> threads;
  auto connect = [&]() -> std::unique_ptr<AttndClient> {
    auto c = AttndClient::Connect(target, options);
    if (!c.ok()) {
      n.Note("Connect", c.status(), false);
      return nullptr;
    }
    return *std::move(c);
  };
  for (int i = 0; i < absl::GetFlag(FLAGS_clients); ++i) {
    threads.emplace_back([&, i] {
      std::mt19937 rng(1000 + i);
      std::unique_ptr<AttndClient> c = connect();
      while (c != nullptr && absl::Now() < end) {
        auto id = c->CreateSequence();
        if (!n.Note("CreateSequence", id.status(), true)) {
          absl::SleepFor(absl::Milliseconds(20));
          continue;
        }
        if (Prefill(c.get(), g, *id, prompt, chunk, &rng, &n) &&
            DecodeSteps(c.get(), g, *id, steps, &rng, &n)) {
          n.completed.fetch_add(1);
        }
        Release(c.get(), *id, &n);
      }
    });
  }
  for (int i = 0; i < absl::GetFlag(FLAGS_abandoners); ++i) {
    threads.emplace_back([&, i] {
      std::mt19937 rng(2000 + i);
      std::unique_ptr<AttndClient> c = connect();
      while (c != nullptr && absl::Now() < end) {
        auto id = c->CreateSequence();
        if (n.Note("CreateSequence", id.status(), true)) {
          // Half a prompt, then walk away: the reaper must give the pages back.
          if (Prefill(c.get(), g, *id, prompt / 2, chunk, &rng, &n)) n.abandoned.fetch_add(1);
        }
        absl::SleepFor(absl::Seconds(1));
      }
    });
  }
  for (int i = 0; i < absl::GetFlag(FLAGS_hammers); ++i) {
    threads.emplace_back([&, i] {
      std::mt19937 rng(3000 + i);
      std::unique_ptr<AttndClient> c = connect();
      while (c != nullptr && absl::Now() < end) {
        // Grab sequences of 2 x prompt tokens (one chunk per layer) until the pool refuses,
        // hold them briefly, let go.
        std::vector<std::string> held;
        while (absl::Now() < end && held.size() < static_cast<size_t>(pages_total)) {
          auto id = c->CreateSequence();
          if (!n.Note("CreateSequence", id.status(), true)) break;
          held.push_back(*id);
          if (!Prefill(c.get(), g, *id, 2 * prompt, 2 * prompt, &rng, &n)) break;
        }
        n.hammer_rounds.fetch_add(1);
        absl::SleepFor(absl::Milliseconds(50));
        for (const std::string& id : held) Release(c.get(), id, &n);
      }
    });
  }

  // RSS samples every 250 ms while the load runs.
  std::vector<int64_t> rss;
  const int pid = absl::GetFlag(FLAGS_attnd_pid);
  while (absl::Now() < end) {
    if (pid > 0) rss.push_back(VmRssKib(pid));
    absl::SleepFor(absl::Milliseconds(250));
  }
  for (std::thread& t : threads) t.join();
  const double secs = absl::ToDoubleSeconds(absl::Now() - start);

  // Idle reclaim: the abandoned sequences go once the reaper sees them idle.
  int64_t free_pages = -1, live = -1;
  const absl::Time give_up = absl::Now() + absl::Seconds(absl::GetFlag(FLAGS_reclaim_wait_s));
  absl::Time reclaimed_at = absl::InfinitePast();
  while (true) {
    auto i = (*main_client)->Info();
    if (!n.Note("GetServerInfo", i.status(), false)) break;
    free_pages = i->kv_cache().pages_free();
    live = i->live_sequences();
    if (free_pages == pages_total && live == 0) {
      reclaimed_at = absl::Now();
      break;
    }
    if (absl::Now() > give_up) break;
    absl::SleepFor(absl::Milliseconds(200));
  }

  bool ok = true;
  std::printf(
      "loadgen: %.1f s: %lld RPCs (%.0f/s), %lld sequences completed (%.1f/s), %lld "
      "prefill tokens x layers (%.0f/s), %lld decode tokens (%.0f/s), %lld abandoned, %lld "
      "hammer rounds, %lld RESOURCE_EXHAUSTED (intended), %lld failed\n",
      secs, static_cast<long long>(n.rpcs.load()), n.rpcs.load() / secs,
      static_cast<long long>(n.completed.load()), n.completed.load() / secs,
      static_cast<long long>(n.prefill_tokens.load()), n.prefill_tokens.load() / secs,
      static_cast<long long>(n.decode_tokens.load()), n.decode_tokens.load() / secs,
      static_cast<long long>(n.abandoned.load()), static_cast<long long>(n.hammer_rounds.load()),
      static_cast<long long>(n.exhausted.load()), static_cast<long long>(n.failed.load()));
  for (const auto& [what, count] : n.failures) {
    std::printf("  FAILED %lld x %s\n", static_cast<long long>(count), what.c_str());
  }
  if (n.failed.load() != 0) ok = false;
  if (n.completed.load() == 0) {
    std::printf("  FAILED: no sequence completed\n");
    ok = false;
  }
  if (absl::GetFlag(FLAGS_hammers) > 0 && n.exhausted.load() == 0) {
    std::printf("  FAILED: the hammers never saw RESOURCE_EXHAUSTED (the pool never filled)\n");
    ok = false;
  }
  std::printf("loadgen: at the end %lld of %lld pages free, %lld live sequences%s\n",
              static_cast<long long>(free_pages), static_cast<long long>(pages_total),
              static_cast<long long>(live),
              reclaimed_at != absl::InfinitePast()
                  ? absl::StrCat(
                        " (",
                        absl::FormatDuration(absl::Trunc(
                            reclaimed_at - (start + absl::Seconds(secs)), absl::Milliseconds(100))),
                        " after the load)")
                        .c_str()
                  : " -- FAILED: pages leaked or sequences not reclaimed");
  if (free_pages != pages_total || live != 0) ok = false;

  if (pid > 0) {
    const size_t k = rss.size() / 3;
    if (k == 0 || std::count(rss.begin(), rss.end(), -1) > 0) {
      std::printf("  FAILED: could not sample VmRSS of pid %d\n", pid);
      ok = false;
    } else {
      const int64_t first = *std::max_element(rss.begin(), rss.begin() + k);
      const int64_t middle = *std::max_element(rss.begin() + k, rss.begin() + 2 * k);
      const int64_t last = *std::max_element(rss.begin() + 2 * k, rss.end());
      const double limit = middle * (1 + absl::GetFlag(FLAGS_rss_tolerance)) +
                           absl::GetFlag(FLAGS_rss_slack_mib) * 1024;
      const bool flat = last <= limit;
      std::printf(
          "loadgen: attnd VmRSS max per third: %.1f / %.1f / %.1f MiB (%zu samples); last "
          "third limit %.1f MiB: %s\n",
          first / 1024.0, middle / 1024.0, last / 1024.0, rss.size(), limit / 1024.0,
          flat ? "flat" : "FAILED: grows");
      if (!flat) ok = false;
    }
  }
  std::printf("loadgen: %s\n", ok ? "PASS" : "FAIL");
  return ok ? 0 : 1;
}

}  // namespace
}  // namespace attnd

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return attnd::Main();
}
