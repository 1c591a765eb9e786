"""The packed Decode form (DecodeRequest.sequence_ids/q/k/v, DecodeResponse.o/lengths): _wire's encoder
byte-equal to the protobuf library's serialization, its answer decoder equal to protobuf's parse, the client's
choice of form, and, against a live CPU attnd, both forms equal to the fp64 reference and to each other, in
unary calls and in a Session, with malformed packed requests refused by the server."""
import os
import sys
import unittest

import grpc
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import attnd_testing as at  # noqa: E402
import dca_ref  # noqa: E402

attnd = at.attnd
pb = attnd.proto
w = attnd._wire

_NP = {pb.DTYPE_FP32: np.float32, pb.DTYPE_FP16: np.float16, pb.DTYPE_BF16: np.uint16}


def _protobuf_packed(layer, seqs, q, k, v, layout, dt):
    """The packed request built and serialized by the protobuf library (independent of _wire)."""
    t = lambda a: pb.Tensor(dtype=dt, shape=a.shape, data=a.tobytes())  # noqa: E731
    return pb.DecodeRequest(layer=layer, sequence_ids=seqs, q=t(q), k=t(k), v=t(v),
                            q_layout=layout).SerializeToString()


def _protobuf_entries(layer, seqs, q, k, v, layout, dt):
    req = pb.DecodeRequest(layer=layer)
    for i, s in enumerate(seqs):
        e = req.entries.add(sequence_id=s, q_layout=layout)
        for field, a in (("q", q), ("k", k), ("v", v)):
            getattr(e, field).CopyFrom(pb.Tensor(dtype=dt, shape=a.shape[1:], data=a[i].tobytes()))
    return req


def _batch(rng, n, dt, variants, hq=4, hkv=2, d=8):
    shape = (n, hq, d) if variants is None else (n, variants, hq, d)
    make = (lambda s: rng.integers(0, 1 << 16, s).astype(np.uint16)) if dt == pb.DTYPE_BF16 else \
        (lambda s: rng.standard_normal(s).astype(_NP[dt]))
    return make(shape), make((n, hkv, d)), make((n, hkv, d))


class PackedEncoding(unittest.TestCase):
    def test_byte_equal_to_protobuf(self):
        rng = np.random.default_rng(5)
        cases = 0
        for n in (1, 2, 17, 32):
            for dt in (pb.DTYPE_FP32, pb.DTYPE_BF16, pb.DTYPE_FP16):
                for variants, layout in ((5, 0), (3, 0), (None, 1)):
                    for ids in (["%032x" % rng.integers(1 << 62) for _ in range(n)],
                                ["inst-7.%032x" % i for i in range(n)], ["s%d" % i for i in range(n)],
                                ["é%d" % i for i in range(n)], ["x" * 200] * n):
                        q, k, v = _batch(rng, n, dt, variants)
                        layer = int(rng.integers(0, 300))  # two-byte varints too
                        got = w.decode_request_packed(layer, ids, (q, dt), (k, dt), (v, dt), layout).tobytes()
                        self.assertEqual(got, _protobuf_packed(layer, ids, q, k, v, layout, dt))
                        cases += 1
        self.assertEqual(cases, 4 * 3 * 3 * 5)

    def test_7b_rows(self):
        rng = np.random.default_rng(6)
        q, k, v = _batch(rng, 32, pb.DTYPE_BF16, 5, hq=28, hkv=4, d=128)
        ids = ["%032x" % i for i in range(32)]
        got = w.decode_request_packed(0, ids, (q, pb.DTYPE_BF16), (k, pb.DTYPE_BF16), (v, pb.DTYPE_BF16), 0)
        self.assertEqual(got.tobytes(), _protobuf_packed(0, ids, q, k, v, 0, pb.DTYPE_BF16))

    def test_client_sends_packed_unless_a_form_needs_entries(self):
        from attnd._client import _decode_request
        rng = np.random.default_rng(8)
        q, k, v = _batch(rng, 4, pb.DTYPE_FP32, 3)
        ids = ["%032x" % i for i in range(4)]
        msg, like = _decode_request(1, ids, q, k, v, q_layout="variants")
        self.assertEqual(msg.tobytes(), _protobuf_packed(1, ids, q, k, v, 0, pb.DTYPE_FP32))
        self.assertEqual(like.kind, "numpy")
        # Non-contiguous input is made contiguous first: still packed, same bytes.
        wide = np.concatenate([q, q], axis=2)[:, :, :4]
        msg, _ = _decode_request(1, ids, wide, k, v)
        self.assertEqual(msg.tobytes(), _protobuf_packed(1, ids, np.ascontiguousarray(wide), k, v, 0,
                                                         pb.DTYPE_FP32))
        # Mixed layouts (a list of rows) need entries.
        qs = [q[0], q[1, 0], q[2], q[3, 0]]
        msg, _ = _decode_request(1, ids, qs, k, v, q_layout=["variants", "pre_rotary"] * 2)
        parsed = pb.DecodeRequest.FromString(msg.tobytes())
        self.assertEqual(len(parsed.entries), 4)
        self.assertEqual(len(parsed.sequence_ids), 0)
        with self.assertRaises(attnd.AttndError) as e:
            _decode_request(1, ids, q, k[:3], v)
        self.assertIn("k: expected a leading batch dimension of 4", e.exception.message)


