#!/usr/bin/env python3
"""transformers' Qwen2 with every attention layer in attnd (attnd.transformers), against the same model with
transformers' own attention, on the GPU machine (docs/transformers.md; run by bench/gpu/transformers.sh):

  tokens    random-weight fp32 models (the 7B geometry with 4 layers, the 14B geometry with 2), greedy generate()
            of 64 tokens after 1K-16K-token prompts (and a left-padded batch): tokens identical to sdpa's;
  logits    the same in bf16 with the fp32 sdpa tokens forced: attnd's bf16 logits against fp32 sdpa's, next to
            sdpa's own bf16 logits against fp32 sdpa's (the bar: a correct bf16 attention's own error);
  chunks    a prompt over 4 DCA chunks (chunk_size 2048): final hidden states against plain-torch DCA
            (tests/python/dca_torch.py, fp64) and, to show the test can tell, against standard attention;
  decode    decode tokens/s at batch x context, attnd (time per token split into attnd calls and the rest) next
            to sdpa with transformers' DynamicCache; per step from a logits-processor clock and, with no hook in
            the loop, by difference of two generate() calls;
  profile   torch's profiler and Python's cProfile over generate() at batch 1, 4K, sdpa and attnd;
  million   (not in the default parts) the 7B geometry, all 28 layers, a 1,010,000-token prompt with sparse
            prefill in 16K-token forwards, then 32 decode steps, model and attnd on one GPU: prefill time split
            into attnd and the rest, decode tokens/s, device memory.

Each part needs its own attnd (started by the script on this GPU) and prints tab-separated lines; a part that
fails prints its error and the others go on.

    python3 bench/python/hf_bench.py [--parts tokens,logits,chunks,decode,profile,million] [--attnd attnd]
"""
import argparse
import copy
import cProfile
import gc
import json
import os
import pstats
import shutil
import subprocess
import sys
import tempfile
import time
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(REPO, "tests", "python"))
import attnd_testing as at  # noqa: E402
import dca_torch  # noqa: E402

attnd = at.attnd
import attnd.transformers as ahf  # noqa: E402
import transformers  # noqa: E402


def log(*fields):
    print("\t".join(str(f) for f in fields), flush=True)


def config_json(name):
    with open(os.path.join(REPO, "configs", name, "config.json")) as f:
        return json.load(f)


class Daemon:
    def __init__(self, binary, config, kv_dtype, kv_bytes, extra=(), device="cuda", sparse_from=None):
        self.dir = tempfile.mkdtemp(prefix="hf-bench-")
        path = os.path.join(self.dir, "config.json")
        with open(path, "w") as f:
            json.dump(config, f)
        if sparse_from:  # the sparse budgets sit beside config.json (docs/DCA.md)
            shutil.copy(os.path.join(REPO, "configs", sparse_from, "sparse_attention_config.json"), self.dir)
        self.target = "127.0.0.1:%d" % at.free_port()
        self.log = open(os.path.join(self.dir, "attnd.log"), "w")
        self.proc = subprocess.Popen([binary, "--device", device, "--listen", self.target, "--model-config", path,
                                      "--kv-dtype", kv_dtype, "--kv-cache-bytes", str(kv_bytes),
                                      "--metrics-listen=", *extra], stdout=self.log, stderr=subprocess.STDOUT)
        self.client = attnd.Client(self.target, timeout=600)
        deadline = time.time() + 300
        while True:
            if self.proc.poll() is not None or time.time() > deadline:
                self.proc.kill()
                with open(self.log.name) as f:
                    raise RuntimeError("attnd did not start: %s" % f.read()[-2000:])
            try:
                self.client.info(timeout=1)
                break
            except attnd.AttndError:
                time.sleep(0.2)

    def close(self):
        self.client.close()
        self.proc.terminate()
        self.proc.wait(30)
        self.log.close()


def hf_model(config, layers, dtype, seed=0, attn="sdpa"):
    cfg = dict(config, num_hidden_layers=layers)
    hc = transformers.Qwen2Config(**cfg)
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in its dtype: a 7B model in fp32 first would not fit beside the KV pool
    try:
        with torch.device("cuda"):
            model = transformers.Qwen2ForCausalLM(hc).to(dtype)
    finally:
        torch.set_default_dtype(default)
    model.set_attn_implementation(attn)
    return model.eval()


def prompt(n, seed, vocab, batch=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (batch, n), generator=g).cuda()


def greedy(model, ids, mask, new_tokens):
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, 1).float()


