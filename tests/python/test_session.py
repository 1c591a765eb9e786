"""The Session stream: answers in order, equal to the unary RPCs, per-request errors keep the stream open."""
import os
import sys
import unittest

import grpc
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import attnd_testing as at  # noqa: E402
import dca_ref  # noqa: E402

attnd = at.attnd


class SessionStream(at.DaemonTestCase, unittest.TestCase):
    def setUp(self):
        m = self.info.model
        self.h, self.hkv, self.d = m.num_q_heads, m.num_kv_heads, m.head_dim
        self.cfg = dca_ref.DcaConfig(self.info.dca.chunk_size, self.info.dca.local_size,
                                     self.info.dca.original_max_position_embeddings, m.softmax_scale,
                                     self.h, self.hkv, self.d)
        self.rng = np.random.default_rng(11)

    def tokens(self, t, variants=5, batch_first=True):
        r = self.rng
        return (at.random_bf16_exact(r, (t, variants, self.h, self.d)), at.random_bf16_exact(r, (t, self.hkv, self.d)),
                at.random_bf16_exact(r, (t, self.hkv, self.d)))

    def test_session_equals_unary(self):
        # Two sequences (and two layers) per path; a chunked prompt that crosses the chunk length, then decodes.
        cl = self.info.dca.chunk_len
        chunks = [self.tokens(n) for n in (cl - 7, 50, 30)]
        prompt_len = sum(c[0].shape[0] for c in chunks)
        steps = [self.tokens(2, variants=3) for _ in range(6)]
        unary = [self.client.create_sequence() for _ in range(2)]
        streamed = [self.client.create_sequence() for _ in range(2)]
        refs = [dca_ref.RefLayer(self.cfg) for _ in range(2)]
        try:
            want, got = [], []
            for layer in (0, 1):
                for q, k, v in chunks:
                    for seq in unary:
                        want.append(self.client.prefill(seq, layer, q, k, v, prompt_len=prompt_len))
                for q, k, v in steps:
                    want.append(self.client.decode(layer, unary, q, k, v))
            with self.client.session() as s:
                for layer in (0, 1):
                    for q, k, v in chunks:
                        for seq in streamed:
                            got.append(s.prefill(seq, layer, q, k, v, prompt_len=prompt_len))
                    for q, k, v in steps:
                        got.append(s.decode(layer, streamed, q, k, v))
            # an independent check of one path, so "equal" is not "equally wrong"
            ref_out = [refs[0].prefill(q, k, v, prompt_len) for q, k, v in chunks]
            ref_out += [refs[0].decode(q[0], k[0], v[0]) for q, k, v in steps]
            unary_seq0 = [want[0], want[2], want[4]] + [w[0] for w in want[6:12]]
            for a, b in zip(unary_seq0, ref_out):
                self.assertLessEqual(at.error_stats(a, b)[0], 1e-4)
            self.assertEqual(len(want), len(got))
            for a, b in zip(want, got):
                self.assertEqual(a.shape, b.shape)
                np.testing.assert_allclose(b, a, rtol=0, atol=1e-6)
        finally:
            for seq in unary + streamed:
                self.client.release(seq)

    def test_pipelined_requests_answer_in_order(self):
        seqs = [self.client.create_sequence() for _ in range(3)]
        refs = {seq: dca_ref.RefLayer(self.cfg) for seq in seqs}
        try:
            with self.client.session() as s:
                pending, expected = [], []
                for i, seq in enumerate(seqs):
                    q, k, v = self.tokens(10 + 7 * i)
                    pending.append(s.submit_prefill(seq, 0, q, k, v))
                    expected.append(refs[seq].prefill(q, k, v))
                for _ in range(4):
                    q, k, v = self.tokens(3, variants=5)
                    pending.append(s.submit_decode(0, seqs, q, k, v))
                    expected.append(np.stack([refs[seq].decode(q[i], k[i], v[i]) for i, seq in enumerate(seqs)]))
                self.assertFalse(pending[-1].done())
                # read the last first: earlier answers are read (in order) on the way
                last = pending[-1].result()
                self.assertTrue(all(p.done() for p in pending))
                self.assertLessEqual(at.error_stats(last, expected[-1])[0], 1e-4)
                for p, e in zip(pending, expected):
                    self.assertLessEqual(at.error_stats(p.result(), e)[0], 1e-4)
        finally:
            for seq in seqs:
                self.client.release(seq)

    def test_failed_request_keeps_the_stream(self):
        seq = self.client.create_sequence()
        ref = dca_ref.RefLayer(self.cfg)
        try:
            with self.client.session() as s:
                q, k, v = self.tokens(4)
                with self.assertRaises(attnd.AttndError) as ctx:
                    s.prefill("fedcba9876543210fedcba9876543210", 0, q, k, v)
                self.assertIs(ctx.exception.code, grpc.StatusCode.NOT_FOUND)
                self.assertIn("not found", ctx.exception.message)
                with self.assertRaises(attnd.AttndError) as ctx:
                    s.prefill(seq, 0, q[:, :2], k, v)
                self.assertIs(ctx.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
                self.assertIn("shape", ctx.exception.message)
                with self.assertRaises(attnd.AttndError) as ctx:
                    s.decode(0, [seq], q[:1], k[:1], v[:1])
                self.assertIs(ctx.exception.code, grpc.StatusCode.FAILED_PRECONDITION)
                out = s.prefill(seq, 0, q, k, v)
                self.assertLessEqual(at.error_stats(out, ref.prefill(q, k, v))[0], 1e-4)
        finally:
            self.client.release(seq)

    def test_closed_session_refuses_requests(self):
        s = self.client.session()
        s.close()
        q, k, v = self.tokens(1)
        with self.assertRaises(attnd.AttndError) as ctx:
            s.prefill("0" * 32, 0, q, k, v)
        self.assertIs(ctx.exception.code, grpc.StatusCode.FAILED_PRECONDITION)


if __name__ == "__main__":
    unittest.main()
