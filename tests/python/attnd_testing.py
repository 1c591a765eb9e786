"""Shared test support: the in-tree attnd package with freshly generated stubs, golden cases, a live daemon.

Importing this module generates the gRPC stubs from proto/attnd/v1/attention.proto into a temporary directory
and puts client/python and that directory at the front of sys.path, so the tests exercise the source tree (not
an installed copy).

Environment:
  ATTND_PYTHON_STUBS  a directory holding attnd/v1/attention_pb2*.py already generated (the GPU bundle's
                  python/, for machines without protoc): used instead of generating them
  ATTND_BIN       the daemon binary (default: bazel-bin/server/attnd under the repository root). If it is
                  missing the daemon tests FAIL: script/test builds it first.
The golden cases are read from tests/testdata/dca in this checkout.
"""
import atexit
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
CLIENT_DIR = os.path.join(REPO, "client", "python")


def _setup_package():
    if "attnd" in sys.modules:
        return sys.modules["attnd"]
    sys.path.insert(0, CLIENT_DIR)
    out = os.environ.get("ATTND_PYTHON_STUBS")
    if not out:
        import generate  # client/python/generate.py
        out = tempfile.mkdtemp(prefix="attnd-pystubs-")
        atexit.register(shutil.rmtree, out, True)
        generate.generate(out)
    sys.path.insert(1, out)
    import attnd as pkg
    if not os.path.abspath(pkg.__file__).startswith(CLIENT_DIR):
        raise AssertionError("imported attnd from %s, expected the source tree %s" % (pkg.__file__, CLIENT_DIR))
    return pkg


attnd = _setup_package()


# ---------------------------------------------------------------------------------------------------------------
# Golden cases.

def testdata_dir():
    """tests/testdata/dca in this checkout: the golden cases are part of the repository, so missing ones fail."""
    path = os.path.join(REPO, "tests", "testdata", "dca")
    if not os.path.isfile(os.path.join(path, "README.md")):
        raise AssertionError("golden test data not found at %s (it is committed in the repository)" % path)
    return path


def bf16_bits_to_f32(bits):
    """Independent of the client's helper: bfloat16 is the top half of a float32."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16_bits_exact(x):
    """For values already exactly representable in bf16 (golden inputs, rounded random data): truncation."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    if np.any(u & 0xFFFF):
        raise AssertionError("value not exactly representable in bf16")
    return (u >> 16).astype(np.uint16)


