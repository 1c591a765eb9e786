"""A minimal Qwen2-shaped causal LM in plain torch, for testing attnd.transformers where transformers is absent.

The same module tree and call shapes as transformers' Qwen2ForCausalLM (model.model.layers[i].self_attn with
q/k/v/o_proj, RMSNorm, SwiGLU MLP; the decoder's forward takes input_ids, attention_mask, past_key_values,
use_cache; the attention module returns (output, weights)), and a greedy `generate` that calls forward the way
transformers' does: the whole prompt (or `prefill_chunk_size` pieces of it, each with the mask so far), then one
token per step with the mask extended by one column. Attention is the plain-torch reference of dca_torch.py
("standard" by default) over the whole input, so without attnd every step recomputes the whole sequence.
"""
import json
import types

import torch
from torch import nn

import dca_torch  # noqa: E402 - tests/python is on sys.path in the tests


def load_config(path, **overrides):
    with open(path) as f:
        d = json.load(f)
    d.update(overrides)
    return types.SimpleNamespace(**d)


class RMSNorm(nn.Module):
    def __init__(self, n, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        d = config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * d, bias=True)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * d, bias=True)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * d, bias=True)
        self.o_proj = nn.Linear(config.num_attention_heads * d, config.hidden_size, bias=False)
        self.reference = dca_torch.ReferenceAttention(self, "standard", dca_torch.Geometry.from_config(config))

    def forward(self, hidden_states, attention_mask=None, past_key_values=None, **kwargs):
        if past_key_values is not None and past_key_values.get_seq_length() > 0:
            raise RuntimeError("the tiny model's own attention keeps no cache")
        return self.reference(hidden_states, attention_mask=attention_mask)


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h, attention_mask=None, past_key_values=None):
        a, _ = self.self_attn(hidden_states=self.input_layernorm(h), attention_mask=attention_mask,
                              past_key_values=past_key_values)
        h = h + a
        return h + self.mlp(self.post_attention_layernorm(h))


class Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, use_cache=None, **kwargs):
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        for layer in self.layers:
            h = layer(h, attention_mask=attention_mask, past_key_values=past_key_values)
        return types.SimpleNamespace(last_hidden_state=self.norm(h),
                                     past_key_values=past_key_values if use_cache is not False else None)


class ForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids=None, attention_mask=None, past_key_values=None, use_cache=None):
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=past_key_values,
                         use_cache=use_cache)
        return types.SimpleNamespace(logits=self.lm_head(out.last_hidden_state), hidden=out.last_hidden_state,
                                     past_key_values=out.past_key_values)

    @torch.no_grad()
    def generate(self, input_ids, attention_mask=None, max_new_tokens=16, past_key_values=None,
                 prefill_chunk_size=None, on_step=None):
        """Greedy. With past_key_values (an attnd cache) each forward takes only the new positions; without,
        every step recomputes the whole sequence. Returns (tokens [B, prompt + new], last logits per step)."""
        ids = input_ids
        mask = attention_mask if attention_mask is not None else torch.ones_like(ids)
        steps = []
        for step in range(max_new_tokens):
            if past_key_values is None:
                logits = self(ids, attention_mask=mask, use_cache=False).logits[:, -1]
            elif step == 0:
                chunk = prefill_chunk_size or ids.shape[1]
                for s in range(0, ids.shape[1], chunk):
                    e = min(ids.shape[1], s + chunk)
                    logits = self(ids[:, s:e], attention_mask=mask[:, :e], past_key_values=past_key_values).logits
                logits = logits[:, -1]
            else:
                logits = self(ids[:, -1:], attention_mask=mask, past_key_values=past_key_values).logits[:, -1]
            steps.append(logits)
            if on_step is not None:
                on_step(step)
            nxt = logits.argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
            mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
        return ids, steps


def build(config, seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    model = ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.02)
            else:
                p.normal_(0.0, 0.05 if name.startswith(("lm_head", "model.embed")) else 0.02)
        # Larger q/k weights make attention sharp enough for a wrong position or chunk to change tokens.
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(6.0)
            layer.self_attn.k_proj.weight.mul_(6.0)
    return model.to(dtype).eval()
