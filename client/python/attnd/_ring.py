"""The shared-memory ring from Python (docs/regions.md, "Rings"; the layout is proto/attnd/v1/shm_ring.h).

A Ring carries Prefill and Decode requests as serialized SessionRequests (version 1) or binary frames (version
2) through a POSIX shm object that this process creates and attnd maps (OpenRing), with a futex doorbell: no gRPC
call, no extension module. One request at a time, or with `slots` S > 1 (version 2) up to S in flight, request n
in slot n % S. The request is written from the arrays' buffers straight into its slot's request half; the answer
is parsed where it lies in the slot's response half and the output copied out once (request n + S overwrites
the half).

Memory ordering. The header's words are std::atomic<uint32_t> on attnd's side; here they are read and written
through a memoryview cast to "I", whose item access is one aligned 4-byte load or store (CPython packs and
unpacks a single item with a fixed-size memcpy, a single mov; the words are 64-byte aligned in a page-aligned
mapping). The ring is driven only on x86-64, whose memory model (x86-TSO) makes every plain load an acquire and
every plain store a release: the request bytes written before request_seq are visible to attnd once it sees the
new request_seq, and the response bytes attnd wrote before response_seq are visible here once we see it. The
Python interpreter cannot reorder them either (each access is a separate call into C). The one reordering TSO
allows, a later load passing an earlier store, matters twice, where the C++ side uses seq_cst: after storing
request_seq we read server_sleeping, and after storing client_sleeping we read response_seq (each side stores
its word and reads the other's, so without a full barrier both could miss each other and the doorbell would not
ring; attnd would then answer only after its 100 ms futex slice). There a full barrier is taken by acquiring and
releasing an uncontended lock: acquiring a lock is an atomic read-modify-write, and on x86-64 every such
instruction is LOCK-prefixed, which orders all earlier stores before all later loads. Other architectures are
refused with FAILED_PRECONDITION (their plain accesses are not ordered; use Session or regions there).
"""
import collections
import ctypes
import ctypes.util
import mmap
import os
import platform
import struct
import threading
import time
import weakref

import grpc
import numpy as np

from ._errors import AttndError, invalid_argument
from ._proto import pb
from . import _regions, _tensors, _wire

# proto/attnd/v1/shm_ring.h.
MAGIC = 0x31474E52444E5441  # "ATNDRNG1" read as little-endian
VERSION = 1
HEADER_BYTES = 4096  # the halves start at page boundaries
MAX_SLOTS = 16  # kMaxSlots: the most requests one ring holds in flight
LENGTH_BYTES = 8  # a half starts with the message's length as a uint64
# The header's words, as indices of uint32 (byte offset / 4).
_REQUEST_SEQ = 64 // 4
_RESPONSE_SEQ = 128 // 4
_SERVER_SLEEPING = 192 // 4
_CLIENT_SLEEPING = 256 // 4
_CLOSED = 320 // 4
_SEQ_MASK = 0xFFFFFFFF  # the sequence words wrap at 2^32

_SYS_FUTEX = 202  # x86-64's syscall number
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # process-shared: no FUTEX_PRIVATE_FLAG
_INT32_MAX = 0x7FFFFFFF


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_syscall = None


def _futex_syscall():
    global _syscall
    if _syscall is None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        f = libc.syscall
        f.restype = ctypes.c_long
        f.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p,
                      ctypes.c_void_p, ctypes.c_int]
        _syscall = f
    return _syscall


def check_architecture(machine=None):
    """Raises FAILED_PRECONDITION unless this is x86-64 (the module's memory-ordering argument is x86-TSO's)."""
    machine = machine if machine is not None else platform.machine()
    if machine.lower() not in ("x86_64", "amd64"):
        raise AttndError(grpc.StatusCode.FAILED_PRECONDITION,
                         "the Python ring client runs on x86-64 only (its lock-free header accesses rely on "
                         "x86-64's memory ordering); this machine is %s: use Client.session() or shm regions, "
                         "or the C++ RingClient" % (machine or "unknown"))


def _fail(code, message):
    return AttndError(code, message)


_U64 = struct.Struct("<Q")
# Tags cycle through 1..127 (one-byte varints, precomputed): at most MAX_SLOTS requests are in flight, so an
# answer for any other request (a late one left in the slot, say) still shows as another tag.
_TAG_CYCLE = 127
_TAG_FIELDS = [b""] + [_wire._key(_wire.SQ_TAG, _wire._VARINT) + _wire.varint(t) for t in range(1, _TAG_CYCLE + 1)]
_DECODE_KEY = _wire.SR_DECODE << 3 | _wire._LEN
_LENGTHS_KEY = _wire.DR_LENGTHS << 3 | _wire._LEN
_LAYOUTS = {"variants": pb.Q_LAYOUT_VARIANTS, "pre_rotary": pb.Q_LAYOUT_PRE_ROTARY,
            pb.Q_LAYOUT_VARIANTS: pb.Q_LAYOUT_VARIANTS, pb.Q_LAYOUT_PRE_ROTARY: pb.Q_LAYOUT_PRE_ROTARY}
# numpy dtypes whose bytes are already a wire dtype (int16 is bf16 bits, as _tensors reads it).
_WIRE_DTYPES = {np.dtype("<f4"): pb.DTYPE_FP32, np.dtype("<f2"): pb.DTYPE_FP16, np.dtype("<u2"): pb.DTYPE_BF16,
                np.dtype("<i2"): pb.DTYPE_BF16}
_NP_OUT = {pb.DTYPE_FP32: np.dtype("<f4"), pb.DTYPE_FP16: np.dtype("<f2"), pb.DTYPE_BF16: np.dtype("<u2")}


# _CONT[w]: a w-byte varint's continuation bits (0x80 on every byte but the last).
_CONT = [None] + [np.array([0x80] * (w - 1) + [0], np.uint8) for w in range(1, 10)]
_SHIFTS = np.int64(1) << (7 * np.arange(9, dtype=np.int64))


def _uniform_varints(buf, n):
    """The n varints of `buf` as a list when they all have the same width (a batch's lengths mostly do), in
    four numpy calls: with the continuation bits subtracted (uint8, wrapping) every byte of a well-formed run
    is below 0x80, and each row's 7-bit groups summed at their shifts is its value. None otherwise."""
    a = np.frombuffer(buf, np.uint8)
    w = a.size // n if n else 0
    if w < 1 or w > 9 or a.size != w * n:
        return None
    d = a.reshape(n, w) - _CONT[w]
    if d.max() >= 0x80:
        return None
    return d.dot(_SHIFTS[:w]).tolist()


def _tensor_head(dtype, shape, nbytes):
    """A Tensor's fields before its data's bytes: dtype, packed shape, the data field's key and length."""
    m = _wire.Msg()
    m.varint_field(_wire.T_DTYPE, dtype)
    packed = b"".join(_wire.varint(d) for d in shape)
    m.raw(_wire._key(_wire.T_SHAPE, _wire._LEN) + _wire.varint(len(packed)) + packed)
    m.raw(_wire._key(_wire.T_DATA, _wire._LEN) + _wire.varint(nbytes))
    return m.tobytes()


