"""The golden dense DCA case through the Python client and a live attnd (fp32 and bf16 KV caches)."""
import os
import sys
import unittest

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import attnd_testing as at  # noqa: E402

attnd = at.attnd

FP32_MAX_ABS = 1e-4
BF16_MAX_ABS, BF16_MEAN_ABS = 2e-2, 2e-3


def run_golden(test, client, layer, wire, unwire, out_dtype, variants=None):
    """Replays dense_gqa_chunked on `layer`; returns [(step index, max_abs, mean_abs)].

    wire(f32 array) -> request tensor; unwire(out) -> float32 array. out_dtype: the expected numpy dtype of
    outputs. variants(step_index) -> 3 or 5: how many query variants decode sends.
    """
    case = at.GoldenCase("dense_gqa_chunked")
    ids = {}
    stats = []
    try:
        for i, step in enumerate(case.steps):
            q, k, v = case.f32(step["q"]), case.f32(step["k"]), case.f32(step["v"])
            if step["op"] == "prefill":
                if step["seq"] not in ids:
                    ids[step["seq"]] = client.create_sequence()
                out, length = client.prefill(ids[step["seq"]], layer, wire(q), wire(k), wire(v),
                                             prompt_len=step["prompt_len"], return_length=True)
                test.assertEqual(length, step["start"] + step["tokens"])
            else:
                nv = variants(i) if variants else 5
                out, lengths = client.decode(layer, [ids[s] for s in step["seqs"]], wire(q[:, :nv]), wire(k),
                                             wire(v), return_lengths=True)
                test.assertEqual(lengths, step["lens_after"])
            test.assertIsInstance(out, np.ndarray)
            test.assertEqual(out.dtype, out_dtype)
            max_abs, mean_abs = at.error_stats(unwire(out), case.f32(step["out"]))
            stats.append((i, max_abs, mean_abs))
    finally:
        for seq in ids.values():
            client.release(seq)
    return stats


def fmt(stats):
    worst = max(stats, key=lambda s: s[1])
    return "worst step %d: max abs %.3g, mean abs %.3g" % worst


class GoldenFp32Kv(at.DaemonTestCase, unittest.TestCase):
    KV_DTYPE = "fp32"

    def test_server_reports_the_geometry(self):
        m = at.GoldenCase("dense_gqa_chunked").meta
        self.assertEqual((self.info.model.num_q_heads, self.info.model.num_kv_heads, self.info.model.head_dim),
                         (m["num_q_heads"], m["num_kv_heads"], m["head_dim"]))
        d = m["dual_chunk_attention_config"]
        self.assertEqual(self.info.dca.chunk_len, d["chunk_size"] - d["local_size"])
        self.assertEqual(self.info.model.kv_dtype, attnd.proto.DTYPE_FP32)

    def test_fp32_within_1e4(self):
        stats = run_golden(self, self.client, 0, lambda x: x.astype(np.float32), lambda o: o, np.float32,
                           variants=lambda i: 3 if i % 2 else 5)
        self.assertEqual(len(stats), 84)
        self.assertLessEqual(max(s[1] for s in stats), FP32_MAX_ABS, fmt(stats))

    def test_bf16_as_uint16(self):
        stats = run_golden(self, self.client, 1, at.f32_to_bf16_bits_exact, at.bf16_bits_to_f32, np.uint16)
        self.assertLessEqual(max(s[1] for s in stats), BF16_MAX_ABS, fmt(stats))
        self.assertLessEqual(max(s[2] for s in stats), BF16_MEAN_ABS, fmt(stats))

    def test_fp16(self):
        stats = run_golden(self, self.client, 1, lambda x: x.astype(np.float16), lambda o: o.astype(np.float32),
                           np.float16)
        self.assertLessEqual(max(s[1] for s in stats), BF16_MAX_ABS, fmt(stats))
        self.assertLessEqual(max(s[2] for s in stats), BF16_MEAN_ABS, fmt(stats))

    def test_release_returns_pages(self):
        before = self.client.info().kv_cache.pages_free
        seq = self.client.create_sequence()
        self.assertRegex(seq, "^[0-9a-f]{32}$")
        rng = np.random.default_rng(3)
        h, hkv, d = self.info.model.num_q_heads, self.info.model.num_kv_heads, self.info.model.head_dim
        t = 40
        self.client.prefill(seq, 0, at.random_bf16_exact(rng, (t, 5, h, d)), at.random_bf16_exact(rng, (t, hkv, d)),
                            at.random_bf16_exact(rng, (t, hkv, d)))
        page = self.info.kv_cache.page_size
        self.assertEqual(self.client.info().kv_cache.pages_free, before - (t + page - 1) // page)
        self.assertEqual(self.client.release(seq), (t + page - 1) // page)
        self.assertEqual(self.client.info().kv_cache.pages_free, before)


class GoldenBf16Kv(at.DaemonTestCase, unittest.TestCase):
    KV_DTYPE = "bf16"

    def test_kv_dtype_reported(self):
        self.assertEqual(self.info.model.kv_dtype, attnd.proto.DTYPE_BF16)

    def test_bf16_as_uint16(self):
        stats = run_golden(self, self.client, 0, at.f32_to_bf16_bits_exact, at.bf16_bits_to_f32, np.uint16)
        self.assertLessEqual(max(s[1] for s in stats), BF16_MAX_ABS, fmt(stats))
        self.assertLessEqual(max(s[2] for s in stats), BF16_MEAN_ABS, fmt(stats))

    def test_fp32_requests(self):
        stats = run_golden(self, self.client, 1, lambda x: x.astype(np.float32), lambda o: o, np.float32)
        self.assertLessEqual(max(s[1] for s in stats), BF16_MAX_ABS, fmt(stats))
        self.assertLessEqual(max(s[2] for s in stats), BF16_MEAN_ABS, fmt(stats))


if __name__ == "__main__":
    unittest.main()
