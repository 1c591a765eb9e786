#!/usr/bin/env python3
"""How a serving stack calls attnd: once per layer, for a batch of sequences.

The model's other parts (embeddings, QKV projections, rotary embedding, MLPs) run in the serving stack; here they
are replaced by random tensors of the right shapes. The loop structure is the real one:

  chunked prefill:  for each prompt chunk: for each layer: for each sequence: prefill(seq, layer, q, k, v,
                    prompt_len=the whole prompt's length)   (the layer's output feeds the next layer)
  decode:           for each step: for each layer: one batched decode(layer, seqs, q, k, v)

Per layer it reports wall time of the attnd calls and the tensor bytes moved (sent + received).

    bazel-bin/server/attnd --listen 127.0.0.1:50051 --model-config configs/tiny/config.json --device cpu &
    /usr/bin/python3 examples/python/layer_loop.py --target 127.0.0.1:50051 --batch 4 --prompt-len 1000 \\
        --chunk 256 --decode-steps 32

Without an installed package it uses the source tree (client/python) and generates the stubs into a temporary
directory.
"""
import argparse
import os
import sys
import time

import numpy as np


def import_attnd():
    try:
        import attnd  # installed: pip install ./client/python
        return attnd
    except ImportError:
        pass
    import shutil
    import tempfile
    client_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "client", "python")
    sys.path.insert(0, os.path.abspath(client_dir))
    import generate
    out = tempfile.mkdtemp(prefix="attnd-stubs-")
    generate.generate(out)
    sys.path.insert(1, out)
    import atexit
    atexit.register(shutil.rmtree, out, True)
    import attnd
    return attnd


attnd = import_attnd()


class Tensors:
    """Random unit-scale tensors in the wire dtype chosen on the command line (numpy or torch)."""

    def __init__(self, dtype, use_torch, seed=0):
        self.dtype, self.use_torch = dtype, use_torch
        self.rng = np.random.default_rng(seed)
        if use_torch:
            import torch
            self.torch = torch
            self.torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]

        self.cache = {}

    def __call__(self, *shape):
        # A few pre-made tensors per shape, rotated: making random data costs more than the call being shown.
        pool = self.cache.get(shape)
        if pool is None:
            pool = self.cache[shape] = [[self._make(shape) for _ in range(3)], 0]
        pool[1] = (pool[1] + 1) % len(pool[0])
        return pool[0][pool[1]]

    def _make(self, shape):
        x = self.rng.uniform(-1, 1, size=shape).astype(np.float32)
        if self.use_torch:
            return self.torch.from_numpy(x).to(self.torch_dtype)
        if self.dtype == "bf16":
            return attnd.float32_to_bf16(x)  # numpy has no bfloat16: raw bits as uint16
        return x.astype(np.float16) if self.dtype == "fp16" else x


def dtype_name(attnd, value):
    """bf16 / fp16 / fp32 for a DType enum value (the proto's DTYPE_BF16 ...), as attnd's flags spell them."""
    try:
        return attnd.proto.DType.Name(value).replace("DTYPE_", "").lower()
    except ValueError:
        return "dtype %d" % value


