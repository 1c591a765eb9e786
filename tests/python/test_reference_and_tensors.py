"""Checks that need no daemon: the numpy DCA reference against the golden files, and tensor conversions."""
import os
import sys
import unittest

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import attnd_testing as at  # noqa: E402
import dca_ref  # noqa: E402

attnd = at.attnd
pb = attnd.proto


class ReferenceMatchesGolden(unittest.TestCase):
    """The fp64 reference the daemon tests use is itself checked against the golden outputs."""

    def test_dense_gqa_chunked(self):
        case = at.GoldenCase("dense_gqa_chunked")
        cfg = dca_ref.DcaConfig.from_case(case.meta)
        seqs = {}
        worst = 0.0
        for step in case.steps:
            if step["op"] == "prefill":
                layer = seqs.setdefault(step["seq"], dca_ref.RefLayer(cfg))
                self.assertEqual(len(layer), step["start"])
                out = layer.prefill(case.f32(step["q"]), case.f32(step["k"]), case.f32(step["v"]),
                                    step["prompt_len"])
            else:
                q, k, v = case.f32(step["q"]), case.f32(step["k"]), case.f32(step["v"])
                out = np.stack([seqs[s].decode(q[i], k[i], v[i]) for i, s in enumerate(step["seqs"])])
                self.assertEqual([len(seqs[s]) for s in step["seqs"]], step["lens_after"])
            max_abs, _ = at.error_stats(out, case.f32(step["out"]))
            worst = max(worst, max_abs)
        self.assertLess(worst, 1e-5, "numpy reference disagrees with the golden outputs")

    def test_scaling_matters(self):
        """The golden case exercises length scaling: ignoring it must break agreement (the check can fail)."""
        case = at.GoldenCase("dense_gqa_chunked")
        cfg = dca_ref.DcaConfig.from_case(case.meta)
        cfg.omp = 0
        layer = dca_ref.RefLayer(cfg)
        step = case.steps[0]
        out = layer.prefill(case.f32(step["q"]), case.f32(step["k"]), case.f32(step["v"]), step["prompt_len"])
        max_abs, _ = at.error_stats(out, case.f32(step["out"]))
        self.assertGreater(max_abs, 1e-3)