def _field_head(field, head, nbytes):
    """A message field holding a Tensor: its key, its length, the Tensor's head (its data follows)."""
    return _wire._key(field, _wire._LEN) + _wire.varint(len(head) + nbytes) + head


# proto/attnd/v1/ring_frame.h: the frames of a version 2 ring.
VERSION_FRAMES = 2
_V2_REQUEST_MAGIC = 0x32514652
_V2_RESPONSE_MAGIC = 0x32524652
_V2_PREFILL, _V2_DECODE = 1, 2
_V2_ABSENT, _V2_INLINE, _V2_REGION = 0, 1, 2
_V2_HAS_PROMPT_LEN = 1
_V2_DEVICE_ORDERED = 2
_V2_OUTPUT_IN_REGION = 1
_V2_MAX_RANK = 4
_V2_HEAD = struct.Struct("<IHHQiIIIqQ")   # RequestHeader up to q: 48 bytes
_V2_TENSOR = struct.Struct("<HHiQQII4q")  # Tensor: 64 bytes
_V2_REQUEST_BYTES = _V2_HEAD.size + 4 * _V2_TENSOR.size  # 304
_V2_TAG_AT = 8  # the RequestHeader's tag, the layer right after it (byte 16)
_V2_TAG_LAYER = struct.Struct("<Qi")  # both in one store per request
_V2_RESPONSE = struct.Struct("<IiQHHiIIQQQQQ4q")  # ResponseHeader: 104 bytes
# A response half's length word and the ResponseHeader after it, read with one unpack.
_V2_ANSWER = struct.Struct("<Q" + _V2_RESPONSE.format[1:])
# The same bytes as (length word, magic and code; tag; the rest of the header): an answer whose bytes but the
# tag equal those of an answer already checked passes the same checks (_Twin).
_V2_ANSWER_SPLIT = struct.Struct("<16sQ%ds" % (_V2_ANSWER.size - 24))
_V2_OPS = {_V2_PREFILL: "prefill", _V2_DECODE: "decode"}
_INT64S = {}  # struct.Struct("<{n}q") by n: a frame's n lengths (n <= 4096), unpacked in one call


def _int64s(n):
    s = _INT64S.get(n)
    if s is None:
        s = _INT64S[n] = struct.Struct("<%dq" % n)
    return s


_CLIENT = []


def _client_module():
    """attnd._client, which imports this module (so it is not imported at the top); looked up once, not
    per call."""
    if not _CLIENT:
        from . import _client
        _CLIENT.append(_client)
    return _CLIENT[0]


def _align64(n):
    return (n + 63) & ~63


class _Frame:
    """A version 2 request frame without its tensors' inline bytes: `head` (header, id table, ids and region
    names, tag and layer 0) and where each inline tensor's bytes go, as (start, end) from the frame's start.
    Built once per shape of request and reused (only the tag and the layer change between a model's layers).
    `prefix` is what a request half starts with: the frame's length, then its head (one copy per request)."""

    __slots__ = ("head", "inline", "size", "prefix")

    def __init__(self, op, layer, q_layout, seqs, tensors, out, prompt_len, ordered=False):
        ids = [s.encode("ascii") for s in seqs]
        strings = bytearray()
        at = _V2_REQUEST_BYTES + 8 * len(ids)

        def place(b):
            nonlocal strings
            ref = (at + len(strings), len(b))
            strings += b
            return ref

        table = b"".join(struct.pack("<II", *place(i)) for i in ids)
        descs = []
        region_names = {}
        for t in tensors + ([out] if out is not None else []):
            if isinstance(t, _wire.RegionTensor) and t.region_id not in region_names:
                region_names[t.region_id] = place(t.region_id.encode("ascii"))
        pos = _align64(at + len(strings))
        self.inline = []
        for t in tensors:
            if isinstance(t, _wire.RegionTensor):
                shape = tuple(t.shape)
                descs.append((_V2_REGION, len(shape), t.dtype, t.offset, t.nbytes) + region_names[t.region_id] +
                             _shape4(shape))
            else:
                a, dtype = t
                descs.append((_V2_INLINE, a.ndim, dtype, pos, a.nbytes, 0, 0) + _shape4(a.shape))
                self.inline.append((pos, pos + a.nbytes))
                pos = _align64(pos + a.nbytes)
        if out is None:
            descs.append((_V2_ABSENT, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0))
        else:
            descs.append((_V2_REGION, len(out.shape), out.dtype, out.offset, out.nbytes) +
                         region_names[out.region_id] + _shape4(out.shape))
        flags = (_V2_HAS_PROMPT_LEN if prompt_len is not None else 0) | (_V2_DEVICE_ORDERED if ordered else 0)
        head = bytearray(_V2_HEAD.pack(_V2_REQUEST_MAGIC, op, q_layout, 0, int(layer), len(ids), flags, 0,
                                       int(prompt_len or 0), _V2_REQUEST_BYTES))
        for d in descs:
            head += _V2_TENSOR.pack(*d)
        head += table
        head += strings
        self.head = bytes(head)
        self.size = pos if self.inline else len(self.head)
        self.prefix = _U64.pack(self.size) + self.head


class _Twin:
    """The last plain version 2 call (numpy q, k, v sent as given: no regions, no out=), for its twins, the calls
    with the same `sig` (op, ids, layout, prompt_len, shapes and dtypes) that a decode loop makes layer after
    layer: they skip the checks and the frame lookup it passed and reuse its `frame` and `like`. `answer`, once
    an answer to one of them was read in full: its header's bytes but the tag, where its lengths and output lie
    and the output's dtype and shape, so that a later answer with the same header bytes skips the checks too
    (its tag is compared; only its lengths and its output are read)."""

    __slots__ = ("sig", "frame", "like", "answer")

    def __init__(self, sig, frame, like):
        self.sig, self.frame, self.like, self.answer = sig, frame, like, None


def _shape4(shape):
    if len(shape) > _V2_MAX_RANK:
        raise invalid_argument("a tensor of rank %d; at most %d" % (len(shape), _V2_MAX_RANK))
    return tuple(int(x) for x in shape) + (0,) * (_V2_MAX_RANK - len(shape))


