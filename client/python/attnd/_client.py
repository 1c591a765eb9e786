"""The attnd client: one gRPC channel, unary calls and the streaming Session."""
import collections
import os
import queue
import time

import grpc
import numpy as np

from ._errors import AttndError, invalid_argument, status_code_from_int
from ._proto import pb, pb_grpc
from . import _regions, _ring, _tensors, _wire

# gRPC Python caps received messages at 4 MiB by default; prefill outputs are larger. The server enforces its
# own limit (GetServerInfo().limits.max_message_bytes) and answers RESOURCE_EXHAUSTED above it.
_DEFAULT_OPTIONS = (
    ("grpc.max_receive_message_length", -1),
    ("grpc.max_send_message_length", -1),
)


def _read_pem(value):
    if value is None:
        return None
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if isinstance(value, str) and "-----BEGIN" in value:
        return value.encode()
    with open(os.fspath(value), "rb") as f:
        return f.read()


_Q_LAYOUTS = {"variants": 0, "pre_rotary": 1}


def _q_layout(value):
    """"variants" | "pre_rotary" (or an attnd.v1.QLayout value) -> the wire value."""
    if isinstance(value, str):
        if value not in _Q_LAYOUTS:
            raise invalid_argument("q_layout must be 'variants' or 'pre_rotary', got %r" % value)
        return _Q_LAYOUTS[value]
    return int(value)


def _tensor_arg(x, name, regions, used):
    """-> ((array or RegionTensor, DType), Like): a reference when x lies in a registered region."""
    ref, region = _regions.find_ref(regions, x)
    if ref is not None:
        used.append(region)
        return (ref, ref.dtype), region.like(x)
    a, dt, like = _tensors.to_numpy(x, name)
    return (a, dt), like


def _batch_arg(x, name, regions, used, n):
    """-> ([(array or RegionTensor, DType)] per row, Like) for a [n, ...] batch."""
    ref, region = _regions.find_ref(regions, x)
    if ref is not None:
        used.append(region)
        return [(r, r.dtype) for r in _regions.row_refs(ref, n)], region.like(x)
    return _tensors.split_arrays(x, name, n)


def _out_ref(out, regions, used):
    if out is None:
        return None
    ref, region = _regions.find_ref(regions, out)
    if ref is None:
        raise invalid_argument("out= must be a C-contiguous array inside a region this client registered (a "
                               "ShmRegion.ndarray view or a CUDA tensor in a register_cuda region), in the "
                               "request's dtype")
    used.append(region)
    return ref


def _sync(used):
    """Device work that wrote a CUDA region must be finished before attnd reads it."""
    done = set()
    for r in used:
        if id(r) not in done:
            done.add(id(r))
            r.sync()


def _prefill_request(seq, layer, q, k, v, prompt_len, q_layout="variants", regions=(), out=None):
    """-> (serialized attnd.v1.PrefillRequest as a _wire.Msg, Like of q)."""
    if not isinstance(seq, str):
        raise invalid_argument("sequence id must be a str, got %s" % type(seq).__name__)
    used = []
    qa, like = _tensor_arg(q, "q", regions, used)
    ka, _ = _tensor_arg(k, "k", regions, used)
    va, _ = _tensor_arg(v, "v", regions, used)
    output = _out_ref(out, regions, used)
    _sync(used)
    return _wire.prefill_request(seq, int(layer), qa, ka, va, prompt_len, _q_layout(q_layout), output), like


