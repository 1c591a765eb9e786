"""The shared-memory ring from Python (client/python/attnd/_ring.py; docs/regions.md, "Rings").

Without a daemon: the header the client lays out (proto/attnd/v1/shm_ring.h), the fast packed-decode request
byte for byte against the general encoder and the protobuf library, a request larger than the half refused
before anything is written, and the doorbell protocol against a server played by a thread of this test (answers
while the client spins and while it sleeps, the server's futex wake, a wrong tag, `closed`, a timeout and the
late answer after it). A version 2 ring with slots against attnd's side of shm_ring.h played by a thread: each
slot's halves where the layout puts them, every slot posted before any answer, results read in any order, the
(S+1)th request waiting for the oldest answer, blocking calls between pending ones, a closed ring failing every
pending request, a timeout, a wrong tag or an error failing only its own, bad `slots` refused before anything is
created. Against a live attnd (CPU backend): the golden dense case (fp32, bf16 bits, fp16),
packed batches of both layouts equal to the fp64 reference and bit for bit to unary calls on twin sequences,
pre-rotary golden replay, region references, every bad input with the same code and message as unary, and
UNAVAILABLE once attnd closed the ring (CloseRing, idle reclamation, shutdown); with slots (skipped by an attnd
that takes one request at a time), decodes in flight together equal to unary calls on twin sequences."""
import ctypes
import os
import shutil
import struct
import sys
import tempfile
import threading
import time
import unittest

import grpc
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import attnd_testing as at  # noqa: E402
import dca_ref  # noqa: E402
import test_golden  # noqa: E402
import test_pre_rotary  # noqa: E402

attnd = at.attnd
pb = attnd.proto
_ring = attnd._ring
_wire = attnd._wire
SC = grpc.StatusCode

# The header's layout, written out here from proto/attnd/v1/shm_ring.h (not taken from the module under test).
MAGIC = 0x31474E52444E5441
REQUEST_SEQ, RESPONSE_SEQ, SERVER_SLEEPING, CLIENT_SLEEPING, CLOSED = 64, 128, 192, 256, 320
HEADER = 4096


class FakeClient:
    """Answers GetServerInfo and OpenRing/CloseRing as attnd would, recording the calls (GetServerInfo too)."""

    def __init__(self, rings=True, boot_id="", max_ring_slots=0):
        self._regions = []
        self.calls = []
        self._stub = type("Stub", (), {"OpenRing": "OpenRing", "CloseRing": "CloseRing"})()
        self._info = pb.GetServerInfoResponse(regions=pb.RegionSupport(rings=rings, host_boot_id=boot_id,
                                                                       max_ring_slots=max_ring_slots))

    def info(self, timeout=None):
        self.calls.append(("GetServerInfo", None))
        return self._info

    def _call(self, method, request, timeout):
        self.calls.append((method, request))
        if method == "OpenRing":
            return pb.OpenRingResponse(ring_id="ab" * 16)
        return pb.CloseRingResponse()


def word(ring, offset):
    return struct.unpack_from("<I", ring._mm, offset)[0]


def set_word(ring, offset, value):
    struct.pack_into("<I", ring._mm, offset, value)


def request_bytes(ring):
    n = struct.unpack_from("<Q", ring._mm, HEADER)[0]
    return bytes(ring._mm[HEADER + 8:HEADER + 8 + n])


class PlayedServer:
    """attnd's side of the ring, played by a thread: answers each request with answer(SessionRequest) ->
    SessionResponse (or None: no answer) after `delay` seconds, sleeping on the request futex as attnd does."""

    def __init__(self, ring, answer, delay=0.0, spin=0.0):
        self.ring, self.answer, self.delay, self.spin = ring, answer, delay, spin
        self.stop = False
        self.requests = []
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        self.syscall = libc.syscall
        self.syscall.restype = ctypes.c_long
        self.syscall.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p,
                                 ctypes.c_void_p, ctypes.c_int]
        self.base = ring._base
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def futex_wait(self, offset, expected, seconds):
        ts = (ctypes.c_long * 2)(int(seconds), int((seconds % 1) * 1e9))
        self.syscall(202, self.base + offset, 0, expected, ctypes.byref(ts), None, 0)

    def futex_wake(self, offset):
        self.syscall(202, self.base + offset, 1, 0x7FFFFFFF, None, None, 0)

    def request_seq_past(self, seen):
        """request_seq once it has moved past `seen`; else None, after sleeping on its futex (as attnd does) for
        up to 50 ms."""
        seq = word(self.ring, REQUEST_SEQ)
        if seq != seen:
            return seq
        set_word(self.ring, SERVER_SLEEPING, 1)
        if word(self.ring, REQUEST_SEQ) == seen:
            self.futex_wait(REQUEST_SEQ, seen, 0.05)
        set_word(self.ring, SERVER_SLEEPING, 0)
        return None

    def publish(self, off, body, seq):
        """Writes answer `body` (length first) at `off`, moves response_seq to seq and wakes a sleeping client."""
        struct.pack_into("<Q", self.ring._mm, off, len(body))
        self.ring._mm[off + 8:off + 8 + len(body)] = body
        set_word(self.ring, RESPONSE_SEQ, seq)
        if word(self.ring, CLIENT_SLEEPING):
            self.futex_wake(RESPONSE_SEQ)

    def run(self):
        last = word(self.ring, REQUEST_SEQ)
        while not self.stop:
            seq = self.request_seq_past(last)
            if seq is None:
                continue
            last = seq
            request = pb.SessionRequest.FromString(request_bytes(self.ring))
            self.requests.append(request)
            time.sleep(self.delay)
            response = self.answer(request)
            if response is None:
                continue
            self.publish(HEADER + self.ring.half_bytes, response.SerializeToString(), seq)

    def close(self):
        self.stop = True
        self.futex_wake(REQUEST_SEQ)
        self.thread.join(5)


def decode_answer(request, tag_delta=0):
    """The answer attnd gives a packed decode: o [B, Hq, D] (q's dtype; here q's first variant) and lengths."""
    d = request.decode
    b = len(d.sequence_ids)
    q = np.frombuffer(d.q.data, {pb.DTYPE_FP32: np.float32, pb.DTYPE_FP16: np.float16,
                                 pb.DTYPE_BF16: np.uint16}[d.q.dtype]).reshape(list(d.q.shape))
    o = q[:, 0] if q.ndim == 4 else q
    return pb.SessionResponse(tag=request.tag + tag_delta, decode=pb.DecodeResponse(
        o=pb.Tensor(dtype=d.q.dtype, shape=list(o.shape), data=o.tobytes()), lengths=answer_lengths(request.tag, b)))


def answer_lengths(tag, b):
    """Odd tags: 100, 1097, 2094, ... (one-byte and two-byte varints mixed); even tags: three bytes each."""
    return [(100 if tag % 2 else 20000) + 997 * i for i in range(b)]


class Layout(unittest.TestCase):
    def test_header_and_open_ring(self):
        client = FakeClient()
        with _ring.Ring(client, half_bytes=3 * 4096) as ring:
            self.assertEqual(ring.size, 4096 + 2 * 3 * 4096)
            self.assertEqual(os.stat("/dev/shm" + ring.name).st_size, ring.size)
            magic, version, reserved, half = struct.unpack_from("<QIIQ", ring._mm, 0)
            self.assertEqual((magic, version, reserved, half), (MAGIC, 1, 0, 3 * 4096))
            self.assertEqual(bytes(ring._mm[0:8]), b"ATNDRNG1")
            for off in (REQUEST_SEQ, RESPONSE_SEQ, SERVER_SLEEPING, CLIENT_SLEEPING, CLOSED):
                self.assertEqual(word(ring, off), 0)
            self.assertTrue(ring.name.startswith("/attnd-"))
            self.assertEqual(len(ring.name), len("/attnd-") + 32)
            self.assertEqual(client.calls[0][0], "GetServerInfo")
            method, request = client.calls[1]
            self.assertEqual(method, "OpenRing")
            self.assertEqual((request.name, request.byte_size), (ring.name, ring.size))
            self.assertEqual(ring.capacity, 3 * 4096 - 8)
            name = ring.name
        self.assertEqual(client.calls[-1], ("CloseRing", pb.CloseRingRequest(ring_id="ab" * 16)))
        self.assertFalse(os.path.exists("/dev/shm" + name), "close() unlinks the ring's name")

    def test_bad_options_and_servers_are_refused(self):
        for half in (0, 8, 4095, 4097):
            with self.assertRaises(attnd.AttndError) as ctx:
                _ring.Ring(FakeClient(), half_bytes=half)
            self.assertIs(ctx.exception.code, SC.INVALID_ARGUMENT)
            self.assertIn("multiple of 4096, got %d" % half, ctx.exception.message)
        with self.assertRaises(attnd.AttndError) as ctx:
            _ring.Ring(FakeClient(rings=False))
        self.assertIs(ctx.exception.code, SC.FAILED_PRECONDITION)
        self.assertIn("serves no rings", ctx.exception.message)
        if attnd._regions.local_boot_id():
            with self.assertRaises(attnd.AttndError) as ctx:
                _ring.Ring(FakeClient(boot_id="another-host"))
            self.assertIs(ctx.exception.code, SC.FAILED_PRECONDITION)
            self.assertIn("another host", ctx.exception.message)

    def test_other_architectures_are_refused(self):
        for machine in ("aarch64", "ppc64le", "riscv64", ""):
            with self.assertRaises(attnd.AttndError) as ctx:
                _ring.check_architecture(machine)
            self.assertIs(ctx.exception.code, SC.FAILED_PRECONDITION)
            self.assertIn("x86-64 only", ctx.exception.message)
        _ring.check_architecture("x86_64")