class TensorConversion(unittest.TestCase):
    def setUp(self):
        self.rng = np.random.default_rng(1)

    def test_numpy_float32_and_float16(self):
        for dt, want in ((np.float32, pb.DTYPE_FP32), (np.float16, pb.DTYPE_FP16)):
            a = self.rng.standard_normal((3, 5, 4, 8)).astype(dt)
            t, like = attnd._tensors.to_proto(a, "q")
            self.assertEqual(t.dtype, want)
            self.assertEqual(list(t.shape), [3, 5, 4, 8])
            self.assertEqual(len(t.data), a.nbytes)
            back = attnd._tensors.from_proto(t, like)
            self.assertEqual(back.dtype, dt)
            np.testing.assert_array_equal(back, a)

    def test_numpy_bf16_as_uint16_and_big_endian(self):
        bits = self.rng.integers(0, 1 << 16, size=(2, 3, 4), dtype=np.uint16)
        t, like = attnd._tensors.to_proto(bits, "k")
        self.assertEqual(t.dtype, pb.DTYPE_BF16)
        self.assertEqual(t.data, bits.astype("<u2").tobytes())
        np.testing.assert_array_equal(attnd._tensors.from_proto(t, like), bits)
        big = np.arange(6, dtype=">f4").reshape(2, 3)
        t, _ = attnd._tensors.to_proto(big, "v")
        np.testing.assert_array_equal(np.frombuffer(t.data, "<f4").reshape(2, 3), big.astype("<f4"))
        # a non-contiguous view is serialized in logical row-major order
        a = np.arange(24, dtype=np.float32).reshape(4, 6)[:, ::2]
        t, _ = attnd._tensors.to_proto(a, "q")
        np.testing.assert_array_equal(np.frombuffer(t.data, "<f4").reshape(4, 3), a)
        # int16 holding bf16 bits: sent as the same bits, answered as int16
        signed = bits.view(np.int16)
        t, like = attnd._tensors.to_proto(signed, "k")
        self.assertEqual(t.dtype, pb.DTYPE_BF16)
        self.assertEqual(t.data, bits.astype("<u2").tobytes())
        back = attnd._tensors.from_proto(t, like)
        self.assertEqual(back.dtype, np.int16)
        np.testing.assert_array_equal(back, signed)
        # the array a decode loop passes is taken as it is, not copied
        a = np.zeros((2, 3), np.float32)
        self.assertIs(attnd._tensors.to_numpy(a, "q")[0], a)

    def test_unsupported_dtype_is_invalid_argument(self):
        with self.assertRaises(attnd.AttndError) as ctx:
            attnd._tensors.to_proto(np.zeros((2, 2), np.float64), "q")
        self.assertEqual(ctx.exception.code.name, "INVALID_ARGUMENT")
        self.assertIn("float64", ctx.exception.message)

    def test_bf16_helpers_round_to_nearest_even(self):
        x = np.array([1.0, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, -2.5, 3.0, np.inf], dtype=np.float32)
        bits = attnd.float32_to_bf16(x)
        # 1+2^-8 is a tie between 1 and 1+2^-7: even mantissa is 1.0; 1+3*2^-8 ties up to 1+2^-6.
        np.testing.assert_array_equal(attnd.bf16_to_float32(bits),
                                      np.array([1.0, 1.0, 1.0 + 2 ** -6, -2.5, 3.0, np.inf],
                                               dtype=np.float32))
        self.assertTrue(np.isnan(attnd.bf16_to_float32(attnd.float32_to_bf16(np.array([np.nan], np.float32))))[0])

    def test_split_batch_and_stack(self):
        q = self.rng.standard_normal((3, 5, 4, 8)).astype(np.float32)
        parts, like = attnd._tensors.split_batch(q, "q", 3)
        self.assertEqual(len(parts), 3)
        for i, t in enumerate(parts):
            self.assertEqual(list(t.shape), [5, 4, 8])
            np.testing.assert_array_equal(np.frombuffer(t.data, "<f4").reshape(5, 4, 8), q[i])
        np.testing.assert_array_equal(attnd._tensors.from_protos(parts, like), q)
        with self.assertRaises(attnd.AttndError) as ctx:
            attnd._tensors.split_batch(q, "q", 2)
        self.assertEqual(ctx.exception.code.name, "INVALID_ARGUMENT")

    def test_error_type(self):
        import grpc
        err = attnd.AttndError(5, "sequence abc not found")
        self.assertIs(err.code, grpc.StatusCode.NOT_FOUND)
        self.assertEqual(err.message, "sequence abc not found")
        self.assertIn("NOT_FOUND", str(err))


if __name__ == "__main__":
    unittest.main()


