"""The vectorised DecodeRequest encoding (_wire.decode_request_batch): byte-equal to the per-entry loop and to
the protobuf library's own serialization for regular batches, None for irregular ones (the client then uses
the loop), and decode results over it equal to those of protobuf-built requests against a live CPU attnd."""
import os
import sys
import unittest

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import attnd_testing as at  # noqa: E402

attnd = at.attnd
pb = attnd.proto
w = attnd._wire

_NP = {pb.DTYPE_FP32: np.float32, pb.DTYPE_FP16: np.float16, pb.DTYPE_BF16: np.uint16}


def _protobuf(layer, seqs, q, k, v, layout, dt):
    """The request built and serialized by the protobuf library (independent of _wire)."""
    req = pb.DecodeRequest(layer=layer)
    for i, s in enumerate(seqs):
        e = req.entries.add(sequence_id=s, q_layout=layout)
        for field, a in (("q", q), ("k", k), ("v", v)):
            getattr(e, field).CopyFrom(pb.Tensor(dtype=dt, shape=a.shape[1:], data=a[i].tobytes()))
    return req.SerializeToString()


class DecodeRequestBatch(unittest.TestCase):
    def batch(self, rng, n, dt, variants, hq=4, hkv=2, d=8):
        npdt = _NP[dt]
        shape = (n, hq, d) if variants is None else (n, variants, hq, d)
        make = (lambda s: rng.integers(0, 1 << 16, s).astype(np.uint16)) if dt == pb.DTYPE_BF16 else \
            (lambda s: rng.standard_normal(s).astype(npdt))
        return make(shape), make((n, hkv, d)), make((n, hkv, d))

    def test_byte_equal_to_the_loop_and_to_protobuf(self):
        rng = np.random.default_rng(5)
        cases = 0
        for n in (1, 2, 17, 32):
            for dt in (pb.DTYPE_FP32, pb.DTYPE_BF16, pb.DTYPE_FP16):
                for variants, layout in ((5, 0), (3, 0), (None, 1)):
                    for ids in (["%032x" % rng.integers(1 << 62) for _ in range(n)],
                                ["inst-7.%032x" % i for i in range(n)], ["s%02d" % i for i in range(n)]):
                        q, k, v = self.batch(rng, n, dt, variants)
                        layer = int(rng.integers(0, 300))  # two-byte varints too
                        got = w.decode_request_batch(layer, ids, (q, dt), (k, dt), (v, dt), layout)
                        self.assertIsNotNone(got)
                        got = got.tobytes()
                        loop = w.decode_request(layer, [(ids[i], (q[i], dt), (k[i], dt), (v[i], dt), layout)
                                                         for i in range(n)]).tobytes()
                        self.assertEqual(got, loop)
                        self.assertEqual(got, _protobuf(layer, ids, q, k, v, layout, dt))
                        cases += 1
        self.assertEqual(cases, 4 * 3 * 3 * 3)

    def test_large_rows_need_multi_byte_sizes(self):
        """7B geometry: 5 x 28 x 128 bf16 is 35840 bytes a row (three-byte size varints)."""
        rng = np.random.default_rng(6)
        q, k, v = self.batch(rng, 3, pb.DTYPE_BF16, 5, hq=28, hkv=4, d=128)
        ids = ["%032x" % i for i in range(3)]
        got = w.decode_request_batch(0, ids, (q, pb.DTYPE_BF16), (k, pb.DTYPE_BF16), (v, pb.DTYPE_BF16), 0)
        self.assertEqual(got.tobytes(), _protobuf(0, ids, q, k, v, 0, pb.DTYPE_BF16))

    def test_irregular_batches_are_left_to_the_loop(self):
        rng = np.random.default_rng(7)
        q, k, v = self.batch(rng, 3, pb.DTYPE_FP32, 5)
        f = pb.DTYPE_FP32
        for ids in (["a" * 32, "b" * 31, "c" * 33],  # lengths differ (the total is still 3 x 32)
                    ["é" * 4, "abcd", "wxyz"]):       # a non-ASCII id: more bytes than characters
            self.assertIsNone(w.decode_request_batch(0, ids, (q, f), (k, f), (v, f), 0))
        ids = ["%032x" % i for i in range(3)]
        self.assertIsNone(w.decode_request_batch(0, ids, (q[:, ::2], f), (k, f), (v, f), 0))  # not contiguous
        # Through the client: irregular ids and non-contiguous input fall back and still encode right.
        from attnd._client import _decode_request
        for ids in (["a" * 32, "b" * 31, "c" * 33], ["é" * 4, "abcd", "wxyz"]):
            msg, _ = _decode_request(2, ids, q, k, v)
            self.assertEqual(pb.DecodeRequest.FromString(msg.tobytes()),
                             pb.DecodeRequest.FromString(_protobuf(2, ids, q, k, v, 0, f)))

    def test_client_uses_it_and_checks_the_batch_dimension(self):
        from attnd._client import _decode_request
        rng = np.random.default_rng(8)
        q, k, v = self.batch(rng, 4, pb.DTYPE_FP32, 3)
        ids = ["%032x" % i for i in range(4)]
        msg, like = _decode_request(1, ids, q, k, v, q_layout="variants")
        self.assertEqual(msg.tobytes(), _protobuf(1, ids, q, k, v, 0, pb.DTYPE_FP32))
        self.assertEqual(like.kind, "numpy")
        with self.assertRaises(attnd.AttndError) as e:
            _decode_request(1, ids, q, k[:3], v)
        self.assertIn("k: expected a leading batch dimension of 4", e.exception.message)


class DecodeBatchLive(at.DaemonTestCase, unittest.TestCase):
    """Decode through the vectorised encoding equals decode of the same inputs sent as protobuf messages."""

    def test_batched_decode_matches_protobuf_requests(self):
        m = self.info.model
        h, hkv, d = m.num_q_heads, m.num_kv_heads, m.head_dim
        rng = np.random.default_rng(9)
        n = 6
        a = [self.client.create_sequence() for _ in range(n)]
        b = [self.client.create_sequence() for _ in range(n)]
        try:
            for i in range(n):
                t = 3 + i
                q = at.random_bf16_exact(rng, (t, 5, h, d))
                k = at.random_bf16_exact(rng, (t, hkv, d))
                v = at.random_bf16_exact(rng, (t, hkv, d))
                self.client.prefill(a[i], 0, q, k, v)
                self.client.prefill(b[i], 0, q, k, v)
            for step, (variants, layout) in enumerate(((5, "variants"), (3, "variants"), (None, "pre_rotary"))):
                q = at.random_bf16_exact(rng, (n, h, d) if variants is None else (n, variants, h, d))
                k = at.random_bf16_exact(rng, (n, hkv, d))
                v = at.random_bf16_exact(rng, (n, hkv, d))
                got, lengths = self.client.decode(0, a, q, k, v, q_layout=layout, return_lengths=True)
                req = pb.DecodeRequest.FromString(_protobuf(0, b, q, k, v, 1 if variants is None else 0,
                                                            pb.DTYPE_FP32))
                want = self.client._call(self.client.stub.Decode, req, None)
                self.assertEqual(lengths, [o.length for o in want.outputs])
                self.assertEqual(lengths, [3 + i + step + 1 for i in range(n)])
                want_o = np.stack([np.frombuffer(o.o.data, np.float32).reshape(h, d) for o in want.outputs])
                np.testing.assert_array_equal(got, want_o)
                self.assertGreater(float(np.abs(got).sum()), 0.0)
        finally:
            for s in a + b:
                self.client.release(s)


if __name__ == "__main__":
    unittest.main()