def _decode_request(layer, seqs, q, k, v, q_layout="variants", regions=(), out=None):
    """-> (serialized attnd.v1.DecodeRequest as a _wire.Msg, Like of q)."""
    if isinstance(seqs, str):
        seqs = [seqs]
    seqs = list(seqs)
    if not seqs:
        raise invalid_argument("decode needs at least one sequence")
    for s in seqs:
        if not isinstance(s, str):
            raise invalid_argument("sequence id must be a str, got %s" % type(s).__name__)
    if isinstance(q_layout, (str, int)):
        layouts = [_q_layout(q_layout)] * len(seqs)
    else:  # one per sequence: a batch may mix layouts
        layouts = [_q_layout(x) for x in q_layout]
        if len(layouts) != len(seqs):
            raise invalid_argument("q_layout: %d layouts for %d sequences" % (len(layouts), len(seqs)))
    used = []
    if len(set(layouts)) == 1 and out is None:
        packed = _decode_request_packed(int(layer), seqs, q, k, v, layouts[0], regions)
        if packed is not None:
            return packed
    ks, _ = _batch_arg(k, "k", regions, used, len(seqs))
    vs, _ = _batch_arg(v, "v", regions, used, len(seqs))
    if len(set(layouts)) == 1:
        qs, like = _batch_arg(q, "q", regions, used, len(seqs))
    else:  # mixed layouts have differently shaped q rows: a list of per-sequence arrays
        if len(q) != len(seqs):
            raise invalid_argument("q: %d rows for %d sequences" % (len(q), len(seqs)))
        qs, like = [], None
        for i, row in enumerate(q):
            a, row_like = _tensor_arg(row, "q[%d]" % i, regions, used)
            qs.append(a)
            like = like or row_like
    outs = [None] * len(seqs)
    output = _out_ref(out, regions, used)
    if output is not None:
        outs = _regions.row_refs(output, len(seqs))
    _sync(used)
    return _wire.decode_request(int(layer), list(zip(seqs, qs, ks, vs, layouts, outs))), like


def _decode_request_packed(layer, seqs, q, k, v, q_layout, regions):
    """(packed message, Like) when q/k/v travel as bytes (none lies in a registered region), else None (the
    caller builds the entries form, which carries region references)."""
    arrays = []
    for x, name in ((q, "q"), (k, "k"), (v, "v")):
        if regions and _regions.find_ref(regions, x)[0] is not None:
            return None
        a, dt, like = _tensors.to_numpy(x, name)
        if a.ndim < 1 or a.shape[0] != len(seqs):
            raise invalid_argument("%s: expected a leading batch dimension of %d (one per sequence), got shape %s"
                                   % (name, len(seqs), list(a.shape)))
        arrays.append((a, dt))
        if name == "q":
            q_like = like
    return _wire.decode_request_packed(layer, seqs, *arrays, q_layout), q_like


def _bad_output(message):
    return AttndError(grpc.StatusCode.INTERNAL, message)


def _prefill_output(mv, start, end, like, out=None):
    t, length = _wire.parse_prefill_response(mv, start, end)
    if out is not None:
        if not t.region:
            raise _bad_output("server returned the output's bytes instead of writing the output region")
        return out, length
    if t.region:
        raise _bad_output("server wrote the output to a region the request did not name")
    return _tensors.from_proto(t, like), length


def _decode_output(mv, start, end, like, out=None):
    packed = _wire.parse_packed_decode_response(mv, start, end)
    if packed is not None:  # the answer to a packed request: o [B, Hq, D] as a view, no per-entry work
        t, lengths = packed
        if t.region:
            raise _bad_output("server wrote the output to a region the request did not name")
        result = _tensors.from_proto(t, like)
        if len(t.shape) != 3 or t.shape[0] != len(lengths):
            raise _bad_output("server returned a packed output of shape %s with %d lengths"
                              % (list(t.shape), len(lengths)))
        return result, lengths.tolist()
    outputs = _wire.parse_decode_response(mv, start, end)
    if out is not None:
        if not outputs or not all(t.region for t, _ in outputs):
            raise _bad_output("server returned output bytes instead of writing the output region")
        return out, [n for _, n in outputs]
    if any(t.region for t, _ in outputs):
        raise _bad_output("server wrote an output to a region the request did not name")
    return _tensors.from_protos([t for t, _ in outputs], like), [n for _, n in outputs]


# Bytes a Prefill message adds to its tensors (ids, shapes, tags), as the server's rule counts them.
_FRAMING = 1024


def _with_prefill_limit_hint(err):
    """gRPC's own refusal of a large message names no attnd limit: say where the client reads them."""
    if err.code is not grpc.StatusCode.RESOURCE_EXHAUSTED or "larger than max" not in err.message:
        return err
    return AttndError(err.code, err.message + "; a Prefill message must fit the server's "
                      "GetServerInfo().limits.max_message_bytes: send the prompt in calls of at most "
                      "limits.max_prefill_tokens_per_call tokens (any encoding), or Client.max_prefill_tokens() "
                      "for yours")


