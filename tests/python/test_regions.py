"""Tensor regions through the Python client (docs/regions.md): request encoding without a daemon, then against
a live attnd on the CPU backend: the golden case replayed through a registered shm region, output regions,
sessions, and every bad reference with its status code. A torch CUDA region test skips without torch/CUDA."""
import os
import secrets
import shutil
import sys
import tempfile
import unittest

import numpy as np

import grpc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import attnd_testing as at  # noqa: E402

attnd = at.attnd
pb = attnd.proto
_regions = attnd._regions
try:
    import torch
except ImportError:
    torch = None

FP32_MAX_ABS = 1e-4
BF16_MAX_ABS, BF16_MEAN_ABS = 2e-2, 2e-3


class RegionRequestEncoding(unittest.TestCase):
    """What _wire writes for references and output regions must parse as the proto says."""

    def test_prefill_with_references_and_output(self):
        w = attnd._wire
        rid = "ab" * 16
        q = w.RegionTensor(pb.DTYPE_BF16, (3, 5, 4, 8), rid, 4096, 3 * 5 * 4 * 8 * 2)
        k = np.arange(3 * 2 * 8, dtype=np.float32).reshape(3, 2, 8)
        v = w.RegionTensor(pb.DTYPE_FP32, (3, 2, 8), rid, 0, 3 * 2 * 8 * 4)  # offset 0: the default
        out = w.RegionTensor(pb.DTYPE_BF16, (3, 4, 8), rid, 8192, 3 * 4 * 8 * 2)
        msg = w.prefill_request("cd" * 16, 1, (q, q.dtype), (k, pb.DTYPE_FP32), (v, v.dtype), 3, 1, out)
        parsed = pb.PrefillRequest.FromString(msg.tobytes())
        want = pb.PrefillRequest(
            sequence_id="cd" * 16, layer=1, prompt_len=3, q_layout=1,
            q=pb.Tensor(dtype=pb.DTYPE_BF16, shape=[3, 5, 4, 8],
                        region=pb.RegionRef(region_id=rid, offset=4096, byte_size=q.nbytes)),
            k=pb.Tensor(dtype=pb.DTYPE_FP32, shape=[3, 2, 8], data=k.tobytes()),
            v=pb.Tensor(dtype=pb.DTYPE_FP32, shape=[3, 2, 8], region=pb.RegionRef(region_id=rid, byte_size=v.nbytes)),
            output_region=pb.RegionRef(region_id=rid, offset=8192, byte_size=out.nbytes))
        self.assertEqual(parsed, want)
        self.assertTrue(parsed.v.HasField("region"))

    def test_decode_entries_with_output_rows(self):
        w = attnd._wire
        rid = "ef" * 16
        q = w.RegionTensor(pb.DTYPE_FP32, (2, 3, 4, 8), rid, 0, 2 * 3 * 4 * 8 * 4)
        o = w.RegionTensor(pb.DTYPE_FP32, (2, 4, 8), rid, 4096, 2 * 4 * 8 * 4)
        rows, outs = attnd._regions.row_refs(q, 2), attnd._regions.row_refs(o, 2)
        kv = np.zeros((2, 8), np.float32)
        msg = w.decode_request(0, [("%032x" % i, (rows[i], pb.DTYPE_FP32), (kv, pb.DTYPE_FP32),
                                    (kv, pb.DTYPE_FP32), 0, outs[i]) for i in range(2)])
        parsed = pb.DecodeRequest.FromString(msg.tobytes())
        self.assertEqual(parsed.entries[1].q.region.offset, 3 * 4 * 8 * 4)
        self.assertEqual(parsed.entries[1].q.region.byte_size, 3 * 4 * 8 * 4)
        self.assertEqual(list(parsed.entries[1].q.shape), [3, 4, 8])
        self.assertEqual(parsed.entries[1].output_region.offset, 4096 + 4 * 8 * 4)
        self.assertEqual(parsed.entries[0].q.data, b"")

    def test_output_in_a_region_parses(self):
        resp = pb.PrefillResponse(o=pb.Tensor(dtype=pb.DTYPE_FP32, shape=[1, 4, 8],
                                              region=pb.RegionRef(region_id="ab" * 16, byte_size=128)), length=9)
        t, length = attnd._wire.parse_prefill_response(memoryview(resp.SerializeToString()))
        self.assertTrue(t.region)
        self.assertEqual(length, 9)
        self.assertEqual(len(t.data), 0)