class _PackedPlan:
    """The bytes of a packed decode's SessionRequest that depend only on its geometry (layer, shapes, dtype,
    layout, the ids' length), and of its answer's o header: computed once, reused call after call.

    SessionRequest{tag, decode: DecodeRequest{layer, sequence_ids..., q, k, v, q_layout}} is written as
    tag field + head + ids + q_head + q + k_head + k + v_head + v + tail, the order _wire.decode_request_packed
    uses (the tests check the two byte for byte)."""

    def __init__(self, layer, q, k, v, dtype, layout, ids_bytes):
        heads = [_field_head(f, _tensor_head(dtype, a.shape, a.nbytes), a.nbytes)
                 for f, a in ((_wire.D_Q, q), (_wire.D_K, k), (_wire.D_V, v))]
        self.q_head, self.k_head, self.v_head = heads
        layer_field = _wire.varint(_wire.D_LAYER << 3 | _wire._VARINT) + _wire.varint(layer) if layer else b""
        self.tail = _wire.varint(_wire.D_Q_LAYOUT << 3 | _wire._VARINT) + _wire.varint(layout) if layout else b""
        body = len(layer_field) + ids_bytes + sum(map(len, heads)) + q.nbytes + k.nbytes + v.nbytes + len(self.tail)
        self.head = _wire._key(_wire.SQ_DECODE, _wire._LEN) + _wire.varint(body) + layer_field
        self._size = len(self.head) + body - len(layer_field)
        # The answer's o: [B, Hq, D] in q's wire dtype, Hq and D as the server's model says; B from the request.
        b = q.shape[0]
        self.o_shape = (b,) + tuple(q.shape[-2:])
        self.o_dtype = _NP_OUT[dtype]
        self.o_count = int(np.prod(self.o_shape))
        self.o_bytes = self.o_count * self.o_dtype.itemsize
        self.o_head = _field_head(_wire.DR_O, _tensor_head(dtype, self.o_shape, self.o_bytes), self.o_bytes)

    def size(self, tag):
        return len(_TAG_FIELDS[tag]) + self._size


class RingStats:
    """How round trips were answered (as the C++ RingStats), and how many were ordered on the device."""
    __slots__ = ("round_trips", "answered_spinning", "answered_sleeping", "server_wakes", "device_ordered")

    def __init__(self):
        self.round_trips = self.answered_spinning = self.answered_sleeping = self.server_wakes = 0
        self.device_ordered = 0

    def __repr__(self):
        return ("RingStats(round_trips=%d, answered_spinning=%d, answered_sleeping=%d, server_wakes=%d, "
                "device_ordered=%d)" % (self.round_trips, self.answered_spinning, self.answered_sleeping,
                                        self.server_wakes, self.device_ordered))


class RingPending:
    """A request submit_decode() posted whose answer may not be read yet. result() waits for it (reading the
    answers of earlier pending requests of the ring first, in order, and keeping them for their own result())."""
    __slots__ = ("_ring", "_return_lengths", "_n", "_deadline", "_answer", "_done", "_value", "_error")

    def __init__(self, ring, return_lengths):
        self._ring, self._return_lengths = ring, return_lengths
        self._n = self._deadline = self._answer = None
        self._done, self._value, self._error = False, None, None

    def _posted(self, n, deadline, answer):
        """Request number n (the request_seq it was posted as), read by Ring._v2_answer(*answer)."""
        self._n, self._deadline, self._answer = n, deadline, answer

    def done(self):
        """True once its answer (or its failure) has been read."""
        return self._done

    def result(self):
        """What decode() returns: the output, or (output, lengths) with return_lengths; raises its AttndError."""
        while not self._done:
            self._ring._collect()
        if self._error is not None:
            raise self._error
        value, lengths = self._value
        return (value, lengths) if self._return_lengths else value

    def _fail(self, err):
        self._done, self._error, self._answer = True, err, None