class WireFormat(unittest.TestCase):
    """attnd._wire against the protobuf library: what it writes must parse to the same message, and what the
    library writes must decode to the same tensors."""

    def setUp(self):
        self.rng = np.random.default_rng(2)
        self.wire = attnd._wire

    def arrays(self, t, dt=np.float32):
        return (self.rng.standard_normal((t, 5, 4, 8)).astype(dt), self.rng.standard_normal((t, 2, 8)).astype(dt),
                self.rng.standard_normal((t, 2, 8)).astype(dt))

    def test_prefill_request_parses(self):
        from attnd._client import _prefill_request
        for layer, prompt_len in ((0, None), (3, 0), (1, 123456789012)):
            q, k, v = self.arrays(7)
            msg, _ = _prefill_request("ab" * 16, layer, q, k, v, prompt_len)
            parsed = pb.PrefillRequest.FromString(msg.tobytes())
            want = pb.PrefillRequest(sequence_id="ab" * 16, layer=layer,
                                     q=pb.Tensor(dtype=pb.DTYPE_FP32, shape=q.shape, data=q.tobytes()),
                                     k=pb.Tensor(dtype=pb.DTYPE_FP32, shape=k.shape, data=k.tobytes()),
                                     v=pb.Tensor(dtype=pb.DTYPE_FP32, shape=v.shape, data=v.tobytes()))
            if prompt_len is not None:
                want.prompt_len = prompt_len
            self.assertEqual(parsed, want)
            self.assertEqual(parsed.HasField("prompt_len"), prompt_len is not None)
            self.assertEqual(len(msg.tobytes()), want.ByteSize())

    def test_decode_and_session_requests_parse(self):
        from attnd._client import _decode_request
        q = attnd.float32_to_bf16(self.rng.standard_normal((3, 3, 4, 8)).astype(np.float32))
        k = attnd.float32_to_bf16(self.rng.standard_normal((3, 2, 8)).astype(np.float32))
        seqs = ["%032x" % i for i in range(3)]
        msg, _ = _decode_request(2, seqs, q, k, k)  # the packed form
        want = pb.DecodeRequest(layer=2, sequence_ids=seqs,
                                q=pb.Tensor(dtype=pb.DTYPE_BF16, shape=[3, 3, 4, 8], data=q.tobytes()),
                                k=pb.Tensor(dtype=pb.DTYPE_BF16, shape=[3, 2, 8], data=k.tobytes()),
                                v=pb.Tensor(dtype=pb.DTYPE_BF16, shape=[3, 2, 8], data=k.tobytes()))
        self.assertEqual(pb.DecodeRequest.FromString(msg.tobytes()), want)
        sess = pb.SessionRequest.FromString(self.wire.session_request(2 ** 40, decode=msg).tobytes())
        self.assertEqual(sess, pb.SessionRequest(tag=2 ** 40, decode=want))

    def test_responses_decode(self):
        out = self.rng.standard_normal((6, 4, 8)).astype(np.float16)
        resp = pb.PrefillResponse(o=pb.Tensor(dtype=pb.DTYPE_FP16, shape=out.shape, data=out.tobytes()), length=77)
        t, length = self.wire.parse_prefill_response(memoryview(resp.SerializeToString()))
        self.assertEqual(length, 77)
        self.assertEqual((t.dtype, t.shape), (pb.DTYPE_FP16, [6, 4, 8]))
        like = attnd._tensors.Like("numpy", np_dtype=np.dtype(np.float16))
        np.testing.assert_array_equal(attnd._tensors.from_proto(t, like), out)

        outs = [self.rng.standard_normal((4, 8)).astype(np.float32) for _ in range(3)]
        dresp = pb.DecodeResponse(outputs=[
            pb.DecodeOutput(o=pb.Tensor(dtype=pb.DTYPE_FP32, shape=o.shape, data=o.tobytes()), length=10 + i)
            for i, o in enumerate(outs)])
        sresp = pb.SessionResponse(tag=9, decode=dresp)
        mv = memoryview(sresp.SerializeToString())
        tag, code, message, kind, span = self.wire.parse_session_response(mv)
        self.assertEqual((tag, code, message, kind), (9, 0, "", "decode"))
        parsed = self.wire.parse_decode_response(mv, *span)
        self.assertEqual([n for _, n in parsed], [10, 11, 12])
        like = attnd._tensors.Like("numpy", np_dtype=np.dtype(np.float32))
        np.testing.assert_array_equal(attnd._tensors.from_protos([t for t, _ in parsed], like), np.stack(outs))

        err = pb.SessionResponse(tag=3, code=5, message="sequence x not found")
        self.assertEqual(self.wire.parse_session_response(memoryview(err.SerializeToString()))[:4],
                         (3, 5, "sequence x not found", None))

    def test_unpacked_shape_and_unknown_fields_are_accepted(self):
        # Tensor: dtype=FP32 (field 1), shape 2 and 3 unpacked (field 2 varints), an unknown field 9, data.
        data = np.arange(6, dtype="<f4").tobytes()
        body = bytes([0x08, 3, 0x10, 2, 0x10, 3, 0x48, 1, 0x1A, len(data)]) + data
        msg = bytes([0x0A, len(body)]) + body + bytes([0x10, 6])
        self.assertEqual(pb.PrefillResponse.FromString(msg).o.shape, [2, 3])
        t, length = self.wire.parse_prefill_response(memoryview(msg))
        self.assertEqual((t.dtype, t.shape, length, bytes(t.data)), (3, [2, 3], 6, data))

    def test_truncated_response_is_an_error(self):
        resp = pb.PrefillResponse(o=pb.Tensor(dtype=pb.DTYPE_FP32, shape=[4], data=b"\0" * 16), length=4)
        raw = resp.SerializeToString()[:-3]
        with self.assertRaises(attnd.AttndError) as ctx:
            self.wire.parse_prefill_response(memoryview(raw))
        self.assertEqual(ctx.exception.code.name, "INTERNAL")