class GoldenCase:
    def __init__(self, name):
        self.dir = os.path.join(testdata_dir(), name)
        with open(os.path.join(self.dir, "case.json")) as f:
            self.meta = json.load(f)
        with open(os.path.join(self.dir, "tensors.bin"), "rb") as f:
            self.blob = f.read()
        self.steps = self.meta["steps"]

    def bits(self, name):
        """A bf16 tensor as its raw uint16 bits."""
        t = self.meta["tensors"][name]
        assert t["dtype"] == "bf16", t
        return np.frombuffer(self.blob, "<u2", t["nbytes"] // 2, t["offset"]).reshape(t["shape"])

    def f32(self, name):
        t = self.meta["tensors"][name]
        if t["dtype"] == "bf16":
            return bf16_bits_to_f32(self.bits(name))
        assert t["dtype"] == "f32", t
        return np.frombuffer(self.blob, "<f4", t["nbytes"] // 4, t["offset"]).reshape(t["shape"]).copy()

    def write_model_config(self, path, num_layers=2, max_position_embeddings=1 << 16):
        """A Hugging Face style config.json with the case's geometry (the daemon's --model-config)."""
        m = self.meta
        write_model_config(path, "golden-" + os.path.basename(self.dir), num_layers, m["num_q_heads"],
                           m["num_kv_heads"], m["head_dim"], max_position_embeddings,
                           m["dual_chunk_attention_config"])
        return path


def write_model_config(path, name, num_layers, num_q_heads, num_kv_heads, head_dim, max_position_embeddings,
                       dca):
    config = {
        "_name_or_path": name,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_q_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "hidden_size": num_q_heads * head_dim,
        "max_position_embeddings": max_position_embeddings,
        "dual_chunk_attention_config": dict(dca),
    }
    with open(path, "w") as f:
        json.dump(config, f, indent=2)
    return path


def error_stats(actual, expected):
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    if actual.shape != expected.shape:
        raise AssertionError("shape %s != expected %s" % (actual.shape, expected.shape))
    if not np.all(np.isfinite(actual)):
        return float("inf"), float("inf")
    err = np.abs(actual - expected)
    return float(err.max()), float(err.mean())


def random_bf16_exact(rng, shape):
    """Unit-scale uniform data rounded to bf16 (exact in fp32 and bf16), as float32."""
    x = rng.uniform(-1.0, 1.0, size=shape).astype(np.float32)
    return bf16_bits_to_f32((x.view(np.uint32) >> 16).astype(np.uint16))


# ---------------------------------------------------------------------------------------------------------------
# A live daemon on loopback.

def attnd_binary():
    path = os.path.abspath(os.environ.get("ATTND_BIN") or os.path.join(REPO, "bazel-bin", "server", "attnd"))
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        raise AssertionError("attnd binary not found at %s: build it with `bazel build //server:attnd` or set "
                             "ATTND_BIN (the Python client tests need a live daemon and do not skip)" % path)
    return path


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Daemon:
    """Starts attnd on a free loopback port, waits until GetServerInfo answers, stops it (SIGTERM, then kill)."""

    def __init__(self, model_config, kv_dtype="fp32", page_size=16, kv_cache_bytes=256 << 20, extra_args=(),
                 token=None):
        self.args = ["--model-config", model_config, "--device", "cpu", "--kv-dtype", kv_dtype,
                     "--page-size", str(page_size), "--kv-cache-bytes", str(kv_cache_bytes),
                     # metrics on a free port, so test daemons never contend for the default 9400
                     "--metrics-listen", "127.0.0.1:0"] + list(extra_args)
        self.proc = None
        self.target = None
        self.log_path = None
        self.token = token  # the readiness probe's bearer token, for daemons started with --auth-token-file

    def start(self, ready_timeout=60.0, port=None):
        """port: listen there (e.g. the port of a daemon that was killed, to restart it); default a free one."""
        binary = attnd_binary()
        last = None
        for _ in range(1 if port else 3):  # the free port may be taken between probing and binding: retry
            self.target = "127.0.0.1:%d" % (port or free_port())
            fd, self.log_path = tempfile.mkstemp(prefix="attnd-pytest-", suffix=".log")
            with os.fdopen(fd, "w") as log:
                self.proc = subprocess.Popen([binary, "--listen", self.target] + self.args, cwd=REPO,
                                             stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            try:
                self._wait_ready(ready_timeout)
                return self
            except AssertionError as err:
                last = err
                self.stop()
        raise last

    def _wait_ready(self, timeout):
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise AssertionError("attnd exited with %s at start-up:\n%s" % (self.proc.returncode, self.log()))
            # A fresh channel each time: one that failed before the daemon listened would wait out gRPC's
            # reconnect backoff (seconds) after it does.
            client = attnd.Client(self.target, token=self.token)
            try:
                client.info(timeout=1.0)
                return
            except attnd.AttndError as err:
                if time.monotonic() > deadline:
                    raise AssertionError("attnd not ready after %.0fs (%s):\n%s" % (timeout, err, self.log()))
            finally:
                client.close()
            time.sleep(0.05)

    def log(self):
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-8000:]
        except OSError:
            return ""

    def kill(self):
        """SIGKILL, like a crashed pod: no drain."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None
        if self.log_path and os.path.exists(self.log_path):
            os.unlink(self.log_path)
            self.log_path = None

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        if self.log_path and os.path.exists(self.log_path):
            os.unlink(self.log_path)
            self.log_path = None


class DaemonTestCase:
    """Mixin for unittest.TestCase classes: one daemon per class (setUpClass), stopped in tearDownClass.

    Subclasses set KV_DTYPE and may override model_config(tmpdir) (default: the golden dense case's geometry).
    """
    KV_DTYPE = "fp32"
    PAGE_SIZE = 16

    @classmethod
    def model_config(cls, tmpdir):
        return GoldenCase("dense_gqa_chunked").write_model_config(os.path.join(tmpdir, "config.json"))

    @classmethod
    def setUpClass(cls):
        cls._tmp = tempfile.mkdtemp(prefix="attnd-pytest-")
        cls.daemon = Daemon(cls.model_config(cls._tmp), kv_dtype=cls.KV_DTYPE, page_size=cls.PAGE_SIZE)
        try:
            cls.daemon.start()
            cls.client = attnd.Client(cls.daemon.target, timeout=120)
            cls.info = cls.client.info()
        except BaseException:
            cls.daemon.stop()  # tearDownClass does not run when setUpClass fails
            shutil.rmtree(cls._tmp, True)
            raise

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        cls.daemon.stop()
        shutil.rmtree(cls._tmp, True)
