#!/usr/bin/env python3
"""Per-layer decode latency from Python through the shared-memory ring (Client.ring) against Python unary
Client.decode and the C++ client's ring (attnctl bench --transport ring) on the same daemon, at batch 1, 8, 32:
p50 / p99 of one layer call, bf16 inputs with 3 query variants (what attnctl sends), `--context` tokens
prefilled per sequence first. Then the Python ring's own work per call with no server (the answer already in
the ring): encoding into the request half, parsing the answer, copying o out.

    python3 bench/python/ring_bench.py --target HOST:PORT [--attnctl bazel-bin/client/attnctl] \\
        [--batch 1,8,32] [--context 256] [--calls 300] [--rounds 2] [--spin-us 50]
    python3 bench/python/ring_bench.py --client-only [--geometry 28,4,128]

The daemon must run on this host (the ring is shared memory). Runs from a source checkout (stubs generated as
the tests do, or ATTND_PYTHON_STUBS from a GPU bundle).
"""
import argparse
import os
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "python"))
import attnd_testing as at  # noqa: E402

attnd = at.attnd
pb = attnd.proto


def percentiles(us):
    """p50, p99 as attnctl computes them (nearest rank on the sorted samples)."""
    s = sorted(us)
    pick = lambda p: s[min(len(s) - 1, int(p * (len(s) - 1) + 0.5))]  # noqa: E731
    return pick(0.50), pick(0.99)


def timed_calls(fn, calls):
    out = []
    clock = time.perf_counter_ns
    for _ in range(calls):
        t0 = clock()
        fn()
        out.append((clock() - t0) / 1000.0)
    return out


def attnctl_ring(attnctl, target, context, batch, calls, spin_us, version):
    """(p50, p99) us per layer call of `attnctl bench --transport ring`, or None with the reason printed."""
    cmd = [attnctl, "bench", "--target", target, "--context", str(context), "--batch", str(batch),
           "--decode-steps", str(calls), "--layers", "1", "--dtype", "bf16", "--transport", "ring",
           "--ring-spin-us", str(spin_us), "--ring-version", str(version)]
    run = subprocess.run(cmd, capture_output=True, text=True)
    for line in run.stdout.splitlines():
        cols = line.split()
        if cols and cols[0] == str(context) and len(cols) >= 8:
            return float(cols[-2]), float(cols[-1])
    print("attnctl bench failed (%d): %s %s" % (run.returncode, " ".join(cmd), (run.stderr or run.stdout)[-400:]))
    return None


