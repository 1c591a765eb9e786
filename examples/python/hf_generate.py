#!/usr/bin/env python3
"""Generate text with a Hugging Face Qwen2 model whose attention runs in attnd (docs/transformers.md).

A checkpoint (weights, config.json and tokenizer in a local directory):
    attnd --device cuda --model-config CKPT/config.json &
    python3 examples/python/hf_generate.py --model CKPT --prompt-file prompt.txt --max-new-tokens 256

Random weights from a config (no tokenizer: the prompt is random token ids, the output token ids):
    python3 examples/python/hf_generate.py --config configs/qwen2.5-7b-instruct-1m/config.json --layers 4 \\
        --prompt-tokens 8192 --max-new-tokens 32

attnd must serve the model's geometry (start it with the same config.json); on the same host and GPU the q/k/v
go through CUDA IPC and a shared-memory ring, elsewhere as gRPC bytes. Output is streamed as it is generated.
Needs torch and transformers (>= 5.0) next to the attnd package.
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "client", "python"))

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers.generation.streamers import BaseStreamer  # noqa: E402

import attnd  # noqa: E402
import attnd.transformers  # noqa: E402


class Printer(BaseStreamer):
    """Prints tokens as generate() produces them (text with a tokenizer, ids without)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.first, self.count = tokenizer, True, 0

    def put(self, value):
        if self.first:  # the prompt
            self.first = False
            return
        ids = value.flatten().tolist()
        self.count += len(ids)
        text = self.tokenizer.decode(ids) if self.tokenizer else " " + " ".join(map(str, ids))
        print(text, end="", flush=True)

    def end(self):
        print(flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a local checkpoint directory (from_pretrained)")
    src.add_argument("--config", help="a config.json: random weights")
    ap.add_argument("--layers", type=int, help="with --config: this many layers (default: the config's)")
    ap.add_argument("--target", default="127.0.0.1:50051", help="attnd's address")
    ap.add_argument("--prompt-file", help="the prompt (UTF-8 text; needs --model's tokenizer)")
    ap.add_argument("--prompt-tokens", type=int, default=1024, help="without --prompt-file: random token ids")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--prefill-chunk", type=int, default=8192, help="prompt tokens per forward")
    ap.add_argument("--transport", default="auto", help="auto, grpc, ring, cuda-ipc or ring-cuda-ipc")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    device = "cuda" if torch.cuda.is_available() else "cpu"

    tokenizer = None
    if args.model:
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device)
        tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
    else:
        with open(args.config) as f:
            cfg = json.load(f)
        if args.layers:
            cfg["num_hidden_layers"] = args.layers
        with torch.device(device):
            model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**cfg)).to(dtype)
    model.eval()

    if args.prompt_file:
        if tokenizer is None:
            sys.exit("--prompt-file needs --model (a tokenizer)")
        with open(args.prompt_file, encoding="utf-8") as f:
            text = f.read()
        messages = [{"role": "user", "content": text}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
        if not isinstance(ids, torch.Tensor):  # a BatchEncoding in some versions
            ids = ids["input_ids"]
    else:
        ids = torch.randint(100, model.config.vocab_size - 100, (1, args.prompt_tokens))
    ids = ids.to(device)

    client = attnd.Client(args.target)
    attachment = attnd.transformers.attach(model, client, transport=args.transport,
                                           max_tokens_per_call=args.prefill_chunk)
    print("# %d prompt tokens; attnd %s at %s, transport %s" % (
        ids.shape[1], client.info().backend, args.target, attachment.transport.name), file=sys.stderr)
    printer = Printer(tokenizer)
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                       do_sample=False, streamer=printer, prefill_chunk_size=args.prefill_chunk,
                       pad_token_id=tokenizer.eos_token_id if tokenizer else 0)
    took = time.perf_counter() - start
    print("# %d tokens in %.2f s; sequences left in attnd: %d" % (
        printer.count, took, client.info().live_sequences), file=sys.stderr)
    attachment.detach()
    client.close()


if __name__ == "__main__":
    main()