def forced_logits(model, ids, mask, forced, attached):
    """Logits predicting each forced token: attnd through prefill then one decode per token; sdpa in one
    forward over prompt + tokens (what a correct attention gives for the same positions)."""
    with torch.no_grad():
        if not attached:
            full = torch.cat([ids, forced[:, :-1]], 1)
            m = torch.cat([mask, torch.ones_like(forced[:, :-1])], 1)
            if bool(m.all()):
                m = None  # no padding: sdpa's causal kernels, no mask materialised
            return model(full, attention_mask=m, use_cache=False, logits_to_keep=forced.shape[1]).logits.float()
        cache = model._attnd.new_cache()
        cache.set_prompt(mask)
        out = [model(ids, attention_mask=mask, past_key_values=cache, logits_to_keep=1).logits[:, -1]]
        for i in range(forced.shape[1] - 1):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            out.append(model(forced[:, i:i + 1], attention_mask=mask, past_key_values=cache).logits[:, -1])
        cache.release()
        return torch.stack(out, 1).float()


def cases(quick):
    return [("7b", "qwen2.5-7b-instruct-1m", 4), ("14b", "qwen2.5-14b-instruct-1m", 2)][: 1 if quick else 2]


def part_tokens_and_logits(args, parts):
    lengths = [int(x) for x in args.prompts.split(",")]
    for name, cfgname, layers in cases(args.quick):
        config = config_json(cfgname)
        ref32 = hf_model(config, layers, torch.float32)
        vocab = config["vocab_size"]
        inputs = [(n, prompt(n, n, vocab), None) for n in lengths]
        # A left-padded batch: rows of 1000 and 3000 tokens.
        pad = prompt(3000, 7, vocab, batch=2)
        pmask = torch.ones_like(pad)
        pmask[0, :2000] = 0
        pad[0, :2000] = 0
        inputs.append(("2x[1000,3000]", pad, pmask))
        refs = {}
        for label, ids, mask in inputs:
            mask = mask if mask is not None else torch.ones_like(ids)
            refs[label] = greedy(ref32, ids, mask, args.new_tokens)
        if "tokens" in parts:
            # fp32 end to end needs attnd's CPU backend (the CUDA backend keeps K/V in bf16); the CUDA backend
            # with the same fp32 model follows, to show how far bf16 K/V alone moves greedy tokens.
            for backend, kv in (("cpu", "fp32"), ("cuda", "bf16")):
                gc.collect()
                torch.cuda.empty_cache()
                d = Daemon(args.attnd, config, kv, 8 << 30, device=backend)
                try:
                    ahf.attach(ref32, d.client)
                    for label, ids, mask in inputs:
                        mask = mask if mask is not None else torch.ones_like(ids)
                        toks, logits = greedy(ref32, ids, mask, args.new_tokens)
                        want, want_logits = refs[label]
                        same = bool(torch.equal(toks, want))
                        first = "-" if same else int((toks != want).any(0).nonzero()[0])
                        log("tokens", name, "fp32 model, attnd %s %s K/V" % (backend, kv), label,
                            "identical" if same else "DIFFER from token %s" % first,
                            "logits max abs %.3g" % float((logits - want_logits).abs().max()),
                            "live after %d" % d.client.info().live_sequences, ref32._attnd.transport.name)
                    ref32._attnd.detach()
                finally:
                    d.close()
        if "logits" in parts:
            bf = copy.deepcopy(ref32).to(torch.bfloat16)
            bf.set_attn_implementation("sdpa")
            rows = []
            for label, ids, mask in inputs:
                mask = mask if mask is not None else torch.ones_like(ids)
                want_toks, _ = refs[label]
                try:
                    exact = forced_logits(ref32, ids, mask, want_toks, False)
                    sdpa = forced_logits(bf, ids, mask, want_toks, False)
                except torch.cuda.OutOfMemoryError as err:
                    log("logits", name, label, "reference out of memory: %s" % str(err)[:160])
                    continue
                finally:
                    gc.collect()
                    torch.cuda.empty_cache()
                rows.append((label, ids, mask, want_toks, exact, sdpa))
            gc.collect()
            torch.cuda.empty_cache()  # the references' cached blocks: attnd's pool needs the device memory
            d = Daemon(args.attnd, config, "bf16", 8 << 30)
            try:
                ahf.attach(bf, d.client)
                for label, ids, mask, want_toks, exact, sdpa in rows:
                    got = forced_logits(bf, ids, mask, want_toks, True)
                    e_sdpa = (sdpa - exact).abs()
                    e_attnd = (got - exact).abs()
                    agree_sdpa = float((sdpa.argmax(-1) == want_toks).float().mean())
                    agree_attnd = float((got.argmax(-1) == want_toks).float().mean())
                    log("logits", name, "bf16", label,
                        "attnd-fp32 max %.4f mean %.5f" % (float(e_attnd.max()), float(e_attnd.mean())),
                        "sdpa_bf16-fp32 max %.4f mean %.5f" % (float(e_sdpa.max()), float(e_sdpa.mean())),
                        "argmax=fp32 tokens: attnd %.3f sdpa %.3f" % (agree_attnd, agree_sdpa))
                bf._attnd.detach()
            finally:
                d.close()
            del bf
        del ref32
        gc.collect()
        torch.cuda.empty_cache()


