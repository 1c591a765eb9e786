"""An independent numpy float64 implementation of dense dual-chunk attention, written from docs/DCA.md.

Shares no code with attnd (neither the C++ kernels nor the Python client). One RefLayer holds one layer of one
sequence: its length-scaled keys and its values, in float64.

For a query at position p, with cl = chunk_size - local_size and prev = floor(p / cl) * cl, the keys j <= p are
seen with the query variant
    intra (0) for prev <= j <= p,   succ (1) for prev - cl <= j < prev,   inter (2) for j < prev - cl,
and one softmax runs over all of them (DCA.md: the union of the three logit sets). This is the same for the
prefill piece loop and for decode (decode's p is the new token, L - 1).
Length scaling s(L) = max(1, 0.1 ln(L / omp) + 1) (1 when omp == 0):
  prefill: keys cached as s(L) k with L = prompt_len (default: the length after the call); logits scale * s * q.k
  decode:  L = the length including the new token; key cached as s(L) k; queries times s; logits scale * (s q).k
"""
import math

import numpy as np


def length_scale(length, original_max_position_embeddings):
    if original_max_position_embeddings <= 0:
        return 1.0
    return max(1.0, 0.1 * math.log(length / original_max_position_embeddings) + 1.0)


class DcaConfig:
    def __init__(self, chunk_size, local_size, original_max_position_embeddings, softmax_scale, num_q_heads,
                 num_kv_heads, head_dim):
        self.chunk_len = chunk_size - local_size
        self.omp = original_max_position_embeddings
        self.scale = softmax_scale
        self.num_q_heads = num_q_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim

    @classmethod
    def from_case(cls, case):
        d = case["dual_chunk_attention_config"]
        return cls(d["chunk_size"], d["local_size"], d.get("original_max_position_embeddings", 0),
                   case["softmax_scale"], case["num_q_heads"], case["num_kv_heads"], case["head_dim"])


class RefLayer:
    def __init__(self, cfg):
        self.cfg = cfg
        self.k = np.zeros((0, cfg.num_kv_heads, cfg.head_dim))
        self.v = np.zeros((0, cfg.num_kv_heads, cfg.head_dim))

    def __len__(self):
        return self.k.shape[0]

    def _attend(self, positions, q_variants, logit_scale):
        """positions [T]; q_variants [T, 3, Hq, D] float64 -> out [T, Hq, D]."""
        cfg = self.cfg
        cl = cfg.chunk_len
        g = cfg.num_q_heads // cfg.num_kv_heads
        n_keys = self.k.shape[0]
        j = np.arange(n_keys)[None, :]                       # [1, Lk]
        p = np.asarray(positions)[:, None]                   # [T, 1]
        prev = (p // cl) * cl
        variant = np.where(j >= prev, 0, np.where(j >= prev - cl, 1, 2))  # [T, Lk]
        visible = j <= p
        k_q = np.repeat(self.k, g, axis=1)                   # [Lk, Hq, D]: q head h reads kv head h // g
        v_q = np.repeat(self.v, g, axis=1)
        # logits[var, h, t, j] for each variant, then pick per (t, j).
        logits = np.einsum("tvhd,jhd->vhtj", q_variants, k_q) * logit_scale
        chosen = np.take_along_axis(logits, np.broadcast_to(variant[None, None], (1,) + logits.shape[1:]),
                                    axis=0)[0]               # [Hq, T, Lk]
        chosen = np.where(visible[None], chosen, -np.inf)
        chosen -= chosen.max(axis=-1, keepdims=True)
        w = np.exp(chosen)
        w /= w.sum(axis=-1, keepdims=True)
        return np.einsum("htj,jhd->thd", w, v_q)

    def prefill(self, q, k, v, prompt_len=None):
        """q [T, 5, Hq, D], k/v [T, Hkv, D] (any float dtype) -> out [T, Hq, D] float64."""
        q = np.asarray(q, dtype=np.float64)
        t = q.shape[0]
        start = len(self)
        length = prompt_len if prompt_len is not None else start + t
        s = length_scale(length, self.cfg.omp)
        self.k = np.concatenate([self.k, s * np.asarray(k, dtype=np.float64)])
        self.v = np.concatenate([self.v, np.asarray(v, dtype=np.float64)])
        return self._attend(np.arange(start, start + t), q[:, :3], self.cfg.scale * s)

    def decode(self, q, k, v):
        """q [3 or 5, Hq, D], k/v [Hkv, D] -> out [Hq, D] float64."""
        q = np.asarray(q, dtype=np.float64)
        length = len(self) + 1
        s = length_scale(length, self.cfg.omp)
        self.k = np.concatenate([self.k, s * np.asarray(k, dtype=np.float64)[None]])
        self.v = np.concatenate([self.v, np.asarray(v, dtype=np.float64)[None]])
        return self._attend(np.array([length - 1]), (s * q[:3])[None], self.cfg.scale)[0]
