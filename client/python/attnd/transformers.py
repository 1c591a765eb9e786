"""Run a Hugging Face Qwen2 model's attention in attnd (docs/transformers.md).

    import attnd, attnd.transformers, torch, transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda()
    client = attnd.Client("127.0.0.1:50051")        # attnd started with the model's config.json
    attnd.transformers.attach(model, client)
    out = model.generate(input_ids, attention_mask=mask, max_new_tokens=64)

`attach` replaces every decoder layer's attention module with one that projects q, k and v with the layer's own
weights and sends them to attnd before the rotary (q_layout "pre_rotary"): attnd applies the dual-chunk rotary,
length scaling, DCA and (above the sparse threshold) vertical-slash sparse prefill, and holds the K/V. The model's
cache becomes an `AttndCache`: attnd sequence ids, one per batch row, and no K/V in the client. `generate()` is
unchanged; it gets a fresh cache whose sequences are released when it returns or raises.

Why the attention modules and not transformers' attention interface: an attention function registered there
receives q and k after the model's own rotary, and DCA rotates each query by several positions (docs/DCA.md), so
the function would have to undo the model's rotary first. The cache, the mask hook and `generate` are transformers'
own extension points (a `Cache` subclass, a registered attention implementation that needs no mask).

torch is required; transformers is optional (a model shaped like transformers' Qwen2, `model.model.layers[i]
.self_attn.{q,k,v,o}_proj`, works without it: the tests use one).
"""
import inspect
import math
import time
import warnings
import weakref

try:
    import torch
except ImportError as _err:  # pragma: no cover - the message is the point
    raise ImportError("attnd.transformers needs torch (pip install torch, or python3-torch on Debian)") from _err

from ._errors import AttndError

try:
    import transformers as _hf
    from transformers.cache_utils import Cache as _HfCache
    from transformers.cache_utils import CacheLayerMixin as _HfCacheLayer
except ImportError:  # transformers absent, or older than 5.0 (no per-layer cache objects)
    _hf = None
    _HfCache = object
    _HfCacheLayer = None

TESTED_TRANSFORMERS = "5.17"
IMPLEMENTATION = "attnd"  # the attention implementation name attach() gives the model's config

__all__ = ["AttndCache", "Attachment", "GeometryMismatch", "attach", "model_geometry", "check_geometry",
           "TESTED_TRANSFORMERS"]


class GeometryMismatch(ValueError):
    """The model's config and the daemon's (GetServerInfo) disagree on something attention depends on."""


# -- geometry -----------------------------------------------------------------------------------------------------