class SameHostCheck(unittest.TestCase):
    """The client refuses regions a server cannot map: another host (boot id), another GPU, a kind it
    does not accept; the same host passes. A fake client answers GetServerInfo."""

    class _Fake:
        def __init__(self, info):
            self._info = info

        def info(self, timeout=None):
            return self._info

    def _info(self, boot_id, kinds, uuid=""):
        info = pb.GetServerInfoResponse()
        info.regions.host_boot_id = boot_id
        info.regions.kinds.extend(kinds)
        info.regions.device_uuid = uuid
        return info

    def test_the_same_host_passes_and_another_is_refused(self):
        here = _regions.local_boot_id()
        if not here:
            self.skipTest("no /proc/sys/kernel/random/boot_id here")
        shm = pb.REGION_KIND_SYSTEM_SHM
        _regions.check_can_share(self._Fake(self._info(here, [shm])), shm)
        with self.assertRaises(attnd.AttndError) as e:
            _regions.check_can_share(self._Fake(self._info("another-host", [shm])), shm)
        self.assertEqual(e.exception.code, grpc.StatusCode.FAILED_PRECONDITION)
        self.assertIn("another host", e.exception.message)

    def test_a_kind_the_server_does_not_take_or_another_gpu(self):
        here = _regions.local_boot_id()
        cuda = pb.REGION_KIND_CUDA_IPC
        with self.assertRaises(attnd.AttndError) as e:
            _regions.check_can_share(self._Fake(self._info(here, [pb.REGION_KIND_SYSTEM_SHM])), cuda)
        self.assertIn("no CUDA IPC regions", e.exception.message)
        info = self._info(here, [pb.REGION_KIND_SYSTEM_SHM, cuda], "GPU-aaaa")
        with self.assertRaises(attnd.AttndError) as e:
            _regions.check_can_share(self._Fake(info), cuda, "GPU-bbbb")
        self.assertIn("CUDA IPC needs the same GPU", e.exception.message)
        _regions.check_can_share(self._Fake(info), cuda, "GPU-aaaa")


def _torch_shareable(type_char, payload):
    """torch's untyped_storage()._share_cuda_()[1] of newer torch (2.11 for one): version 2, a type byte, the payload (the
    layout of c10/cuda/CUDACachingAllocator.cpp's shareIpcHandle, built here byte by byte)."""
    return bytes([2, ord(type_char)]) + payload