class FastEncoding(unittest.TestCase):
    """The packed decode the ring writes from its cached plan is the general encoder's message, byte for byte."""

    def test_byte_equal_to_the_general_encoder_and_protobuf(self):
        rng = np.random.default_rng(3)
        cases = [  # (layer, B, variants or None for pre-rotary, dtype, ids)
            (0, 1, 5, np.uint16, None), (3, 2, 3, np.float32, None), (27, 8, 5, np.float16, None),
            (1, 3, None, np.uint16, None), (200, 32, 5, np.int16, None),
            (0, 2, 5, np.float32, ["a" * 200, "b" * 200]),  # two-byte id lengths: framed one by one
        ]
        for layer, b, variants, dtype, ids in cases:
            with self.subTest(layer=layer, b=b, variants=variants, dtype=dtype):
                client = FakeClient()
                with _ring.Ring(client) as ring:
                    seqs = ids or ["%032x" % rng.integers(1 << 62) for _ in range(b)]
                    qshape = (b, variants, 4, 8) if variants else (b, 4, 8)
                    q = rng.integers(0, 1 << 15, qshape).astype(dtype)
                    k = rng.integers(0, 1 << 15, (b, 2, 8)).astype(dtype)
                    v = rng.integers(0, 1 << 15, (b, 2, 8)).astype(dtype)
                    layout = "variants" if variants else "pre_rotary"
                    server = PlayedServer(ring, decode_answer)
                    try:
                        for tag in (1, 2):  # the second call reuses the cached plan
                            out, lengths = ring.decode(layer, seqs, q, k, v, return_lengths=True,
                                                       q_layout=layout)
                            got = request_bytes(ring)
                            a, dt, _ = attnd._tensors.to_numpy(q, "q")
                            want = _wire.session_request(tag, decode=_wire.decode_request_packed(
                                layer, seqs, (a, dt), attnd._tensors.to_numpy(k, "k")[:2],
                                attnd._tensors.to_numpy(v, "v")[:2], 1 if layout == "pre_rotary" else 0)).tobytes()
                            self.assertEqual(got, want)
                            parsed = pb.SessionRequest.FromString(got)
                            self.assertEqual(parsed.tag, tag)
                            self.assertEqual(parsed.decode.layer, layer)
                            self.assertEqual(list(parsed.decode.sequence_ids), seqs)
                            self.assertEqual(parsed.decode.q.data, q.tobytes())
                            self.assertEqual(parsed.decode.q_layout, 1 if layout == "pre_rotary" else 0)
                            o = q[:, 0] if variants else q
                            np.testing.assert_array_equal(out, o)
                            self.assertEqual(out.dtype, q.dtype)
                            self.assertTrue(out.flags.writeable, "a ring output is copied out of the ring")
                            self.assertEqual(lengths, answer_lengths(tag, b))
                    finally:
                        server.close()
                    self.assertEqual(ring.stats.round_trips, 2)

    def test_outputs_outlive_the_next_request(self):
        """The response half is rewritten by every answer: an output handed back must not be a view of it."""
        with _ring.Ring(FakeClient()) as ring:
            server = PlayedServer(ring, decode_answer)
            try:
                seqs = ["%032x" % 1, "%032x" % 2]
                kv = np.zeros((2, 2, 8), np.float32)
                q = np.arange(2 * 5 * 4 * 8, dtype=np.float32).reshape(2, 5, 4, 8)
                first = ring.decode(0, seqs, q, kv, kv)
                entries = ring.decode(0, seqs, list(q), kv, kv, q_layout=["variants"] * 2)  # the general path
                kept = first.copy(), entries.copy()
                ring.decode(0, seqs, -q, kv, kv)
                ring.decode(0, seqs, -q, kv, kv, q_layout=["variants"] * 2)
                np.testing.assert_array_equal(first, kept[0])
                np.testing.assert_array_equal(entries, kept[1])
            finally:
                server.close()


class Doorbell(unittest.TestCase):
    """The client against attnd's side played by a thread."""

    def setUp(self):
        self.client = FakeClient()
        self.rng = np.random.default_rng(5)
        self.q = self.rng.standard_normal((2, 3, 4, 8)).astype(np.float32)
        self.kv = self.rng.standard_normal((2, 2, 8)).astype(np.float32)
        self.seqs = ["%032x" % 1, "%032x" % 2]

    def test_answers_while_spinning_and_while_sleeping(self):
        with _ring.Ring(self.client, spin_us=200000) as ring:  # 0.2 s of spin: the answer comes first
            server = PlayedServer(ring, decode_answer)
            try:
                time.sleep(0.2)  # the server is asleep on the futex: the client must wake it
                out = ring.decode(0, self.seqs, self.q, self.kv, self.kv)
                np.testing.assert_array_equal(out, self.q[:, 0])
                self.assertEqual(ring.stats.server_wakes, 1)
                self.assertEqual(ring.stats.answered_spinning, 1)
            finally:
                server.close()
        with _ring.Ring(self.client, spin_us=0) as ring:
            server = PlayedServer(ring, decode_answer, delay=0.05)
            try:
                for _ in range(3):
                    np.testing.assert_array_equal(ring.decode(0, self.seqs, self.q, self.kv, self.kv), self.q[:, 0])
                self.assertEqual(ring.stats.answered_sleeping, 3)
                self.assertEqual(word(ring, CLIENT_SLEEPING), 0)
            finally:
                server.close()

    def test_sequence_words_wrap(self):
        with _ring.Ring(self.client) as ring:
            set_word(ring, REQUEST_SEQ, 0xFFFFFFFF)
            set_word(ring, RESPONSE_SEQ, 0xFFFFFFFF)
            server = PlayedServer(ring, decode_answer)
            try:
                for _ in range(2):
                    np.testing.assert_array_equal(ring.decode(0, self.seqs, self.q, self.kv, self.kv), self.q[:, 0])
                self.assertEqual(word(ring, REQUEST_SEQ), 1)
            finally:
                server.close()

    def test_wrong_tag_is_internal(self):
        with _ring.Ring(self.client) as ring:
            server = PlayedServer(ring, lambda r: decode_answer(r, tag_delta=5))
            try:
                with self.assertRaises(attnd.AttndError) as ctx:
                    ring.decode(0, self.seqs, self.q, self.kv, self.kv)
                self.assertIs(ctx.exception.code, SC.INTERNAL)
                self.assertEqual(ctx.exception.message, "the ring answered tag 6 for request tag 1")
            finally:
                server.close()

    def test_error_answer_raises_its_code_and_message(self):
        with _ring.Ring(self.client) as ring:
            server = PlayedServer(ring, lambda r: pb.SessionResponse(tag=r.tag, code=5, message="seq gone"))
            try:
                with self.assertRaises(attnd.AttndError) as ctx:
                    ring.decode(0, self.seqs, self.q, self.kv, self.kv)
                self.assertIs(ctx.exception.code, SC.NOT_FOUND)
                self.assertEqual(ctx.exception.message, "seq gone")
            finally:
                server.close()

    def test_closed_while_waiting_is_unavailable(self):
        with _ring.Ring(self.client, spin_us=0) as ring:
            def close_instead(request):
                set_word(ring, CLOSED, 1)
                server.futex_wake(RESPONSE_SEQ)
            server = PlayedServer(ring, close_instead)
            try:
                start = time.monotonic()
                with self.assertRaises(attnd.AttndError) as ctx:
                    ring.decode(0, self.seqs, self.q, self.kv, self.kv)
                self.assertIs(ctx.exception.code, SC.UNAVAILABLE)
                self.assertEqual(ctx.exception.message, "the ring was closed by the server")
                self.assertLess(time.monotonic() - start, 5)
                before = word(ring, REQUEST_SEQ)
                with self.assertRaises(attnd.AttndError) as ctx:  # refused before anything is written
                    ring.decode(0, self.seqs, self.q, self.kv, self.kv)
                self.assertIs(ctx.exception.code, SC.UNAVAILABLE)
                self.assertEqual(word(ring, REQUEST_SEQ), before)
                self.assertTrue(ring.closed_by_server)
            finally:
                server.close()

    def test_timeout_then_the_late_answer_is_skipped(self):
        with _ring.Ring(self.client, timeout=0.2, sleep_slice=0.01) as ring:
            answers = []

            def slow_first(request):
                if not answers:
                    answers.append(1)
                    time.sleep(0.5)
                return decode_answer(request)
            server = PlayedServer(ring, slow_first)
            try:
                with self.assertRaises(attnd.AttndError) as ctx:
                    ring.decode(0, self.seqs, self.q, self.kv, self.kv)
                self.assertIs(ctx.exception.code, SC.DEADLINE_EXCEEDED)
                self.assertIn("no answer in the ring within 0.2s", ctx.exception.message)
                # The next call waits for the late answer first, so its own answer is its own.
                q2 = self.q * 2
                ring.timeout = 5.0
                np.testing.assert_array_equal(ring.decode(0, self.seqs, q2, self.kv, self.kv), q2[:, 0])
                self.assertEqual([r.tag for r in server.requests], [1, 2])
            finally:
                server.close()

    def test_too_large_request_is_refused_before_anything_is_written(self):
        with _ring.Ring(self.client, half_bytes=4096) as ring:
            q = np.zeros((8, 5, 4, 32), np.float32)  # 20 KiB of q alone
            kv = np.zeros((8, 2, 32), np.float32)
            for call in (lambda: ring.decode(0, ["%032x" % i for i in range(8)], q, kv, kv),
                         lambda: ring.prefill("%032x" % 1, 0, q, kv, kv)):
                with self.assertRaises(attnd.AttndError) as ctx:
                    call()
                self.assertIs(ctx.exception.code, SC.RESOURCE_EXHAUSTED)
                self.assertRegex(ctx.exception.message, r"^request of \d+ bytes exceeds the ring's 4088-byte half")
                self.assertEqual(word(ring, REQUEST_SEQ), 0)
                self.assertEqual(bytes(ring._mm[HEADER:HEADER + 4096]), bytes(4096), "nothing was written")
                self.assertEqual(ring.stats.round_trips, 0)