def _rope(config):
    """-> (rope_theta, rope_type) from a Qwen2 config of any transformers version."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        theta = params.get("rope_theta", getattr(config, "rope_theta", None))
        return theta, params.get("rope_type", params.get("type", "default"))
    scaling = getattr(config, "rope_scaling", None)
    kind = "default"
    if isinstance(scaling, dict) and scaling:
        kind = scaling.get("rope_type", scaling.get("type", "default"))
    return getattr(config, "rope_theta", 10000.0), kind


def model_geometry(config):
    """What attention depends on in a Qwen2 config (a transformers config or any object with its attributes)."""
    heads = int(config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    theta, rope_type = _rope(config)
    dca = getattr(config, "dual_chunk_attention_config", None)
    if dca is not None and not isinstance(dca, dict):
        dca = dict(vars(dca))
    return {
        "num_layers": int(config.num_hidden_layers),
        "num_q_heads": heads,
        "num_kv_heads": int(getattr(config, "num_key_value_heads", None) or heads),
        "head_dim": int(head_dim),
        "rope_theta": float(theta if theta is not None else 10000.0),
        "rope_type": rope_type or "default",
        "rotary_dim": int(int(head_dim) * float(getattr(config, "partial_rotary_factor", 1.0) or 1.0)),
        "sliding_window": bool(getattr(config, "use_sliding_window", False)),
        "dca": dca,
    }


def check_geometry(config, info):
    """Raises GeometryMismatch naming the first field where the model and the daemon differ; returns the model's
    geometry. A model may have fewer layers than the daemon serves (it uses the first ones)."""
    g = model_geometry(config)
    m, d = info.model, info.dca
    fix = " Start attnd with this model's config.json (attnd --model-config PATH/config.json)."

    def differ(field, ours, theirs, where):
        return GeometryMismatch("the model's %s is %s but the attnd daemon's is %s (GetServerInfo %s).%s"
                                % (field, ours, theirs, where, fix))

    if g["num_layers"] > m.num_layers:
        raise differ("num_hidden_layers", g["num_layers"], "%d (at most that many layers)" % m.num_layers,
                     "model.num_layers")
    for field, key, theirs, where in (
            ("num_attention_heads", "num_q_heads", m.num_q_heads, "model.num_q_heads"),
            ("num_key_value_heads", "num_kv_heads", m.num_kv_heads, "model.num_kv_heads"),
            ("head_dim", "head_dim", m.head_dim, "model.head_dim")):
        if g[key] != theirs:
            raise differ(field, g[key], theirs, where)
    if m.rope_theta and not math.isclose(g["rope_theta"], m.rope_theta, rel_tol=1e-9):
        raise differ("rope_theta", g["rope_theta"], m.rope_theta, "model.rope_theta")
    if m.rotary_dim and g["rotary_dim"] != m.rotary_dim:
        raise differ("rotary dimension (head_dim x partial_rotary_factor)", g["rotary_dim"], m.rotary_dim,
                     "model.rotary_dim")
    if g["rope_type"] != "default":
        raise GeometryMismatch(
            "the model's rope scaling is %r; attnd applies the plain rotary with rope_theta and extends the context "
            "with dual chunk attention instead (docs/DCA.md): use the config without rope_scaling" % g["rope_type"])
    if g["sliding_window"]:
        raise GeometryMismatch("the model uses sliding-window attention (use_sliding_window), which attnd does not "
                               "serve; every layer is full dual-chunk attention")
    if g["dca"]:
        # docs/DCA.md: an absent key takes the reference's default.
        for field, default, theirs in (("chunk_size", 8192, d.chunk_size), ("local_size", 1024, d.local_size),
                                       ("original_max_position_embeddings", 0,
                                        d.original_max_position_embeddings)):
            ours = int(g["dca"].get(field, default))
            if ours != theirs:
                raise differ("dual_chunk_attention_config.%s" % field, ours, theirs, "dca.%s" % field)
    return g


# -- transports ---------------------------------------------------------------------------------------------------

_WIRE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# A ring's half holds one request and one answer: with bytes inline, 32 MiB is ~1,800 prefill tokens of the 7B
# model per call in bf16; with CUDA IPC references a request is a few hundred bytes.
_RING_HALF_BYTES = 32 << 20


class _Inline:
    """q, k, v travel as bytes (gRPC, or inline in a ring): any host, any device."""

    name = "grpc"

    def __init__(self, calls, max_tokens, name=None):
        self.calls = calls
        self.max_tokens = max_tokens
        if name:
            self.name = name

    def prefill(self, seq, layer, q, k, v, prompt_len, out):
        n = q.shape[0]
        for s in range(0, n, self.max_tokens):
            e = min(n, s + self.max_tokens)
            out[s:e] = self.calls.prefill(seq, layer, q[s:e], k[s:e], v[s:e], prompt_len=prompt_len,
                                          q_layout="pre_rotary")

    def decode(self, layer, seqs, q, k, v):
        return self.calls.decode(layer, seqs, q, k, v, q_layout="pre_rotary")

    def close(self):
        close = getattr(self.calls, "close", None)
        if close is not None and self.name == "ring":
            close()


class _CudaStaging:
    """q, k, v and the output in one CUDA buffer shared with attnd by CUDA IPC (same host and GPU): each call
    copies the layer's q/k/v into it on the device and names them by reference; attnd writes the output there."""

    def __init__(self, client, calls, geometry, device, dtype, max_tokens, name):
        self.calls, self.max_tokens, self.name = calls, max_tokens, name
        hq, hkv, d = geometry["num_q_heads"], geometry["num_kv_heads"], geometry["head_dim"]
        es = torch.tensor([], dtype=dtype).element_size()

        def aligned(n):
            return (n + 255) // 256 * 256

        shapes = {"q": (max_tokens, hq, d), "k": (max_tokens, hkv, d), "v": (max_tokens, hkv, d),
                  "o": (max_tokens, hq, d)}
        offsets, total = {}, 0
        for key, shape in shapes.items():
            offsets[key] = total
            total += aligned(math.prod(shape) * es)
        self.buffer = torch.empty(total, dtype=torch.uint8, device=device)
        self.region = client.register_cuda(self.buffer)
        self.views = {}
        for key, shape in shapes.items():
            nbytes = math.prod(shape) * es
            self.views[key] = self.buffer[offsets[key]:offsets[key] + nbytes].view(dtype).view(shape)

    def prefill(self, seq, layer, q, k, v, prompt_len, out):
        n = q.shape[0]
        qv, kv, vv, ov = (self.views[x] for x in "qkvo")
        for s in range(0, n, self.max_tokens):
            e = min(n, s + self.max_tokens)
            m = e - s
            qv[:m].copy_(q[s:e])
            kv[:m].copy_(k[s:e])
            vv[:m].copy_(v[s:e])
            self.calls.prefill(seq, layer, qv[:m], kv[:m], vv[:m], prompt_len=prompt_len, q_layout="pre_rotary",
                               out=ov[:m])
            out[s:e] = ov[:m]

    def decode(self, layer, seqs, q, k, v):
        qv, kv, vv, ov = (self.views[x] for x in "qkvo")
        n = q.shape[0]
        if n > self.max_tokens:
            raise ValueError("a decode of %d sequences is more than the staging buffer holds (%d): attach(..., "
                             "max_tokens_per_call=%d) or more" % (n, self.max_tokens, n))
        qv[:n].copy_(q)
        kv[:n].copy_(k)
        vv[:n].copy_(v)
        self.calls.decode(layer, seqs, qv[:n], kv[:n], vv[:n], q_layout="pre_rotary", out=ov[:n])
        return ov[:n].clone()

    def close(self):
        if self.name == "ring":
            self.calls.close()
        self.region.close()


