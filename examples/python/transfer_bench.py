#!/usr/bin/env python3
"""The per-call cost of moving tensors through gRPC from Python: bytes per second on a live attnd.

For a prefill of N tokens of the server's geometry it measures, median of --repeat runs:
  encode     client only: numpy -> serialized PrefillRequest bytes (what the client does per call: one copy)
  encodepb   the same through the generated protobuf classes (tobytes, into the message, serialize: 3 copies)
  upload     a Prefill to an unknown sequence id: the whole request crosses the channel and is parsed by the
             server, which answers NOT_FOUND without computing: request bytes / wall time
  prefill    a real Prefill of N tokens into a fresh sequence (one layer): request + response bytes / wall
             time; includes the attention compute, so it is a lower bound on the transport rate
  decode     a batched decode of --batch sequences: bytes / wall time, and the per-call latency

    /usr/bin/python3 examples/python/transfer_bench.py --target 127.0.0.1:50051 --tokens 1024 --dtype bf16
"""
import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from layer_loop import attnd  # noqa: E402  (installed package, or the source tree with generated stubs)


def median_time(fn, repeat):
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="127.0.0.1:50051")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    ap.add_argument("--batch", type=int, default=8, help="sequences per decode call")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()

    client = attnd.Client(args.target, timeout=600)
    info = client.wait_ready(timeout=30)
    m = info.model
    h, hkv, d, n = m.num_q_heads, m.num_kv_heads, m.head_dim, args.tokens
    rng = np.random.default_rng(0)

    def rand(*shape):
        x = rng.uniform(-1, 1, size=shape).astype(np.float32)
        if args.dtype == "bf16":
            return attnd.float32_to_bf16(x)
        return x.astype(np.float16) if args.dtype == "fp16" else x

    q, k, v = rand(n, 5, h, d), rand(n, hkv, d), rand(n, hkv, d)
    out_bytes = n * h * d * q.itemsize
    req_bytes = q.nbytes + k.nbytes + v.nbytes
    print("attnd %s (%s, %s), model %s: %d q heads, %d kv heads, head_dim %d; prefill of %d tokens, %s"
          % (info.version, info.backend, info.device, m.name, h, hkv, d, n, args.dtype))
    print("request tensors %.2f MB, response tensor %.2f MB" % (req_bytes / 1e6, out_bytes / 1e6))

    def encode():  # what the client does per call: one copy of the tensors into the request bytes
        from attnd._client import _prefill_request
        req, _ = _prefill_request("0" * 32, 0, q, k, v, n)
        return req.tobytes()

    def encode_protobuf():  # the same bytes through the generated protobuf classes (three copies)
        pb = attnd.proto
        dt = {"bf16": pb.DTYPE_BF16, "fp16": pb.DTYPE_FP16, "fp32": pb.DTYPE_FP32}[args.dtype]
        t = [pb.Tensor(dtype=dt, shape=a.shape, data=a.tobytes()) for a in (q, k, v)]
        return pb.PrefillRequest(sequence_id="0" * 32, layer=0, q=t[0], k=t[1], v=t[2],
                                 prompt_len=n).SerializeToString()

    wire = len(encode())
    assert encode() == encode_protobuf()
    t_enc = median_time(encode, args.repeat)
    t_enc_pb = median_time(encode_protobuf, args.repeat)

    unknown = "f" * 32

    def upload():
        try:
            client.prefill(unknown, 0, q, k, v)
        except attnd.AttndError as err:
            if err.code.name != "NOT_FOUND":
                raise
        else:
            raise RuntimeError("expected NOT_FOUND")

    upload()  # warm the channel
    t_up = median_time(upload, args.repeat)

    seqs = []

    def prefill():
        seq = client.create_sequence()
        seqs.append(seq)
        t0 = time.perf_counter()
        client.prefill(seq, 0, q, k, v)
        dt = time.perf_counter() - t0
        client.release(seq)
        seqs.pop()
        return dt

    t_pre = statistics.median(prefill() for _ in range(args.repeat))

    b = args.batch
    dseqs = [client.create_sequence() for _ in range(b)]
    try:
        for s in dseqs:
            client.prefill(s, 0, q[:16], k[:16], v[:16])
        dq, dk, dv = rand(b, 3, h, d), rand(b, hkv, d), rand(b, hkv, d)
        t_dec = median_time(lambda: client.decode(0, dseqs, dq, dk, dv), max(args.repeat, 20))
        dec_bytes = dq.nbytes + dk.nbytes + dv.nbytes + b * h * d * dq.itemsize
    finally:
        for s in dseqs:
            client.release(s)

    print("\n%-8s %12s %10s %10s" % ("path", "bytes", "ms", "MB/s"))
    print("%-8s %12d %10.2f %10.1f" % ("encode", wire, 1e3 * t_enc, wire / t_enc / 1e6))
    print("%-8s %12d %10.2f %10.1f   (protobuf classes, for comparison)" % ("encodepb", wire, 1e3 * t_enc_pb,
                                                                           wire / t_enc_pb / 1e6))
    print("%-8s %12d %10.2f %10.1f" % ("upload", wire, 1e3 * t_up, wire / t_up / 1e6))
    print("%-8s %12d %10.2f %10.1f" % ("prefill", req_bytes + out_bytes, 1e3 * t_pre,
                                       (req_bytes + out_bytes) / t_pre / 1e6))
    print("%-8s %12d %10.3f %10.1f   (batch %d, %.3f ms per call)" % ("decode", dec_bytes, 1e3 * t_dec,
                                                                   dec_bytes / t_dec / 1e6, b, 1e3 * t_dec))
    client.close()


if __name__ == "__main__":
    main()
