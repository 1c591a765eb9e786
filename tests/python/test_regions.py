"""Tensor regions through the Python client (docs/regions.md): request encoding and shm objects."""
import os
import sys
import unittest

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import attnd_testing as at  # noqa: E402

attnd = at.attnd
pb = attnd.proto


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


if __name__ == "__main__":
    unittest.main()