class TorchCudaHandles(unittest.TestCase):
    """Every form of handle torch's _share_cuda_ gives: the cudaIpcMemHandle_t sent to attnd, or a clear refusal.
    No GPU needed: the handles are built with torch's byte layouts."""

    def setUp(self):
        self.ipc = bytes(range(100, 164))  # a 64-byte cudaIpcMemHandle_t

    def test_raw_64_bytes_of_older_torch(self):
        self.assertEqual(_regions.cuda_ipc_mem_handle(self.ipc), self.ipc)
        # A raw handle may begin with the bytes of a version and type: 64 bytes is always raw.
        raw = b"\x02c" + self.ipc[2:]
        self.assertEqual(_regions.cuda_ipc_mem_handle(raw), raw)

    def test_versioned_66_bytes_of_cuda_malloc_memory(self):
        got = _regions.cuda_ipc_mem_handle(_torch_shareable("c", self.ipc))
        self.assertEqual(got, self.ipc)
        self.assertEqual(len(got), 64)
        self.assertEqual(_regions.cuda_ipc_mem_handle(bytearray(_torch_shareable("c", self.ipc))), self.ipc)

    def test_expandable_segments_are_refused_with_what_to_do(self):
        # ShareHeader {pid_t pid (padded to 8), size_t segment_size, size_t num_handles}, then per segment a
        # POSIX fd (int) or a 64-byte CUmemFabricHandle.
        header = (4242).to_bytes(8, "little") + (2 << 20).to_bytes(8, "little") + (3).to_bytes(8, "little")
        for payload in (header + b"\x07\x00\x00\x00" * 3, header + b"f" * 64 * 3, header[:16]):
            with self.assertRaises(attnd.AttndError) as e:
                _regions.cuda_ipc_mem_handle(_torch_shareable("e", payload))
            self.assertEqual(e.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
            self.assertIn("expandable segment", e.exception.message)
            self.assertIn("expandable_segments:False", e.exception.message)

    def test_other_forms_are_refused(self):
        for bad in (b"", b"\x02", self.ipc[:63], self.ipc + b"\x00", _torch_shareable("c", self.ipc[:63]),
                    _torch_shareable("c", self.ipc + b"\x00"), _torch_shareable("q", self.ipc),
                    b"\x03c" + self.ipc):
            with self.assertRaises(attnd.AttndError) as e:
                _regions.cuda_ipc_mem_handle(bad)
            self.assertEqual(e.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
            self.assertIn("a %d-byte CUDA IPC handle" % len(bad), e.exception.message)
            self.assertIn("66 bytes: version 2, type 'c'", e.exception.message)


class ShmObjects(unittest.TestCase):
    def test_create_and_unlink(self):
        name, fd = attnd._regions.shm_create(8192)
        try:
            self.assertRegex(name, "^/attnd-[0-9a-f]{32}$")
            self.assertEqual(os.fstat(fd).st_size, 8192)
            self.assertTrue(os.path.exists("/dev/shm" + name))
        finally:
            os.close(fd)
            attnd._regions.shm_unlink(name)
        self.assertFalse(os.path.exists("/dev/shm" + name))


def _code(test, code, fn, *args, **kwargs):
    with test.assertRaises(attnd.AttndError) as cm:
        fn(*args, **kwargs)
    test.assertEqual(cm.exception.code, code, cm.exception.message)
    return cm.exception


class RegionsLive(at.DaemonTestCase, unittest.TestCase):
    def setUp(self):
        m = self.info.model
        self.h, self.hkv, self.d = m.num_q_heads, m.num_kv_heads, m.head_dim
        self.rng = np.random.default_rng(11)

    def raw_prefill(self, req):
        return self.client._call(self.client.stub.Prefill, req, None)

    def tensors(self, t, dtype=np.float32):
        r = self.rng
        return (at.random_bf16_exact(r, (t, 5, self.h, self.d)).astype(dtype),
                at.random_bf16_exact(r, (t, self.hkv, self.d)).astype(dtype),
                at.random_bf16_exact(r, (t, self.hkv, self.d)).astype(dtype))

    def test_server_offers_shm_regions_on_this_host(self):
        regions = self.info.regions
        self.assertIn(pb.REGION_KIND_SYSTEM_SHM, list(regions.kinds))
        self.assertNotIn(pb.REGION_KIND_CUDA_IPC, list(regions.kinds))  # the CPU backend
        with open("/proc/sys/kernel/random/boot_id") as f:
            self.assertEqual(regions.host_boot_id, f.read().strip())
        self.assertGreater(regions.max_regions_per_tenant, 0)

    def replay_golden(self, layer, np_dtype, to_wire, from_wire, use_session=False):
        """dense_gqa_chunked with every q/k/v and output in a registered shm region."""
        case = at.GoldenCase("dense_gqa_chunked")
        ids, stats = {}, []
        biggest = max(case.f32(s["q"]).nbytes + 2 * case.f32(s["k"]).nbytes + case.f32(s["out"]).nbytes
                      for s in case.steps)
        with self.client.register_shm(2 * biggest + (1 << 16)) as region:
            self.assertRegex(region.id, "^[0-9a-f]{32}$")
            session = self.client.session() if use_session else None
            api = session if use_session else self.client
            try:
                for i, step in enumerate(case.steps):
                    region._next = 0  # reuse the region from the start every step
                    q, k, v = (to_wire(case.f32(step[n])) for n in ("q", "k", "v"))
                    qs, ks, vs = (region.ndarray(a.shape, a.dtype) for a in (q, k, v))
                    qs[...], ks[...], vs[...] = q, k, v
                    out_shape = case.f32(step["out"]).shape
                    out = region.ndarray(out_shape, np_dtype)
                    if step["op"] == "prefill":
                        if step["seq"] not in ids:
                            ids[step["seq"]] = self.client.create_sequence()
                        got = api.prefill(ids[step["seq"]], layer, qs, ks, vs, prompt_len=step["prompt_len"],
                                          out=out)
                    else:
                        got = api.decode(layer, [ids[s] for s in step["seqs"]], qs, ks, vs, out=out)
                    self.assertIs(got, out)
                    stats.append(at.error_stats(from_wire(out), case.f32(step["out"])))
            finally:
                if session is not None:
                    session.close()
                for seq in ids.values():
                    self.client.release(seq)
        self.assertEqual(len(stats), len(case.steps))
        return stats

    def test_golden_fp32_through_shm(self):
        stats = self.replay_golden(0, np.float32, lambda x: x.astype(np.float32), lambda o: o)
        self.assertLessEqual(max(s[0] for s in stats), FP32_MAX_ABS)

    def test_golden_bf16_through_shm(self):
        stats = self.replay_golden(1, np.uint16, at.f32_to_bf16_bits_exact, at.bf16_bits_to_f32)
        self.assertLessEqual(max(s[0] for s in stats), BF16_MAX_ABS)
        self.assertLessEqual(max(s[1] for s in stats), BF16_MEAN_ABS)

    def test_golden_fp32_through_shm_on_a_session(self):
        stats = self.replay_golden(1, np.float32, lambda x: x.astype(np.float32), lambda o: o, use_session=True)
        self.assertLessEqual(max(s[0] for s in stats), FP32_MAX_ABS)

    def test_references_are_sent_and_match_bytes(self):
        q, k, v = self.tensors(9)
        a, b = self.client.create_sequence(), self.client.create_sequence()
        try:
            want = self.client.prefill(a, 0, q, k, v)
            with self.client.register_shm(1 << 20) as region:
                qs, ks, vs = (region.ndarray(x.shape, x.dtype) for x in (q, k, v))
                qs[...], ks[...], vs[...] = q, k, v
                from attnd._client import _prefill_request
                msg, _ = _prefill_request(b, 0, qs, ks, vs, None, regions=self.client._regions)
                parsed = pb.PrefillRequest.FromString(msg.tobytes())
                for t in (parsed.q, parsed.k, parsed.v):
                    self.assertTrue(t.HasField("region"))
                    self.assertEqual(t.data, b"")
                self.assertLess(len(msg.tobytes()), 400)  # references, not the 6 KiB of tensors
                # Without out= the output comes back as bytes, as numpy.
                got = self.client.prefill(b, 0, qs, ks, vs)
                np.testing.assert_array_equal(got, want)
                # A view that is not C-contiguous is sent as bytes (the fallback).
                qt = region.ndarray(q.shape[::-1], q.dtype).T
                self.assertFalse(qt.flags.c_contiguous)
        finally:
            self.client.release(a)
            self.client.release(b)

    def test_decode_out_rows(self):
        seqs = [self.client.create_sequence() for _ in range(3)]
        try:
            for s in seqs:
                self.client.prefill(s, 0, *self.tensors(5))
            q = at.random_bf16_exact(self.rng, (3, 3, self.h, self.d))
            k = at.random_bf16_exact(self.rng, (3, self.hkv, self.d))
            v = at.random_bf16_exact(self.rng, (3, self.hkv, self.d))
            with self.client.register_shm(1 << 20) as region:
                qs, ks, vs = (region.ndarray(x.shape, x.dtype) for x in (q, k, v))
                qs[...], ks[...], vs[...] = q, k, v
                out = region.ndarray((3, self.h, self.d), np.float32)
                got, lengths = self.client.decode(0, seqs, qs, ks, vs, out=out, return_lengths=True)
                self.assertIs(got, out)
                self.assertEqual(lengths, [6, 6, 6])
                self.assertTrue(np.all(np.isfinite(out)))
                self.assertGreater(float(np.abs(out).sum()), 0.0)
        finally:
            for s in seqs:
                self.client.release(s)

    def test_bad_references(self):
        INVALID, NOT_FOUND = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND
        seq = self.client.create_sequence()
        size = 1 << 16
        q, k, v = self.tensors(2)
        try:
            with self.client.register_shm(size) as region:
                rid = region.id

                def tensor(a, offset, nbytes=None, region_id=None):
                    return pb.Tensor(dtype=pb.DTYPE_FP32, shape=a.shape, region=pb.RegionRef(
                        region_id=region_id or rid, offset=offset, byte_size=a.nbytes if nbytes is None else nbytes))

                def req(qt, kt=None, vt=None, out=None):
                    r = pb.PrefillRequest(sequence_id=seq, layer=0, q=qt, k=kt or tensor(k, 8192),
                                          v=vt or tensor(v, 12288))
                    if out is not None:
                        r.output_region.CopyFrom(out)
                    return r

                self.assertEqual(self.raw_prefill(req(tensor(q, 0))).length, 2)  # the baseline works
                # Past the end, and an offset + size that overflows.
                _code(self, INVALID, self.raw_prefill, req(tensor(q, size - 64)))
                _code(self, INVALID, self.raw_prefill, req(tensor(q, 2 ** 64 - 16)))
                # Misaligned for fp32 (an offset of 2), through the automatic path too.
                _code(self, INVALID, self.raw_prefill, req(tensor(q, 2)))
                qm = region.ndarray(q.shape, np.float32, offset=16386)
                _code(self, INVALID, self.client.prefill, seq, 0, qm, k, v)
                # byte_size that is not the shape's.
                _code(self, INVALID, self.raw_prefill, req(tensor(q, 0, nbytes=q.nbytes - 4)))
                # Unknown region (well formed), malformed id.
                _code(self, NOT_FOUND, self.raw_prefill, req(tensor(q, 0, region_id=secrets.token_hex(16))))
                _code(self, INVALID, self.raw_prefill, req(tensor(q, 0, region_id="not-an-id")))
                # Output overlapping an input of the same request (q at 0: the output at 64 lies inside it).
                o_bytes = 2 * self.h * self.d * 4
                e = _code(self, INVALID, self.raw_prefill,
                          req(tensor(q, 0), out=pb.RegionRef(region_id=rid, offset=64, byte_size=o_bytes)))
                self.assertIn("overlap", e.message)
                qs = region.ndarray(q.shape, np.float32, offset=0)
                _code(self, INVALID, self.client.prefill, seq, 0, qs, k, v,
                      out=region.ndarray((2, self.h, self.d), np.float32, offset=0))
                # Output region of the wrong size.
                _code(self, INVALID, self.raw_prefill,
                      req(tensor(q, 0), out=pb.RegionRef(region_id=rid, offset=32768, byte_size=o_bytes - 4)))
                # None of these changed the sequence: the next good call appends at length 2.
                self.assertEqual(self.raw_prefill(req(tensor(q, 0))).length, 4)
                # Unregister, then use.
                region.unregister()
                _code(self, NOT_FOUND, self.raw_prefill, req(tensor(q, 0)))
                _code(self, NOT_FOUND, self.client.unregister_region, rid)
                # out= outside any registered region is refused before anything is sent.
                _code(self, INVALID, self.client.prefill, seq, 0, q, k, v, out=np.zeros((2, self.h, self.d), np.float32))
        finally:
            self.client.release(seq)

    def test_truncated_after_registration(self):
        seq = self.client.create_sequence()
        q, k, v = self.tensors(2)
        try:
            region = self.client.register_shm(1 << 16)
            try:
                qs, ks, vs = (region.ndarray(x.shape, x.dtype) for x in (q, k, v))
                qs[...], ks[...], vs[...] = q, k, v
                self.assertEqual(self.client.prefill(seq, 0, qs, ks, vs, return_length=True)[1], 2)
                req = pb.PrefillRequest(sequence_id=seq, layer=0)
                for field, a in (("q", qs), ("k", ks), ("v", vs)):
                    getattr(req, field).CopyFrom(pb.Tensor(dtype=pb.DTYPE_FP32, shape=a.shape, region=pb.RegionRef(
                        region_id=region.id, offset=region.offset_of(a), byte_size=a.nbytes)))
                del qs, ks, vs  # no view may touch the pages past the new end
                os.ftruncate(region.fd, 4096)
                e = _code(self, grpc.StatusCode.FAILED_PRECONDITION, self.raw_prefill, req)
                self.assertIn("shrank", e.message)
                self.assertEqual(self.client.prefill(seq, 0, q, k, v, return_length=True)[1], 4)  # server alive
            finally:
                region.close()
        finally:
            self.client.release(seq)

    def test_register_errors(self):
        _code(self, grpc.StatusCode.INVALID_ARGUMENT, self.client.register_shm_name, "no-slash", 0, 4096)
        _code(self, grpc.StatusCode.INVALID_ARGUMENT, self.client.register_shm_name,
              "/attnd-" + secrets.token_hex(16), 0, 4096)  # no such object
        with self.client.register_shm(8192) as region:
            _code(self, grpc.StatusCode.INVALID_ARGUMENT, self.client.register_shm_name, region.name, 0, 16384)
            _code(self, grpc.StatusCode.INVALID_ARGUMENT, self.client.register_shm_name, region.name, 100, 4096)
            rid = self.client.register_shm_name(region.name, 4096, 4096)
            self.client.unregister_region(rid)
        _code(self, grpc.StatusCode.NOT_FOUND, self.client.unregister_region, secrets.token_hex(16))


class RegionsTwoTenants(unittest.TestCase):
    """A region id is valid for the tenant that registered it only."""

    @classmethod
    def setUpClass(cls):
        cls._tmp = tempfile.mkdtemp(prefix="attnd-pytest-")
        tokens = os.path.join(cls._tmp, "tokens")
        cls.token_a, cls.token_b = secrets.token_hex(16), secrets.token_hex(16)
        with open(tokens, "w") as f:
            f.write("team-a %s\nteam-b %s\n" % (cls.token_a, cls.token_b))
        config = at.GoldenCase("dense_gqa_chunked").write_model_config(os.path.join(cls._tmp, "config.json"))
        cls.daemon = at.Daemon(config, extra_args=["--auth-token-file", tokens], token=cls.token_a)
        try:
            cls.daemon.start()
        except BaseException:
            shutil.rmtree(cls._tmp, True)
            raise
        cls.a = attnd.Client(cls.daemon.target, token=cls.token_a, timeout=60)
        cls.b = attnd.Client(cls.daemon.target, token=cls.token_b, timeout=60)
        cls.info = cls.a.info()

    @classmethod
    def tearDownClass(cls):
        cls.a.close()
        cls.b.close()
        cls.daemon.stop()
        shutil.rmtree(cls._tmp, True)

    def test_another_tenants_region_is_not_found(self):
        m = self.info.model
        rng = np.random.default_rng(4)
        q = at.random_bf16_exact(rng, (2, 5, m.num_q_heads, m.head_dim))
        k = at.random_bf16_exact(rng, (2, m.num_kv_heads, m.head_dim))
        seq_b = self.b.create_sequence()
        try:
            with self.a.register_shm(1 << 16) as region:
                qs, ks = region.ndarray(q.shape, q.dtype), region.ndarray(k.shape, k.dtype)
                qs[...], ks[...] = q, k
                seq_a = self.a.create_sequence()
                self.a.prefill(seq_a, 0, qs, ks, ks)  # tenant a may use it
                self.a.release(seq_a)
                req = pb.PrefillRequest(sequence_id=seq_b, layer=0)
                for field, arr in (("q", qs), ("k", ks), ("v", ks)):
                    getattr(req, field).CopyFrom(pb.Tensor(dtype=pb.DTYPE_FP32, shape=arr.shape, region=pb.RegionRef(
                        region_id=region.id, offset=region.offset_of(arr), byte_size=arr.nbytes)))
                _code(self, grpc.StatusCode.NOT_FOUND, self.b._call, self.b.stub.Prefill, req, None)
                _code(self, grpc.StatusCode.NOT_FOUND, self.b.unregister_region, region.id)
        finally:
            self.b.release(seq_b)

    def test_a_tenant_maps_only_objects_named_for_it(self):
        """Anyone on the host can list /dev/shm: knowing a name must not let another tenant map it."""
        self.assertEqual(self.a.info().regions.shm_name_prefix, "/attnd-team-a.")
        self.assertEqual(self.b.info().regions.shm_name_prefix, "/attnd-team-b.")
        with self.a.register_shm(8192) as region:
            self.assertRegex(region.name, r"^/attnd-team-a\.[0-9a-f]{32}$")
            with self.assertRaises(attnd.AttndError) as e:
                self.b.register_shm_name(region.name, 0, 4096)
            self.assertEqual(e.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
            self.assertIn('"/attnd-team-b."', e.exception.message)
            rid = self.a.register_shm_name(region.name, 4096, 4096)  # its owner may, again
            self.a.unregister_region(rid)
        name, fd = attnd._regions.shm_create(4096)  # an unauthenticated client's name
        try:
            _code(self, grpc.StatusCode.INVALID_ARGUMENT, self.a.register_shm_name, name, 0, 4096)
        finally:
            os.close(fd)
            attnd._regions.shm_unlink(name)


def _cuda_ok():
    return torch is not None and torch.cuda.is_available()


@unittest.skipUnless(_cuda_ok(), "torch with a CUDA device is not available (CUDA IPC regions need both)")
class CudaRegionTorch(unittest.TestCase):
    """Torch CUDA tensors registered by CUDA IPC with a daemon this class starts with --device cuda: the handle
    this torch gives (printed), the golden case through CUDA regions, and the refusals."""

    @classmethod
    def setUpClass(cls):
        cls._tmp = tempfile.mkdtemp(prefix="attnd-pytest-")
        config = at.GoldenCase("dense_gqa_chunked").write_model_config(os.path.join(cls._tmp, "config.json"))
        # The CUDA backend keeps K/V in bf16 (docs/DCA.md, "Numerics").
        cls.daemon = at.Daemon(config, kv_dtype="bf16")
        cls.daemon.args[cls.daemon.args.index("cpu")] = "cuda"
        try:
            cls.daemon.start()
            cls.client = attnd.Client(cls.daemon.target, timeout=60)
            cls.info = cls.client.info()
        except BaseException:
            cls.daemon.stop()
            shutil.rmtree(cls._tmp, True)
            raise
        sys.stderr.write("\n[CudaRegionTorch] torch %s (CUDA %s), grpcio %s, %s; _share_cuda_ handle: %d bytes\n" % (
            torch.__version__, torch.version.cuda, grpc.__version__, torch.cuda.get_device_name(),
            len(torch.zeros(1, device="cuda").untyped_storage()._share_cuda_()[1])))

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        cls.daemon.stop()
        shutil.rmtree(cls._tmp, True)

    def setUp(self):
        if pb.REGION_KIND_CUDA_IPC not in list(self.info.regions.kinds):
            self.fail("attnd --device cuda accepts no CUDA IPC regions: %s" % list(self.info.regions.kinds))
        m = self.info.model
        self.h, self.hkv, self.d = m.num_q_heads, m.num_kv_heads, m.head_dim

    def test_prefill_through_a_cuda_region(self):
        client, h, hkv, d = self.client, self.h, self.hkv, self.d
        t = 7
        gen = torch.Generator().manual_seed(3)
        q = torch.rand((t, 5, h, d), generator=gen) - 0.5
        k = torch.rand((t, hkv, d), generator=gen) - 0.5
        v = torch.rand((t, hkv, d), generator=gen) - 0.5
        want_seq, seq = client.create_sequence(), client.create_sequence()
        try:
            want = client.prefill(want_seq, 0, q, k, v)
            n = q.numel() + 2 * k.numel() + t * h * d
            buf = torch.zeros(n + 1024, dtype=torch.float32, device="cuda")
            with client.register_cuda(buf) as region:
                views, at_ = [], 256  # not at the start: the offset must be right
                for x in (q, k, v):
                    view = buf[at_:at_ + x.numel()].view(x.shape)
                    view.copy_(x.cuda())
                    views.append(view)
                    at_ += x.numel()
                out = buf[at_:at_ + t * h * d].view(t, h, d)
                got = client.prefill(seq, 0, *views, out=out)
                self.assertIs(got, out)
                torch.testing.assert_close(out.cpu(), want, rtol=0, atol=1e-5)
                # Offsets count from the allocation's start, where torch's caching allocator may
                # have put buf anywhere: relative to buf, q starts 256 elements in.
                self.assertEqual(region.offset_of(views[0]) - region.offset_of(buf), 256 * 4)
        finally:
            client.release(want_seq)
            client.release(seq)

    def test_the_server_takes_torch_handle_as_torch_gives_it(self):
        """RegisterRegion with _share_cuda_'s own bytes (66 on newer torch), not the client's 64."""
        buf = torch.arange(4096, dtype=torch.float32, device="cuda")
        shared = buf.untyped_storage()._share_cuda_()
        size = int(shared[3]) + int(shared[2])
        rid = self.client._register(pb.RegisterRegionRequest(
            cuda_ipc=pb.CudaIpcRegion(handle=bytes(shared[1]), byte_size=size)), None)
        self.client.unregister_region(rid)
        bad = bytes([2, ord("e")]) + bytes(28)  # an expandable segment's form
        e = _code(self, grpc.StatusCode.INVALID_ARGUMENT, self.client._register, pb.RegisterRegionRequest(
            cuda_ipc=pb.CudaIpcRegion(handle=bad, byte_size=size)), None)
        self.assertIn("expandable segment", e.message)

    def test_expandable_segments_are_refused(self):
        settings = getattr(torch.cuda.memory, "_set_allocator_settings", None)
        if settings is None:
            self.skipTest("this torch cannot switch expandable segments at run time")
        settings("expandable_segments:True")
        try:
            buf = torch.zeros(8 << 20, dtype=torch.uint8, device="cuda")  # > 2 MiB: a new segment
            with self.assertRaises(attnd.AttndError) as e:
                self.client.register_cuda(buf)
            self.assertEqual(e.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
            self.assertIn("expandable segment", e.exception.message)
            del buf
        finally:
            settings("expandable_segments:False")
        self.assertEqual(self.client.stub.GetServerInfo(pb.GetServerInfoRequest()).regions.max_regions_per_tenant,
                         self.info.regions.max_regions_per_tenant)

    def replay_golden(self, layer, tdtype, use_session=False, open_api=None):
        """dense_gqa_chunked with q/k/v and every output in one registered CUDA buffer (prefill and decode), through
        the client, a Session or what open_api() opens (closed at the end)."""
        case = at.GoldenCase("dense_gqa_chunked")
        biggest = max(case.f32(s["q"]).size + 2 * case.f32(s["k"]).size + case.f32(s["out"]).size
                      for s in case.steps)
        buf = torch.zeros(biggest + 4 * 64, dtype=tdtype, device="cuda")
        ids, stats, prefills, decodes = {}, [], 0, 0
        with self.client.register_cuda(buf) as region:
            session = self.client.session() if use_session else open_api() if open_api else None
            api = session if session is not None else self.client
            try:
                for step in case.steps:
                    at_, views = 0, []
                    for name in ("q", "k", "v"):
                        x = torch.from_numpy(case.f32(step[name]).copy()).to(tdtype)
                        view = buf[at_:at_ + x.numel()].view(x.shape)
                        view.copy_(x.cuda())
                        views.append(view)
                        at_ += (x.numel() + 63) // 64 * 64
                    out_shape = case.f32(step["out"]).shape
                    n = int(np.prod(out_shape))
                    out = buf[at_:at_ + n].view(out_shape)
                    self.assertIsNotNone(region.ref(out))
                    if step["op"] == "prefill":
                        if step["seq"] not in ids:
                            ids[step["seq"]] = self.client.create_sequence()
                        got = api.prefill(ids[step["seq"]], layer, *views, prompt_len=step["prompt_len"], out=out)
                        prefills += 1
                    else:
                        got = api.decode(layer, [ids[s] for s in step["seqs"]], *views, out=out)
                        decodes += 1
                    self.assertIs(got, out)
                    stats.append(at.error_stats(out.float().cpu().numpy(), case.f32(step["out"])))
            finally:
                if session is not None:
                    session.close()
                for seq in ids.values():
                    self.client.release(seq)
        self.assertEqual(len(stats), len(case.steps))
        self.assertGreater(prefills, 0)
        self.assertGreater(decodes, 0)
        return stats

    def test_golden_fp32_through_cuda_regions(self):
        stats = self.replay_golden(0, torch.float32)
        # fp32 requests, bf16 K/V: the bf16 bars, as golden_cuda_test uses for both dtypes.
        self.assertLessEqual(max(s[0] for s in stats), BF16_MAX_ABS)
        self.assertLessEqual(max(s[1] for s in stats), BF16_MEAN_ABS)

    def test_golden_bf16_through_cuda_regions_on_a_session(self):
        stats = self.replay_golden(1, torch.bfloat16, use_session=True)
        self.assertLessEqual(max(s[0] for s in stats), BF16_MAX_ABS)
        self.assertLessEqual(max(s[1] for s in stats), BF16_MEAN_ABS)

    def device_ordered_ring(self):
        if not self.info.regions.device_ordered_rings:
            self.fail("attnd --device cuda on one GPU orders no ring on the device (regions.device_ordered_rings)")
        ring = self.client.ring(version=2, device_events=True)
        self.assertTrue(ring.device_events)
        return ring

    def test_golden_through_a_device_ordered_ring(self):
        rings = []

        def open_ring():
            rings.append(self.device_ordered_ring())
            return rings[-1]

        stats = self.replay_golden(0, torch.bfloat16, open_api=open_ring)
        self.assertLessEqual(max(s[0] for s in stats), BF16_MAX_ABS)
        self.assertLessEqual(max(s[1] for s in stats), BF16_MEAN_ABS)
        # Every request named only CUDA regions: each was ordered on the device.
        self.assertEqual(rings[0].stats.device_ordered, len(stats))

    def test_a_device_ordered_ring_waits_for_the_late_inputs(self):
        """The inputs are written by the client's stream behind ~100 ms of queued GPU work and the client does not
        synchronize: attnd's output is that of the late inputs (it waited for the ready event), and reading the
        output after the call sees attnd's writes (the stream waited for the done event)."""
        client, h, hkv, d = self.client, self.h, self.hkv, self.d
        gen = torch.Generator().manual_seed(11)
        t = 9
        pq, pk, pv = (torch.rand(s, generator=gen) - 0.5 for s in ((t, 5, h, d), (t, hkv, d), (t, hkv, d)))
        q, k, v = (torch.rand(s, generator=gen) - 0.5 for s in ((1, 3, h, d), (1, hkv, d), (1, hkv, d)))
        want_seq, seq = client.create_sequence(), client.create_sequence()
        try:
            for s in (want_seq, seq):
                client.prefill(s, 0, pq, pk, pv)
            want = client.decode(0, [want_seq], q, k, v)
            slot = (q.numel() + 63) // 64 * 64  # the largest of q, k, v and the output
            buf = torch.zeros(4 * slot, dtype=torch.float32, device="cuda")
            qv, kv, vv, ov = (buf[i * slot:i * slot + x.numel()].view(x.shape)
                              for i, x in enumerate((q, k, v, torch.empty(1, h, d))))
            qd, kd, vd = q.cuda(), k.cuda(), v.cuda()
            with client.register_cuda(buf), self.device_ordered_ring() as ring:
                torch.cuda.synchronize()
                torch.cuda._sleep(200_000_000)  # about 100 ms of GPU time ahead of the inputs
                qv.copy_(qd)
                kv.copy_(kd)
                vv.copy_(vd)
                got = ring.decode(0, [seq], qv, kv, vv, out=ov)
                self.assertIs(got, ov)
                result = ov.cpu()  # on the current stream, after its wait for attnd's event
                self.assertEqual(ring.stats.device_ordered, 1)
            torch.testing.assert_close(result, want, rtol=0, atol=1e-5)
        finally:
            client.release(want_seq)
            client.release(seq)


if __name__ == "__main__":
    unittest.main()