# Version 2 frames, written out here from proto/attnd/v1/ring_frame.h (not taken from the module under test).
REQUEST_MAGIC, RESPONSE_MAGIC = 0x32514652, 0x32524652
FRAME_HEAD = struct.Struct("<IHHQiIIIqQ")  # RequestHeader up to its tensors: 48 bytes
FRAME_TENSOR = struct.Struct("<HHiQQII4q")  # Tensor: 64 bytes
RESPONSE_HEAD = struct.Struct("<IiQHHiIIQQQQQ4q")  # ResponseHeader: 104 bytes
NP_DTYPE = {pb.DTYPE_FP32: np.float32, pb.DTYPE_FP16: np.float16, pb.DTYPE_BF16: np.uint16}
SEQ_MASK = 0xFFFFFFFF


def slot_request_offset(half, slots, n):
    """Where request n's request half starts (shm_ring.h: slot n % S, its halves after the header, in pairs)."""
    return HEADER + 2 * (n % slots) * half


def read_frame(mm, at):
    """The request frame in the half at `at`: its header's fields, its ids and q (inline) as numpy."""
    length = struct.unpack_from("<Q", mm, at)[0]
    frame = bytes(mm[at + 8:at + 8 + length])
    magic, op, layout, tag, layer, num, flags, _, prompt_len, ids_off = FRAME_HEAD.unpack_from(frame, 0)
    where, rank, dtype, off, nbytes, _, _, *shape = FRAME_TENSOR.unpack_from(frame, FRAME_HEAD.size)
    ids = []
    for i in range(num):
        o, n = struct.unpack_from("<II", frame, ids_off + 8 * i)
        ids.append(frame[o:o + n].decode())
    q = np.frombuffer(frame, NP_DTYPE[dtype], nbytes // np.dtype(NP_DTYPE[dtype]).itemsize, off).reshape(
        shape[:rank]) if where == 1 else None
    return dict(magic=magic, op=op, tag=tag, layer=layer, ids=ids, q=q, dtype=dtype)


def frame_lengths(n, b):
    """The lengths the played server answers request n with: they name the request."""
    return [1000 * n + i for i in range(b)]


def frame_answer(n, req, tag_delta=0, code=0, message=""):
    """attnd's answer frame to a decode: o = q's first variant [B, Hq, D], lengths frame_lengths(n, B); or an
    error with `code` and `message`."""
    tag = req["tag"] + tag_delta
    if code:
        msg = message.encode()
        return RESPONSE_HEAD.pack(RESPONSE_MAGIC, code, tag, req["op"], 0, 0, 0, 0, RESPONSE_HEAD.size, len(msg),
                                  0, 0, 0, 0, 0, 0, 0) + msg
    q = req["q"]
    o = q[:, 0] if q.ndim == 4 else q
    b = len(req["ids"])
    lengths_off = RESPONSE_HEAD.size
    o_off = (lengths_off + 8 * b + 63) // 64 * 64
    head = RESPONSE_HEAD.pack(RESPONSE_MAGIC, 0, tag, req["op"], o.ndim, req["dtype"], b, 0, 0, 0, o_off, o.nbytes,
                              lengths_off, *(list(o.shape) + [0] * (4 - o.ndim)))
    body = bytearray(o_off + o.nbytes)
    body[:len(head)] = head
    body[lengths_off:lengths_off + 8 * b] = np.array(frame_lengths(n, b), np.int64).tobytes()
    body[o_off:] = o.tobytes()
    return bytes(body)


class PlayedSlotServer(PlayedServer):
    """attnd's side of a version 2 ring with `slots` S, played by a thread as shm_ring.h says: request n is read
    from slot n % S's request half when request_seq passes it and answered, in order, in that slot's response
    half (answer(n, request) -> the frame, or None: no answer). With `hold`, an answer waits for a release();
    `violations` records every request_seq more than S ahead of response_seq."""

    def __init__(self, ring, slots, answer=frame_answer, hold=False, delay=0.0):
        self.slots, self.half = slots, ring.half_bytes
        self.gate = threading.Semaphore(0) if hold else None
        self.violations = []
        self.seen = []  # (n, request) in the order read
        super().__init__(ring, answer, delay)

    def release(self, count=1):
        for _ in range(count):
            self.gate.release()

    def run(self):
        try:
            self.serve()
        except (TypeError, ValueError):  # the client unmapped the ring (close() once it read what it was owed)
            pass

    def serve(self):
        answered = word(self.ring, RESPONSE_SEQ)
        while not self.stop:
            seq = self.request_seq_past(answered)
            if seq is None:
                continue
            if (seq - word(self.ring, RESPONSE_SEQ)) & SEQ_MASK > self.slots:
                self.violations.append((seq, word(self.ring, RESPONSE_SEQ)))
            n = (answered + 1) & SEQ_MASK
            at = slot_request_offset(self.half, self.slots, n)
            request = read_frame(self.ring._mm, at)
            self.seen.append((n, request))
            while self.gate is not None and not self.gate.acquire(timeout=0.05):
                if self.stop:
                    return
            time.sleep(self.delay)
            body = self.answer(n, request)
            answered = n
            if body is None:
                continue
            self.publish(at + self.half, body, n)