def _element_size(dtype):
    """Bytes per element on the wire: 2 for bf16 (a "bfloat16" name, torch or ml_dtypes, or uint16 bits)."""
    name = str(dtype).replace("torch.", "")
    if name in ("bfloat16", "bf16"):
        return 2
    return np.dtype(name).itemsize


class Client:
    """A connection to one attnd server.

    Args:
      target: "host:port" (any gRPC target string).
      token: if given, every call carries the metadata ``authorization: Bearer <token>``.
      root_cert: if given, the channel uses TLS with this root certificate: PEM bytes, a PEM string, or a path
        to a PEM file. Without it the channel is plaintext.
      timeout: default deadline in seconds for each unary call (None: no deadline).
      options: extra gRPC channel options, e.g. (("grpc.ssl_target_name_override", "attnd.local"),).
      client_cert, client_key: PEM (bytes, string or path) for mutual TLS.

    Tensors: q/k/v may be numpy arrays (float32, float16, or uint16 holding bfloat16 bits) or torch tensors
    (float32, float16, bfloat16). Outputs come back in the representation of the request's q.
    Every failure raises AttndError (.code: grpc.StatusCode, .message).
    A Client may be shared by threads (gRPC channels are thread safe); a Session may not.
    """

    def __init__(self, target, token=None, root_cert=None, *, timeout=None, options=(), client_cert=None,
                 client_key=None):
        self.target = target
        self.timeout = timeout
        self._metadata = (("authorization", "Bearer " + token),) if token else None
        opts = list(_DEFAULT_OPTIONS) + list(options or ())
        if root_cert is not None or client_cert is not None:
            creds = grpc.ssl_channel_credentials(root_certificates=_read_pem(root_cert),
                                                 private_key=_read_pem(client_key),
                                                 certificate_chain=_read_pem(client_cert))
            self._channel = grpc.secure_channel(target, creds, options=opts)
        else:
            self._channel = grpc.insecure_channel(target, options=opts)
        self._stub = pb_grpc.AttentionStub(self._channel)
        # The tensor-carrying RPCs take and return raw bytes: _wire encodes requests straight from the arrays'
        # buffers and decodes outputs as views into the response (see _wire.py for why).
        self._prefill = self._channel.unary_unary("/attnd.v1.Attention/Prefill")
        self._decode = self._channel.unary_unary("/attnd.v1.Attention/Decode")
        self._session = self._channel.stream_stream("/attnd.v1.Attention/Session")
        self._regions = []  # ShmRegion / CudaRegion objects registered and not yet unregistered

    @property
    def stub(self):
        """The generated attnd.v1 AttentionStub on this channel, for anything the methods do not cover."""
        return self._stub

    # -- lifecycle --
    def close(self):
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _call(self, method, request, timeout):
        try:
            return method(request, timeout=self.timeout if timeout is None else timeout, metadata=self._metadata)
        except grpc.RpcError as err:
            raise AttndError.from_rpc_error(err) from None

    def wait_ready(self, timeout=30.0, interval=0.05):
        """Polls GetServerInfo until it answers OK; returns its response. Raises AttndError on timeout.

        UNAVAILABLE (not listening yet, starting, draining) is retried; any other error is raised at once.
        """
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                return self.info(timeout=max(0.05, min(left, 2.0)))
            except AttndError as err:
                if err.code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise
                if time.monotonic() + interval >= deadline:
                    raise AttndError(err.code, "server at %s not ready after %.1fs: %s"
                                     % (self.target, timeout, err.message)) from None
            time.sleep(interval)

    # -- unary RPCs --
    def info(self, timeout=None):
        """GetServerInfo: the attnd.v1.GetServerInfoResponse (version, backend, model geometry, dca config,
        kv_cache accounting, live_sequences, limits)."""
        return self._call(self._stub.GetServerInfo, pb.GetServerInfoRequest(), timeout)

    def max_prefill_tokens(self, dtype="bfloat16", q_layout="variants", info=None, timeout=None):
        """The most tokens one prefill may carry with q, k and v inline in `dtype` ("bfloat16", "float16",
        "float32", or a numpy / torch dtype; uint16 is bf16 bits) and `q_layout`: what the
        server's limits.max_message_bytes allows for the model's geometry (the rule of
        Limits.max_prefill_tokens_per_call, which itself holds for every encoding). Send a longer prompt in
        calls of at most this many tokens (the same prompt_len in each); tensors in registered regions travel
        outside the message. info: a GetServerInfo response to use instead of asking the server."""
        info = self.info(timeout) if info is None else info
        m = info.model
        q_rows = 1 if _q_layout(q_layout) == pb.Q_LAYOUT_PRE_ROTARY else 5
        per_token = (q_rows * m.num_q_heads + 2 * m.num_kv_heads) * m.head_dim * _element_size(dtype)
        limit = info.limits.max_message_bytes
        return 0 if per_token <= 0 or limit <= _FRAMING else (limit - _FRAMING) // per_token

    def create_sequence(self, timeout=None):
        """A new empty sequence; returns its id (32 hex characters, after "<instance>." on a daemon started with
        --instance-name; treat it as a secret capability)."""
        return self._call(self._stub.CreateSequence, pb.CreateSequenceRequest(), timeout).sequence_id

    def release(self, seq, timeout=None):
        """Frees a sequence's pages; returns how many pages went back to the pool."""
        return self._call(self._stub.ReleaseSequence, pb.ReleaseSequenceRequest(sequence_id=seq),
                          timeout).pages_freed

    def prefill(self, seq, layer, q, k, v, prompt_len=None, timeout=None, return_length=False,
                q_layout="variants", out=None):
        """Appends T tokens to one layer of a sequence and returns their attention output.

        q [T, 5, Hq, D] (intra, succ, inter, succ_critical, inter_critical), k/v [T, Hkv, D] -> out [T, Hq, D]
        in q's dtype and kind. q_layout="pre_rotary": q [T, Hq, D] and k before the rotary embedding; the
        server applies the dual-chunk rotary (docs/rotary.md). prompt_len: the whole prompt's length when the
        prompt is sent in several calls (the same value in every call). return_length=True returns (out, layer
        length after the call).
        Regions (docs/regions.md): q/k/v that lie in a region this client registered (register_shm views,
        CUDA tensors in register_cuda regions) travel as references, not bytes. out=: an array in such a
        region, [T, Hq, D] in q's dtype: attnd writes the output there and `out` itself is returned.
        """
        req, like = _prefill_request(seq, layer, q, k, v, prompt_len, q_layout, self._regions, out)
        try:
            resp = self._call(self._prefill, req.tobytes(), timeout)
        except AttndError as err:
            raise _with_prefill_limit_hint(err) from None
        mv = memoryview(resp)
        result, length = _prefill_output(mv, 0, len(mv), like, out)
        return (result, length) if return_length else result

    def decode(self, layer, seqs, q, k, v, timeout=None, return_lengths=False, q_layout="variants", out=None):
        """One decode step of a batch of sequences in one layer (all or nothing).

        seqs: B sequence ids (each at most once); q [B, 3 or 5, Hq, D], k/v [B, Hkv, D] -> out [B, Hq, D].
        q_layout="pre_rotary": q [B, Hq, D] and k before the rotary; a list of B layouts mixes them per
        sequence (then q is a list of B arrays, [3 or 5, Hq, D] or [Hq, D]).
        return_lengths=True returns (out, [layer length after the token, per sequence]).
        Regions: as prefill; out= is [B, Hq, D] in a registered region (row i is entry i's output).
        """
        req, like = _decode_request(layer, seqs, q, k, v, q_layout, self._regions, out)
        resp = self._call(self._decode, req.tobytes(), timeout)
        mv = memoryview(resp)
        result, lengths = _decode_output(mv, 0, len(mv), like, out)
        return (result, lengths) if return_lengths else result

    # -- tensor regions (docs/regions.md) --
    def register_shm(self, size, timeout=None):
        """A new POSIX shared-memory object of `size` bytes, registered with attnd: a ShmRegion (use as a
        context manager). Numpy views from region.ndarray(shape, dtype) passed as q/k/v/out travel as
        references."""
        return _regions.ShmRegion(self, size, timeout)

    def register_cuda(self, tensor, timeout=None):
        """Registers a torch CUDA tensor's allocation (CUDA IPC; the server must run the CUDA backend on this
        host and GPU): a CudaRegion (a context manager). CUDA tensors inside it travel as references."""
        return _regions.CudaRegion(self, tensor, timeout)

    def register_shm_name(self, name, offset, size, timeout=None):
        """RegisterRegion of an existing shm object (a name for shm_open); returns the region id."""
        return self._register(pb.RegisterRegionRequest(
            system_shm=pb.SystemShmRegion(name=name, offset=offset, byte_size=size)), timeout)

    def unregister_region(self, region_id, timeout=None):
        self._unregister(region_id, timeout)

    def _register(self, request, timeout):
        return self._call(self._stub.RegisterRegion, request, timeout).region_id

    def _unregister(self, region_id, timeout):
        self._call(self._stub.UnregisterRegion, pb.UnregisterRegionRequest(region_id=region_id), timeout)

    def ring(self, half_bytes=8 << 20, spin_us=50, sleep_slice=0.01, timeout=60.0, rpc_timeout=None, version=1,
             device_events=False, slots=1):
        """A shared-memory ring to attnd on this host (docs/regions.md, "Rings"): a Ring (a context manager) whose
        prefill()/decode() are Session's through shared memory with a futex doorbell, no gRPC call per request.
        half_bytes: the largest request and answer (minus 8 bytes); spin_us: how long to spin on the answer
        before sleeping on the futex; timeout: seconds per round trip; version: 1 carries protobuf messages,
        2 binary frames (one frame per request, built once per request shape; region references and out= in
        the packed decode form); device_events (version 2, CUDA backend): requests whose q, k, v and out all
        lie in CUDA regions are ordered on the GPU with the current stream instead of by host synchronisation
        (docs/regions.md, "Device-ordered rings"); slots (version 2, a power of two up to 16, at most
        info().regions.max_ring_slots): requests in flight at once, ring.submit_decode() posting without waiting.
        x86-64 only."""
        return _ring.Ring(self, half_bytes, spin_us, sleep_slice, timeout, rpc_timeout, version, device_events,
                          slots)

    # -- streaming --
    def session(self, timeout=None):
        """A Session over one Session stream: use as a context manager.

            with client.session() as s:
                out = s.prefill(seq, layer, q, k, v)
                out = s.decode(layer, seqs, q, k, v)

        timeout: a deadline in seconds for the whole stream (None: none).
        """
        return Session(self, timeout)


