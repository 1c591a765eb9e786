"""Plain-torch attention references for model-level tests, written from docs/DCA.md (shares no code with attnd).

One row (one sequence, padding removed) at a time, in float64, over the whole sequence at once (no cache): the
standard causal attention with the model's rotary (what transformers' sdpa computes for Qwen2), and dense dual
chunk attention with the dual-chunk rotary, as one prefill of the whole sequence with prompt_len = its length.
`ReferenceAttention` swaps either in for a Qwen2 decoder layer's attention (transformers' or the tests' model).
"""
import math

import torch


def length_scale(length, original_max_position_embeddings):
    if original_max_position_embeddings <= 0:
        return 1.0
    return max(1.0, 0.1 * math.log(length / original_max_position_embeddings) + 1.0)


def rotate(x, positions, rope_theta, rotary_dim):
    """Neox-style rotary of x [T, H, D] by positions [T] (float64)."""
    half = rotary_dim // 2
    inv_freq = rope_theta ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64, device=x.device) / rotary_dim)
    a = positions.to(device=x.device, dtype=torch.float64)[:, None] * inv_freq[None]
    cos, sin = a.cos()[:, None, :], a.sin()[:, None, :]
    x1, x2 = x[..., :half], x[..., half:rotary_dim]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., rotary_dim:]], dim=-1)


class Geometry:
    def __init__(self, num_q_heads, num_kv_heads, head_dim, rope_theta, rotary_dim=None, chunk_size=8192,
                 local_size=1024, original_max_position_embeddings=0):
        self.num_q_heads, self.num_kv_heads, self.head_dim = num_q_heads, num_kv_heads, head_dim
        self.rope_theta = float(rope_theta)
        self.rotary_dim = rotary_dim or head_dim
        self.chunk_size, self.local_size = chunk_size, local_size
        self.chunk_len = chunk_size - local_size
        self.omp = original_max_position_embeddings
        self.scale = head_dim ** -0.5

    @classmethod
    def from_config(cls, config):
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        theta = getattr(config, "rope_theta", None)
        params = getattr(config, "rope_parameters", None)
        if theta is None and isinstance(params, dict):
            theta = params.get("rope_theta")
        dca = getattr(config, "dual_chunk_attention_config", None) or {}
        return cls(heads, config.num_key_value_heads, head_dim, theta or 10000.0, None,
                   dca.get("chunk_size", 8192), dca.get("local_size", 1024),
                   dca.get("original_max_position_embeddings", 0))


def _softmax_attend(logits, visible, v_q):
    """logits [Hq, Tq, Tk] with visible [Tq, Tk] -> [Tq, Hq, D]."""
    logits = logits.masked_fill(~visible[None], float("-inf"))
    w = torch.softmax(logits, dim=-1)
    return torch.einsum("htj,jhd->thd", w, v_q)


def standard_attention(q, k, v, g, block=256):
    """Causal attention with the plain rotary at positions 0..n-1: q [n, Hq, D], k and v [n, Hkv, D]."""
    q, k, v = q.double(), k.double(), v.double()
    n = q.shape[0]
    p = torch.arange(n, device=q.device)
    rep = g.num_q_heads // g.num_kv_heads
    kr = rotate(k, p, g.rope_theta, g.rotary_dim).repeat_interleave(rep, dim=1)
    v_q = v.repeat_interleave(rep, dim=1)
    qr = rotate(q, p, g.rope_theta, g.rotary_dim)
    out = torch.empty_like(q)
    j = torch.arange(n, device=q.device)
    for s in range(0, n, block):
        e = min(n, s + block)
        logits = torch.einsum("thd,jhd->htj", qr[s:e], kr) * g.scale
        out[s:e] = _softmax_attend(logits, j[None, :] <= p[s:e, None], v_q)
    return out