def part_chunks(args):
    config = config_json("qwen2.5-7b-instruct-1m")
    config["dual_chunk_attention_config"] = {"chunk_size": 2048, "local_size": 256,
                                             "original_max_position_embeddings": 262144}
    model = hf_model(config, 4, torch.float32)
    n = args.chunk_prompt
    ids = prompt(n, 11, config["vocab_size"])
    got = {}
    for backend, kv in (("cpu", "fp32"), ("cuda", "bf16")):
        d = Daemon(args.attnd, config, kv, 8 << 30, device=backend)
        try:
            ahf.attach(model, d.client)
            with torch.no_grad():
                got[backend + " " + kv] = model(ids, use_cache=False, output_hidden_states=True).hidden_states[-1].double()
            model._attnd.detach()
        finally:
            d.close()
    geometry = dca_torch.Geometry.from_config(model.config)
    results = {}
    for kind in ("dca", "standard"):
        restore = dca_torch.use_reference(model.model.layers, kind, geometry)
        with torch.no_grad():
            results[kind] = model(ids, use_cache=False, output_hidden_states=True).hidden_states[-1].double()
        restore()
    scale = float(results["dca"].abs().max())
    for which, hidden in got.items():
        for kind, want in results.items():
            err = (hidden - want).abs()
            log("chunks", "7b-4layers fp32 model, attnd %s K/V" % which,
                "%d tokens, chunk_len %d (%d chunks)" % (n, geometry.chunk_len, -(-n // geometry.chunk_len)),
                "vs plain-torch %s" % kind, "max abs %.3g" % float(err.max()), "mean abs %.3g" % float(err.mean()),
                "max |hidden| %.3g" % scale)


class StepClock(transformers.LogitsProcessor):
    def __init__(self):
        self.times = []

    def __call__(self, input_ids, scores):
        torch.cuda.synchronize()
        self.times.append(time.perf_counter())
        return scores


def generate_seconds(model, ids, new_tokens):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def decode_step_by_difference(model, ids, new_tokens):
    """Seconds per decode step with no hook in the loop: generate() of new_tokens + 1 tokens less generate() of
    one (the prefill and the first token), over new_tokens."""
    one = min(generate_seconds(model, ids, 1) for _ in range(2))
    return (generate_seconds(model, ids, new_tokens + 1) - one) / new_tokens


def decode_rate(model, ids, new_tokens, chunk):
    clock = StepClock()
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, prefill_chunk_size=chunk,
                       logits_processor=transformers.LogitsProcessorList([clock]))
    steps = [b - a for a, b in zip(clock.times[1:], clock.times[2:])]  # the first interval holds prefill work
    steps.sort()
    return steps[len(steps) // 2], sum(steps) / len(steps)


def part_decode(args):
    config = config_json("qwen2.5-7b-instruct-1m")
    layers = args.decode_layers
    model = hf_model(config, layers, torch.bfloat16)
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    vocab = config["vocab_size"]
    for batch, ctx in shapes:
        ids = prompt(ctx, batch * 7 + ctx, vocab, batch)
        try:
            p50, mean = decode_rate(model, ids, args.decode_tokens, None)
            diff = decode_step_by_difference(model, ids, args.decode_tokens)
            log("decode", "sdpa", "7b-%dlayers bf16" % layers, "batch %d" % batch, "context %d" % ctx,
                "step p50 %.2f ms" % (p50 * 1e3), "tokens/s %.0f" % (batch / mean),
                "by difference: step %.2f ms, tokens/s %.0f" % (diff * 1e3, batch / diff))
        except torch.cuda.OutOfMemoryError as err:
            log("decode", "sdpa", "batch %d" % batch, "context %d" % ctx, "out of memory: %s" % str(err)[:120])
        gc.collect()
        torch.cuda.empty_cache()
    # The daemon's ring thread spins a while after each request for the next layer's (its default, 50 us, is
    # shorter than the model's work between two layers).
    d = Daemon(args.attnd, config, "bf16", args.decode_kv_bytes, extra=("--ring-spin-us", str(args.ring_spin_us)))
    try:
        for transport in args.transports.split(","):
            # "NAME+host": the same transport with the host synchronising each call (no device events).
            name, _, host = transport.partition("+")
            attachment = ahf.attach(model, d.client, transport=name, max_tokens_per_call=8192,
                                    device_events=host != "host")
            for batch, ctx in shapes:
                ids = prompt(ctx, batch * 7 + ctx, vocab, batch)
                p50, mean = decode_rate(model, ids, args.decode_tokens, None)
                diff = decode_step_by_difference(model, ids, args.decode_tokens)
                # Again with the device synchronized around each attnd call: attnd's share of a step.
                attachment.timed = True
                cache = attachment.new_cache()
                clock = StepClock()
                with torch.no_grad():
                    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.decode_tokens,
                                   min_new_tokens=args.decode_tokens, do_sample=False, pad_token_id=0,
                                   past_key_values=cache,
                                   logits_processor=transformers.LogitsProcessorList([clock]))
                attachment.timed = False
                st = cache.stats
                cache.release()
                steps = sorted(b - a for a, b in zip(clock.times[1:], clock.times[2:]))
                timed_step = sum(steps) / len(steps)
                per_layer = st.decode_seconds / max(1, st.decode_calls)
                calls = attachment.transport.calls if hasattr(attachment.transport, "calls") else None
                name = attachment.transport.name + (
                    " device-ordered" if getattr(calls, "device_events", False) else "")
                log("decode", "attnd " + name, "7b-%dlayers bf16" % layers,
                    "batch %d" % batch, "context %d" % ctx, "step p50 %.2f ms" % (p50 * 1e3),
                    "tokens/s %.0f" % (batch / mean),
                    "by difference: step %.2f ms, tokens/s %.0f" % (diff * 1e3, batch / diff),
                    "timed step %.2f ms = attnd %.1f us x %d layers + rest %.2f ms" % (
                        timed_step * 1e3, per_layer * 1e6, layers, (timed_step - per_layer * layers) * 1e3),
                    "prefill attnd %.2f s (%d calls)" % (st.prefill_seconds, st.prefill_calls))
            attachment.detach()
    finally:
        d.close()


def part_million(args):
    """The 7B geometry, all layers, random weights, a prompt of --million-tokens (sparse prefill on) in
    --million-chunk-token forwards, then 32 decode steps; model and attnd on one GPU."""
    config = config_json("qwen2.5-7b-instruct-1m")
    n, chunk, steps = args.million_tokens, args.million_chunk, 32
    d = Daemon(args.attnd, config, args.million_kv_dtype, args.million_kv_bytes,
               sparse_from="qwen2.5-7b-instruct-1m",
               extra=("--max-sequence-length", str(n + 64), "--ring-spin-us", str(args.ring_spin_us)))
    try:
        layers = args.million_layers or config["num_hidden_layers"]
        model = hf_model(config, layers, torch.bfloat16)
        attachment = ahf.attach(model, d.client, max_tokens_per_call=chunk, timed=True)
        ids = prompt(n, 17, config["vocab_size"])
        cache = attachment.new_cache()
        cache.set_prompt(None, ids)
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            for i, s in enumerate(range(0, n, chunk)):
                out = model(ids[:, s:s + chunk], past_key_values=cache, logits_to_keep=1)
                if i % 8 == 7:  # progress, so a run cut short by a time limit still says how far it got
                    torch.cuda.synchronize()
                    log("million", "progress: %d tokens after %.1f s (attnd %.1f s)" % (
                        s + chunk, time.perf_counter() - t0, cache.stats.prefill_seconds))
        torch.cuda.synchronize()
        prefill = time.perf_counter() - t0
        used = subprocess.run(["nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv,noheader"],
                              capture_output=True, text=True).stdout.strip()
        log("million", "7b-%dlayers bf16, %s KV" % (layers, args.million_kv_dtype),
            "prompt %d tokens in %d-token forwards" % (n, chunk),
            "prefill %.1f s = attnd %.1f s (%d calls) + rest %.1f s" % (
                prefill, cache.stats.prefill_seconds, cache.stats.prefill_calls,
                prefill - cache.stats.prefill_seconds),
            "device memory in use (both processes) %s" % used,
            "model process peak %.1f GiB" % (torch.cuda.max_memory_allocated() / 2**30))
        tok = out.logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            for _ in range(steps):
                tok = model(tok, past_key_values=cache).logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
        took = time.perf_counter() - t0
        info = d.client.info()
        log("million", "decode %d steps at %d tokens: %.1f ms/step, %.2f tokens/s; attnd %.0f us per layer call" % (
            steps, n, took / steps * 1e3, steps / took, 1e6 * cache.stats.decode_seconds / max(1, cache.stats.decode_calls)),
            "sequence length in attnd %d" % (cache.lengths[0]),
            "KV pages used %d of %d" % (info.kv_cache.pages_total - info.kv_cache.pages_free, info.kv_cache.pages_total))
        cache.release()
        attachment.detach()
    finally:
        d.close()


def part_profile(args):
    """Where one decode step of generate() goes, sdpa and attnd (batch 1, 4K context): the top operators."""
    config = config_json("qwen2.5-7b-instruct-1m")
    model = hf_model(config, args.decode_layers, torch.bfloat16)
    ids = prompt(4096, 5, config["vocab_size"])
    d = None
    for name in ("sdpa", "attnd"):
        if name == "attnd":
            d = Daemon(args.attnd, config, "bf16", 8 << 30)
            ahf.attach(model, d.client)
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, min_new_tokens=2,
                           do_sample=False, pad_token_id=0)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=9, min_new_tokens=9,
                               do_sample=False, pad_token_id=0)
        print("## profile %s: generate() of 9 tokens after 4096 (8 decode steps)" % name, flush=True)
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=14, max_name_column_width=60),
              flush=True)
        # The Python side of the same (where the adapter's and the client's time goes), by function.
        py = cProfile.Profile()
        with torch.no_grad():
            py.enable()
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=33, min_new_tokens=33,
                           do_sample=False, pad_token_id=0)
            py.disable()
        print("## Python profile %s: generate() of 33 tokens after 4096" % name, flush=True)
        pstats.Stats(py, stream=sys.stdout).sort_stats("tottime").print_stats(18)
    model._attnd.detach()
    d.close()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="tokens,logits,chunks,decode,profile")
    ap.add_argument("--attnd", default="attnd")
    ap.add_argument("--prompts", default="1024,4096,16384")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--chunk-prompt", type=int, default=7000)
    ap.add_argument("--decode-layers", type=int, default=4)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--decode-kv-bytes", type=int, default=24 << 30)
    ap.add_argument("--shapes", default="1x4096,8x4096,32x4096,1x32768,8x32768,1x131072")
    ap.add_argument("--transports", default="auto,auto+host",
                    help="attach() transports for the decode part; NAME+host: without device events")
    ap.add_argument("--ring-spin-us", type=int, default=2000, help="attnd --ring-spin-us for the decode part")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--million-tokens", type=int, default=1010000)
    ap.add_argument("--million-chunk", type=int, default=16384)
    ap.add_argument("--million-kv-bytes", type=int, default=int(54.5 * 2**30))
    ap.add_argument("--million-kv-dtype", default="bf16",
                    help="attnd --kv-dtype of the million part (int8: half the pool for the same tokens)")
    ap.add_argument("--million-layers", type=int, default=0,
                    help="layers of the million part (0: all 28); random weights make every vertical-slash call "
                         "about dense, so all 28 layers take longer than one 10-minute device call")
    args = ap.parse_args()
    parts = args.parts.split(",")
    log("versions", "transformers %s" % transformers.__version__, "torch %s" % torch.__version__,
        torch.cuda.get_device_name())
    jobs = []
    if "tokens" in parts or "logits" in parts:
        jobs.append(("tokens/logits", lambda: part_tokens_and_logits(args, parts)))
    if "chunks" in parts:
        jobs.append(("chunks", lambda: part_chunks(args)))
    if "decode" in parts:
        jobs.append(("decode", lambda: part_decode(args)))
    if "profile" in parts:
        jobs.append(("profile", lambda: part_profile(args)))
    if "million" in parts:
        jobs.append(("million", lambda: part_million(args)))
    status = 0
    for name, job in jobs:
        t0 = time.time()
        try:
            job()
        except Exception:  # noqa: BLE001 - report and go on to the next part
            status = 1
            log("FAILED", name, traceback.format_exc().replace("\n", " | "))
        log("part", name, "%.0f s" % (time.time() - t0))
        gc.collect()
        torch.cuda.empty_cache()
    sys.exit(status)


if __name__ == "__main__":
    main()
