"""Status codes and messages surface as attnd.AttndError; a failed request changes nothing."""
import os
import sys
import unittest

import grpc
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import attnd_testing as at  # noqa: E402
import dca_ref  # noqa: E402

attnd = at.attnd
SC = grpc.StatusCode


class Errors(at.DaemonTestCase, unittest.TestCase):
    def setUp(self):
        m = self.info.model
        self.h, self.hkv, self.d = m.num_q_heads, m.num_kv_heads, m.head_dim
        self.rng = np.random.default_rng(7)
        self.cfg = dca_ref.DcaConfig(self.info.dca.chunk_size, self.info.dca.local_size,
                                     self.info.dca.original_max_position_embeddings, m.softmax_scale,
                                     self.h, self.hkv, self.d)

    def tokens(self, t, variants=5):
        r = self.rng
        return (at.random_bf16_exact(r, (t, variants, self.h, self.d)), at.random_bf16_exact(r, (t, self.hkv, self.d)),
                at.random_bf16_exact(r, (t, self.hkv, self.d)))

    def assertCode(self, ctx, code, *fragments):
        err = ctx.exception
        self.assertIsInstance(err, attnd.AttndError)
        self.assertIs(err.code, code, err.message)
        self.assertTrue(err.message, "an error must carry a message")
        for f in fragments:
            self.assertIn(f, err.message)

    def test_unknown_sequence_is_not_found(self):
        unknown = "0123456789abcdef0123456789abcdef"
        q, k, v = self.tokens(4)
        with self.assertRaises(attnd.AttndError) as ctx:
            self.client.prefill(unknown, 0, q, k, v)
        self.assertCode(ctx, SC.NOT_FOUND, "not found")
        with self.assertRaises(attnd.AttndError) as ctx:
            self.client.decode(0, [unknown], q[:1], k[:1], v[:1])
        self.assertCode(ctx, SC.NOT_FOUND, "not found")
        with self.assertRaises(attnd.AttndError) as ctx:
            self.client.release(unknown)
        self.assertCode(ctx, SC.NOT_FOUND, "not found")

    def test_released_sequence_is_not_found(self):
        seq = self.client.create_sequence()
        q, k, v = self.tokens(3)
        self.client.prefill(seq, 0, q, k, v)
        self.client.release(seq)
        with self.assertRaises(attnd.AttndError) as ctx:
            self.client.prefill(seq, 0, q, k, v)
        self.assertCode(ctx, SC.NOT_FOUND, "not found")
        with self.assertRaises(attnd.AttndError) as ctx:
            self.client.release(seq)
        self.assertCode(ctx, SC.NOT_FOUND)

    def test_malformed_id_is_invalid_argument(self):
        with self.assertRaises(attnd.AttndError) as ctx:
            self.client.release("not-a-sequence-id")
        self.assertCode(ctx, SC.INVALID_ARGUMENT)

    def test_bad_shapes_are_invalid_argument_and_change_nothing(self):
        seq = self.client.create_sequence()
        try:
            q, k, v = self.tokens(6)
            with self.assertRaises(attnd.AttndError) as ctx:  # 4 query variants instead of 5
                self.client.prefill(seq, 0, q[:, :4], k, v)
            self.assertCode(ctx, SC.INVALID_ARGUMENT, "shape")
            with self.assertRaises(attnd.AttndError) as ctx:  # k for 5 tokens, q for 6
                self.client.prefill(seq, 0, q, k[:5], v)
            self.assertCode(ctx, SC.INVALID_ARGUMENT, "shape")
            bad_v = np.zeros((6, self.hkv + 1, self.d), np.float32)
            with self.assertRaises(attnd.AttndError) as ctx:  # wrong kv head count
                self.client.prefill(seq, 0, q, k, bad_v)
            self.assertCode(ctx, SC.INVALID_ARGUMENT, "shape")
            with self.assertRaises(attnd.AttndError) as ctx:  # mixed dtypes
                self.client.prefill(seq, 0, q, k.astype(np.float16), v)
            self.assertCode(ctx, SC.INVALID_ARGUMENT, "dtype")
            with self.assertRaises(attnd.AttndError) as ctx:
                self.client.prefill(seq, self.info.model.num_layers, q, k, v)
            self.assertCode(ctx, SC.INVALID_ARGUMENT, "layer")
            # Nothing changed: a valid prefill starts at position 0 and matches the reference.
            out, length = self.client.prefill(seq, 0, q, k, v, return_length=True)
            self.assertEqual(length, 6)
            ref = dca_ref.RefLayer(self.cfg).prefill(q, k, v)
            self.assertLessEqual(at.error_stats(out, ref)[0], 1e-4)
            with self.assertRaises(attnd.AttndError) as ctx:  # decode q must be [3|5, Hq, D]
                self.client.decode(0, [seq], q[:1, :4], k[:1], v[:1])
            self.assertCode(ctx, SC.INVALID_ARGUMENT, "shape")
        finally:
            self.client.release(seq)

    def test_decode_on_empty_layer_is_failed_precondition(self):
        seq = self.client.create_sequence()
        try:
            q, k, v = self.tokens(1)
            with self.assertRaises(attnd.AttndError) as ctx:
                self.client.decode(1, [seq], q, k, v)
            self.assertCode(ctx, SC.FAILED_PRECONDITION)
        finally:
            self.client.release(seq)

    def test_decode_batch_is_all_or_nothing(self):
        a, b = self.client.create_sequence(), self.client.create_sequence()
        try:
            ref_a = dca_ref.RefLayer(self.cfg)
            q, k, v = self.tokens(5)
            self.client.prefill(a, 0, q, k, v)
            ref_a.prefill(q, k, v)
            q1, k1, v1 = self.tokens(2, variants=3)
            with self.assertRaises(attnd.AttndError) as ctx:  # b holds no tokens in layer 0
                self.client.decode(0, [a, b], q1, k1, v1)
            self.assertCode(ctx, SC.FAILED_PRECONDITION)
            out, lengths = self.client.decode(0, [a], q1[:1], k1[:1], v1[:1], return_lengths=True)
            self.assertEqual(lengths, [6], "the failed batch must not have appended a's token")
            self.assertLessEqual(at.error_stats(out[0], ref_a.decode(q1[0], k1[0], v1[0]))[0], 1e-4)
            with self.assertRaises(attnd.AttndError) as ctx:
                self.client.decode(0, [a, a], q1, k1, v1)
            self.assertCode(ctx, SC.INVALID_ARGUMENT)
        finally:
            self.client.release(a)
            self.client.release(b)

    def test_client_side_batch_mismatch(self):
        q, k, v = self.tokens(2, variants=3)
        with self.assertRaises(attnd.AttndError) as ctx:
            self.client.decode(0, ["0" * 32, "1" * 32, "2" * 32], q, k, v)
        self.assertCode(ctx, SC.INVALID_ARGUMENT, "batch")

    def test_prefill_token_limit_follows_the_message_limit(self):
        lim = self.info.limits
        fp32_variants = (5 * self.h + 2 * self.hkv) * self.d * 4
        self.assertEqual(lim.max_prefill_tokens_per_call, (lim.max_message_bytes - 1024) // fp32_variants)
        self.assertEqual(self.client.max_prefill_tokens("float32", info=self.info), lim.max_prefill_tokens_per_call)
        bf16_pre_rotary = (self.h + 2 * self.hkv) * self.d * 2
        self.assertEqual(self.client.max_prefill_tokens("bfloat16", "pre_rotary"),
                         (lim.max_message_bytes - 1024) // bf16_pre_rotary)

    def test_oversized_prefill_says_where_the_limits_are(self):
        d = at.Daemon(self.model_config(self._tmp), extra_args=["--max-message-bytes", "65536"])
        d.start()
        c = attnd.Client(d.target, timeout=30)
        try:
            n = c.max_prefill_tokens(self.tokens(1)[0].dtype)
            seq = c.create_sequence()
            c.prefill(seq, 0, *self.tokens(n))
            with self.assertRaises(attnd.AttndError) as ctx:
                c.prefill(seq, 1, *self.tokens(n + 2))
            self.assertCode(ctx, SC.RESOURCE_EXHAUSTED, "larger than max", "limits.max_message_bytes",
                            "limits.max_prefill_tokens_per_call")
        finally:
            c.close()
            d.stop()

    def test_unreachable_server_is_unavailable(self):
        c = attnd.Client("127.0.0.1:%d" % at.free_port(), timeout=5)
        try:
            with self.assertRaises(attnd.AttndError) as ctx:
                c.create_sequence()
            self.assertCode(ctx, SC.UNAVAILABLE)
            q, k, v = self.tokens(2)
            s = c.session()
            with self.assertRaises(attnd.AttndError) as ctx:  # the stream's failure reaches the request
                s.prefill("0" * 32, 0, q, k, v)
            self.assertCode(ctx, SC.UNAVAILABLE)
            with self.assertRaises(attnd.AttndError) as ctx:  # and close() reports it too
                s.close()
            self.assertCode(ctx, SC.UNAVAILABLE)
        finally:
            c.close()


if __name__ == "__main__":
    unittest.main()