class Slots(unittest.TestCase):
    """A version 2 ring with several slots against attnd's side played by a thread."""

    def setUp(self):
        self.client = FakeClient(max_ring_slots=16)
        self.rng = np.random.default_rng(9)
        self.seqs = ["%032x" % 1, "%032x" % 2]
        self.kv = self.rng.standard_normal((2, 2, 8)).astype(np.float32)

    def q(self):
        return self.rng.standard_normal((2, 3, 4, 8)).astype(np.float32)

    def submit(self, ring, q, **kwargs):
        return ring.submit_decode(0, self.seqs, q, self.kv, self.kv, return_lengths=True, **kwargs)

    def assert_answer(self, pending, q, n):
        out, lengths = pending.result()
        np.testing.assert_array_equal(out, q[:, 0])
        self.assertEqual(lengths, frame_lengths(n, 2))

    def test_one_slot_is_todays_layout(self):
        with _ring.Ring(self.client, half_bytes=2 * 4096, version=2) as ring:
            self.assertEqual(ring.slots, 1)
            self.assertEqual(ring.size, 4096 + 2 * 2 * 4096)
            self.assertEqual(struct.unpack_from("<QIIQ", ring._mm, 0), (MAGIC, 2, 0, 2 * 4096))
            self.assertEqual(self.client.calls[1][1].byte_size, 4096 + 2 * 2 * 4096)

    def test_each_slots_halves(self):
        half, slots = 2 * 4096, 4
        with _ring.Ring(self.client, half_bytes=half, version=2, slots=slots) as ring:
            self.assertEqual(ring.size, 4096 + 2 * slots * half)
            self.assertEqual(os.stat("/dev/shm" + ring.name).st_size, ring.size)
            self.assertEqual(struct.unpack_from("<QIIQ", ring._mm, 0), (MAGIC, 2, slots, half))
            self.assertEqual((self.client.calls[1][0], self.client.calls[1][1].byte_size), ("OpenRing", ring.size))
            server = PlayedSlotServer(ring, slots, hold=True)
            try:
                qs = [self.q() for _ in range(slots + 2)]
                pending = [self.submit(ring, q) for q in qs[:slots]]
                self.assertEqual(word(ring, REQUEST_SEQ), slots)
                for n in range(1, slots + 1):  # request n in slot n % S: 1, 2, 3, then 4 in slot 0
                    req = read_frame(ring._mm, HEADER + 2 * (n % slots) * half)
                    self.assertEqual((req["magic"], req["tag"], req["ids"]), (REQUEST_MAGIC, n, self.seqs))
                    np.testing.assert_array_equal(req["q"], qs[n - 1])
                server.release(slots)
                for n, p in enumerate(pending, 1):
                    self.assert_answer(p, qs[n - 1], n)
                    resp = HEADER + (2 * (n % slots) + 1) * half  # each answer in its slot's response half
                    self.assertEqual(struct.unpack_from("<IiQ", ring._mm, resp + 8), (RESPONSE_MAGIC, 0, n))
                # Requests 5 and 6 reuse slots 1 and 2.
                server.release(2)
                for n in (5, 6):
                    self.assert_answer(self.submit(ring, qs[n - 1]), qs[n - 1], n)
                    req = read_frame(ring._mm, HEADER + 2 * (n % slots) * half)
                    self.assertEqual(req["tag"], n)
                self.assertEqual(server.violations, [])
            finally:
                server.close()

    def test_posts_every_slot_before_any_answer_and_reads_in_any_order(self):
        slots = 4
        with _ring.Ring(self.client, version=2, slots=slots) as ring:
            server = PlayedSlotServer(ring, slots, hold=True)
            try:
                qs = [self.q() for _ in range(slots)]
                pending = [self.submit(ring, q) for q in qs]
                deadline = time.monotonic() + 5
                while len(server.seen) < 1 and time.monotonic() < deadline:
                    time.sleep(0.01)
                self.assertEqual(word(ring, REQUEST_SEQ), slots, "every slot posted before any answer")
                self.assertEqual(word(ring, RESPONSE_SEQ), 0)
                self.assertFalse(any(p.done() for p in pending))
                server.release(slots)
                for i in (2, 0, 3, 1):  # reading the third reads (and keeps) the first two on the way
                    self.assert_answer(pending[i], qs[i], i + 1)
                    if i == 2:
                        self.assertEqual([p.done() for p in pending], [True, True, True, False])
                self.assertEqual(ring.stats.round_trips, slots)
                self.assertEqual(server.violations, [])
            finally:
                server.close()

    def test_one_more_than_the_slots_waits_for_the_oldest(self):
        slots = 2
        with _ring.Ring(self.client, version=2, slots=slots, spin_us=0) as ring:
            server = PlayedSlotServer(ring, slots, hold=True)
            try:
                qs = [self.q() for _ in range(slots + 1)]
                pending = [self.submit(ring, q) for q in qs[:slots]]
                seq_at_release = []

                def release_one():
                    seq_at_release.append(word(ring, REQUEST_SEQ))
                    server.release()
                timer = threading.Timer(0.3, release_one)
                start = time.monotonic()
                timer.start()
                pending.append(self.submit(ring, qs[slots]))  # waits for request 1's answer
                waited = time.monotonic() - start
                timer.join()
                self.assertGreaterEqual(waited, 0.25)
                self.assertEqual(seq_at_release, [slots], "the third was posted only after the first answer")
                self.assertEqual(word(ring, REQUEST_SEQ), slots + 1)
                self.assertEqual([p.done() for p in pending], [True, False, False], "the oldest was read and kept")
                server.release(2)
                for i in (2, 1, 0):
                    self.assert_answer(pending[i], qs[i], i + 1)
                self.assertEqual(server.violations, [])
            finally:
                server.close()

    def test_blocking_calls_beside_pending_ones(self):
        """decode() and prefill() wait for their own answer; earlier pending results stay readable, also after
        their slots were reused (each answer was copied out of its slot before the slot's next request)."""
        slots = 2
        with _ring.Ring(self.client, version=2, slots=slots) as ring:
            server = PlayedSlotServer(ring, slots)
            try:
                qs = [self.q() for _ in range(6)]
                first = [self.submit(ring, q) for q in qs[:2]]
                out, lengths = ring.decode(0, self.seqs, qs[2], self.kv, self.kv, return_lengths=True)  # request 3
                np.testing.assert_array_equal(out, qs[2][:, 0])
                self.assertEqual(lengths, frame_lengths(3, 2))
                self.assertTrue(first[0].done(), "request 3 reused request 1's slot: its answer was read first")
                self.assertFalse(first[1].done())
                for n in (4, 5, 6):  # every slot reused again
                    np.testing.assert_array_equal(ring.decode(0, self.seqs, qs[n - 1], self.kv, self.kv),
                                                  qs[n - 1][:, 0])
                for n in (2, 1):
                    self.assert_answer(first[n - 1], qs[n - 1], n)
                self.assertEqual(server.violations, [])
            finally:
                server.close()

    def test_one_slot_submit_then_decode(self):
        with _ring.Ring(self.client, version=2) as ring:
            server = PlayedSlotServer(ring, 1)
            try:
                qs = [self.q() for _ in range(4)]
                p = self.submit(ring, qs[0])
                for n in (2, 3):  # the twin shortcut, after the submit's answer was read
                    np.testing.assert_array_equal(ring.decode(0, self.seqs, qs[n - 1], self.kv, self.kv),
                                                  qs[n - 1][:, 0])
                self.assertIsNotNone(ring._v2_last)
                p4 = self.submit(ring, qs[3])
                self.assert_answer(p4, qs[3], 4)
                self.assert_answer(p, qs[0], 1)
                self.assertEqual(server.violations, [])
            finally:
                server.close()

    def test_a_closed_ring_fails_every_pending_request(self):
        slots = 4

        def answer_once(n, req):
            if n == 1:
                return frame_answer(n, req)
            set_word(ring, CLOSED, 1)
            server.futex_wake(RESPONSE_SEQ)
            return None
        with _ring.Ring(self.client, version=2, slots=slots, spin_us=0) as ring:
            server = PlayedSlotServer(ring, slots, answer=answer_once, hold=True)
            try:
                qs = [self.q() for _ in range(slots)]
                pending = [self.submit(ring, q) for q in qs]
                server.release(slots)
                start = time.monotonic()
                for p in pending[:0:-1]:
                    with self.assertRaises(attnd.AttndError) as ctx:
                        p.result()
                    self.assertIs(ctx.exception.code, SC.UNAVAILABLE)
                    self.assertEqual(ctx.exception.message, "the ring was closed by the server")
                self.assertLess(time.monotonic() - start, 5)
                self.assert_answer(pending[0], qs[0], 1)  # answered before the ring closed
                before = word(ring, REQUEST_SEQ)
                with self.assertRaises(attnd.AttndError) as ctx:
                    self.submit(ring, qs[0])
                self.assertIs(ctx.exception.code, SC.UNAVAILABLE)
                self.assertEqual(word(ring, REQUEST_SEQ), before, "nothing posted on a closed ring")
            finally:
                server.close()

    def test_timeout_fails_its_pending_and_later_ones_still_land(self):
        slots = 2
        with _ring.Ring(self.client, version=2, slots=slots, timeout=0.2) as ring:
            server = PlayedSlotServer(ring, slots, hold=True)
            try:
                qs = [self.q() for _ in range(4)]
                pending = [self.submit(ring, q) for q in qs[:2]]
                with self.assertRaises(attnd.AttndError) as ctx:
                    pending[0].result()
                self.assertIs(ctx.exception.code, SC.DEADLINE_EXCEEDED)
                self.assertIn("no answer in the ring within 0.2s", ctx.exception.message)
                self.assertTrue(pending[0].done())
                server.release(2)
                deadline = time.monotonic() + 5
                while word(ring, RESPONSE_SEQ) != 2 and time.monotonic() < deadline:
                    time.sleep(0.01)
                self.assert_answer(pending[1], qs[1], 2)
                ring.timeout = 5.0
                server.release(2)
                for n in (3, 4):  # request 3 reuses the abandoned request's slot
                    self.assert_answer(self.submit(ring, qs[n - 1]), qs[n - 1], n)
                with self.assertRaises(attnd.AttndError) as ctx:
                    pending[0].result()  # its failure stays
                self.assertIs(ctx.exception.code, SC.DEADLINE_EXCEEDED)
                self.assertEqual(server.violations, [])
            finally:
                server.close()

    def test_a_wrong_tag_or_an_error_fails_only_its_own_request(self):
        slots = 4

        def answer(n, req):
            if n == 2:
                return frame_answer(n, req, tag_delta=5)
            if n == 3:
                return frame_answer(n, req, code=5, message="seq gone")
            return frame_answer(n, req)
        with _ring.Ring(self.client, version=2, slots=slots) as ring:
            server = PlayedSlotServer(ring, slots, answer=answer)
            try:
                qs = [self.q() for _ in range(slots)]
                pending = [self.submit(ring, q) for q in qs]
                self.assert_answer(pending[3], qs[3], 4)
                with self.assertRaises(attnd.AttndError) as ctx:
                    pending[1].result()
                self.assertIs(ctx.exception.code, SC.INTERNAL)
                self.assertEqual(ctx.exception.message, "the ring answered tag 7 (magic 0x32524652) for request tag 2")
                with self.assertRaises(attnd.AttndError) as ctx:
                    pending[2].result()
                self.assertIs(ctx.exception.code, SC.NOT_FOUND)
                self.assertEqual(ctx.exception.message, "seq gone")
                self.assert_answer(pending[0], qs[0], 1)
            finally:
                server.close()

    def test_close_reads_what_is_owed_and_an_exception_cancels_it(self):
        slots = 4
        ring = _ring.Ring(self.client, version=2, slots=slots)
        server = PlayedSlotServer(ring, slots, delay=0.02)
        try:
            qs = [self.q() for _ in range(3)]
            pending = [self.submit(ring, q) for q in qs]
            ring.close()
        finally:
            server.close()
        for n, p in enumerate(pending, 1):
            self.assertTrue(p.done())
            self.assert_answer(p, qs[n - 1], n)
        with self.assertRaises(ZeroDivisionError):
            with _ring.Ring(self.client, version=2, slots=slots) as ring:
                server = PlayedSlotServer(ring, slots, hold=True)
                try:
                    p = self.submit(ring, qs[0])
                    1 / 0
                finally:
                    server.close()
        with self.assertRaises(attnd.AttndError) as ctx:
            p.result()
        self.assertIs(ctx.exception.code, SC.CANCELLED)
        self.assertIn("closed on an exception", ctx.exception.message)

    def test_bad_slots_are_refused_before_anything_is_created(self):
        created = []
        shm_create = attnd._regions.shm_create

        def counting(*args):
            created.append(args)
            return shm_create(*args)
        attnd._regions.shm_create = counting
        try:
            cases = [  # (kwargs, server's max_ring_slots, code, message)
                (dict(slots=s), 16, SC.INVALID_ARGUMENT,
                 "ring slots must be a power of two from 1 to 16 (requests in flight), got %r" % (s,))
                for s in (0, -1, 3, 6, 17, 32, True, 2.0, "4", None)
            ] + [
                (dict(slots=2, version=1), 16, SC.INVALID_ARGUMENT,
                 "ring slots > 1 need a version 2 ring (binary frames); a version 1 ring carries one request at a "
                 "time"),
                (dict(slots=4, device_events=True), 16, SC.INVALID_ARGUMENT,
                 "a ring with device_events carries one request at a time: open it with slots=1 (got slots=4)"),
                (dict(slots=8), 4, SC.FAILED_PRECONDITION,
                 "this server takes at most 4 requests in flight per ring (GetServerInfo().regions.max_ring_slots), "
                 "not slots=8: open the ring with slots=4 or fewer"),
                (dict(slots=2), 0, SC.FAILED_PRECONDITION,
                 "this server takes one request at a time per ring (GetServerInfo().regions.max_ring_slots is 0: an "
                 "attnd that predates ring slots), not slots=2: open the ring with slots=1, or upgrade attnd"),
            ]
            for kwargs, most, code, message in cases:
                with self.subTest(kwargs=kwargs, max_ring_slots=most):
                    client = FakeClient(max_ring_slots=most)
                    kwargs.setdefault("version", 2)
                    with self.assertRaises(attnd.AttndError) as ctx:
                        _ring.Ring(client, **kwargs)
                    self.assertIs(ctx.exception.code, code)
                    self.assertEqual(ctx.exception.message, message)
                    self.assertEqual(created, [])
                    want = [("GetServerInfo", None)] if code is SC.FAILED_PRECONDITION else []
                    self.assertEqual(client.calls, want, "refused before OpenRing (bad arguments before asking)")
            with _ring.Ring(FakeClient(max_ring_slots=4), version=2, slots=4) as ring:  # the server's most
                self.assertEqual(ring.slots, 4)
            with _ring.Ring(FakeClient(), version=2, slots=1):  # an old server: one slot
                pass
        finally:
            attnd._regions.shm_create = shm_create
        with _ring.Ring(FakeClient(), version=1) as ring:
            with self.assertRaises(attnd.AttndError) as ctx:
                ring.submit_decode(0, self.seqs, self.q(), self.kv, self.kv)
            self.assertIs(ctx.exception.code, SC.FAILED_PRECONDITION)
            self.assertIn("submit_decode needs a version 2 ring", ctx.exception.message)
            self.assertEqual(word(ring, REQUEST_SEQ), 0)

    def test_sequence_words_wrap(self):
        slots = 4
        with _ring.Ring(self.client, version=2, slots=slots) as ring:
            set_word(ring, REQUEST_SEQ, SEQ_MASK - 1)
            set_word(ring, RESPONSE_SEQ, SEQ_MASK - 1)
            server = PlayedSlotServer(ring, slots, hold=True)
            try:
                qs = [self.q() for _ in range(6)]
                pending = [self.submit(ring, q) for q in qs[:4]]  # requests 2^32 - 1, 0, 1, 2
                self.assertEqual(word(ring, REQUEST_SEQ), 2)
                server.release(6)
                pending += [self.submit(ring, q) for q in qs[4:]]
                for i in (5, 0, 3, 1, 4, 2):
                    self.assert_answer(pending[i], qs[i], (SEQ_MASK - 1 + i + 1) & SEQ_MASK)
                self.assertEqual(server.violations, [])
            finally:
                server.close()

    def test_twin_calls_write_and_read_as_full_calls(self):
        """A decode loop's calls after the first are twins (same ids, shapes and dtypes), which skip to writing
        the frame and read an answer like their twin's without its checks. Each step of one ring taking that
        shortcut and of one made to take the full path every time: the same request bytes, outputs (dtype,
        shape, read-only), lengths and errors; with one slot and with two (alternating halves)."""
        def answer(n, req):
            if n == 4:
                return frame_answer(n, req, code=5, message="seq gone")
            if n == 5:
                return frame_answer(n, req, tag_delta=3)
            return frame_answer(n, req)

        for slots, dtype in ((1, np.float32), (2, np.uint16)):
            steps = [(layer, self.q().astype(dtype), self.kv.astype(dtype), (self.kv + layer).astype(dtype))
                     for layer in (0, 7, 3, 1, 2, 5, 4)]
            runs = []
            for full in (False, True):
                with _ring.Ring(self.client, half_bytes=2 * 4096, version=2, slots=slots) as ring:
                    requests = []

                    def recorded(n, req, ring=ring, requests=requests):
                        at = slot_request_offset(ring.half_bytes, slots, n)
                        requests.append(bytes(ring._mm[at:at + 8 + struct.unpack_from("<Q", ring._mm, at)[0]]))
                        return answer(n, req)
                    server = PlayedSlotServer(ring, slots, answer=recorded)
                    results = []
                    try:
                        for layer, q, k, v in steps:
                            if full:
                                ring._v2_last = None
                            twin = ring._v2_last
                            try:
                                out, lengths = ring.decode(layer, self.seqs, q, k, v, return_lengths=True)
                                results.append((out.dtype, out.shape, out.flags.writeable, out.tobytes(), lengths))
                            except attnd.AttndError as err:
                                results.append((err.code, err.message))
                            if not full and twin is not None:
                                self.assertIs(ring._v2_last, twin, "step %d is its twin's" % len(results))
                    finally:
                        server.close()
                runs.append((requests, results))
            (twin_requests, twin_results), (full_requests, full_results) = runs
            self.assertEqual(len(twin_requests), len(steps))
            for i, (a, b) in enumerate(zip(twin_requests, full_requests)):
                self.assertEqual(a, b, "request %d (slots=%d)" % (i + 1, slots))
            self.assertEqual(twin_results, full_results)
            self.assertEqual(full_results[3], (SC.NOT_FOUND, "seq gone"))
            self.assertIs(full_results[4][0], SC.INTERNAL)
            for i, (_, q, _, _) in enumerate(steps):
                if i not in (3, 4):
                    self.assertEqual(full_results[i][:3], (np.dtype(dtype), (2, 4, 8), False))
                    self.assertEqual(full_results[i][3], np.ascontiguousarray(q[:, 0]).tobytes())
                    self.assertEqual(full_results[i][4], frame_lengths(i + 1, 2))