def _open_transport(client, info, geometry, device, dtype, transport, max_tokens, spin_us, device_events=True):
    """-> a transport object; transport is "auto", "grpc", "ring", "cuda-ipc" or "ring-cuda-ipc"."""
    if transport not in ("auto", "grpc", "ring", "cuda-ipc", "ring-cuda-ipc"):
        raise ValueError("transport must be auto, grpc, ring, cuda-ipc or ring-cuda-ipc, got %r" % (transport,))
    want_cuda = transport in ("cuda-ipc", "ring-cuda-ipc") or (transport == "auto" and device.type == "cuda")
    want_ring = transport in ("ring", "ring-cuda-ipc") or transport == "auto"
    ring = None
    if want_ring:
        # With the staging buffer in a CUDA region, a ring ordered on the device: no host synchronisation per call.
        ordered = device_events and want_cuda and info.regions.device_ordered_rings
        if ordered and not info.regions.cuda_mps:
            warnings.warn("attnd.transformers: attnd is not under CUDA MPS, so this process and attnd take turns on "
                          "the GPU and every device-ordered layer call waits for a time slice (about 0.3 ms on an "
                          "H100); run both under MPS (docs/operations.md, 'Device-ordered rings need CUDA MPS')")
        try:
            ring = client.ring(half_bytes=_RING_HALF_BYTES, spin_us=spin_us, version=2, device_events=ordered)
        except (AttndError, OSError) as err:
            if transport != "auto":
                raise
            warnings.warn("attnd.transformers: no ring (%s); using gRPC calls" % err)
    calls = ring if ring is not None else client
    if want_cuda:
        try:
            return _CudaStaging(client, calls, geometry, device, dtype, max_tokens,
                                "ring-cuda-ipc" if ring is not None else "cuda-ipc")
        except (AttndError, RuntimeError) as err:
            if transport != "auto":
                if ring is not None:
                    ring.close()
                raise
            warnings.warn("attnd.transformers: no CUDA IPC region (%s); sending q, k, v as bytes" % err)
    if ring is not None:
        # A ring's half holds one request: the prefill tokens per call follow from its size.
        es = torch.tensor([], dtype=dtype).element_size()
        per_token = (geometry["num_q_heads"] + 2 * geometry["num_kv_heads"]) * geometry["head_dim"] * es
        return _Inline(ring, max(1, min(max_tokens, (ring.capacity - 65536) // per_token)), "ring")
    limit = client.max_prefill_tokens(dtype=dtype, q_layout="pre_rotary", info=info)
    return _Inline(client, max(1, min(max_tokens, limit)))


# -- the cache ----------------------------------------------------------------------------------------------------

class Stats:
    """Where the time went: seconds inside attnd calls (staging copies included; exact with attach(timed=True)),
    and calls made (a decode call is one layer of one batched step; a prefill call one layer of one row)."""

    def __init__(self):
        self.prefill_seconds = 0.0
        self.decode_seconds = 0.0
        self.prefill_calls = 0
        self.decode_calls = 0

    @property
    def attnd_seconds(self):
        return self.prefill_seconds + self.decode_seconds

    def __repr__(self):
        return "Stats(prefill %d calls %.6f s, decode %d calls %.6f s)" % (
            self.prefill_calls, self.prefill_seconds, self.decode_calls, self.decode_seconds)


class _Forward:
    """One model forward: which of its B x T positions are tokens (not padding)."""

    __slots__ = ("rows", "tokens", "index", "prompt_lens", "decode")

    def __init__(self, valid, lengths, prompt_lens):
        self.rows = valid.shape[0]
        self.tokens = valid.sum(dim=1).tolist()
        t = valid.shape[1]
        self.index = [None if n == t else torch.nonzero(valid[b]).flatten() for b, n in enumerate(self.tokens)]
        self.prompt_lens = prompt_lens
        # One token per sequence that already holds tokens: one batched Decode per layer.
        self.decode = t == 1 and all(lengths[b] > 0 for b in range(self.rows) if self.tokens[b])


if _HfCacheLayer is not None:
    class _AttndLayer(_HfCacheLayer):
        """One layer of an AttndCache for transformers: lengths only; the K/V live in attnd."""

        is_compileable = False
        is_sliding = False
        supports_early_init = False

        def __init__(self, cache):
            super().__init__()
            self._cache = weakref.ref(cache)

        def lazy_initialization(self, key_states, value_states):
            pass

        def update(self, key_states, value_states, *args, **kwargs):
            raise RuntimeError("attnd holds this layer's keys and values; an AttndCache takes no update() (is the "
                               "model still attached? attnd.transformers.attach)")

        def get_seq_length(self):
            return self._cache().columns

        def get_mask_sizes(self, query_length, *args):
            return self._cache().columns + int(query_length), 0

        def get_max_length(self):
            return -1

        def reset(self):
            self._cache().release()

        def reorder_cache(self, beam_idx):
            raise NotImplementedError("attnd sequences cannot be reordered: beam search is not supported with "
                                      "attnd.transformers (use greedy or sampling)")

        def crop(self, tokens_to_remove):
            raise NotImplementedError("attnd sequences cannot be cropped (assisted generation and cache "
                                      "rollback are not supported with attnd.transformers)")

        def batch_repeat_interleave(self, repeats):
            raise NotImplementedError("attnd sequences cannot be repeated within a batch (expand the inputs "
                                      "before the first forward instead)")

        def batch_select_indices(self, indices):
            raise NotImplementedError("attnd sequences cannot be selected within a batch")


class AttndCache(_HfCache):
    """The model's cache while it runs on attnd: one attnd sequence per batch row (created at the first forward,
    released by release(), when generate() ends, or when the cache is garbage collected), and the number of
    positions seen (`columns`, padding included, what transformers calls the cache's length). No K/V."""

    def __init__(self, attachment):
        if _HfCacheLayer is not None:
            super().__init__(layers=[_AttndLayer(self) for _ in range(attachment.geometry["num_layers"])])
        self._attachment = attachment
        self._client = attachment.client
        self.sequence_ids = None
        self.lengths = None       # tokens per row in attnd (padding excluded)
        self.columns = 0
        self.prompt_lengths = None  # per row, while the prompt is prefilled (generate() sets it)
        self._prompt_columns = 0
        self._forward = None
        self._broken = None
        self.stats = Stats()
        self._finalizer = None

    # transformers' Cache API (without transformers the same names serve the tests' model).
    def get_seq_length(self, layer_idx=0):
        return self.columns

    def get_mask_sizes(self, query_length, layer_idx=0):
        return self.columns + int(query_length), 0

    def get_max_length(self, layer_idx=None):
        return -1

    @property
    def is_compileable(self):
        return False

    def set_prompt(self, attention_mask=None, input_ids=None):
        """The whole prompt, before the first forward: its per-row lengths are the prompt_len of every prefill
        call while the prompt goes in (in chunks or not), as attnd's length scaling and sparse threshold need."""
        if self.columns:
            return
        if attention_mask is not None:
            self.prompt_lengths = [int(x) for x in (attention_mask != 0).sum(dim=-1).tolist()]
            self._prompt_columns = int(attention_mask.shape[-1])
        elif input_ids is not None:
            self._prompt_columns = int(input_ids.shape[-1])
            self.prompt_lengths = [self._prompt_columns] * int(input_ids.shape[0])

    def release(self):
        """Releases the sequences in attnd (idempotent); the cache can start over with a new prompt."""
        ids, self.sequence_ids = self.sequence_ids, None
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        self.lengths, self.columns, self._broken = None, 0, None
        self.prompt_lengths, self._prompt_columns = None, 0
        if ids:
            _release_all(self._client, ids)

    def _begin(self, attention_mask, rows, t):
        if self._broken:
            raise RuntimeError("this AttndCache is unusable: %s; release() it and start again" % self._broken)
        if self.sequence_ids is None:
            ids = []
            try:
                for _ in range(rows):
                    ids.append(self._client.create_sequence())
            except BaseException:
                _release_all(self._client, ids)
                raise
            self.sequence_ids, self.lengths = ids, [0] * rows
            self._finalizer = weakref.finalize(self, _release_all, self._client, list(ids))
        elif len(self.sequence_ids) != rows:
            raise ValueError("this AttndCache holds %d sequences but the forward has %d rows"
                             % (len(self.sequence_ids), rows))
        if attention_mask is None:
            valid = torch.ones((rows, t), dtype=torch.bool)
        else:
            if attention_mask.dim() != 2 or attention_mask.shape[0] != rows or attention_mask.shape[1] < t:
                raise ValueError("attnd.transformers needs a 2D attention mask [batch, positions so far] (got "
                                 "shape %s for %d rows of %d new positions)" % (tuple(attention_mask.shape), rows, t))
            valid = (attention_mask[:, -t:] != 0).cpu()
        prompt_lens = None
        if self.prompt_lengths is not None and self.columns + t <= self._prompt_columns:
            n = len(self.prompt_lengths)
            if n != rows:
                # generate() repeats each prompt row (repeat_interleave) for num_return_sequences after it
                # handed over the prompt: each row's length, repeated the same way.
                if rows % n:
                    raise ValueError("the prompt had %d rows but the forward has %d" % (n, rows))
                self.prompt_lengths = [x for x in self.prompt_lengths for _ in range(rows // n)]
            prompt_lens = self.prompt_lengths
        self._forward = _Forward(valid, self.lengths, prompt_lens)

    def _end(self, t, ok):
        f, self._forward = self._forward, None
        if not ok:
            # Some layers may have taken this forward's tokens and others not.
            self._broken = "a forward failed after some of its layers reached attnd"
            return
        self.columns += t
        for b, n in enumerate(f.tokens):
            self.lengths[b] += n

    def attend(self, layer, q, k, v):
        """q [B, T, Hq, D], k and v [B, T, Hkv, D] before the rotary -> the attention output [B, T, Hq, D]."""
        f = self._forward
        if f is None:
            raise RuntimeError("attention ran outside a forward of the attached model")
        transport = self._attachment.transport
        rows, t = q.shape[0], q.shape[1]
        timed = self._attachment.timed
        if timed and q.is_cuda:
            torch.cuda.current_stream(q.device).synchronize()
        start = time.perf_counter()
        if f.decode:
            take = [b for b in range(rows) if f.tokens[b]]
            seqs = [self.sequence_ids[b] for b in take]
            if len(take) == rows:
                out = transport.decode(layer, seqs, q[:, 0], k[:, 0], v[:, 0]).view(rows, 1, *q.shape[2:])
            else:
                out = torch.zeros_like(q)
                if take:
                    ix = torch.tensor(take, device=q.device)
                    out[ix, 0] = transport.decode(layer, seqs, q[ix, 0], k[ix, 0], v[ix, 0])
            self.stats.decode_calls += 1
        else:
            out = torch.empty_like(q) if all(n == t for n in f.tokens) else torch.zeros_like(q)
            for b in range(rows):
                n = f.tokens[b]
                if not n:
                    continue
                # A forward sent in several calls must name its whole length in each (docs/DCA.md).
                prompt_len = f.prompt_lens[b] if f.prompt_lens is not None else self.lengths[b] + n
                ix = f.index[b]
                if ix is None:
                    transport.prefill(self.sequence_ids[b], layer, q[b], k[b], v[b], prompt_len, out[b])
                else:
                    ix = ix.to(q.device)
                    o = torch.empty((n,) + tuple(q.shape[2:]), dtype=q.dtype, device=q.device)
                    transport.prefill(self.sequence_ids[b], layer, q[b, ix], k[b, ix], v[b, ix], prompt_len, o)
                    out[b, ix] = o
                self.stats.prefill_calls += 1
        if timed and q.is_cuda:
            torch.cuda.current_stream(q.device).synchronize()
        if f.decode:
            self.stats.decode_seconds += time.perf_counter() - start
        else:
            self.stats.prefill_seconds += time.perf_counter() - start
        return out

    def __repr__(self):
        return "AttndCache(sequences=%s, columns=%d)" % (self.sequence_ids, self.columns)


def _release_all(client, ids):
    for seq in ids:
        try:
            client.release(seq)
        except Exception:  # noqa: BLE001 - best effort: a sequence already gone (idle timeout) is fine
            pass


# -- the attention module -----------------------------------------------------------------------------------------

class AttndAttention(torch.nn.Module):
    """A decoder layer's attention with attnd doing the attention: the layer's own q/k/v/o projections (the same
    parameters, so state_dict names are unchanged) around one attnd call per forward."""

    def __init__(self, original, layer_idx, attachment):
        super().__init__()
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(self, name, getattr(original, name))
        self.layer_idx = layer_idx
        g = attachment.geometry
        self.num_heads, self.num_kv_heads, self.head_dim = g["num_q_heads"], g["num_kv_heads"], g["head_dim"]
        self._attachment = attachment
        self._original = (original,)  # a tuple: not registered as a submodule

    def forward(self, hidden_states, *args, **kwargs):
        cache = self._attachment.active_cache
        if cache is None:
            raise RuntimeError("attnd attention ran outside the attached model's forward")
        b, t = hidden_states.shape[:2]
        q = self.q_proj(hidden_states).view(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(hidden_states).view(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(hidden_states).view(b, t, self.num_kv_heads, self.head_dim)
        out = cache.attend(self.layer_idx, q.contiguous(), k.contiguous(), v.contiguous())
        return self.o_proj(out.reshape(b, t, self.num_heads * self.head_dim)), None


# -- attach -------------------------------------------------------------------------------------------------------

def _decoder(model):
    """The module holding the decoder layers (`model.model` for Qwen2ForCausalLM, or the model itself)."""
    for candidate in (getattr(model, "model", None), model):
        layers = getattr(candidate, "layers", None)
        if layers is not None and len(layers) and hasattr(layers[0], "self_attn"):
            return candidate
    raise TypeError("attnd.transformers: %s has no decoder layers with self_attn (a Qwen2-architecture model, "
                    "e.g. Qwen2ForCausalLM, is expected)" % type(model).__name__)


if _hf is not None:
    def _no_attention_function(*args, **kwargs):
        raise RuntimeError("the attnd attention implementation runs only in layers attach() replaced")

    try:
        from transformers import AttentionInterface as _AttentionInterface
        _AttentionInterface.register(IMPLEMENTATION, _no_attention_function)
    except (ImportError, AttributeError):  # pragma: no cover - older transformers
        _AttentionInterface = None


class Attachment:
    """What attach() did to a model; detach() undoes it."""

    def __init__(self, model, client, info, geometry, transport, max_tokens, timed, spin_us=1000,
                 device_events=True):
        self.model = model
        self.client = client
        self.info = info
        self.geometry = geometry
        self.timed = timed
        self.active_cache = None
        self._decoder = _decoder(model)
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        if self.dtype not in _WIRE_DTYPES:
            raise TypeError("attnd.transformers: the model's dtype is %s; attnd takes float32, float16 or bfloat16"
                            % self.dtype)
        self.transport = _open_transport(client, info, geometry, self.device, self.dtype, transport, max_tokens,
                                         spin_us, device_events)
        self._replaced = []
        self._saved = {}
        try:
            self._install()
        except BaseException:
            self.detach()
            raise

    def new_cache(self):
        """A fresh AttndCache for this model (pass it as past_key_values to keep sequences across calls)."""
        return AttndCache(self)

    def _install(self):
        for i, layer in enumerate(self._decoder.layers):
            original = layer.self_attn
            layer.self_attn = AttndAttention(original, getattr(original, "layer_idx", i), self)
            self._replaced.append((layer, original))
        forward = self._decoder.forward
        self._saved["forward"] = forward
        self._decoder.forward = self._wrap_forward(forward)
        generate = getattr(self.model, "generate", None)
        if generate is not None:
            self._saved["generate"] = generate
            self.model.generate = self._wrap_generate(generate)
        config = getattr(self.model, "config", None)
        if _hf is not None and config is not None and hasattr(config, "_attn_implementation"):
            # A registered implementation without a mask function: transformers builds no attention mask
            # (attnd needs none: it reads padding from the 2D mask and causality is its own).
            self._saved["attn_implementation"] = config._attn_implementation
            _set_implementation(self.model, IMPLEMENTATION)

    def detach(self):
        """Puts the original attention modules, forward, generate and attention implementation back."""
        for layer, original in self._replaced:
            layer.self_attn = original
        self._replaced = []
        if "forward" in self._saved:
            del self._decoder.forward  # the instance attribute; the class's method shows again
        if "generate" in self._saved:
            del self.model.generate
        if "attn_implementation" in self._saved:
            _set_implementation(self.model, self._saved["attn_implementation"])
        self._saved = {}
        if getattr(self, "transport", None) is not None:
            self.transport.close()
            self.transport = None
        if getattr(self.model, "_attnd", None) is self:
            del self.model._attnd

    def _wrap_forward(self, forward):
        signature = inspect.signature(forward)
        var_keyword = next((p.name for p in signature.parameters.values() if p.kind == p.VAR_KEYWORD), None)
        if any(p.kind in (p.POSITIONAL_ONLY, p.VAR_POSITIONAL) for p in signature.parameters.values()):
            raise TypeError("attnd.transformers: %s.forward takes positional-only arguments"
                            % type(self._decoder).__name__)
        if "past_key_values" not in signature.parameters:
            raise TypeError("attnd.transformers: %s.forward takes no past_key_values" % type(self._decoder).__name__)
        attachment = self

        def attnd_forward(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            arguments = bound.arguments
            extra = arguments.get(var_keyword, {}) if var_keyword else {}
            cache = arguments.get("past_key_values")
            one_shot = False
            if not isinstance(cache, AttndCache):
                if cache is not None and cache.get_seq_length() > 0:
                    raise ValueError("attnd.transformers: past_key_values holds K/V of another cache; an attached "
                                     "model keeps its K/V in attnd (pass an AttndCache, or none)")
                cache = attachment.new_cache()
                use_cache = arguments.get("use_cache", extra.get("use_cache"))
                one_shot = use_cache is False
                arguments["past_key_values"] = cache
            tokens = arguments.get("input_ids")
            if tokens is None:
                tokens = arguments.get("inputs_embeds")
            rows, t = int(tokens.shape[0]), int(tokens.shape[1])
            mask = arguments.get("attention_mask")
            if isinstance(mask, dict) or (mask is not None and mask.dim() != 2):
                raise ValueError("attnd.transformers needs the 2D attention mask (got a prepared mask)")
            if cache.columns == 0 and cache.prompt_lengths is None:
                cache.set_prompt(mask, tokens if mask is None else None)
            cache._begin(mask, rows, t)
            attachment.active_cache = cache
            ok = False
            # Everything by name: decorators around transformers' forward fill in defaults by name, and a value
            # passed by position as well would arrive twice.
            named = {k: v for k, v in arguments.items() if k != var_keyword}
            named.update(arguments.get(var_keyword, {}) if var_keyword else {})
            try:
                result = forward(**named)
                ok = True
            finally:
                attachment.active_cache = None
                cache._end(t, ok)
                if one_shot:
                    cache.release()
            return result

        attnd_forward.__signature__ = signature
        return attnd_forward

    def _wrap_generate(self, generate):
        attachment = self

        def attnd_generate(*args, **kwargs):
            cache = kwargs.get("past_key_values")
            own = cache is None
            if own:
                cache = attachment.new_cache()
                kwargs["past_key_values"] = cache
            if isinstance(cache, AttndCache) and cache.columns == 0:
                inputs = kwargs.get("input_ids", kwargs.get("inputs", args[0] if args else None))
                cache.set_prompt(kwargs.get("attention_mask"), inputs)
            try:
                return generate(*args, **kwargs)
            finally:
                if own:
                    cache.release()

        return attnd_generate


def _set_implementation(model, name):
    setter = getattr(model, "set_attn_implementation", None)
    if setter is not None:
        try:
            setter(name)
            return
        except (ValueError, ImportError, TypeError):
            pass
    model.config._attn_implementation = name


def attach(model, client, *, transport="auto", max_tokens_per_call=8192, timed=False, spin_us=1000,
           device_events=True):
    """Makes `model` (a Qwen2-architecture transformers model, or one shaped like it) run its attention in attnd
    through `client` (attnd.Client). Checks the model's config against the daemon's GetServerInfo and raises
    GeometryMismatch naming the field that differs. transport: "auto" (same host and a CUDA model: CUDA IPC
    staging through a ring; otherwise bytes over a ring when attnd is on this host, else gRPC), "grpc", "ring",
    "cuda-ipc" or "ring-cuda-ipc". max_tokens_per_call: the most tokens of one sequence per prefill call (longer
    forwards are sent in pieces). timed: synchronize the device around attnd calls so cache.stats.attnd_seconds
    is exact (costs a little). spin_us: a ring client spins this long on each answer before it sleeps (the model
    waits for the answer anyway; a sleeping client wakes tens of microseconds late). device_events: with CUDA
    staging through a ring, order each call on the GPU by the ring's events where attnd offers them (no host
    synchronisation per layer; docs/regions.md, "Device-ordered rings"); False: synchronize the host as on
    other transports. Returns an Attachment
    (detach() undoes it); `model._attnd` holds it."""
    if getattr(model, "_attnd", None) is not None:
        raise ValueError("this model is already attached to attnd (model._attnd.detach() first)")
    if _hf is not None and isinstance(model, _hf.PreTrainedModel) and _HfCacheLayer is None:
        raise ImportError("attnd.transformers needs transformers >= 5.0 (found %s); tested with %s"
                          % (_hf.__version__, TESTED_TRANSFORMERS))
    info = client.info()
    geometry = check_geometry(model.config, info)
    attachment = Attachment(model, client, info, geometry, transport, int(max_tokens_per_call), timed,
                            int(spin_us), bool(device_events))
    model._attnd = attachment
    return attachment

