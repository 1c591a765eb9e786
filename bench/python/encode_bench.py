#!/usr/bin/env python3
"""Python client cost of a decode call: encoding the request and decoding the answer per call, in the entries
form (one DecodeEntry / DecodeOutput per sequence, built in a Python loop) and the packed form that
Client.decode sends (one q, k, v and o tensor per batch), at batch 1, 16, 32, 128, 7B geometry (28 q / 4 kv
heads, head_dim 128, bf16, --variants query variants); with --target, unary Client.decode timed end to end
against a running attnd at --batch (its geometry).

    python3 bench/python/encode_bench.py [--target HOST:PORT] [--batch 32] [--context 256] [--calls 200]
                                         [--variants 3]

--variants: the query variants each decode entry carries, 3 (what a decode reads, and what attnctl bench sends:
the same call as the C++ client's) or 5 (the prefill layout, which decode also accepts).

Runs from a source checkout (stubs generated as the tests do, or ATTND_PYTHON_STUBS from a GPU bundle).
Compare the end-to-end figure with the C++ client's on the same daemon:
    attnctl bench --target HOST:PORT --context 256 --batch 32 --decode-steps 200 --layers 1 --dtype bf16
"""
import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "python"))
import attnd_testing as at  # noqa: E402

attnd = at.attnd
pb = attnd.proto
w = attnd._wire


def per_call_us(fn, min_seconds=0.5):
    fn()
    n, start = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds and n >= 5:
            return elapsed / n * 1e6


def encode_table(variants, hq=28, hkv=4, d=128):
    from attnd._client import _decode_output
    from attnd._tensors import Like
    rng = np.random.default_rng(1)
    bf = pb.DTYPE_BF16
    like = Like("numpy", np_dtype=np.dtype(np.uint16))
    print("one Decode call's client work, 7B geometry bf16 (q [B, %d, %d, %d], k/v [B, %d, %d]), us per call:" %
          (variants, hq, d, hkv, d))
    print("encode (to the bytes gRPC sends) and decode of the answer, entries form (a per-entry loop) and")
    print("packed form (one tensor per kind)")
    print("%6s %14s %14s %14s %14s" % ("batch", "encode loop", "encode packed", "decode loop", "decode packed"))
    for n in (1, 16, 32, 128):
        q = rng.integers(0, 1 << 16, (n, variants, hq, d)).astype(np.uint16)
        k = rng.integers(0, 1 << 16, (n, hkv, d)).astype(np.uint16)
        v = rng.integers(0, 1 << 16, (n, hkv, d)).astype(np.uint16)
        o = rng.integers(0, 1 << 16, (n, hq, d)).astype(np.uint16)
        ids = ["%032x" % i for i in range(n)]
        lengths = list(range(4096, 4096 + n))

        def loop():
            return w.decode_request(0, [(ids[i], (q[i], bf), (k[i], bf), (v[i], bf), 0)
                                        for i in range(n)]).tobytes()

        def packed():
            return w.decode_request_packed(0, ids, (q, bf), (k, bf), (v, bf), 0).tobytes()

        want = pb.DecodeRequest(layer=0, sequence_ids=ids, q=pb.Tensor(dtype=bf, shape=q.shape, data=q.tobytes()),
                                k=pb.Tensor(dtype=bf, shape=k.shape, data=k.tobytes()),
                                v=pb.Tensor(dtype=bf, shape=v.shape, data=v.tobytes()))
        assert packed() == want.SerializeToString()
        entries_resp = pb.DecodeResponse(outputs=[
            pb.DecodeOutput(o=pb.Tensor(dtype=bf, shape=o.shape[1:], data=o[i].tobytes()), length=lengths[i])
            for i in range(n)]).SerializeToString()
        packed_resp = pb.DecodeResponse(o=pb.Tensor(dtype=bf, shape=o.shape, data=o.tobytes()),
                                        lengths=lengths).SerializeToString()
        for resp in (entries_resp, packed_resp):
            got, got_lengths = _decode_output(memoryview(resp), 0, len(resp), like)
            assert np.array_equal(got, o) and got_lengths == lengths

        def parse(resp):
            return lambda: _decode_output(memoryview(resp), 0, len(resp), like)

        print("%6d %14.1f %14.1f %14.1f %14.1f" % (n, per_call_us(loop), per_call_us(packed),
                                                   per_call_us(parse(entries_resp)),
                                                   per_call_us(parse(packed_resp))))


def end_to_end(target, batch, context, calls, variants):
    client = attnd.Client(target, timeout=120)
    info = client.info()
    m = info.model
    h, hkv, d = m.num_q_heads, m.num_kv_heads, m.head_dim
    rng = np.random.default_rng(2)
    bits = lambda s: at.f32_to_bf16_bits_exact(at.random_bf16_exact(rng, s))  # noqa: E731
    seqs = [client.create_sequence() for _ in range(batch)]
    try:
        for s in seqs:
            for start in range(0, context, 4096):
                t = min(4096, context - start)
                client.prefill(s, 0, bits((t, 5, h, d)), bits((t, hkv, d)), bits((t, hkv, d)), prompt_len=context)
        q, k, v = bits((batch, variants, h, d)), bits((batch, hkv, d)), bits((batch, hkv, d))
        from attnd._client import _decode_request, _decode_output
        bf = pb.DTYPE_BF16
        packed_body = _decode_request(0, seqs, q, k, v)[0].tobytes()
        resp = client._call(client._decode, packed_body, None)
        like = _decode_request(0, seqs, q, k, v)[1]
        encode_us = per_call_us(lambda: _decode_request(0, seqs, q, k, v)[0].tobytes(), 0.2)
        parse_us = per_call_us(lambda: _decode_output(memoryview(resp), 0, len(resp), like), 0.2)

        def entries_decode():  # the entries form: one DecodeEntry / DecodeOutput per sequence
            body = w.decode_request(0, [(seqs[i], (q[i], bf), (k[i], bf), (v[i], bf), 0)
                                        for i in range(batch)]).tobytes()
            r = client._call(client._decode, body, None)
            return _decode_output(memoryview(r), 0, len(r), like)

        def timed(fn):
            fn()
            times = []
            for _ in range(calls):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return np.array(times) * 1e3

        print("end to end (%s, %s, %s): unary Decode, batch %d, context %d, %d calls, layer 0, bf16, q [B, %d, %d, %d]" %
              (target, info.backend, "%d/%d/%d heads/kv/dim" % (h, hkv, d), batch, context, calls, variants, h, d))
        for name, fn in (("Client.decode (packed)", lambda: client.decode(0, seqs, q, k, v)),
                         ("gRPC call alone (packed bytes)", lambda: client._call(client._decode, packed_body, None)),
                         ("entries form (per-entry loop)", entries_decode)):
            t = timed(fn)
            print("  %-31s per call ms: median %.3f  p10 %.3f  p90 %.3f" %
                  (name, np.median(t), np.percentile(t, 10), np.percentile(t, 90)))
        print("  Client.decode's own work: encode %.1f us, answer decode %.1f us" % (encode_us, parse_us))
    finally:
        for s in seqs:
            client.release(s)
        client.close()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", help="a running attnd for the end-to-end timing")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--variants", type=int, choices=(3, 5), default=3,
                   help="query variants per decode entry (3: what a decode reads and attnctl bench sends)")
    args = p.parse_args()
    encode_table(args.variants)
    if args.target:
        end_to_end(args.target, args.batch, args.context, args.calls, args.variants)


if __name__ == "__main__":
    main()