class RingAdapter:
    """A Ring where test_golden.run_golden expects a client: sequences are created and released over gRPC."""

    def __init__(self, client, ring):
        self.client, self.ring = client, ring

    def create_sequence(self):
        return self.client.create_sequence()

    def release(self, seq):
        return self.client.release(seq)

    def prefill(self, *args, **kwargs):
        return self.ring.prefill(*args, **kwargs)

    def decode(self, *args, **kwargs):
        return self.ring.decode(*args, **kwargs)


class LiveRing(at.DaemonTestCase, unittest.TestCase):
    KV_DTYPE = "fp32"
    RING_VERSION = 1

    def ring(self, **kwargs):
        return self.client.ring(version=self.RING_VERSION, **kwargs)

    def setUp(self):
        m = self.info.model
        self.h, self.hkv, self.d = m.num_q_heads, m.num_kv_heads, m.head_dim
        self.cfg = dca_ref.DcaConfig(self.info.dca.chunk_size, self.info.dca.local_size,
                                     self.info.dca.original_max_position_embeddings, m.softmax_scale,
                                     self.h, self.hkv, self.d)
        self.rng = np.random.default_rng(11)

    def tokens(self, t, variants=5, lead=None):
        r, h, hkv, d = self.rng, self.h, self.hkv, self.d
        lead = (t,) if lead is None else lead
        return (at.random_bf16_exact(r, lead + ((variants,) if variants else ()) + (h, d)),
                at.random_bf16_exact(r, lead + (hkv, d)), at.random_bf16_exact(r, lead + (hkv, d)))

    def test_server_serves_rings(self):
        self.assertTrue(self.info.regions.rings)

    def test_golden_fp32_bf16_fp16(self):
        with self.ring() as ring:
            target = RingAdapter(self.client, ring)
            stats = test_golden.run_golden(self, target, 0, lambda x: x, lambda x: x, np.float32,
                                           variants=lambda i: 3 if i % 2 else 5)
            self.assertLessEqual(max(s[1] for s in stats), test_golden.FP32_MAX_ABS, test_golden.fmt(stats))
            stats = test_golden.run_golden(self, target, 1, attnd.float32_to_bf16, attnd.bf16_to_float32, np.uint16)
            self.assertLessEqual(max(s[1] for s in stats), test_golden.BF16_MAX_ABS, test_golden.fmt(stats))
            self.assertLessEqual(max(s[2] for s in stats), test_golden.BF16_MEAN_ABS, test_golden.fmt(stats))
            stats = test_golden.run_golden(self, target, 0, lambda x: x.astype(np.float16),
                                           lambda x: x.astype(np.float32), np.float16)
            self.assertLessEqual(max(s[1] for s in stats), test_golden.BF16_MAX_ABS, test_golden.fmt(stats))
            self.assertGreater(ring.stats.round_trips, 100)

    def test_packed_batches_equal_unary_and_the_reference(self):
        n = 5
        a = [self.client.create_sequence() for _ in range(n)]
        b = [self.client.create_sequence() for _ in range(n)]
        refs = [dca_ref.RefLayer(self.cfg) for _ in range(n)]
        try:
            with self.ring() as ring:
                for i in range(n):
                    q, k, v = self.tokens(4 + i)
                    got, length = ring.prefill(a[i], 0, q, k, v, return_length=True)
                    want = self.client.prefill(b[i], 0, q, k, v)
                    np.testing.assert_array_equal(got, want)
                    self.assertEqual(length, 4 + i)
                    self.assertLessEqual(at.error_stats(got, refs[i].prefill(q, k, v))[0], 1e-4)
                for step, variants in enumerate((5, 3, 5, 3)):
                    q, k, v = self.tokens(None, variants, lead=(n,))
                    got, lengths = ring.decode(0, a, q, k, v, return_lengths=True)
                    want, want_lengths = self.client.decode(0, b, q, k, v, return_lengths=True)
                    np.testing.assert_array_equal(got, want)
                    self.assertEqual(lengths, want_lengths)
                    self.assertEqual(lengths, [4 + i + step + 1 for i in range(n)])
                    ref = np.stack([refs[i].decode(q[i], k[i], v[i]) for i in range(n)])
                    self.assertLessEqual(at.error_stats(got, ref)[0], 1e-4)
                # bf16 bits and fp16 in, the same dtype out, as unary.
                for wire in (attnd.float32_to_bf16, lambda x: x.astype(np.float16),
                             lambda x: attnd.float32_to_bf16(x).view(np.int16)):
                    q, k, v = (wire(x) for x in self.tokens(None, 5, lead=(n,)))
                    got = ring.decode(0, a, q, k, v)
                    want = self.client.decode(0, b, q, k, v)
                    self.assertEqual(got.dtype, want.dtype)
                    np.testing.assert_array_equal(got, want)
                # The general path (mixed layouts, a tuple of ids) through the ring too.
                q5, k, v = self.tokens(None, 5, lead=(n,))
                got = ring.decode(0, tuple(a), list(q5), k, v, q_layout=["variants"] * n)
                want = self.client.decode(0, b, q5, k, v)
                np.testing.assert_array_equal(got, want)
                self.assertGreaterEqual(ring.stats.round_trips, n + 8)
        finally:
            for s in a + b:
                self.client.release(s)

    def test_region_references_through_the_ring(self):
        seq, twin = self.client.create_sequence(), self.client.create_sequence()
        try:
            q, k, v = self.tokens(6)
            with self.client.register_shm(1 << 20) as region, self.ring() as ring:
                rq, rk, rv = (region.ndarray(x.shape, np.float32) for x in (q, k, v))
                rq[...], rk[...], rv[...] = q, k, v
                out = region.ndarray((6, self.h, self.d), np.float32)
                self.assertIs(ring.prefill(seq, 0, rq, rk, rv, out=out), out)
                np.testing.assert_array_equal(out, self.client.prefill(twin, 0, q, k, v))
                q1, k1, v1 = self.tokens(None, 3, lead=(1,))
                rq1 = region.ndarray(q1.shape, np.float32)
                rq1[...] = q1
                np.testing.assert_array_equal(ring.decode(0, [seq], rq1, k1, v1),
                                              self.client.decode(0, [twin], q1, k1, v1))
        finally:
            self.client.release(seq)
            self.client.release(twin)

    def assertSameError(self, ring_call, unary_call, names=()):
        """Both calls fail with the same code and message (each (ring's, unary's) pair of `names`, the twin
        sequences' ids, read as one); returns the ring's error."""
        with self.assertRaises(attnd.AttndError) as via_ring:
            ring_call()
        with self.assertRaises(attnd.AttndError) as via_unary:
            unary_call()
        self.assertIs(via_ring.exception.code, via_unary.exception.code, via_ring.exception.message)
        message = via_unary.exception.message
        for mine, theirs in names:
            message = message.replace(theirs, mine)
        self.assertEqual(via_ring.exception.message, message)
        return via_ring.exception

    def test_bad_inputs_fail_as_unary_and_change_nothing(self):
        c = self.client
        seq, twin, empty = c.create_sequence(), c.create_sequence(), c.create_sequence()
        unknown = "0123456789abcdef0123456789abcdef"
        try:
            with self.ring() as ring:
                q, k, v = self.tokens(6)
                for s, target in ((seq, ring), (twin, c)):
                    target.prefill(s, 0, q, k, v)
                q1, k1, v1 = self.tokens(None, 5, lead=(1,))
                bad_v = np.zeros((6, self.hkv + 1, self.d), np.float32)
                cases = [  # (code, fragment, call(target, sequence))
                    (SC.NOT_FOUND, "not found", lambda t, s: t.prefill(unknown, 0, q, k, v)),
                    (SC.NOT_FOUND, "not found", lambda t, s: t.decode(0, [unknown], q1, k1, v1)),
                    (SC.NOT_FOUND, "entries[1]", lambda t, s: t.decode(0, [s, unknown], np.repeat(q1, 2, 0),
                                                                       np.repeat(k1, 2, 0), np.repeat(v1, 2, 0))),
                    (SC.INVALID_ARGUMENT, "shape", lambda t, s: t.prefill(s, 0, q[:, :4], k, v)),
                    (SC.INVALID_ARGUMENT, "shape", lambda t, s: t.prefill(s, 0, q, k[:5], v)),
                    (SC.INVALID_ARGUMENT, "shape", lambda t, s: t.prefill(s, 0, q, k, bad_v)),
                    (SC.INVALID_ARGUMENT, "dtype", lambda t, s: t.prefill(s, 0, q, k.astype(np.float16), v)),
                    (SC.INVALID_ARGUMENT, "dtype", lambda t, s: t.decode(0, [s], q1, k1.astype(np.float16), v1)),
                    (SC.INVALID_ARGUMENT, "layer", lambda t, s: t.prefill(s, self.info.model.num_layers, q, k, v)),
                    (SC.INVALID_ARGUMENT, "layer", lambda t, s: t.decode(self.info.model.num_layers, [s], q1, k1,
                                                                         v1)),
                    (SC.INVALID_ARGUMENT, "shape", lambda t, s: t.decode(0, [s], q1[:, :4], k1, v1)),
                    (SC.INVALID_ARGUMENT, "", lambda t, s: t.decode(0, [s, s], np.repeat(q1, 2, 0),
                                                                    np.repeat(k1, 2, 0), np.repeat(v1, 2, 0))),
                    (SC.INVALID_ARGUMENT, "batch", lambda t, s: t.decode(0, [s, unknown, unknown], q1, k1, v1)),
                    (SC.INVALID_ARGUMENT, "float64", lambda t, s: t.decode(0, [s], q1.astype(np.float64), k1, v1)),
                    (SC.INVALID_ARGUMENT, "sequence id must be a str", lambda t, s: t.decode(0, [7], q1, k1, v1)),
                    (SC.INVALID_ARGUMENT, "", lambda t, s: t.decode(0, ["not-an-id"], q1, k1, v1)),
                    (SC.FAILED_PRECONDITION, "", lambda t, s: t.decode(1, [s], q1, k1, v1)),
                    (SC.FAILED_PRECONDITION, "", lambda t, s: t.decode(0, [s, empty], np.repeat(q1, 2, 0),
                                                                       np.repeat(k1, 2, 0), np.repeat(v1, 2, 0))),
                ]
                for code, fragment, call in cases:
                    with self.subTest(code=code, fragment=fragment):
                        err = self.assertSameError(lambda: call(ring, seq), lambda: call(c, twin), [(seq, twin)])
                        self.assertIs(err.code, code, err.message)
                        self.assertIn(fragment, err.message)
                        self.assertTrue(err.message)
                # Nothing changed: the next good decode makes the layer 7 tokens long in both, equal outputs.
                got, lengths = ring.decode(0, [seq], q1, k1, v1, return_lengths=True)
                want, want_lengths = c.decode(0, [twin], q1, k1, v1, return_lengths=True)
                self.assertEqual(lengths, [7])
                self.assertEqual(want_lengths, [7])
                np.testing.assert_array_equal(got, want)
        finally:
            for s in (seq, twin, empty):
                c.release(s)

    def test_request_larger_than_the_half_is_refused_before_sending(self):
        seq = self.client.create_sequence()
        try:
            with self.ring(half_bytes=8192) as ring:
                q, k, v = self.tokens(16)
                with self.assertRaises(attnd.AttndError) as ctx:
                    ring.prefill(seq, 0, q, k, v)
                self.assertIs(ctx.exception.code, SC.RESOURCE_EXHAUSTED)
                self.assertRegex(ctx.exception.message, r"^request of \d+ bytes exceeds the ring's 8184-byte half")
                self.assertEqual(word(ring, REQUEST_SEQ), 0, "nothing was sent")
                out, length = ring.prefill(seq, 0, q[:1], k[:1], v[:1], return_length=True)
                self.assertEqual(length, 1, "the refused prefill appended nothing")
        finally:
            self.client.release(seq)

    def test_close_ring_makes_it_unavailable(self):
        seq = self.client.create_sequence()
        try:
            ring = self.ring()
            q, k, v = self.tokens(3)
            ring.prefill(seq, 0, q, k, v)
            self.client._call(self.client.stub.CloseRing, pb.CloseRingRequest(ring_id=ring.ring_id), None)
            deadline = time.monotonic() + 5
            while not ring.closed_by_server and time.monotonic() < deadline:
                time.sleep(0.01)
            self.assertTrue(ring.closed_by_server)
            with self.assertRaises(attnd.AttndError) as ctx:
                ring.prefill(seq, 0, q, k, v)
            self.assertIs(ctx.exception.code, SC.UNAVAILABLE)
            self.assertEqual(ctx.exception.message, "the ring was closed by the server")
            name = ring.name
            ring.close()  # CloseRing's NOT_FOUND is dropped; the memory goes
            ring.close()
            self.assertFalse(os.path.exists("/dev/shm" + name))
            with self.assertRaises(attnd.AttndError) as ctx:
                ring.decode(0, [seq], q[:1], k[:1], v[:1])
            self.assertIs(ctx.exception.code, SC.FAILED_PRECONDITION)
            self.assertEqual(self.client.prefill(seq, 0, q[:1], k[:1], v[:1], return_length=True)[1], 4,
                             "the refused request changed nothing")
        finally:
            self.client.release(seq)