class Ring:
    """A shared-memory ring to attnd: prefill() and decode() as Session's, through shared memory.

        with client.ring() as ring:
            out = ring.prefill(seq, layer, q, k, v)
            out = ring.decode(layer, seqs, q, k, v)

        with client.ring(version=2, slots=4) as ring:  # up to 4 decodes in flight
            pending = [ring.submit_decode(layer, b.seqs, b.q, b.k, b.v) for b in micro_batches]
            outs = [p.result() for p in pending]

    Args (Client.ring passes them):
      half_bytes: each half's size, a positive multiple of 4096; the largest request (and answer) is
        half_bytes - 8 bytes. Larger requests are refused with RESOURCE_EXHAUSTED before anything is written.
      spin_us: after posting a request, spin this long on the answer before sleeping on its futex.
      sleep_slice: one futex wait's length in seconds: a sleeping client looks at `closed` and the deadline this
        often.
      timeout: seconds per round trip (waiting for the ring to be free, then for the answer); past it
        DEADLINE_EXCEEDED (the next round trip first waits for the late answer, so answers never shift).
      rpc_timeout: deadline of the OpenRing / CloseRing / GetServerInfo calls (None: the client's).
      device_events: (version 2, the CUDA backend on one GPU) attnd creates two CUDA events shared with this
        process; a request whose q, k, v and out are all tensors in CUDA regions is then ordered on the GPU:
        the current stream records the "ready" event instead of being synchronized (attnd waits for it), and
        after attnd's answer (sent once its work is queued) the current stream waits for attnd's "done" event.
        This process never waits for the GPU, so the GPU does not drain between the model's layers. Other
        requests are synchronized as usual. Only with one slot.
      slots: (version 2) how many requests the ring holds in flight: a power of two from 1 to MAX_SLOTS, at
        most the server's GetServerInfo().regions.max_ring_slots. The shm object is 4096 + 2 * slots *
        half_bytes bytes (each slot its own request and response half). submit_decode() posts without waiting;
        prefill() and decode() post and wait for their own answer. With slots=1 the layout and the protocol
        are the one-at-a-time ring's.

    Errors are AttndError, as Session's: the request's own code and message; UNAVAILABLE once attnd closed the
    ring (CloseRing, idle reclamation, shutdown); DEADLINE_EXCEEDED; INTERNAL for an answer that does not parse
    or carries another tag. numpy outputs are fresh arrays (copied out of the ring; writable), torch outputs
    fresh tensors. Not thread safe: one thread at a time (one ring per thread).
    Close it (or leave the `with` block): CloseRing, then the memory is unmapped and its name unlinked.
    """

    def __init__(self, client, half_bytes=8 << 20, spin_us=50, sleep_slice=0.01, timeout=60.0, rpc_timeout=None,
                 version=1, device_events=False, slots=1):
        check_architecture()
        if version not in (VERSION, VERSION_FRAMES):
            raise invalid_argument("ring version must be %d (protobuf) or %d (binary frames), got %r"
                                   % (VERSION, VERSION_FRAMES, version))
        if device_events and version != VERSION_FRAMES:
            raise invalid_argument("device_events need a version %d ring" % VERSION_FRAMES)
        if isinstance(slots, bool) or not isinstance(slots, (int, np.integer)) or not 1 <= slots <= MAX_SLOTS or \
                slots & (slots - 1):
            raise invalid_argument("ring slots must be a power of two from 1 to %d (requests in flight), got %r"
                                   % (MAX_SLOTS, slots))
        slots = int(slots)
        if slots > 1 and version != VERSION_FRAMES:
            raise invalid_argument("ring slots > 1 need a version %d ring (binary frames); a version %d ring "
                                   "carries one request at a time" % (VERSION_FRAMES, version))
        if slots > 1 and device_events:
            raise invalid_argument("a ring with device_events carries one request at a time: open it with "
                                   "slots=1 (got slots=%d)" % slots)
        self.version = version
        self.slots = slots
        self._pending = collections.deque()  # RingPending posted by submit_decode, not read yet, oldest first
        # While submit_decodes writes its micro-batches: the last one written, not yet posted (else None).
        self._unposted = None
        self._events = None  # (ready, done): torch CUDA events opened from attnd's handles
        self._frames = {}  # _Frame by the request's shape (version 2)
        self._v2_last = None  # _Twin: the last plain version 2 call, for the decode loop's next one
        half_bytes = int(half_bytes)
        if half_bytes <= LENGTH_BYTES or half_bytes % 4096 != 0:
            raise invalid_argument("ring half_bytes must be a positive multiple of 4096, got %d" % half_bytes)
        if spin_us < 0 or sleep_slice <= 0 or timeout <= 0:
            raise invalid_argument("ring spin_us must be >= 0 and sleep_slice, timeout > 0 (got %r, %r, %r)"
                                   % (spin_us, sleep_slice, timeout))
        self._client = client
        self.half_bytes = half_bytes
        self.capacity = half_bytes - LENGTH_BYTES
        self.size = HEADER_BYTES + 2 * slots * half_bytes
        # Slot s's request half starts at _request_offs[s], its response half half_bytes later.
        # NOTE: a Ring keeps fewer than 30 instance attributes: from 30 on, CPython 3.11 stops sharing the
        # instance's dict keys and every attribute load on the per-call path gets slower.
        self._request_offs = [HEADER_BYTES + 2 * s * half_bytes for s in range(slots)]
        self._spin = spin_us * 1e-6
        self._slice = float(sleep_slice)
        self.timeout = float(timeout)
        self.stats = RingStats()
        self.ring_id = None
        self.name = None
        self._mm = None
        self._next_tag = 1
        self._plans = {}  # _PackedPlan by the packed decode's geometry
        self._fence_lock = threading.Lock()
        self._ts = _Timespec()
        self._futex = _futex_syscall()
        info = client.info(timeout=rpc_timeout).regions
        if not info.rings:
            raise _fail(grpc.StatusCode.FAILED_PRECONDITION,
                        "this server serves no rings (GetServerInfo().regions.rings is false: its backend or "
                        "--max-regions-per-tenant); use Client.session()")
        if slots > max(info.max_ring_slots, 1):
            if info.max_ring_slots:
                raise _fail(grpc.StatusCode.FAILED_PRECONDITION,
                            "this server takes at most %d requests in flight per ring "
                            "(GetServerInfo().regions.max_ring_slots), not slots=%d: open the ring with slots=%d "
                            "or fewer" % (info.max_ring_slots, slots, info.max_ring_slots))
            raise _fail(grpc.StatusCode.FAILED_PRECONDITION,
                        "this server takes one request at a time per ring (GetServerInfo().regions.max_ring_slots "
                        "is 0: an attnd that predates ring slots), not slots=%d: open the ring with slots=1, or "
                        "upgrade attnd" % slots)
        torch = None
        if device_events:
            if not info.device_ordered_rings:
                raise _fail(grpc.StatusCode.FAILED_PRECONDITION,
                            "this server orders no ring on the device (GetServerInfo().regions.device_ordered_rings "
                            "is false: it needs the cuda backend on one GPU); open the ring without device_events")
            torch = _tensors._torch()
            if torch is None or not torch.cuda.is_available():
                raise _fail(grpc.StatusCode.FAILED_PRECONDITION, "device_events need torch with CUDA")
        mine = _regions.local_boot_id()
        if info.host_boot_id and mine and info.host_boot_id != mine:
            raise _fail(grpc.StatusCode.FAILED_PRECONDITION,
                        "attnd runs on another host (boot id %s, this host %s): a ring needs the same host; "
                        "use Client.session()" % (info.host_boot_id, mine))
        self.name, fd = _regions.shm_create(self.size, info.shm_name_prefix or _regions.DEFAULT_SHM_PREFIX)
        self._unlink_at_exit = weakref.finalize(self, _regions.shm_unlink, self.name)
        try:
            try:
                self._mm = mmap.mmap(fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)  # the mapping keeps the object
            # The mapping is zero-filled: every word starts at 0, nothing is in flight. The fields attnd checks:
            # `slots` is 0 for one slot, as a ring laid out before slots existed.
            struct.pack_into("<QIIQ", self._mm, 0, MAGIC, version, slots if slots > 1 else 0, half_bytes)
            self._mv = memoryview(self._mm)
            self._words = self._mv[:HEADER_BYTES].cast("I")
            # The mapping's address, for the futex calls: it stays put until close(), which stops using it.
            probe = ctypes.c_char.from_buffer(self._mm)
            base = ctypes.addressof(probe)
            del probe
            self._response_off = HEADER_BYTES + half_bytes
            self._base = base
            opened = client._call(client._stub.OpenRing, pb.OpenRingRequest(
                name=self.name, byte_size=self.size, device_events=bool(device_events)), rpc_timeout)
            self.ring_id = opened.ring_id
            if device_events:
                device = _regions.cuda_device_of(torch, info.device_uuid)
                self._events = (torch.cuda.Event.from_ipc_handle(device, opened.ready_event),
                                torch.cuda.Event.from_ipc_handle(device, opened.done_event))
        except BaseException:
            self._free()
            raise

    @property
    def device_events(self):
        """Whether requests with every tensor in CUDA regions are ordered on the device (device_events)."""
        return self._events is not None

    # -- lifecycle --
    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:  # the block failed: its pending requests' answers are not waited for
            self._fail_pending(_fail(grpc.StatusCode.CANCELLED, "the ring was closed on an exception before this "
                                     "request's answer was read"))
        self.close()

    @property
    def closed_by_server(self):
        """True once attnd set the header's `closed` word (CloseRing, idle reclamation, shutdown), or once this
        ring was closed here."""
        return self._mm is None or self._words[_CLOSED] != 0

    def close(self, timeout=None):
        """Reads the answers still owed to submit_decode()'s pending requests (each within its own deadline; a
        failure stays with its pending), then CloseRing (errors are dropped: attnd may have reclaimed the ring
        already), unmaps the memory and unlinks its name. Idempotent."""
        try:
            while self._pending:
                self._collect()
            if self.ring_id is not None:
                rid, self.ring_id = self.ring_id, None
                try:
                    self._client._call(self._client._stub.CloseRing, pb.CloseRingRequest(ring_id=rid), timeout)
                except AttndError:
                    pass
        finally:
            self._free()

    def _free(self):
        if getattr(self, "_mm", None) is not None:
            m, self._mm = self._mm, None
            try:
                for view in (getattr(self, "_words", None), getattr(self, "_mv", None)):
                    if view is not None:
                        view.release()
                m.close()
            except BufferError:
                pass  # a view of the ring is still alive (an exception's frame): the mapping goes with it
        if getattr(self, "name", None):
            self._unlink_at_exit()  # shm_unlink, once
            self.name = None

    # -- requests --
    def prefill(self, seq, layer, q, k, v, prompt_len=None, return_length=False, q_layout="variants", out=None):
        """As Client.prefill, through the ring (region references and out= included)."""
        if self.version == VERSION_FRAMES:
            result, lengths = self._v2(_V2_PREFILL, layer, [seq], q, k, v, q_layout, out, prompt_len)
            return (result, lengths[0]) if return_length else result
        from ._client import _prefill_output, _prefill_request  # _client imports this module
        req, like = _prefill_request(seq, layer, q, k, v, prompt_len, q_layout, self._client._regions, out)
        mv, span = self._round_trip("prefill", req)
        result, length = _prefill_output(mv, span[0], span[1], like, out)
        result = self._own(result)
        return (result, length) if return_length else result

    def decode(self, layer, seqs, q, k, v, return_lengths=False, q_layout="variants", out=None):
        """As Client.decode, through the ring: the packed form (one q, k, v tensor per batch) unless a tensor lies
        in a registered region, out= is given or the layouts are mixed. A version 2 ring sends one frame with
        the batch's q, k, v inline or as region references."""
        if self.version == VERSION_FRAMES:
            if isinstance(seqs, str):
                seqs = [seqs]
            result, lengths = self._v2(_V2_DECODE, layer, seqs, q, k, v, q_layout, out, None)
            return (result, lengths) if return_lengths else result
        if out is None and not self._client._regions:
            done = self._decode_packed(layer, seqs, q, k, v, return_lengths, q_layout)
            if done is not None:
                return done
        from ._client import _decode_output, _decode_request
        req, like = _decode_request(layer, seqs, q, k, v, q_layout, self._client._regions, out)
        mv, span = self._round_trip("decode", req)
        result, lengths = _decode_output(mv, span[0], span[1], like, out)
        result = self._own(result)
        return (result, lengths) if return_lengths else result

    def submit_decode(self, layer, seqs, q, k, v, return_lengths=False, q_layout="variants", out=None):
        """As decode(), without waiting for the answer (version 2): posts the request and returns a RingPending,
        whose result() is what decode() returns. Up to `slots` requests are in flight; submitting one more
        first waits for the oldest's answer and keeps it for its result() (so with one slot, each submit waits
        for the previous answer). Answers land in request order; results may be read in any order. Raises at
        once what decode() raises before sending (bad arguments, a request larger than the half, a closed ring,
        DEADLINE_EXCEEDED while a request abandoned past its deadline still holds the slot)."""
        if self.version != VERSION_FRAMES:
            raise _fail(grpc.StatusCode.FAILED_PRECONDITION,
                        "submit_decode needs a version %d ring (binary frames); this ring is version %d: open it "
                        "with client.ring(version=%d, slots=...)" % (VERSION_FRAMES, self.version, VERSION_FRAMES))
        if isinstance(seqs, str):
            seqs = [seqs]
        return self._v2(_V2_DECODE, layer, seqs, q, k, v, q_layout, out, None, RingPending(self, return_lengths))

    def submit_decodes(self, layer, batches, return_lengths=False, q_layout="variants"):
        """Several micro-batches of one layer posted together (version 2): each of `batches` is (seqs, q, k, v) or
        (seqs, q, k, v, out) as submit_decode() takes them. All are written into their slots first and then
        posted with one store, so attnd runs them as one batch where they fit (micro-batches posted one by one
        may start apart). At most `slots` of them; the oldest pending answers are read first as far as room
        needs. A micro-batch refused before sending (bad arguments, too large) raises and leaves none of them
        posted. -> [RingPending], one per micro-batch."""
        if self.version != VERSION_FRAMES:
            raise _fail(grpc.StatusCode.FAILED_PRECONDITION,
                        "submit_decodes needs a version %d ring (binary frames); this ring is version %d"
                        % (VERSION_FRAMES, self.version))
        batches = list(batches)
        if not 1 <= len(batches) <= self.slots:
            raise invalid_argument("submit_decodes takes 1 to %d micro-batches (the ring's slots), got %d"
                                   % (self.slots, len(batches)))
        while len(self._pending) + len(batches) > self.slots:
            self._collect()
        made = []
        self._unposted = self._words[_REQUEST_SEQ]
        try:
            for b in batches:
                if not isinstance(b, (tuple, list)) or len(b) not in (4, 5):
                    raise invalid_argument("a micro-batch is (seqs, q, k, v) or (seqs, q, k, v, out), got %r"
                                           % (type(b).__name__,))
                out = b[4] if len(b) == 5 else None
                made.append(self.submit_decode(layer, b[0], b[1], b[2], b[3], return_lengths, q_layout, out))
        except BaseException:
            for _ in made:  # written, never posted: their slots are written over by the next requests
                self._pending.pop()
            self.stats.round_trips -= len(made)
            self._unposted = None
            raise
        last, self._unposted = self._unposted, None
        self._publish(last)
        return made

    def _decode_packed(self, layer, seqs, q, k, v, return_lengths, q_layout):
        """The common decode (numpy q, k, v of one wire dtype, C-contiguous, [B, ...]; B equal-length ASCII ids;
        one layout) written straight into the ring from a cached layout of its headers, its answer read in
        place: no per-sequence work but the ids' join. None when the call is not of that kind (the general path
        then builds it, and raises its errors)."""
        if isinstance(seqs, str):
            seqs = [seqs]
        layout = _LAYOUTS.get(q_layout) if isinstance(q_layout, (str, int)) else None
        if layout is None or type(q) is not np.ndarray or type(k) is not np.ndarray or \
                type(v) is not np.ndarray or not isinstance(seqs, (list, tuple)) or not seqs:
            return None
        dtype = _WIRE_DTYPES.get(q.dtype)
        if dtype is None or k.dtype != q.dtype or v.dtype != q.dtype:
            return None
        b = len(seqs)
        if not (q.ndim and k.ndim and v.ndim and q.shape[0] == b and k.shape[0] == b and v.shape[0] == b and
                q.flags.c_contiguous and k.flags.c_contiguous and v.flags.c_contiguous and q.size and k.size and
                v.size):
            return None
        try:
            ids = _wire._packed_ids(seqs)
        except (TypeError, AttributeError):  # an id that is not a str: the general path says so
            return None
        key = (layer, q.shape, k.shape, v.shape, dtype, layout, len(ids), q.dtype)
        plan = self._plans.get(key)
        if plan is None:
            if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or len(self._plans) >= 64:
                return None
            plan = self._plans[key] = _PackedPlan(int(layer), q, k, v, dtype, layout, len(ids))
        tag, size, seq, deadline = self._start(plan.size(self._next_tag))
        mv = self._mv
        pos = HEADER_BYTES
        head = _U64.pack(size) + _TAG_FIELDS[tag] + plan.head + ids + plan.q_head
        for part in (head, memoryview(q).cast("B"), plan.k_head, memoryview(k).cast("B"), plan.v_head,
                     memoryview(v).cast("B"), plan.tail):
            n = len(part)
            mv[pos:pos + n] = part
            pos += n
        start, n = self._exchange(seq, deadline)
        # The answer: SessionResponse{tag, decode: DecodeResponse{o, lengths}}, as attnd's serializer orders
        # the fields; anything else (an error, another order) goes to the general parser.
        tf = _TAG_FIELDS[tag]
        p = start + len(tf)
        if n <= self.capacity and mv[start:p] == tf and mv[p] == _DECODE_KEY:
            body, p = _wire._read_varint(mv, p + 1, len(mv))
            end = p + body
            oh = plan.o_head
            if end == start + n and mv[p:p + len(oh)] == oh:
                p += len(oh)
                o = np.frombuffer(self._mm, plan.o_dtype, plan.o_count, p).reshape(plan.o_shape)
                p += plan.o_bytes
                lengths = None
                if return_lengths:
                    lengths = self._lengths(mv, p, end, b)
                o = o.copy()
                if q.dtype.kind == "i":  # int16 bf16 bits in, int16 out (as _tensors.from_bytes)
                    o = o.view(np.int16)
                return (o, lengths) if return_lengths else o
        return self._answer_generic("decode", tag, start, n, plan, q, return_lengths)

    def _v2(self, op, layer, seqs, q, k, v, q_layout, out, prompt_len, pending=None):
        """One version 2 frame: q, k, v inline or as references into registered regions, o back inline or into
        `out`'s region. -> (output, lengths), or `pending` once posted (_v2_send)."""
        layer = int(layer)
        seqs = tuple(seqs)
        plain = out is None and not self._client._regions and type(q) is np.ndarray and \
            type(k) is np.ndarray and type(v) is np.ndarray and isinstance(q_layout, (str, int)) and \
            q.flags.c_contiguous and k.flags.c_contiguous and v.flags.c_contiguous
        if plain:
            sig = (op, seqs, q_layout, prompt_len, q.shape, q.dtype, k.shape, k.dtype, v.shape, v.dtype)
            twin = self._v2_last
            if twin is not None and twin.sig == sig:
                return self._v2_send(op, layer, len(seqs), twin.frame, (q, k, v), None, False, twin.like, None,
                                     pending, twin)
        c = _client_module()
        _out_ref, _q_layout, _sync, _tensor_arg = c._out_ref, c._q_layout, c._sync, c._tensor_arg
        # The unary client's checks and messages, so a call fails the same way on either.
        if not seqs:
            raise invalid_argument("decode needs at least one sequence")
        for x in seqs:
            if not isinstance(x, str):
                raise invalid_argument("sequence id must be a str, got %s" % type(x).__name__)
        if op == _V2_DECODE and len(seqs) > 4096:
            raise invalid_argument("a decode frame names at most 4096 sequences, got %d" % len(seqs))
        if isinstance(q_layout, (str, int)):
            layout = _q_layout(q_layout)
        else:
            layouts = {_q_layout(x) for x in q_layout}
            if len(layouts) != 1:
                raise invalid_argument("a version 2 ring's decode takes one q_layout for the whole batch "
                                       "(use a version 1 ring or unary calls to mix them)")
            layout = layouts.pop()
        regions = self._client._regions
        used = []
        (qa, qdt), like = _tensor_arg(q, "q", regions, used)
        (ka, kdt), _ = _tensor_arg(k, "k", regions, used)
        (va, vdt), _ = _tensor_arg(v, "v", regions, used)
        o_ref = _out_ref(out, regions, used)
        if op == _V2_DECODE:
            for name, t in (("q", qa), ("k", ka), ("v", va)):
                shape = list(t.shape)
                if not shape or shape[0] != len(seqs):
                    raise invalid_argument("%s: expected a leading batch dimension of %d (one per sequence), got "
                                           "shape %s" % (name, len(seqs), shape))
        tensors = [t if isinstance(t, _wire.RegionTensor) else (t, dt) for t, dt in ((qa, qdt), (ka, kdt), (va, vdt))]
        key = (op, tuple(seqs), layout, prompt_len) + tuple(
            (t.region_id, t.offset, t.nbytes, t.dtype, t.shape) if isinstance(t, _wire.RegionTensor)
            else (t[0].shape, t[1]) for t in tensors) + (
            None if o_ref is None else (o_ref.region_id, o_ref.offset, o_ref.nbytes, o_ref.dtype, o_ref.shape),)
        # Ordered on the device when every tensor is in a CUDA region (attnd reads and writes them on its
        # stream); otherwise the host synchronizes, as on any ring.
        ordered = self._events is not None and o_ref is not None and all(
            isinstance(r, _regions.CudaRegion) for r in used) and all(
            isinstance(t, _wire.RegionTensor) for t in tensors)
        key += (ordered,)
        frame = self._frames.get(key)
        if frame is None:
            try:
                frame = _Frame(op, 0, layout, seqs, tensors, o_ref, prompt_len, ordered)
            except (UnicodeEncodeError, struct.error) as err:
                raise invalid_argument("cannot frame this request: %s" % err) from None
            if len(self._frames) >= 256:
                self._frames.clear()
            self._frames[key] = frame
        twin = None
        if plain and qa is q and ka is k and va is v:  # sent as given: the next twin may skip to sending
            twin = self._v2_last = _Twin(sig, frame, like)
        if ordered:
            stream = _tensors._torch().cuda.current_stream(used[0].device)
            self._events[0].record(stream)
        else:
            stream = None
            _sync(used)
        inline = [t[0] for t in tensors if not isinstance(t, _wire.RegionTensor)]
        return self._v2_send(op, layer, len(seqs), frame, inline, out, ordered, like, stream, pending, twin)

    def _v2_send(self, op, layer, num_seqs, frame, inline, out, ordered, like, stream=None, pending=None,
                 twin=None):
        """Writes the frame's request (its cached prefix, the tag, the layer and the bytes of `inline`, the
        arrays of its inline tensors in order) into its slot's request half and posts it; reads the answer ->
        (output, lengths), or with `pending` (a RingPending) queues it to be read later and returns it. `twin`:
        the _Twin of a plain call, whose answer is read as its twins' was when its header's bytes are theirs."""
        tag, size, seq, deadline = self._start(frame.size)
        nxt = (seq + 1) & _SEQ_MASK
        half = self._request_offs[nxt & (self.slots - 1)]
        base = half + LENGTH_BYTES
        # Written through the mmap itself: its slice assignment takes any C-contiguous buffer's bytes as they
        # are, where a memoryview's needs a cast of each array to bytes first.
        mm = self._mm
        prefix = frame.prefix
        mm[half:half + len(prefix)] = prefix
        _V2_TAG_LAYER.pack_into(mm, base + _V2_TAG_AT, tag, layer)
        for (a, b), array in zip(frame.inline, inline):
            mm[base + a:base + b] = array
        self._post(nxt)
        half += self.half_bytes  # the slot's response half
        if pending is not None:
            pending._posted(nxt, deadline, (op, tag, num_seqs, out, ordered, like, stream, half))
            self._pending.append(pending)
            return pending
        self._wait(nxt, deadline, True)
        if twin is not None and twin.answer is not None:
            head, rest, o_lo, o_hi, o_dtype, o_shape, lengths_at, lengths = twin.answer
            got_head, got_tag, got_rest = _V2_ANSWER_SPLIT.unpack_from(mm, half)
            if got_tag == tag and got_head == head and got_rest == rest:
                # What _v2_answer returns for it: a read-only array over the output's bytes, copied out.
                return (np.ndarray(o_shape, o_dtype, mm[half + o_lo:half + o_hi]),
                        list(lengths.unpack_from(mm, half + lengths_at)))
        return self._v2_answer(op, tag, num_seqs, out, ordered, like, stream, half, twin)

    def _v2_answer(self, op, tag, num_seqs, out, ordered, like, stream, half, twin=None):
        """The answer in the response half at offset `half` to the request of `tag`. -> (output, lengths). With
        `twin`, an inline numpy output's answer is kept as twin.answer for the answers to its twins."""
        mm = self._mm
        start = half + LENGTH_BYTES
        # The header is read with the length before the length is checked: the half holds it either way.
        (n, magic, code, got_tag, got_op, rank, dtype, num_lengths, flags, msg_off, msg_bytes, o_off, o_bytes,
         lengths_off, *shape) = _V2_ANSWER.unpack_from(mm, half)
        if n > self.capacity or n < _V2_RESPONSE.size:
            raise _fail(grpc.StatusCode.INTERNAL, "the ring's response claims %d bytes; a frame is %d to %d"
                        % (n, _V2_RESPONSE.size, self.capacity))
        if magic != _V2_RESPONSE_MAGIC or got_tag != tag:
            raise _fail(grpc.StatusCode.INTERNAL, "the ring answered tag %d (magic %#x) for request tag %d"
                        % (got_tag, magic, tag))
        # Every [offset, offset + bytes) must lie inside the frame's n bytes (checked without overflow).
        if code != 0:
            message = mm[start + msg_off:start + msg_off + msg_bytes].decode("utf-8", "replace") \
                if msg_off <= n and msg_bytes <= n - msg_off else ""
            raise AttndError(code, message)
        if got_op != op or lengths_off > n or 8 * num_lengths > n - lengths_off or num_lengths != num_seqs:
            raise _fail(grpc.StatusCode.INTERNAL, "the ring answered a %s with %d lengths to a %s of %d sequences"
                        % (_V2_OPS.get(got_op, got_op), num_lengths, _V2_OPS[op], num_seqs))
        lengths = list(_int64s(num_lengths).unpack_from(mm, start + lengths_off))  # at most 4096 (checked)
        if ordered:  # attnd queued the work: the output is there once its event is
            stream.wait_event(self._events[1])
            self.stats.device_ordered += 1
        if out is not None:
            if not flags & _V2_OUTPUT_IN_REGION:
                raise _fail(grpc.StatusCode.INTERNAL, "server returned the output's bytes instead of writing the "
                            "output region")
            return out, lengths
        if flags & _V2_OUTPUT_IN_REGION or rank > _V2_MAX_RANK or o_off > n or o_bytes > n - o_off:
            raise _fail(grpc.StatusCode.INTERNAL, "the ring's answer has no output bytes where it says")
        o = _tensors.from_bytes(mm[start + o_off:start + o_off + o_bytes], dtype, shape[:rank], like)
        if twin is not None and type(o) is np.ndarray:
            head, _, rest = _V2_ANSWER_SPLIT.unpack_from(mm, half)
            o_lo = LENGTH_BYTES + o_off
            twin.answer = (head, rest, o_lo, o_lo + o_bytes, o.dtype, o.shape, LENGTH_BYTES + lengths_off,
                           _int64s(num_lengths))
        return o, lengths

    def _lengths(self, mv, p, end, b):
        if p < end and mv[p] == _LENGTHS_KEY:
            n, p = _wire._read_varint(mv, p + 1, len(mv))
            if p + n == end:
                got = _uniform_varints(mv[p:end], b)
                if got is None:  # widths differ
                    got = _wire._packed_varints(mv[p:end]).tolist()
                if len(got) == b:
                    return got
        raise _fail(grpc.StatusCode.INTERNAL, "the ring's answer carries no %d lengths" % b)

    def _answer_generic(self, kind, tag, start, n, plan, q, return_lengths):
        """The answer to a request the fast path wrote, read by the general parser."""
        from ._client import _decode_output
        from ._tensors import Like
        if n > self.capacity:
            raise _fail(grpc.StatusCode.INTERNAL, "the ring's response claims %d bytes; the half holds %d"
                        % (n, self.capacity))
        resp = self._mv[start:start + n]
        got_tag, code, message, got_kind, span = _wire.parse_session_response(resp)
        if got_tag != tag:
            raise _fail(grpc.StatusCode.INTERNAL, "the ring answered tag %d for request tag %d" % (got_tag, tag))
        if code != 0:
            raise AttndError(code, message)
        if got_kind != kind:
            raise _fail(grpc.StatusCode.INTERNAL, "the ring answered a %s with %s" % (kind, got_kind or "nothing"))
        result, lengths = _decode_output(resp, span[0], span[1], Like("numpy", np_dtype=q.dtype))
        result = self._own(result)
        return (result, lengths) if return_lengths else result

    def _start(self, size):
        """The start of every request: the ring must be open on both sides; the next tag is taken for a
        request of `size` bytes (its size with that tag), refused when larger than the half; a pending request
        whose slot this request takes has its answer read (and kept for its result()) first, with those before
        it; and the request must fit in flight: with one slot, a request abandoned past its deadline is answered
        first, so nothing is; with S, request n waits until response_seq reaches n - S. -> (tag, size,
        request_seq, deadline)."""
        if self._mm is None:
            raise _fail(grpc.StatusCode.FAILED_PRECONDITION, "the ring is closed")
        tag = self._next_tag
        if size > self.capacity:
            raise self._too_large(size)
        w = self._words
        seq = w[_REQUEST_SEQ] if self._unposted is None else self._unposted
        while self._pending and (seq + 1 - self._pending[0]._n) & _SEQ_MASK >= self.slots:
            self._collect()  # a pending request's slot is about to be reused
        if w[_CLOSED]:
            raise _fail(grpc.StatusCode.UNAVAILABLE, "the ring was closed by the server")
        self._next_tag = tag % _TAG_CYCLE + 1
        deadline = time.monotonic() + self.timeout
        if w[_RESPONSE_SEQ] != seq:  # requests in flight (or abandoned): wait until this one fits
            self._wait((seq + 1 - self.slots) & _SEQ_MASK, deadline, False)
        return tag, size, seq, deadline

    def _collect(self):
        """Reads the oldest pending request's answer into it (waiting for it until its deadline): its output
        copied out of the response half, or its error. A closed ring fails it and every later one with
        UNAVAILABLE (answers land in order: none of them can come)."""
        p = self._pending[0]
        if self._mm is None:
            self._fail_pending(_fail(grpc.StatusCode.FAILED_PRECONDITION, "the ring is closed"))
            return
        try:
            self._wait(p._n, p._deadline, True)
        except AttndError as err:
            if err.code is grpc.StatusCode.UNAVAILABLE:
                self._fail_pending(err)
            else:  # DEADLINE_EXCEEDED: abandoned; the next request's _start waits for its late answer
                self._pending.popleft()._fail(err)
            return
        self._pending.popleft()
        try:
            p._value = self._v2_answer(*p._answer)
        except AttndError as err:
            p._error = err
        p._done = True
        p._answer = None

    def _fail_pending(self, err):
        while self._pending:
            self._pending.popleft()._fail(err)

    def _too_large(self, size):
        return _fail(grpc.StatusCode.RESOURCE_EXHAUSTED,
                     "request of %d bytes exceeds the ring's %d-byte half (Client.ring(half_bytes=...) sizes it; "
                     "a prefill needs about T * (5 Hq + 2 Hkv) * D * dtype bytes)" % (size, self.capacity))

    def _post(self, nxt):
        """Publishes request `nxt` (or, inside submit_decodes, leaves it for one store after the last)."""
        self.stats.round_trips += 1
        if self._unposted is not None:
            self._unposted = nxt
            return
        self._publish(nxt)

    def _publish(self, nxt):
        """request_seq = nxt (posting every request written up to it); rings the doorbell if attnd sleeps."""
        w = self._words
        w[_REQUEST_SEQ] = nxt  # release (x86-TSO): the request's bytes are visible before it
        self._fence()  # the store above before the load below (attnd stores server_sleeping, then loads ours)
        if w[_SERVER_SLEEPING]:
            self._futex(_SYS_FUTEX, self._base + 4 * _REQUEST_SEQ, _FUTEX_WAKE, _INT32_MAX, None, None, 0)
            self.stats.server_wakes += 1

    def _own(self, result):
        """A numpy output that is a view of the response half, copied out (the next request overwrites it)."""
        if isinstance(result, np.ndarray) and self._mm is not None:
            addr = result.__array_interface__["data"][0]
            if self._base <= addr < self._base + self.size:
                return result.copy()
        return result

    def _round_trip(self, kind, body):
        """Sends SessionRequest{tag, <kind>: body} (a _wire.Msg) and waits for its answer. Returns (memoryview of
        the SessionResponse in the response half, span of its payload); raises the answer's code as AttndError."""
        request = _wire.session_request(self._next_tag, **{kind: body})  # the tag _start takes
        tag, size, seq, deadline = self._start(request.size)
        # The request, its length first, each part copied once from its buffer.
        mv = self._mv
        struct.pack_into("<Q", self._mm, HEADER_BYTES, size)
        pos = HEADER_BYTES + LENGTH_BYTES
        small = []
        for part in request.parts:
            n = len(part)
            if n <= 64 and isinstance(part, bytes):  # headers: joined, then one copy
                small.append(part)
                continue
            if small:
                head = b"".join(small)
                small = []
                mv[pos:pos + len(head)] = head
                pos += len(head)
            mv[pos:pos + n] = part
            pos += n
        if small:
            head = b"".join(small)
            mv[pos:pos + len(head)] = head
            pos += len(head)
        if pos != HEADER_BYTES + LENGTH_BYTES + size:
            raise _fail(grpc.StatusCode.INTERNAL, "wrote %d request bytes, expected %d"
                        % (pos - HEADER_BYTES - LENGTH_BYTES, size))
        start, n = self._exchange(seq, deadline)
        if n > self.capacity:
            raise _fail(grpc.StatusCode.INTERNAL, "the ring's response claims %d bytes; the half holds %d"
                        % (n, self.capacity))
        resp = mv[start:start + n]
        got_tag, code, message, got_kind, span = _wire.parse_session_response(resp)
        if got_tag != tag:
            raise _fail(grpc.StatusCode.INTERNAL, "the ring answered tag %d for request tag %d" % (got_tag, tag))
        if code != 0:
            raise AttndError(code, message)
        if got_kind != kind:
            raise _fail(grpc.StatusCode.INTERNAL, "the ring answered a %s with %s" % (kind, got_kind or "nothing"))
        return resp, span

    def _exchange(self, seq, deadline):
        """Publishes the request written after request `seq` and waits for its answer. -> (offset of the answer in
        the mapping, its length as the response half says)."""
        nxt = (seq + 1) & _SEQ_MASK
        self._post(nxt)
        self._wait(nxt, deadline, True)
        return self._response_off + LENGTH_BYTES, _U64.unpack_from(self._mm, self._response_off)[0]

    def _fence(self):
        """A full barrier (see the module's docstring): an uncontended lock's atomic read-modify-write."""
        self._fence_lock.acquire()
        self._fence_lock.release()

    def _wait(self, want, deadline, count):
        """Waits until response_seq reaches `want`: spins self._spin seconds, then sleeps on the futex in slices.
        Reached: response_seq - want (wrapping) < reach; with one slot (one request in flight) equal, with several
        at or past want (later requests may be answered too; the words are compared in the half range of their
        wrap)."""
        w = self._words
        reach = 1 if self.slots == 1 else 0x80000000
        if (w[_RESPONSE_SEQ] - want) & _SEQ_MASK < reach:
            if count:
                self.stats.answered_spinning += 1
            return
        clock = time.perf_counter
        spin_end = clock() + self._spin
        i = 0
        while True:
            if (w[_RESPONSE_SEQ] - want) & _SEQ_MASK < reach:
                if count:
                    self.stats.answered_spinning += 1
                return
            if w[_CLOSED]:
                break
            i += 1
            if not i & 7 and clock() >= spin_end:  # the clock costs as much as a round of loads
                break
        # Sleep: announce it, then re-check (attnd sets response_seq before it reads client_sleeping, so one of
        # the two sides sees the other).
        w[_CLIENT_SLEEPING] = 1
        self._fence()
        error = None
        try:
            while True:
                seen = w[_RESPONSE_SEQ]
                if (seen - want) & _SEQ_MASK < reach:
                    if count:
                        self.stats.answered_sleeping += 1
                    return
                if w[_CLOSED]:
                    error = _fail(grpc.StatusCode.UNAVAILABLE, "the ring was closed by the server")
                    break
                now = time.monotonic()
                if now >= deadline:
                    error = _fail(grpc.StatusCode.DEADLINE_EXCEEDED,
                                  "no answer in the ring within %gs" % self.timeout)
                    break
                us = max(1, int(min(self._slice, deadline - now) * 1e6))
                self._ts.tv_sec, self._ts.tv_nsec = us // 1000000, (us % 1000000) * 1000
                self._futex(_SYS_FUTEX, self._base + 4 * _RESPONSE_SEQ, _FUTEX_WAIT, seen, ctypes.byref(self._ts),
                            None, 0)
        finally:
            w[_CLIENT_SLEEPING] = 0
        # Closed, but the answer may have landed just before: prefer it.
        if error.code is grpc.StatusCode.UNAVAILABLE and (w[_RESPONSE_SEQ] - want) & _SEQ_MASK < reach:
            return
        raise error
