"""attnd.transformers on the CPU backend: a Qwen2-shaped model (tiny_qwen2) generates with every attention layer in
attnd, against the same model with plain-torch attention (dca_torch, written from docs/DCA.md): greedy tokens
identical in fp32, below the DCA chunk against standard attention and through three chunks against dense DCA;
batched decode (one Decode per layer per step), padding, chunked prefill, length scaling, sequences released on
return, on error and on garbage collection, the geometry check. transformers itself is not needed (it is not in
Debian): the real-runtime runs are bench/gpu/transformers.sh on the GPU machine."""
import gc
import json
import os
import sys
import types
import unittest
import warnings

import grpc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import attnd_testing as at  # noqa: E402

attnd = at.attnd
try:
    import torch
except ImportError:
    torch = None

if torch is not None:
    import dca_torch  # noqa: E402
    import tiny_qwen2  # noqa: E402
    import attnd.transformers as hf  # noqa: E402

# tiny geometry; cl = 128; no length scaling below 1024 tokens, so a sequence recomputed whole (the reference)
# and one decoded token by token (attnd) have the same math up to 1024 tokens.
CONFIG = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
    "dual_chunk_attention_config": {"chunk_size": 160, "local_size": 32, "original_max_position_embeddings": 1024},
    "head_dim": 64, "hidden_act": "silu", "hidden_size": 256, "intermediate_size": 512,
    "max_position_embeddings": 8192, "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6, "rope_scaling": None, "rope_theta": 10000.0, "vocab_size": 512,
}
TOKENS_ATOL = 1e-4  # fp32 logits, attnd's fp32 kernels against the fp64 reference