class Progress:
    """One status line on stderr, at most every `every` seconds, so a long run shows it is alive."""

    def __init__(self, what, total, every=2.0):
        self.what, self.total, self.every = what, total, every
        self.t0 = self.last = time.perf_counter()

    def update(self, done):
        now = time.perf_counter()
        if now - self.last < self.every and done < self.total:
            return
        self.last = now
        eta = (now - self.t0) / done * (self.total - done) if done else 0.0
        sys.stderr.write("\r%s: %d/%d (%.0f%%), %.0f s elapsed, ~%.0f s left   "
                         % (self.what, done, self.total, 100.0 * done / self.total, now - self.t0, eta))
        if done >= self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def nbytes(x):
    return x.numel() * x.element_size() if hasattr(x, "numel") else x.nbytes


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="127.0.0.1:50051")
    ap.add_argument("--token", default=None, help="sent as `authorization: Bearer <token>`")
    ap.add_argument("--root-cert", default=None, help="PEM file: use TLS")
    ap.add_argument("--batch", type=int, default=4, help="sequences decoded together")
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--chunk", type=int, default=256, help="prefill chunk (tokens per call)")
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--layers", type=int, default=0, help="use the first N layers (0: all)")
    ap.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    ap.add_argument("--torch", action="store_true", help="pass torch tensors instead of numpy arrays")
    ap.add_argument("--session", action="store_true", help="use one Session stream instead of unary RPCs")
    args = ap.parse_args()

    client = attnd.Client(args.target, token=args.token, root_cert=args.root_cert, timeout=600)
    info = client.wait_ready(timeout=30)
    m = info.model
    layers = m.num_layers if args.layers <= 0 else min(args.layers, m.num_layers)
    h, hkv, d = m.num_q_heads, m.num_kv_heads, m.head_dim
    print("attnd %s at %s: backend %s (%s), model %s: %d layers, %d q heads, %d kv heads, head_dim %d, kv %s, "
          "chunk_len %d" % (info.version, args.target, info.backend, info.device, m.name, m.num_layers, h, hkv, d,
                            dtype_name(attnd, m.kv_dtype), info.dca.chunk_len))
    print("batch %d, prompt %d tokens in chunks of %d, %d decode steps, %d layers, %s %s, %s"
          % (args.batch, args.prompt_len, args.chunk, args.decode_steps, layers, args.dtype,
             "torch" if args.torch else "numpy", "session stream" if args.session else "unary RPCs"))
    rand = Tensors(args.dtype, args.torch)

    prefill_s = np.zeros(layers)
    prefill_bytes = np.zeros(layers)
    decode_s = np.zeros(layers)
    decode_bytes = np.zeros(layers)
    seqs = [client.create_sequence() for _ in range(args.batch)]
    session = client.session() if args.session else None
    api = session if session is not None else client
    try:
        # Chunked prefill: every layer of one chunk before the next chunk (the layer's attention output is the
        # next layer's input). Every call passes the whole prompt's length (length scaling, DCA.md).
        t_all = time.perf_counter()
        progress = Progress("prefill chunk x layer", -(-args.prompt_len // args.chunk) * layers)
        for i, start in enumerate(range(0, args.prompt_len, args.chunk)):
            n = min(args.chunk, args.prompt_len - start)
            for layer in range(layers):
                progress.update(i * layers + layer)
                for seq in seqs:
                    q, k, v = rand(n, 5, h, d), rand(n, hkv, d), rand(n, hkv, d)
                    t0 = time.perf_counter()
                    out = api.prefill(seq, layer, q, k, v, prompt_len=args.prompt_len)
                    prefill_s[layer] += time.perf_counter() - t0
                    prefill_bytes[layer] += nbytes(q) + nbytes(k) + nbytes(v) + nbytes(out)
        progress.update(progress.total)
        prefill_wall = time.perf_counter() - t_all

        # Decode: one batched call per layer per step; the three query variants suffice for decode.
        t_all = time.perf_counter()
        progress = Progress("decode step", max(args.decode_steps, 1))
        for step in range(args.decode_steps):
            progress.update(step)
            for layer in range(layers):
                q, k, v = rand(args.batch, 3, h, d), rand(args.batch, hkv, d), rand(args.batch, hkv, d)
                t0 = time.perf_counter()
                out = api.decode(layer, seqs, q, k, v)
                decode_s[layer] += time.perf_counter() - t0
                decode_bytes[layer] += nbytes(q) + nbytes(k) + nbytes(v) + nbytes(out)
        progress.update(progress.total)
        decode_wall = time.perf_counter() - t_all
        if session is not None:
            session.close()
            session = None
    finally:
        if session is not None:
            session.cancel()
        for seq in seqs:
            client.release(seq)

    n_chunks = -(-args.prompt_len // args.chunk)
    print("\nlayer  prefill ms/call  prefill MB/s  decode ms/step  decode MB/s")
    for layer in range(layers):
        p_calls = n_chunks * args.batch
        print("%5d  %15.3f  %12.1f  %14.3f  %11.1f" % (
            layer, 1e3 * prefill_s[layer] / p_calls, prefill_bytes[layer] / max(prefill_s[layer], 1e-12) / 1e6,
            1e3 * decode_s[layer] / max(args.decode_steps, 1),
            decode_bytes[layer] / max(decode_s[layer], 1e-12) / 1e6 if args.decode_steps else 0.0))
    tokens = args.batch * args.prompt_len
    print("\nprefill: %d tokens x %d layers in %.3f s (%.0f tokens/s per layer-pass), %.1f MB moved, %.1f MB/s"
          % (tokens, layers, prefill_wall, tokens * layers / prefill_wall, prefill_bytes.sum() / 1e6,
             prefill_bytes.sum() / prefill_wall / 1e6))
    if args.decode_steps:
        print("decode:  %d steps x %d layers, batch %d in %.3f s: %.3f ms per step (all layers), %.3f ms per layer "
              "call, %.1f MB/s" % (args.decode_steps, layers, args.batch, decode_wall,
                                   1e3 * decode_wall / args.decode_steps,
                                   1e3 * decode_wall / (args.decode_steps * layers),
                                   decode_bytes.sum() / decode_wall / 1e6))
    client.close()


if __name__ == "__main__":
    main()