def live(args):
    client = attnd.Client(args.target, timeout=120)
    info = client.info()
    m = info.model
    h, hkv, d = m.num_q_heads, m.num_kv_heads, m.head_dim
    rng = np.random.default_rng(1)
    bits = lambda shape: attnd.float32_to_bf16(rng.uniform(-1, 1, shape).astype(np.float32))  # noqa: E731
    print("daemon %s: %s on %s, %d q / %d kv heads, head_dim %d; context %d, %d calls per round, %d rounds, "
          "bf16, 3 variants, ring spin %d us, ring version %d (both clients)" % (
              args.target, m.name or "model", info.backend, h, hkv, d, args.context, args.calls, args.rounds,
              args.spin_us, args.ring_version))
    rows = []
    with client.ring(half_bytes=args.half_mib << 20, spin_us=args.spin_us, version=args.ring_version) as ring:
        for b in args.batch:
            seqs = {name: [client.create_sequence() for _ in range(b)] for name in ("ring", "unary")}
            try:
                q0, k0 = bits((args.context, 5, h, d)), bits((args.context, hkv, d))
                for s in seqs["ring"] + seqs["unary"]:
                    for start in range(0, args.context, args.chunk):
                        stop = min(args.context, start + args.chunk)
                        client.prefill(s, 0, q0[start:stop], k0[start:stop], k0[start:stop],
                                       prompt_len=args.context)
                q, k, v = bits((b, 3, h, d)), bits((b, hkv, d)), bits((b, hkv, d))
                np.testing.assert_array_equal(ring.decode(0, seqs["ring"], q, k, v),
                                              client.decode(0, seqs["unary"], q, k, v))
                samples = {"ring": [], "unary": []}
                for _ in range(args.rounds):
                    samples["ring"] += timed_calls(lambda: ring.decode(0, seqs["ring"], q, k, v), args.calls)
                    samples["unary"] += timed_calls(lambda: client.decode(0, seqs["unary"], q, k, v), args.calls)
            finally:
                for s in seqs["ring"] + seqs["unary"]:
                    client.release(s)
            cpp = None
            if args.attnctl:
                cpp = attnctl_ring(args.attnctl, args.target, args.context, b, args.calls * args.rounds,
                                   args.spin_us, args.ring_version)
            rows.append((b, percentiles(samples["ring"]), percentiles(samples["unary"]), cpp))
        stats = ring.stats
    client.close()
    print("\nper-layer decode latency, us (p50 / p99)")
    print("%6s %20s %20s %20s %16s %14s" % ("batch", "Python ring", "Python unary", "C++ ring (attnctl)",
                                             "ring - C++ p50", "unary / ring"))
    for b, r, u, c in rows:
        cpp = "%8.1f / %8.1f" % c if c else "%20s" % "-"
        diff = "%+16.1f" % (r[0] - c[0]) if c else "%16s" % "-"
        print("%6d %9.1f / %8.1f %9.1f / %8.1f %20s %s %14.2f" % (b, r[0], r[1], u[0], u[1], cpp, diff,
                                                                    u[0] / r[0]))
    print("ring answers: %d spinning, %d sleeping; %d server wakes" % (stats.answered_spinning,
                                                                       stats.answered_sleeping, stats.server_wakes))


class _NoServer:
    """GetServerInfo / OpenRing answers for a ring nobody serves: the client's own cost alone."""
    _regions = []
    _stub = type("Stub", (), {"OpenRing": None, "CloseRing": None})()

    def info(self, timeout=None):
        return pb.GetServerInfoResponse(regions=pb.RegionSupport(rings=True))

    def _call(self, method, request, timeout):
        return pb.OpenRingResponse(ring_id="0" * 32)


def client_only(args):
    h, hkv, d = args.geometry
    ring = attnd.Ring(_NoServer())
    rng = np.random.default_rng(2)
    print("\nPython ring client work per decode call with the answer already in the ring (no server): "
          "%d q / %d kv heads, head_dim %d, bf16, 3 variants; us, min of 5 runs" % (h, hkv, d))
    print("%6s %14s %18s %14s" % ("batch", "decode", "decode + lengths", "answer copy"))
    for b in args.batch:
        q = rng.integers(0, 1 << 16, (b, 3, h, d)).astype(np.uint16)
        k = rng.integers(0, 1 << 16, (b, hkv, d)).astype(np.uint16)
        seqs = ["%032x" % rng.integers(1 << 62) for _ in range(b)]
        answers = {}
        for tag in range(1, 128):
            body = pb.SessionResponse(tag=tag, decode=pb.DecodeResponse(
                o=pb.Tensor(dtype=pb.DTYPE_BF16, shape=[b, h, d], data=bytes(b * h * d * 2)),
                lengths=list(range(4000, 4000 + b)))).SerializeToString()
            answers[tag] = len(body).to_bytes(8, "little") + body
        off = ring._response_off

        def answered(want, deadline, count):  # stands in for attnd: the answer is there at once
            if count:
                a = answers[(ring._next_tag - 2) % 127 + 1]
                ring._mv[off:off + len(a)] = a
                ring._words[attnd._ring._RESPONSE_SEQ] = want

        ring._wait = answered
        copy = min(timed_per_call(lambda: answered(0, 0, True), 1000) for _ in range(5))
        plain = min(timed_per_call(lambda: ring.decode(0, seqs, q, k, k), 1000) for _ in range(5))
        lengths = min(timed_per_call(lambda: ring.decode(0, seqs, q, k, k, return_lengths=True), 1000)
                      for _ in range(5))
        print("%6d %14.2f %18.2f %14.2f" % (b, plain - copy, lengths - copy, copy))
    print("(decode columns exclude the 'answer copy', which stands in for attnd writing the answer)")
    client_only_frames(args)