class Pending:
    """A request sent on a Session whose answer has not been read yet. result() waits for it."""
    __slots__ = ("_session", "tag", "_kind", "_like", "_out", "_done", "_value", "_error")

    def __init__(self, session, tag, kind, like, out=None):
        self._session, self.tag, self._kind, self._like, self._out = session, tag, kind, like, out
        self._done, self._value, self._error = False, None, None

    def done(self):
        return self._done

    def result(self):
        """The output array/tensor; raises AttndError if the request failed."""
        while not self._done:
            self._session._read_one()
        if self._error is not None:
            raise self._error
        return self._value

    def _resolve(self, code, message, kind, span, mv):
        self._done = True
        if code != 0:
            self._error = AttndError(status_code_from_int(code), message)
            return
        try:
            if kind != self._kind:
                raise AttndError(grpc.StatusCode.INTERNAL, "session answered a %s with %s" % (self._kind, kind))
            if kind == "prefill":
                self._value = _prefill_output(mv, span[0], span[1], self._like, self._out)[0]
            else:
                self._value = _decode_output(mv, span[0], span[1], self._like, self._out)[0]
        except AttndError as err:
            self._error = err

    def _fail(self, err):
        self._done, self._error = True, err


_CLOSE = object()


class Session:
    """Prefill and Decode requests over one bidirectional stream, answered in order.

    prefill()/decode() send a request and wait for its answer. submit_prefill()/submit_decode() only send and
    return a Pending, so several requests can be in flight (pipelining); read their results in any order (the
    answers are read from the stream in request order). A failed request raises AttndError from its result and
    the stream continues. Not thread safe: use one Session per thread.
    """

    def __init__(self, client, timeout=None):
        self._client = client
        self._requests = queue.Queue()
        self._pending = collections.deque()
        self._next_tag = 1
        self._closed = False
        self._broken = None
        try:
            self._call = client._session(self._request_iter(), timeout=timeout, metadata=client._metadata)
        except grpc.RpcError as err:
            raise AttndError.from_rpc_error(err) from None
        self._responses = iter(self._call)

    def _request_iter(self):
        # Runs on gRPC's sending thread. The timeout lets it end if the call dies without close()/cancel()
        # (e.g. the channel was closed or the Session dropped), instead of blocking that thread forever.
        while True:
            try:
                item = self._requests.get(timeout=1.0)
            except queue.Empty:
                call = getattr(self, "_call", None)
                if call is not None and call.done():
                    return
                continue
            if item is _CLOSE:
                return
            yield item

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            self.cancel()
        else:
            self.close()

    def _send(self, kind, like, out=None, **body):
        if self._closed:
            raise AttndError(grpc.StatusCode.FAILED_PRECONDITION, "the session is closed")
        if self._broken is not None:
            raise self._broken
        tag = self._next_tag
        self._next_tag += 1
        pending = Pending(self, tag, kind, like, out)
        self._pending.append(pending)
        self._requests.put(_wire.session_request(tag, **body).tobytes())
        return pending

    def _read_one(self):
        """Reads the next answer from the stream and hands it to the oldest pending request."""
        if not self._pending:
            raise AttndError(grpc.StatusCode.FAILED_PRECONDITION, "no request is waiting for an answer")
        if self._broken is not None:
            self._fail_all(self._broken)
            return
        try:
            resp = next(self._responses)
        except StopIteration:
            self._broken = AttndError(grpc.StatusCode.UNAVAILABLE, "the session stream ended with requests "
                                      "unanswered")
            self._fail_all(self._broken)
            return
        except grpc.RpcError as err:
            self._broken = AttndError.from_rpc_error(err)
            self._fail_all(self._broken)
            return
        pending = self._pending.popleft()
        mv = memoryview(resp)
        try:
            tag, code, message, kind, span = _wire.parse_session_response(mv)
        except AttndError as err:
            self._broken = err
            pending._fail(err)
            self._fail_all(err)
            return
        if tag != pending.tag:
            self._broken = AttndError(grpc.StatusCode.INTERNAL, "session answer out of order: tag %d, expected %d"
                                      % (tag, pending.tag))
            pending._fail(self._broken)
            self._fail_all(self._broken)
            return
        pending._resolve(code, message, kind, span, mv)

    def _fail_all(self, err):
        while self._pending:
            self._pending.popleft()._fail(err)

    def submit_prefill(self, seq, layer, q, k, v, prompt_len=None, q_layout="variants", out=None):
        req, like = _prefill_request(seq, layer, q, k, v, prompt_len, q_layout, self._client._regions, out)
        return self._send("prefill", like, out, prefill=req)

    def submit_decode(self, layer, seqs, q, k, v, q_layout="variants", out=None):
        req, like = _decode_request(layer, seqs, q, k, v, q_layout, self._client._regions, out)
        return self._send("decode", like, out, decode=req)

    def prefill(self, seq, layer, q, k, v, prompt_len=None, q_layout="variants", out=None):
        """As Client.prefill, over the stream (region references and out= included)."""
        return self.submit_prefill(seq, layer, q, k, v, prompt_len, q_layout, out).result()

    def decode(self, layer, seqs, q, k, v, q_layout="variants", out=None):
        """As Client.decode, over the stream."""
        return self.submit_decode(layer, seqs, q, k, v, q_layout, out).result()

    def close(self):
        """Reads the answers still owed, half-closes the stream and waits for it to end with OK.

        Raises AttndError if the stream itself failed (requests that failed individually raise from their
        Pending.result(), not here)."""
        if self._closed:
            return
        while self._pending and self._broken is None:
            self._read_one()
        self._closed = True
        self._requests.put(_CLOSE)
        if self._broken is not None:
            self._call.cancel()
            raise self._broken
        try:
            for resp in self._responses:
                raise AttndError(grpc.StatusCode.INTERNAL, "unexpected session answer with tag %d"
                                 % _wire.parse_session_response(memoryview(resp))[0])
        except grpc.RpcError as err:
            raise AttndError.from_rpc_error(err) from None

    def cancel(self):
        """Abandons the stream (answers still owed fail with CANCELLED)."""
        if not self._closed:
            self._closed = True
            self._requests.put(_CLOSE)
            self._call.cancel()
            self._fail_all(AttndError(grpc.StatusCode.CANCELLED, "the session was cancelled"))
