"""Pre-rotary requests through the Python client (q_layout="pre_rotary"): the golden dense_pre_rotary case
(tests/testdata/dca, a copy of the shared case) over unary calls and a Session, and a decode batch that mixes
layouts."""
import json
import os
import sys
import unittest

import grpc
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import attnd_testing as at  # noqa: E402

attnd = at.attnd

CASE_DIR = os.path.join(at.REPO, "tests", "testdata", "dca", "dense_pre_rotary")


class PreRotaryCase(at.GoldenCase):
    def __init__(self):  # the in-repo copy, not the shared folder
        self.dir = CASE_DIR
        with open(os.path.join(self.dir, "case.json")) as f:
            self.meta = json.load(f)
        with open(os.path.join(self.dir, "tensors.bin"), "rb") as f:
            self.blob = f.read()
        self.steps = self.meta["steps"]


class PreRotary(at.DaemonTestCase, unittest.TestCase):
    KV_DTYPE = "fp32"

    @classmethod
    def model_config(cls, tmpdir):
        case = PreRotaryCase()
        path = case.write_model_config(os.path.join(tmpdir, "config.json"), num_layers=2)
        with open(path) as f:
            config = json.load(f)
        config["rope_theta"] = case.meta["rope_theta"]
        with open(path, "w") as f:
            json.dump(config, f)
        return path

    def test_reports_the_rotary(self):
        m = PreRotaryCase().meta
        self.assertEqual(self.info.model.rope_theta, m["rope_theta"])
        self.assertEqual(self.info.model.rotary_dim, m["rotary_dim"])
        self.assertEqual(self.info.model.partial_rotary_factor, 1.0)

    def replay(self, target, layer):
        case = PreRotaryCase()
        ids, worst = {}, 0.0
        try:
            for step in case.steps:
                q, k, v = case.f32(step["q"]), case.f32(step["k"]), case.f32(step["v"])
                if step["op"] == "prefill":
                    if step["seq"] not in ids:
                        ids[step["seq"]] = self.client.create_sequence()
                    out = target.prefill(ids[step["seq"]], layer, q, k, v, prompt_len=step["prompt_len"],
                                         q_layout="pre_rotary")
                else:
                    out = target.decode(layer, [ids[s] for s in step["seqs"]], q, k, v, q_layout="pre_rotary")
                max_abs, _ = at.error_stats(out, case.f32(step["out"]))
                worst = max(worst, max_abs)
        finally:
            for seq in ids.values():
                self.client.release(seq)
        return worst

    def test_golden_fp32_within_1e4(self):
        self.assertLessEqual(self.replay(self.client, 0), 1e-4)

    def test_golden_over_a_session(self):
        with self.client.session() as s:
            self.assertLessEqual(self.replay(s, 1), 1e-4)

    def test_mixed_layouts_in_one_decode(self):
        rng = np.random.default_rng(16)
        h, hkv, d = self.info.model.num_q_heads, self.info.model.num_kv_heads, self.info.model.head_dim
        a, b = self.client.create_sequence(), self.client.create_sequence()
        try:
            for seq in (a, b):
                self.client.prefill(seq, 0, at.random_bf16_exact(rng, (20, h, d)),
                                    at.random_bf16_exact(rng, (20, hkv, d)), at.random_bf16_exact(rng, (20, hkv, d)),
                                    q_layout="pre_rotary")
            q = [at.random_bf16_exact(rng, (h, d)), at.random_bf16_exact(rng, (3, h, d))]
            out, lengths = self.client.decode(0, [a, b], q, at.random_bf16_exact(rng, (2, hkv, d)),
                                              at.random_bf16_exact(rng, (2, hkv, d)),
                                              q_layout=["pre_rotary", "variants"], return_lengths=True)
            self.assertEqual(out.shape, (2, h, d))
            self.assertEqual(lengths, [21, 21])
        finally:
            self.client.release(a)
            self.client.release(b)

    def test_wrong_shape_names_the_expected_one(self):
        h, hkv, d = self.info.model.num_q_heads, self.info.model.num_kv_heads, self.info.model.head_dim
        seq = self.client.create_sequence()
        try:
            with self.assertRaises(attnd.AttndError) as ctx:
                self.client.prefill(seq, 0, np.zeros((4, 5, h, d), np.float32), np.zeros((4, hkv, d), np.float32),
                                    np.zeros((4, hkv, d), np.float32), q_layout="pre_rotary")
            self.assertEqual(ctx.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
            self.assertIn("q must have shape [T, %d, %d] (T >= 1) for q_layout pre_rotary" % (h, d),
                          ctx.exception.message)
        finally:
            self.client.release(seq)


if __name__ == "__main__":
    unittest.main()