def dca_attention(q, k, v, g, prompt_len=None, block=256):
    """Dense DCA prefill of a whole sequence (docs/DCA.md, "Dense prefill", "Length scaling", "Dual-chunk
    rotary"): q [n, Hq, D] and k [n, Hkv, D] before the rotary, v [n, Hkv, D]; L = prompt_len or n."""
    q, k, v = q.double(), k.double(), v.double()
    n = q.shape[0]
    cl = g.chunk_len
    s = length_scale(prompt_len or n, g.omp)
    p = torch.arange(n, device=q.device)
    r = p % cl
    rep = g.num_q_heads // g.num_kv_heads
    kr = (s * rotate(k, r, g.rope_theta, g.rotary_dim)).repeat_interleave(rep, dim=1)
    v_q = v.repeat_interleave(rep, dim=1)
    variants = [rotate(q, r, g.rope_theta, g.rotary_dim),                                    # intra
                rotate(q, torch.clamp(r + cl, max=g.chunk_size), g.rope_theta, g.rotary_dim),  # succ
                rotate(q, torch.full_like(r, min(2 * cl - 1, g.chunk_size)), g.rope_theta, g.rotary_dim)]  # inter
    out = torch.empty_like(q)
    j = torch.arange(n, device=q.device)
    for b0 in range(0, n, block):
        b1 = min(n, b0 + block)
        prev = (p[b0:b1] // cl) * cl
        stage = torch.where(j[None, :] >= prev[:, None], 0, torch.where(j[None, :] >= prev[:, None] - cl, 1, 2))
        logits = None
        for which, qv in enumerate(variants):
            lv = torch.einsum("thd,jhd->htj", qv[b0:b1], kr)
            logits = lv if logits is None else torch.where((stage == which)[None], lv, logits)
        out[b0:b1] = _softmax_attend(logits * (g.scale * s), j[None, :] <= p[b0:b1, None], v_q)
    return out


class ReferenceAttention(torch.nn.Module):
    """A Qwen2 decoder layer's attention computed by `standard_attention` or `dca_attention` over the whole input
    (no cache: every forward is the whole sequence). Padding comes from a 2D attention mask when the model passes
    one; otherwise every position is a token."""

    def __init__(self, original, kind, geometry):
        super().__init__()
        if kind not in ("standard", "dca"):
            raise ValueError(kind)
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(self, name, getattr(original, name))
        self.kind, self.g = kind, geometry
        self.layer_idx = getattr(original, "layer_idx", None)

    def forward(self, hidden_states, *args, attention_mask=None, **kwargs):
        g = self.g
        b, t = hidden_states.shape[:2]
        q = self.q_proj(hidden_states).view(b, t, g.num_q_heads, g.head_dim)
        k = self.k_proj(hidden_states).view(b, t, g.num_kv_heads, g.head_dim)
        v = self.v_proj(hidden_states).view(b, t, g.num_kv_heads, g.head_dim)
        valid = None
        if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2:
            valid = attention_mask[:, -t:] != 0
        out = torch.zeros(b, t, g.num_q_heads, g.head_dim, dtype=torch.float64, device=q.device)
        for row in range(b):
            ix = torch.arange(t, device=q.device) if valid is None else torch.nonzero(valid[row]).flatten()
            if ix.numel() == 0:
                continue
            f = standard_attention if self.kind == "standard" else dca_attention
            out[row, ix] = f(q[row, ix], k[row, ix], v[row, ix], g)
        out = out.to(hidden_states.dtype).reshape(b, t, g.num_q_heads * g.head_dim)
        return self.o_proj(out), None


def use_reference(decoder_layers, kind, geometry):
    """Swaps ReferenceAttention into every layer; returns a function that puts the originals back."""
    originals = [layer.self_attn for layer in decoder_layers]
    for layer in decoder_layers:
        layer.self_attn = ReferenceAttention(layer.self_attn, kind, geometry)

    def restore():
        for layer, original in zip(decoder_layers, originals):
            layer.self_attn = original

    return restore