def prompts(lengths, seed=1, vocab=512):
    """Left-padded batch: input_ids and attention_mask [B, max(lengths)]."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, width - n:] = torch.randint(1, vocab, (n,), generator=g)
        mask[b, width - n:] = 1
    return ids, mask


@unittest.skipIf(torch is None, "torch is not importable (Debian: apt-get install python3-torch)")
class TransformersAdapter(at.DaemonTestCase, unittest.TestCase):
    @classmethod
    def model_config(cls, tmpdir):
        path = os.path.join(tmpdir, "config.json")
        with open(path, "w") as f:
            json.dump(CONFIG, f)
        return path

    def setUp(self):
        self.config = types.SimpleNamespace(**CONFIG)
        self.model = tiny_qwen2.build(self.config, seed=3)
        self.reference = tiny_qwen2.build(self.config, seed=3)
        self.assertEqual(self.client.info().live_sequences, 0)

    def tearDown(self):
        if getattr(self.model, "_attnd", None) is not None:
            self.model._attnd.detach()
        gc.collect()
        self.assertEqual(self.client.info().live_sequences, 0, "a sequence outlived its generation")

    def use_dca_reference(self):
        dca_torch.use_reference(self.reference.model.layers, "dca", dca_torch.Geometry.from_config(self.config))

    def generate_both(self, lengths, new_tokens, transport="grpc", chunk=None):
        ids, mask = prompts(lengths)
        want, want_logits = self.reference.generate(ids, attention_mask=mask, max_new_tokens=new_tokens)
        attachment = hf.attach(self.model, self.client, transport=transport)
        got, got_logits = self.model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens,
                                              prefill_chunk_size=chunk)
        attachment.detach()
        return want, got, want_logits, got_logits

    def assert_same(self, want, got, want_logits, got_logits):
        self.assertTrue(torch.equal(want, got), "tokens differ:\n%s\n%s" % (want.tolist(), got.tolist()))
        worst = max(float((a - b).abs().max()) for a, b in zip(want_logits, got_logits))
        self.assertLess(worst, TOKENS_ATOL, "final logits differ by %g" % worst)

    def test_greedy_tokens_equal_standard_attention_below_the_chunk(self):
        # 90 + 30 positions < cl = 128: DCA is standard causal attention there.
        self.assert_same(*self.generate_both([90, 41, 7], 30))

    def test_prompt_in_chunks_and_over_a_ring(self):
        self.assert_same(*self.generate_both([90, 41], 20, chunk=32))
        self.assert_same(*self.generate_both([90, 41], 20, transport="ring", chunk=50))

    def test_greedy_tokens_through_three_chunks_equal_plain_dca(self):
        self.use_dca_reference()
        # 300 + 24 positions: chunks 0, 1, 2 (inter-chunk attention included), prompt sent in 3 calls.
        self.assert_same(*self.generate_both([300, 170], 24, chunk=128))

    def test_standard_attention_is_not_dca_past_the_chunk(self):
        # The reference above could pass by accident if DCA and standard attention agreed here: they must not.
        ids, mask = prompts([300])
        dca = tiny_qwen2.build(self.config, seed=3)
        dca_torch.use_reference(dca.model.layers, "dca", dca_torch.Geometry.from_config(self.config))
        with torch.no_grad():
            a = self.reference(ids, attention_mask=mask, use_cache=False).logits
            b = dca(ids, attention_mask=mask, use_cache=False).logits
        self.assertGreater(float((a - b).abs().max()), 100 * TOKENS_ATOL)

    def test_length_scaled_prefill_matches_plain_dca(self):
        # 1,100 tokens > original_max_position_embeddings (1024): keys and logits length-scaled, 9 chunks.
        self.use_dca_reference()
        ids, mask = prompts([1100], seed=4)
        hf.attach(self.model, self.client, transport="grpc")
        with torch.no_grad():
            got = self.model(ids, attention_mask=mask, use_cache=False).hidden
            want = self.reference(ids, attention_mask=mask, use_cache=False).hidden
        err = float((got - want).abs().max())
        self.assertLess(err, 1e-4, "hidden states differ by %g" % err)

    def test_one_batched_decode_per_layer_per_step(self):
        ids, mask = prompts([20, 9, 30])
        attachment = hf.attach(self.model, self.client, transport="grpc")
        cache = attachment.new_cache()
        self.model.generate(ids, attention_mask=mask, max_new_tokens=6, past_key_values=cache)
        layers = self.config.num_hidden_layers
        self.assertEqual(cache.stats.decode_calls, 5 * layers)
        self.assertEqual(cache.stats.prefill_calls, 3 * layers)  # one per row and layer
        # 5 forwards after the prompt (the sixth token is never fed back); padding never reaches attnd
        self.assertEqual(cache.lengths, [25, 14, 35])
        self.assertEqual(cache.columns, 35)
        self.assertEqual(self.client.info().live_sequences, 3)  # the caller's cache keeps them
        del cache
        gc.collect()
        self.assertEqual(self.client.info().live_sequences, 0)

    def test_prompt_rows_repeated_after_the_prompt_was_given(self):
        # As generate(num_return_sequences=2) does: the cache hears the prompt's 2 rows (generate()'s arguments),
        # then the model's forward gets each row twice.
        ids, mask = prompts([40, 17])
        ids2, mask2 = ids.repeat_interleave(2, 0), mask.repeat_interleave(2, 0)
        attachment = hf.attach(self.model, self.client, transport="grpc")
        cache = attachment.new_cache()
        cache.set_prompt(mask)
        with torch.no_grad():
            got = self.model(ids2, attention_mask=mask2, past_key_values=cache).logits[:, -1]
            want = self.reference(ids2, attention_mask=mask2, use_cache=False).logits[:, -1]
        self.assertLess(float((got - want).abs().max()), TOKENS_ATOL)
        self.assertEqual(cache.prompt_lengths, [40, 40, 17, 17])
        self.assertEqual(cache.lengths, [40, 40, 17, 17])
        cache.release()

    def test_sequences_released_when_generation_raises(self):
        ids, mask = prompts([12, 30])
        hf.attach(self.model, self.client, transport="grpc")

        def fail(step):
            if step == 3:
                self.assertEqual(self.client.info().live_sequences, 2)
                raise KeyboardInterrupt

        with self.assertRaises(KeyboardInterrupt):
            self.model.generate(ids, attention_mask=mask, max_new_tokens=8, on_step=fail)
        self.assertEqual(self.client.info().live_sequences, 0)

    def test_a_cache_whose_forward_failed_midway_refuses_more(self):
        ids, mask = prompts([12])
        attachment = hf.attach(self.model, self.client, transport="grpc")
        cache = attachment.new_cache()
        broken = self.model.model.layers[1].mlp.forward
        self.model.model.layers[1].mlp.forward = lambda x: (_ for _ in ()).throw(ValueError("boom"))
        with self.assertRaises(ValueError):
            self.model(ids, attention_mask=mask, past_key_values=cache)
        self.model.model.layers[1].mlp.forward = broken
        with self.assertRaisesRegex(RuntimeError, "unusable"):
            self.model(ids, attention_mask=mask, past_key_values=cache)
        cache.release()
        self.model(ids, attention_mask=mask, past_key_values=cache)  # released: starts over
        cache.release()

    def test_detach_restores_the_model(self):
        ids, mask = prompts([25])
        want, _ = self.reference.generate(ids, attention_mask=mask, max_new_tokens=5)
        hf.attach(self.model, self.client, transport="grpc").detach()
        got, _ = self.model.generate(ids, attention_mask=mask, max_new_tokens=5)
        self.assertTrue(torch.equal(want, got))
        self.assertFalse(any(isinstance(layer.self_attn, hf.AttndAttention) for layer in self.model.model.layers))

    def test_a_model_that_does_not_match_the_daemon_is_refused(self):
        cases = [("num_key_value_heads", 4, "num_key_value_heads is 4 but the attnd daemon's is 2"),
                 ("rope_theta", 1e6, "rope_theta"),
                 ("num_hidden_layers", 3, "num_hidden_layers is 3"),
                 ("dual_chunk_attention_config", {"chunk_size": 192, "local_size": 32},
                  "dual_chunk_attention_config.chunk_size is 192 but the attnd daemon's is 160"),
                 ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "rope scaling is 'yarn'")]
        for field, value, message in cases:
            with self.subTest(field=field):
                config = types.SimpleNamespace(**dict(CONFIG, **{field: value}))
                model = types.SimpleNamespace(config=config)
                with self.assertRaises(hf.GeometryMismatch) as ctx:
                    hf.attach(model, self.client)
                self.assertIn(message, str(ctx.exception))
        self.assertEqual(self.client.info().live_sequences, 0)

    def test_what_the_geometry_check_accepts_and_refuses_besides_numbers(self):
        # No dual_chunk_attention_config (a plain Qwen2 config): accepted, the daemon's DCA applies.
        plain = types.SimpleNamespace(**{k: v for k, v in CONFIG.items() if k != "dual_chunk_attention_config"})
        self.assertEqual(hf.check_geometry(plain, self.info)["num_kv_heads"], 2)
        # A dual_chunk_attention_config missing keys takes DCA.md's defaults (chunk_size 8192), so it differs.
        partial = types.SimpleNamespace(**dict(CONFIG, dual_chunk_attention_config={"local_size": 32}))
        with self.assertRaisesRegex(hf.GeometryMismatch, "chunk_size is 8192 but the attnd daemon's is 160"):
            hf.check_geometry(partial, self.info)
        sliding = types.SimpleNamespace(**dict(CONFIG, use_sliding_window=True))
        with self.assertRaisesRegex(hf.GeometryMismatch, "sliding-window"):
            hf.check_geometry(sliding, self.info)
        # transformers 5 keeps rope_theta in rope_parameters.
        moved = {k: v for k, v in CONFIG.items() if k != "rope_theta"}
        moved["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
        self.assertEqual(hf.check_geometry(types.SimpleNamespace(**moved), self.info)["rope_theta"], 10000.0)
        moved["rope_parameters"]["rope_theta"] = 5e5
        with self.assertRaisesRegex(hf.GeometryMismatch, "rope_theta is 500000.0"):
            hf.check_geometry(types.SimpleNamespace(**moved), self.info)
        # A dtype attnd does not take is refused before anything is created.
        with self.assertRaisesRegex(TypeError, "float64"):
            hf.attach(tiny_qwen2.build(self.config, dtype=torch.float64), self.client)
        self.assertEqual(self.client.info().live_sequences, 0)

    def test_fewer_layers_than_the_daemon_serves_is_fine(self):
        config = types.SimpleNamespace(**dict(CONFIG, num_hidden_layers=1))
        model = tiny_qwen2.build(config, seed=5)
        reference = tiny_qwen2.build(config, seed=5)
        ids, mask = prompts([33])
        want, _ = reference.generate(ids, attention_mask=mask, max_new_tokens=4)
        hf.attach(model, self.client, transport="grpc")
        got, _ = model.generate(ids, attention_mask=mask, max_new_tokens=4)
        self.assertTrue(torch.equal(want, got))
        model._attnd.detach()


if __name__ == "__main__":
    unittest.main()


@unittest.skipIf(torch is None, "torch is not importable (Debian: apt-get install python3-torch)")
class DeviceOrderedWithoutMps(unittest.TestCase):
    """Choosing device-ordered calls against an attnd that is not under CUDA MPS warns with what to do; under MPS,
    or with a server that orders nothing on the device, it does not. (The ring and the CUDA region fail here, no
    GPU: the adapter falls back to gRPC calls as it does on any host where they fail.)"""

    class Client:
        def ring(self, **kwargs):
            raise attnd.AttndError(grpc.StatusCode.FAILED_PRECONDITION, "no ring in this test")

        def max_prefill_tokens(self, **kwargs):
            return 1000

    def transport_warnings(self, device_ordered_rings, cuda_mps):
        info = types.SimpleNamespace(regions=types.SimpleNamespace(device_ordered_rings=device_ordered_rings,
                                                                   cuda_mps=cuda_mps))
        geometry = {"num_q_heads": 4, "num_kv_heads": 2, "head_dim": 64}
        staging = hf._CudaStaging
        hf._CudaStaging = lambda *args: (_ for _ in ()).throw(RuntimeError("no GPU in this test"))
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                hf._open_transport(self.Client(), info, geometry, torch.device("cuda"), torch.float32, "auto", 1000,
                                   50)
        finally:
            hf._CudaStaging = staging
        return [str(w.message) for w in caught]

    def test_warns_without_mps(self):
        got = self.transport_warnings(True, False)
        self.assertTrue(any("not under CUDA MPS" in m and "operations.md" in m for m in got), got)

    def test_quiet_under_mps_or_without_ordering(self):
        for ordered, mps in ((True, True), (False, False)):
            got = self.transport_warnings(ordered, mps)
            self.assertFalse(any("MPS" in m for m in got), (ordered, mps, got))
