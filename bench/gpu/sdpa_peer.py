#!/usr/bin/env python3
"""Peer numbers for bench/gpu/lab/lab_bench.cc: torch SDPA on the same shapes, same machine, same run.

Prefill: q [1, 28, L, 128], k/v [1, 4, L, 128] bf16, is_causal=True, enable_gqa=True, for the cuDNN,
flash and memory-efficient backends (a backend that refuses GQA is retried with k/v expanded to 28
heads, and labelled so). FLOPs = 4*Hq*D*L(L+1)/2, as in lab_bench (causal-equivalent).
Decode: q [B, 28, 1, 128], k/v [B, 4, ctx, 128] (dense, not paged), is_causal=False. Bytes = K + V.
Small decode cases rotate over several k/v copies (>= 1 GiB) so repeated runs do not measure L2.
Also a device-to-device copy (bytes = read + write).
Timing: torch.cuda.Event around each call after warm-up; median.

  python3 bench/gpu/sdpa_peer.py [--quick] [--prefill-only | --decode-only] [--backends cudnn,flash]
                                 [--out FILE]

--prefill-only skips the decode table (and its copy-bandwidth line), --decode-only the prefill
table; --backends limits the SDPA
backends timed (default: cudnn, flash, efficient).
"""
import argparse
import math
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

HQ, HKV, D = 28, 4, 128
OUT = None


def emit(line=""):
    print(line, flush=True)
    if OUT:
        OUT.write(line + "\n")
        OUT.flush()


def median_ms(fn, warmup=2, iters=7):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for i in range(iters):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn(i)
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def copy_bw():
    n = 4 << 30
    x = torch.ones(n, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = median_ms(lambda i=0: y.copy_(x), 3, 10)
    del x, y
    return 2 * n / (ms * 1e-3) / 1e9


BACKENDS = [("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
            ("efficient", SDPBackend.EFFICIENT_ATTENTION)]


def run_sdpa(backend, q, k, v, causal):
    """Returns (callable, label) or raises: GQA natively, else with k/v expanded."""
    def native(i=0):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    try:
        native()
        torch.cuda.synchronize()
        return native, "gqa"
    except Exception:  # noqa: BLE001 - try the expanded form
        pass
    g = q.shape[1] // k.shape[1]
    if 2 * k.numel() * g * k.element_size() > (24 << 30):
        raise RuntimeError("no native GQA, and expanded k/v would exceed 24 GiB")
    ke = k.repeat_interleave(g, dim=1)
    ve = v.repeat_interleave(g, dim=1)

    def expanded(i=0):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, ke, ve, is_causal=causal)
    expanded()
    torch.cuda.synchronize()
    return expanded, "expanded-kv"


def bench_prefill(quick, backends):
    emit("\n## torch SDPA prefill (bf16, is_causal=True); FLOPs = 4*Hq*D*L(L+1)/2")
    emit(f"{'L':<8} {'backend':<10} {'gqa':<12} {'median_ms':>10} {'TFLOP/s':>9}")
    for L in ([8192] if quick else [8192, 32768, 131072]):
        q = torch.randn(1, HQ, L, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, HKV, L, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(1, HKV, L, D, device="cuda", dtype=torch.bfloat16)
        flops = 4.0 * HQ * D * L * (L + 1) / 2
        for name, be in backends:
            try:
                fn, label = run_sdpa(be, q, k, v, True)
                iters = 3 if L >= 131072 else 7
                ms = median_ms(fn, 1, iters)
                emit(f"{L:<8} {name:<10} {label:<12} {ms:>10.3f} {flops / (ms * 1e-3) / 1e12:>9.1f}")
            except Exception as e:  # noqa: BLE001
                emit(f"{L:<8} {name:<10} {'-':<12} unsupported: {str(e).splitlines()[0][:90]}")
            torch.cuda.empty_cache()
        del q, k, v
        torch.cuda.empty_cache()


def bench_decode(quick, copy_gbs, backends):
    emit("\n## torch SDPA decode (dense k/v, bf16, q_len 1); bytes = B*ctx*Hkv*D*2*2")
    emit(f"{'batch':<6} {'ctx':<8} {'backend':<10} {'gqa':<12} {'median_us':>10} {'GB/s':>7} {'%copy':>6}")
    cases = [(b, c) for b in (1, 8, 32, 128) for c in (4096, 32768, 131072)] + [(1, 1 << 20)]
    if quick:
        cases = [(1, 4096), (8, 32768)]
    for b, ctx in cases:
        step = 2.0 * b * ctx * HKV * D * 2
        sets = max(1, math.ceil((1 << 30) / step))
        q = torch.randn(b, HQ, 1, D, device="cuda", dtype=torch.bfloat16)
        kvs = [(torch.randn(b, HKV, ctx, D, device="cuda", dtype=torch.bfloat16),
                torch.randn(b, HKV, ctx, D, device="cuda", dtype=torch.bfloat16)) for _ in range(sets)]
        for name, be in backends:
            try:
                fns = []
                label = ""
                for k, v in kvs:
                    fn, label = run_sdpa(be, q, k, v, False)
                    fns.append(fn)
                ms = median_ms(lambda i=0: fns[i % sets](), 3, 30)
                gbs = step / (ms * 1e-3) / 1e9
                emit(f"{b:<6} {ctx:<8} {name:<10} {label:<12} {ms * 1e3:>10.1f} {gbs:>7.0f} "
                     f"{100 * gbs / copy_gbs:>5.0f}%")
            except Exception as e:  # noqa: BLE001
                emit(f"{b:<6} {ctx:<8} {name:<10} {'-':<12} unsupported: {str(e).splitlines()[0][:80]}")
            torch.cuda.empty_cache()
        del q, kvs
        torch.cuda.empty_cache()


def main():
    global OUT
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--prefill-only", action="store_true")
    ap.add_argument("--decode-only", action="store_true")
    ap.add_argument("--backends", default=",".join(name for name, _ in BACKENDS))
    ap.add_argument("--out")
    args = ap.parse_args()
    want = args.backends.split(",")
    unknown = set(want) - {name for name, _ in BACKENDS}
    if unknown:
        ap.error(f"unknown backends {sorted(unknown)}")
    backends = [(name, be) for name, be in BACKENDS if name in want]
    if args.out:
        OUT = open(args.out, "w")
    emit(f"# sdpa_peer: torch {torch.__version__}, {torch.cuda.get_device_name()}, "
         f"cudnn {torch.backends.cudnn.version()}")
    if args.prefill_only:
        bench_prefill(args.quick, backends)
        return
    gbs = copy_bw()
    emit(f"D2D copy bandwidth (torch, 4 GiB, read+write): {gbs:.0f} GB/s")
    if not args.decode_only:
        bench_prefill(args.quick, backends)
    bench_decode(args.quick, gbs, backends)


if __name__ == "__main__":
    main()
