"""token -> `authorization: Bearer <token>` metadata on every RPC, root_cert -> a TLS channel.

The daemon does not expose what metadata it received, so these tests run the client against a small in-process
gRPC server (the generated servicer) that records each call's metadata and answers with fixed messages.
"""
import os
import shutil
import subprocess
import sys
import tempfile
import unittest
from concurrent import futures

import grpc
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import attnd_testing as at  # noqa: E402

attnd = at.attnd
pb = attnd.proto
from attnd.v1 import attention_pb2_grpc as pb_grpc  # noqa: E402


class RecordingServicer(pb_grpc.AttentionServicer):
    def __init__(self):
        self.seen = []  # (method, authorization value or None)

    def _record(self, name, context):
        auth = [v for k, v in context.invocation_metadata() if k == "authorization"]
        self.seen.append((name, auth[0] if auth else None))
        if auth and auth[0] != "Bearer good-token":
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "bad token")

    def GetServerInfo(self, request, context):
        self._record("GetServerInfo", context)
        return pb.GetServerInfoResponse(version="fake", backend="cpu")

    def CreateSequence(self, request, context):
        self._record("CreateSequence", context)
        return pb.CreateSequenceResponse(sequence_id="ab" * 16)

    def Prefill(self, request, context):
        self._record("Prefill", context)
        t = request.q.shape[0]
        o = np.full((t, request.q.shape[2], request.q.shape[3]), 0.5, np.float32)
        return pb.PrefillResponse(o=pb.Tensor(dtype=pb.DTYPE_FP32, shape=o.shape, data=o.tobytes()), length=t)

    def Session(self, request_iterator, context):
        self._record("Session", context)
        for req in request_iterator:
            yield pb.SessionResponse(tag=req.tag, code=grpc.StatusCode.NOT_FOUND.value[0], message="nope")


def start_server(servicer, creds=None):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_AttentionServicer_to_server(servicer, server)
    port = server.add_secure_port("127.0.0.1:0", creds) if creds else server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


class TokenMetadata(unittest.TestCase):
    def test_token_on_every_rpc_kind(self):
        rec = RecordingServicer()
        server, port = start_server(rec)
        try:
            with attnd.Client("127.0.0.1:%d" % port, token="good-token", timeout=10) as c:
                self.assertEqual(c.info().version, "fake")
                self.assertEqual(c.create_sequence(), "ab" * 16)
                q = np.zeros((2, 5, 4, 8), np.float32)
                out = c.prefill("ab" * 16, 0, q, np.zeros((2, 2, 8), np.float32), np.zeros((2, 2, 8), np.float32))
                self.assertEqual(out.shape, (2, 4, 8))
                with c.session() as s:
                    with self.assertRaises(attnd.AttndError) as ctx:
                        s.prefill("ab" * 16, 0, q, np.zeros((2, 2, 8), np.float32), np.zeros((2, 2, 8), np.float32))
                    self.assertIs(ctx.exception.code, grpc.StatusCode.NOT_FOUND)
                    self.assertEqual(ctx.exception.message, "nope")
            self.assertEqual(rec.seen, [("GetServerInfo", "Bearer good-token"), ("CreateSequence", "Bearer good-token"),
                                        ("Prefill", "Bearer good-token"), ("Session", "Bearer good-token")])
            with attnd.Client("127.0.0.1:%d" % port, timeout=10) as c:
                c.info()
            self.assertEqual(rec.seen[-1], ("GetServerInfo", None))
            with attnd.Client("127.0.0.1:%d" % port, token="wrong", timeout=10) as c:
                with self.assertRaises(attnd.AttndError) as ctx:
                    c.info()
                self.assertIs(ctx.exception.code, grpc.StatusCode.UNAUTHENTICATED)
                self.assertEqual(ctx.exception.message, "bad token")
        finally:
            server.stop(None)


@unittest.skipIf(shutil.which("openssl") is None, "openssl is needed to make a test certificate")
class Tls(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="attnd-tls-")
        cls.key, cls.cert = os.path.join(cls.dir, "key.pem"), os.path.join(cls.dir, "cert.pem")
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                        "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
                        "-keyout", cls.key, "-out", cls.cert], check=True, capture_output=True)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.dir, True)

    def test_root_cert_makes_a_tls_channel(self):
        with open(self.key, "rb") as f:
            key = f.read()
        with open(self.cert, "rb") as f:
            cert = f.read()
        rec = RecordingServicer()
        server, port = start_server(rec, grpc.ssl_server_credentials([(key, cert)]))
        try:
            for root in (cert, self.cert):  # PEM bytes or a path
                with attnd.Client("localhost:%d" % port, token="good-token", root_cert=root, timeout=10) as c:
                    self.assertEqual(c.info().version, "fake")
            self.assertEqual(rec.seen[-1], ("GetServerInfo", "Bearer good-token"))
            # plaintext against a TLS port fails, and fails as AttndError
            with attnd.Client("localhost:%d" % port, timeout=5) as c:
                with self.assertRaises(attnd.AttndError) as ctx:
                    c.info()
                self.assertIs(ctx.exception.code, grpc.StatusCode.UNAVAILABLE)
        finally:
            server.stop(None)


if __name__ == "__main__":
    unittest.main()