class PackedAnswer(unittest.TestCase):
    def test_lengths_of_every_varint_width(self):
        values = [0, 1, 127, 128, 300, 16383, 16384, 2 ** 21, 2 ** 35 + 5, 2 ** 62]
        resp = pb.DecodeResponse(lengths=values).SerializeToString()
        o, lengths = w.parse_packed_decode_response(memoryview(resp))
        self.assertEqual(lengths.tolist(), values)
        # One width for all (the matrix path), and widths that only mostly agree (the general one).
        for same in ([5, 1, 127], list(range(4096, 4128)), [2 ** 62, 2 ** 62 + 1], [300, 300, 5, 300]):
            resp = pb.DecodeResponse(lengths=same).SerializeToString()
            self.assertEqual(w.parse_packed_decode_response(memoryview(resp))[1].tolist(), same)
        self.assertEqual(w._packed_varints(b"").tolist(), [])
        for bad in (b"\x80", b"\x01\xff", b"\xff" * 11 + b"\x01"):
            with self.assertRaises(attnd.AttndError):
                w._packed_varints(bad)

    def test_decoded_equal_to_protobuf_and_to_the_entries_form(self):
        from attnd._client import _decode_output
        from attnd._tensors import Like
        rng = np.random.default_rng(9)
        for dt in (pb.DTYPE_FP32, pb.DTYPE_BF16, pb.DTYPE_FP16):
            o = _batch(rng, 5, dt, None)[0]
            lengths = [3, 130, 20000, 1, 7]
            packed = pb.DecodeResponse(o=pb.Tensor(dtype=dt, shape=o.shape, data=o.tobytes()),
                                       lengths=lengths).SerializeToString()
            entries = pb.DecodeResponse(outputs=[pb.DecodeOutput(
                o=pb.Tensor(dtype=dt, shape=o.shape[1:], data=o[i].tobytes()), length=lengths[i])
                for i in range(5)]).SerializeToString()
            like = Like("numpy", np_dtype=np.dtype(_NP[dt]))
            for resp in (packed, entries):
                got, got_lengths = _decode_output(memoryview(resp), 0, len(resp), like)
                np.testing.assert_array_equal(got, o)
                self.assertEqual(got.dtype, _NP[dt])
                self.assertEqual(got_lengths, lengths)
            # A packed answer whose rows and lengths disagree is the server's fault: INTERNAL.
            bad = pb.DecodeResponse(o=pb.Tensor(dtype=dt, shape=o.shape, data=o.tobytes()),
                                    lengths=lengths[:4]).SerializeToString()
            with self.assertRaises(attnd.AttndError) as e:
                _decode_output(memoryview(bad), 0, len(bad), like)
            self.assertEqual(e.exception.code, grpc.StatusCode.INTERNAL)


