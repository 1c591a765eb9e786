"""torch tensors in, torch tensors out (same dtype), when torch is importable."""
import os
import sys
import unittest

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import attnd_testing as at  # noqa: E402
import dca_ref  # noqa: E402

attnd = at.attnd
try:
    import torch
except ImportError:  # torch is optional for the client; Debian: apt-get install python3-torch
    torch = None


@unittest.skipIf(torch is None, "torch is not importable (Debian: apt-get install python3-torch)")
class TorchTensors(at.DaemonTestCase, unittest.TestCase):
    def setUp(self):
        m = self.info.model
        self.h, self.hkv, self.d = m.num_q_heads, m.num_kv_heads, m.head_dim
        self.cfg = dca_ref.DcaConfig(self.info.dca.chunk_size, self.info.dca.local_size,
                                     self.info.dca.original_max_position_embeddings, m.softmax_scale,
                                     self.h, self.hkv, self.d)
        self.rng = np.random.default_rng(5)

    def tokens(self, t, variants=5):
        r = self.rng
        return (at.random_bf16_exact(r, (t, variants, self.h, self.d)), at.random_bf16_exact(r, (t, self.hkv, self.d)),
                at.random_bf16_exact(r, (t, self.hkv, self.d)))

    def run_case(self, dtype, layer, bars):
        seqs = [self.client.create_sequence() for _ in range(2)]
        refs = [dca_ref.RefLayer(self.cfg) for _ in range(2)]
        worst_max, worst_mean = 0.0, 0.0
        try:
            for n in (self.info.dca.chunk_len + 20, 37):
                for seq, ref in zip(seqs, refs):
                    q, k, v = self.tokens(n)
                    out = self.client.prefill(seq, layer, *(torch.from_numpy(x).to(dtype) for x in (q, k, v)))
                    self.assertIsInstance(out, torch.Tensor)
                    self.assertEqual(out.dtype, dtype)
                    self.assertEqual(tuple(out.shape), (n, self.h, self.d))
                    e = at.error_stats(out.float().numpy(), ref.prefill(q, k, v))
                    worst_max, worst_mean = max(worst_max, e[0]), max(worst_mean, e[1])
            for _ in range(5):
                q, k, v = self.tokens(2, variants=3)
                out = self.client.decode(layer, seqs, *(torch.from_numpy(x).to(dtype) for x in (q, k, v)))
                self.assertIsInstance(out, torch.Tensor)
                self.assertEqual(out.dtype, dtype)
                self.assertEqual(tuple(out.shape), (2, self.h, self.d))
                want = np.stack([r.decode(q[i], k[i], v[i]) for i, r in enumerate(refs)])
                e = at.error_stats(out.float().numpy(), want)
                worst_max, worst_mean = max(worst_max, e[0]), max(worst_mean, e[1])
        finally:
            for seq in seqs:
                self.client.release(seq)
        self.assertLessEqual(worst_max, bars[0])
        self.assertLessEqual(worst_mean, bars[1])

    def test_bf16_round_trip(self):
        self.run_case(torch.bfloat16, 0, (2e-2, 2e-3))

    def test_fp32(self):
        self.run_case(torch.float32, 1, (1e-4, 1e-4))

    def test_bf16_bits_on_the_wire(self):
        """A torch bf16 tensor travels as the same bits a uint16 numpy view would."""
        x = torch.randn(3, 4).to(torch.bfloat16)
        t, like = attnd._tensors.to_proto(x, "q")
        self.assertEqual(t.dtype, attnd.proto.DTYPE_BF16)
        bits = np.frombuffer(t.data, "<u2").reshape(3, 4)
        np.testing.assert_array_equal(at.bf16_bits_to_f32(bits), x.float().numpy())
        back = attnd._tensors.from_proto(t, like)
        self.assertEqual(back.dtype, torch.bfloat16)
        self.assertTrue(torch.equal(back, x))
        nc = torch.randn(4, 6).t()  # non-contiguous: serialized in logical order
        t, _ = attnd._tensors.to_proto(nc, "q")
        np.testing.assert_array_equal(np.frombuffer(t.data, "<f4").reshape(6, 4), nc.numpy())

    def test_session_with_torch(self):
        seq = self.client.create_sequence()
        ref = dca_ref.RefLayer(self.cfg)
        try:
            q, k, v = self.tokens(20)
            with self.client.session() as s:
                out = s.prefill(seq, 0, *(torch.from_numpy(x).to(torch.bfloat16) for x in (q, k, v)))
            self.assertEqual(out.dtype, torch.bfloat16)
            e = at.error_stats(out.float().numpy(), ref.prefill(q, k, v))
            self.assertLessEqual(e[0], 2e-2)
        finally:
            self.client.release(seq)


if __name__ == "__main__":
    unittest.main()