class LiveRingV2(LiveRing):
    """Every LiveRing test through a version 2 ring (binary frames), and what only frames carry."""
    RING_VERSION = 2

    def test_header_says_version_2(self):
        with self.ring() as ring:
            self.assertEqual(struct.unpack_from("<I", ring._mm, 8)[0], 2)

    def test_device_events_need_the_cuda_backend(self):
        """The CPU daemon orders no ring on the device: the client says so from GetServerInfo before opening, and
        the server itself refuses OpenRing(device_events) with what it needs."""
        self.assertFalse(self.info.regions.device_ordered_rings)
        self.assertFalse(self.info.regions.cuda_mps)
        with self.assertRaises(attnd.AttndError) as e:
            self.client.ring(version=2, device_events=True)
        self.assertEqual(e.exception.code, grpc.StatusCode.FAILED_PRECONDITION)
        self.assertIn("device_ordered_rings", e.exception.message)
        with self.assertRaises(attnd.AttndError) as e:
            self.client.ring(version=1, device_events=True)
        self.assertEqual(e.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
        with self.ring() as ring:  # a real ring object, opened again with device_events by hand
            with self.assertRaises(grpc.RpcError) as e:
                self.client._stub.OpenRing(pb.OpenRingRequest(name=ring.name, byte_size=ring.size,
                                                              device_events=True))
            self.assertEqual(e.exception.code(), grpc.StatusCode.FAILED_PRECONDITION)
            self.assertIn("device_events need attnd on one CUDA GPU", e.exception.details())

    def test_packed_decode_with_region_references_and_output_region(self):
        n = 3
        a = [self.client.create_sequence() for _ in range(n)]
        b = [self.client.create_sequence() for _ in range(n)]
        try:
            with self.client.register_shm(1 << 20) as region, self.ring() as ring:
                for i in range(n):
                    q, k, v = self.tokens(5)
                    ring.prefill(a[i], 0, q, k, v, prompt_len=9)
                    self.client.prefill(b[i], 0, q, k, v, prompt_len=9)
                for step in range(3):  # the same frame, reused with a new tag and the refs' new contents
                    q, k, v = self.tokens(None, 3, lead=(n,))
                    rq, rk, rv = (region.ndarray(x.shape, np.float32, offset=o) for x, o in
                                  ((q, 0), (k, 1 << 16), (v, 2 << 16)))
                    rq[...], rk[...], rv[...] = q, k, v
                    out = region.ndarray((n, self.h, self.d), np.float32, offset=3 << 16)
                    got, lengths = ring.decode(0, a, rq, rk, rv, out=out, return_lengths=True)
                    self.assertIs(got, out)
                    self.assertEqual(lengths, [6 + step] * n)
                    np.testing.assert_array_equal(out, self.client.decode(0, b, q, k, v))
                self.assertEqual(len(ring._frames), n + 1)  # a prefill frame per sequence, one decode frame
        finally:
            for s in a + b:
                self.client.release(s)

    def test_a_decode_loop_of_one_shape_sends_each_steps_data(self):
        """A decode loop's calls after the first are twins (same ids, shapes and dtypes): the client skips to
        writing the frame, and each step's answer is still that step's (equal to unary). Inputs the client
        reinterprets (bf16 bits as int16, viewed as uint16) never take that shortcut, and a call that differs
        from its twin only by a bad id is still refused."""
        n = 3
        a = [self.client.create_sequence() for _ in range(n)]
        b = [self.client.create_sequence() for _ in range(n)]
        try:
            with self.ring() as ring:
                for i in range(n):
                    q, k, v = self.tokens(4)
                    ring.prefill(a[i], 0, q, k, v)
                    self.client.prefill(b[i], 0, q, k, v)
                for step in range(4):
                    q, k, v = self.tokens(None, 3, lead=(n,))
                    if step >= 2:
                        q, k, v = (attnd.float32_to_bf16(x).view(np.int16) for x in (q, k, v))
                    got = ring.decode(0, a, q, k, v)
                    np.testing.assert_array_equal(got, self.client.decode(0, b, q, k, v), "step %d" % step)
                    if step == 1:
                        self.assertIsNotNone(ring._v2_last, "a plain call is remembered for its twin")
                self.assertEqual(ring._v2_last.sig[5], np.float32, "reinterpreted inputs are never remembered")
                q, k, v = self.tokens(None, 3, lead=(n,))
                with self.assertRaises(attnd.AttndError) as ctx:
                    ring.decode(0, a[:2] + [7], q, k, v)
                self.assertIs(ctx.exception.code, SC.INVALID_ARGUMENT)
        finally:
            for s in a + b:
                self.client.release(s)

    def test_mixed_layouts_are_refused_by_the_client(self):
        seq = self.client.create_sequence()
        try:
            with self.ring() as ring:
                q5, k, v = self.tokens(None, 5, lead=(1,))
                with self.assertRaises(attnd.AttndError) as ctx:
                    ring.decode(0, [seq], list(q5), k, v, q_layout=["variants", "pre_rotary"])
                self.assertIs(ctx.exception.code, SC.INVALID_ARGUMENT)
                self.assertIn("one q_layout", ctx.exception.message)
                self.assertEqual(ring.stats.round_trips, 0)
        finally:
            self.client.release(seq)


class LiveRingSlots(at.DaemonTestCase, unittest.TestCase):
    """Version 2 rings with several slots against attnd: decodes in flight together (through layers and steps,
    read in any order) equal bit for bit to unary calls made in the same order on twin sequences, a failing
    request among them failing alone, blocking calls between pending ones. Skipped by an attnd that takes one
    request at a time per ring."""

    def setUp(self):
        most = self.info.regions.max_ring_slots
        if most < 2:
            self.skipTest("this attnd takes one request at a time per ring (GetServerInfo().regions.max_ring_slots "
                          "is %d)" % most)
        self.slots = min(4, most)
        m = self.info.model
        self.h, self.hkv, self.d, self.layers = m.num_q_heads, m.num_kv_heads, m.head_dim, m.num_layers
        self.rng = np.random.default_rng(13)
        self.made = []

    def tearDown(self):
        for s in self.made:
            self.client.release(s)

    def twins(self, n, tokens=5):
        """n sequences for the ring and n for unary, every layer prefilled with the same tokens."""
        a = [self.client.create_sequence() for _ in range(n)]
        b = [self.client.create_sequence() for _ in range(n)]
        self.made += a + b
        for i in range(n):
            for layer in range(self.layers):
                q, k, v = self.tokens((tokens,), 5)
                self.client.prefill(a[i], layer, q, k, v)
                self.client.prefill(b[i], layer, q, k, v)
        return a, b

    def tokens(self, lead, variants):
        r = self.rng
        return (at.random_bf16_exact(r, lead + (variants, self.h, self.d)),
                at.random_bf16_exact(r, lead + (self.hkv, self.d)), at.random_bf16_exact(r, lead + (self.hkv, self.d)))

    def test_decodes_in_flight_equal_unary(self):
        n = 3
        a, b = self.twins(n)
        with self.client.ring(version=2, slots=self.slots) as ring:
            calls = [(step, layer) + self.tokens((n,), 3) for step in range(3) for layer in range(self.layers)]
            pending = [ring.submit_decode(layer, a, q, k, v, return_lengths=True) for _, layer, q, k, v in calls]
            self.assertGreater(len(calls), self.slots, "more requests than slots: some submits waited")
            want = [self.client.decode(layer, b, q, k, v, return_lengths=True) for _, layer, q, k, v in calls]
            for i in reversed(range(len(calls))):
                got, lengths = pending[i].result()
                np.testing.assert_array_equal(got, want[i][0], "call %d" % i)
                self.assertEqual(lengths, want[i][1])
                self.assertEqual(lengths, [5 + calls[i][0] + 1] * n)
            self.assertEqual(ring.stats.round_trips, len(calls))

    def test_a_failing_request_fails_alone_and_blocking_calls_go_between(self):
        n = 2
        a, b = self.twins(n)
        unknown = "0123456789abcdef0123456789abcdef"
        with self.client.ring(version=2, slots=self.slots) as ring:
            q, k, v = self.tokens((n,), 5)
            first = ring.submit_decode(0, a, q, k, v)
            bad = ring.submit_decode(0, [a[0], unknown], q, k, v)
            got = ring.decode(1, a, q, k, v)  # waits for its own answer only
            np.testing.assert_array_equal(got, self.client.decode(1, b, q, k, v))
            pq, pk, pv = self.tokens((2,), 5)
            got = ring.prefill(a[0], 1, pq, pk, pv)
            np.testing.assert_array_equal(got, self.client.prefill(b[0], 1, pq, pk, pv))
            with self.assertRaises(attnd.AttndError) as ctx:
                bad.result()
            with self.assertRaises(attnd.AttndError) as unary:
                self.client.decode(0, [b[0], unknown], q, k, v)
            self.assertIs(ctx.exception.code, SC.NOT_FOUND)
            self.assertEqual(ctx.exception.message, unary.exception.message.replace(b[0], a[0]))
            np.testing.assert_array_equal(first.result(), self.client.decode(0, b, q, k, v))
            # The failed decode changed nothing: both layers are as long in the ring's sequences as in unary's.
            q, k, v = self.tokens((n,), 3)
            for layer in range(self.layers):
                got, lengths = ring.decode(layer, a, q, k, v, return_lengths=True)
                want, want_lengths = self.client.decode(layer, b, q, k, v, return_lengths=True)
                np.testing.assert_array_equal(got, want)
                self.assertEqual(lengths, want_lengths)

    def test_micro_batches_posted_together_run_as_one_batch(self):
        rows, parts = 2, 4
        a, b = self.twins(rows * parts)
        with self.client.ring(version=2, slots=self.slots) as ring:
            for step in range(2):
                calls = [(a[i * rows:(i + 1) * rows],) + self.tokens((rows,), 3) for i in range(parts)]
                before = self.client.info().decode_batching
                pending = ring.submit_decodes(1, calls, return_lengths=True)
                self.assertEqual(len(pending), parts)
                got = [p.result() for p in pending]
                after = self.client.info().decode_batching
                self.assertEqual(after.batches - before.batches, 1, "the micro-batches ran apart")
                self.assertEqual(after.entries - before.entries, rows * parts)
                for i, (seqs, q, k, v) in enumerate(calls):
                    want = self.client.decode(1, b[i * rows:(i + 1) * rows], q, k, v, return_lengths=True)
                    np.testing.assert_array_equal(got[i][0], want[0], "step %d micro-batch %d" % (step, i))
                    self.assertEqual(got[i][1], want[1])
                    self.assertEqual(got[i][1], [5 + step + 1] * rows)
            self.assertEqual(ring.stats.round_trips, 2 * parts)

    def test_submit_decodes_posts_all_or_nothing(self):
        rows = 2
        a, b = self.twins(rows * 2)
        with self.client.ring(version=2, slots=self.slots) as ring:
            good = (a[:rows],) + self.tokens((rows,), 3)
            q, k, v = self.tokens((rows,), 3)
            bad = (a[rows:], q[:1], k, v)  # one q row for two sequences: refused before sending
            posted = ring._words[0x40 // 4]
            with self.assertRaises(attnd.AttndError) as ctx:
                ring.submit_decodes(1, [good, bad])
            self.assertIs(ctx.exception.code, SC.INVALID_ARGUMENT)
            self.assertEqual(ring._words[0x40 // 4], posted, "a refused micro-batch left the others posted")
            self.assertEqual(ring.stats.round_trips, 0)
            for refused in ([], [good] * (self.slots + 1), [("only seqs",)]):
                with self.assertRaises(attnd.AttndError) as ctx:
                    ring.submit_decodes(1, refused)
                self.assertIs(ctx.exception.code, SC.INVALID_ARGUMENT)
            # Nothing ran: the next decode finds every sequence where its unary twin is.
            q, k, v = self.tokens((2 * rows,), 3)
            got, lengths = ring.decode(1, a, q, k, v, return_lengths=True)
            want, want_lengths = self.client.decode(1, b, q, k, v, return_lengths=True)
            np.testing.assert_array_equal(got, want)
            self.assertEqual(lengths, want_lengths)
            self.assertEqual(lengths, [5 + 1] * (2 * rows))


class RingClosedByTheDaemon(unittest.TestCase):
    """A daemon that reclaims idle rings after a second, then stops: UNAVAILABLE both times."""

    def test_idle_reclamation_and_shutdown(self):
        tmp = tempfile.mkdtemp(prefix="attnd-pytest-")
        config = at.GoldenCase("dense_gqa_chunked").write_model_config(os.path.join(tmp, "config.json"))
        daemon = at.Daemon(config, extra_args=["--region-idle-timeout", "1s"])
        try:
            daemon.start()
            with attnd.Client(daemon.target, timeout=60) as client:
                m = client.info().model
                rng = np.random.default_rng(2)
                q = at.random_bf16_exact(rng, (2, 5, m.num_q_heads, m.head_dim))
                kv = at.random_bf16_exact(rng, (2, m.num_kv_heads, m.head_dim))
                seq = client.create_sequence()
                idle = client.ring()
                idle.prefill(seq, 0, q, kv, kv)
                deadline = time.monotonic() + 10
                while not idle.closed_by_server and time.monotonic() < deadline:
                    time.sleep(0.05)
                self.assertTrue(idle.closed_by_server, "the idle ring was not reclaimed within 10 s")
                with self.assertRaises(attnd.AttndError) as ctx:
                    idle.decode(0, [seq], q[:1], kv[:1], kv[:1])
                self.assertIs(ctx.exception.code, SC.UNAVAILABLE)
                idle.close()
                busy = client.ring()
                busy.decode(0, [seq], q[:1], kv[:1], kv[:1])
                daemon.stop()
                self.assertTrue(busy.closed_by_server, "a stopping daemon closes its rings")
                with self.assertRaises(attnd.AttndError) as ctx:
                    busy.decode(0, [seq], q[:1], kv[:1], kv[:1])
                self.assertIs(ctx.exception.code, SC.UNAVAILABLE)
                busy.close()
        finally:
            daemon.stop()
            shutil.rmtree(tmp, True)


class PreRotaryRing(at.DaemonTestCase, unittest.TestCase):
    """The golden dense_pre_rotary case through the ring (the daemon configured with its rotary)."""

    model_config = test_pre_rotary.PreRotary.model_config
    RING_VERSION = 1

    def test_golden_within_1e4(self):
        with self.client.ring(version=self.RING_VERSION) as ring:
            # PreRotary.replay needs only self.client and a target with prefill/decode.
            worst = test_pre_rotary.PreRotary.replay(self, RingAdapter(self.client, ring), 0)
        self.assertLessEqual(worst, 1e-4)


class PreRotaryRingV2(PreRotaryRing):
    RING_VERSION = 2


if __name__ == "__main__":
    unittest.main()