class PackedLive(at.DaemonTestCase, unittest.TestCase):
    """Client.decode (packed) and the entries form on twin sequences: both equal to the fp64 reference."""

    def setUp(self):
        m = self.info.model
        self.h, self.hkv, self.d = m.num_q_heads, m.num_kv_heads, m.head_dim
        self.cfg = dca_ref.DcaConfig(self.info.dca.chunk_size, self.info.dca.local_size,
                                     self.info.dca.original_max_position_embeddings, m.softmax_scale,
                                     self.h, self.hkv, self.d)

    def test_both_forms_match_the_reference(self):
        h, hkv, d = self.h, self.hkv, self.d
        rng = np.random.default_rng(9)
        n = 6
        a = [self.client.create_sequence() for _ in range(n)]
        b = [self.client.create_sequence() for _ in range(n)]
        c = [self.client.create_sequence() for _ in range(n)]
        refs = [dca_ref.RefLayer(self.cfg) for _ in range(n)]
        try:
            for i in range(n):
                t = 3 + i
                q = at.random_bf16_exact(rng, (t, 5, h, d))
                k = at.random_bf16_exact(rng, (t, hkv, d))
                v = at.random_bf16_exact(rng, (t, hkv, d))
                for s in (a[i], b[i], c[i]):
                    self.client.prefill(s, 0, q, k, v)
                refs[i].prefill(q, k, v)
            with self.client.session() as session:
                for step, variants in enumerate((5, 3, 5)):
                    q = at.random_bf16_exact(rng, (n, variants, h, d))
                    k = at.random_bf16_exact(rng, (n, hkv, d))
                    v = at.random_bf16_exact(rng, (n, hkv, d))
                    got, lengths = self.client.decode(0, a, q, k, v, return_lengths=True)
                    streamed = session.decode(0, c, q, k, v)
                    req = _protobuf_entries(0, b, q, k, v, 0, pb.DTYPE_FP32)
                    entries = self.client._call(self.client.stub.Decode, req, None)
                    self.assertEqual(lengths, [3 + i + step + 1 for i in range(n)])
                    self.assertEqual(lengths, [o.length for o in entries.outputs])
                    want = np.stack([refs[i].decode(q[i], k[i], v[i]) for i in range(n)])
                    entries_o = np.stack([np.frombuffer(o.o.data, np.float32).reshape(h, d)
                                          for o in entries.outputs])
                    self.assertEqual(got.shape, (n, h, d))
                    self.assertLessEqual(at.error_stats(got, want)[0], 1e-4)
                    self.assertLessEqual(at.error_stats(entries_o, want)[0], 1e-4)
                    np.testing.assert_array_equal(got, entries_o)
                    np.testing.assert_array_equal(streamed, got)
            # bf16 in, bf16 bits out, in both forms.
            q = at.f32_to_bf16_bits_exact(at.random_bf16_exact(rng, (n, 5, h, d)))
            k = at.f32_to_bf16_bits_exact(at.random_bf16_exact(rng, (n, hkv, d)))
            v = at.f32_to_bf16_bits_exact(at.random_bf16_exact(rng, (n, hkv, d)))
            got = self.client.decode(0, a, q, k, v)
            entries = self.client._call(self.client.stub.Decode,
                                        _protobuf_entries(0, b, q, k, v, 0, pb.DTYPE_BF16), None)
            self.assertEqual(got.dtype, np.uint16)
            np.testing.assert_array_equal(got, np.stack([np.frombuffer(o.o.data, np.uint16).reshape(h, d)
                                                         for o in entries.outputs]))
        finally:
            for s in a + b + c:
                self.client.release(s)

    def test_malformed_packed_requests_are_refused_and_change_nothing(self):
        h, hkv, d = self.h, self.hkv, self.d
        rng = np.random.default_rng(10)
        seqs = [self.client.create_sequence() for _ in range(2)]
        try:
            for s in seqs:
                self.client.prefill(s, 0, *(at.random_bf16_exact(rng, shape)
                                            for shape in ((4, 5, h, d), (4, hkv, d), (4, hkv, d))))
            q = at.random_bf16_exact(rng, (2, 5, h, d))
            k = at.random_bf16_exact(rng, (2, hkv, d))
            f = pb.DTYPE_FP32
            cases = [
                (_protobuf_packed(0, seqs + [seqs[0] + "x"], q, k, k, 0, f),
                 "packed q: shape must be [3, 3, %d, %d] or [3, 5, %d, %d] (one row per sequence_id, 3 "
                 "sequence_ids), got [2, 5, %d, %d]" % (h, d, h, d, h, d)),
                (_protobuf_packed(0, seqs, q, k, k[:, :1], 0, f),
                 "packed v: shape must be [2, %d, %d] (one row per sequence_id, 2 sequence_ids), got [2, 1, %d]"
                 % (hkv, d, d)),
                (_protobuf_packed(0, seqs, q, k, k, 1, f),
                 "packed q: shape must be [2, %d, %d] (one row per sequence_id, 2 sequence_ids), got "
                 "[2, 5, %d, %d]" % (h, d, h, d)),
                (pb.DecodeRequest(layer=0, sequence_ids=seqs,
                                  entries=[pb.DecodeEntry(sequence_id=seqs[0])]).SerializeToString(),
                 "a DecodeRequest carries entries (1) or the packed form (sequence_ids, q, k, v, q_layout), "
                 "not both"),
            ]
            for body, message in cases:
                with self.assertRaises(attnd.AttndError) as e:
                    self.client._call(self.client._decode, body, None)
                self.assertEqual(e.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
                self.assertEqual(e.exception.message, message)
            # A well-formed packed request with an unknown id is refused by the runtime, naming the row.
            with self.assertRaises(attnd.AttndError) as e:
                self.client.decode(0, [seqs[0], "0" * 32], q, k, k)
            self.assertEqual(e.exception.code, grpc.StatusCode.NOT_FOUND)
            self.assertIn("entries[1]", e.exception.message)
            # Nothing changed: the next good step makes each layer 5 tokens long.
            _, lengths = self.client.decode(0, seqs, q, k, k, return_lengths=True)
            self.assertEqual(lengths, [5, 5])
        finally:
            for s in seqs:
                self.client.release(s)


if __name__ == "__main__":
    unittest.main()