def client_only_frames(args):
    """The same for a version 2 ring (binary frames): q, k, v inline, o back inline."""
    h, hkv, d = args.geometry
    R = attnd._ring
    ring = attnd.Ring(_NoServer(), version=2)
    rng = np.random.default_rng(2)
    print("\nversion 2 ring (binary frames), the same calls; us, min of 5 runs")
    print("%6s %14s %14s" % ("batch", "decode", "answer copy"))
    for b in args.batch:
        q = rng.integers(0, 1 << 16, (b, 3, h, d)).astype(np.uint16).view(attnd_bf16())
        k = rng.integers(0, 1 << 16, (b, hkv, d)).astype(np.uint16).view(attnd_bf16())
        seqs = ["%032x" % rng.integers(1 << 62) for _ in range(b)]
        o_bytes = b * h * d * 2
        lengths_off = R._V2_RESPONSE.size
        o_off = (lengths_off + 8 * b + 63) & ~63
        answers = {}
        for tag in range(1, 128):
            head = R._V2_RESPONSE.pack(R._V2_RESPONSE_MAGIC, 0, tag, R._V2_DECODE, 3, pb.DTYPE_BF16, b, 0, 0, 0,
                                       o_off, o_bytes, lengths_off, b, h, d, 0)
            body = bytearray(o_off + o_bytes)
            body[:len(head)] = head
            body[lengths_off:lengths_off + 8 * b] = np.arange(4000, 4000 + b, dtype=np.int64).tobytes()
            answers[tag] = len(body).to_bytes(8, "little") + bytes(body)
        off = ring._response_off

        def answered(want, deadline, count):
            if count:
                a = answers[(ring._next_tag - 2) % 127 + 1]
                ring._mv[off:off + len(a)] = a
                ring._words[R._RESPONSE_SEQ] = want

        ring._wait = answered
        copy = min(timed_per_call(lambda: answered(0, 0, True), 1000) for _ in range(5))
        plain = min(timed_per_call(lambda: ring.decode(0, seqs, q, k, k), 1000) for _ in range(5))
        print("%6d %14.2f %14.2f" % (b, plain - copy, copy))


def attnd_bf16():
    """numpy's view type for bf16 bytes as the client takes them (ml_dtypes' bfloat16 when present)."""
    try:
        import ml_dtypes
        return ml_dtypes.bfloat16
    except ImportError:
        return np.uint16


def timed_per_call(fn, n):
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", help="attnd host:port on this host")
    p.add_argument("--attnctl", help="attnctl binary: also run attnctl bench --transport ring")
    p.add_argument("--batch", default="1,8,32", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--chunk", type=int, default=256, help="prefill tokens per call")
    p.add_argument("--calls", type=int, default=300, help="decode calls per transport per round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--spin-us", type=int, default=50)
    p.add_argument("--half-mib", type=int, default=8)
    p.add_argument("--ring-version", type=int, default=2, help="1: protobuf messages, 2: binary frames")
    p.add_argument("--client-only", action="store_true", help="only the client's own work (no daemon)")
    p.add_argument("--geometry", default="28,4,128", type=lambda s: [int(x) for x in s.split(",")],
                   help="Hq,Hkv,D for --client-only (default 7B)")
    args = p.parse_args()
    if not args.client_only:
        if not args.target:
            p.error("--target is required (or --client-only)")
        live(args)
    client_only(args)


if __name__ == "__main__":
    main()
