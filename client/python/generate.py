#!/usr/bin/env python3
"""Generate the Python gRPC stubs for attnd/v1/attention.proto.

Used by the package build (setup.py runs it into the build directory) and by the in-tree tests
(which generate into a temporary directory put on sys.path). The output is never committed.

    python3 client/python/generate.py OUT_DIR [--proto-root DIR]

writes OUT_DIR/attnd/v1/attention_pb2.py and OUT_DIR/attnd/v1/attention_pb2_grpc.py.

The proto is looked up in this order: --proto-root / $ATTND_PROTO_DIR, ../../proto relative to this file
(the repository layout), ./proto next to this file (a copied source tree). The compiler is /usr/bin/protoc with
grpc_python_plugin (Debian's protobuf-compiler-grpc) when both are on PATH, else grpc_tools.protoc if importable.
"""
import argparse
import os
import shutil
import subprocess
import sys

PROTO_FILE = os.path.join("attnd", "v1", "attention.proto")
HERE = os.path.dirname(os.path.abspath(__file__))


def find_proto_root(proto_root=None):
    candidates = []
    if proto_root:
        candidates.append(proto_root)
    if os.environ.get("ATTND_PROTO_DIR"):
        candidates.append(os.environ["ATTND_PROTO_DIR"])
    candidates.append(os.path.join(HERE, "..", "..", "proto"))
    candidates.append(os.path.join(HERE, "proto"))
    for root in candidates:
        if os.path.isfile(os.path.join(root, PROTO_FILE)):
            return os.path.abspath(root)
    raise FileNotFoundError(
        "cannot find %s under any of %s; set ATTND_PROTO_DIR to the repository's proto/ directory"
        % (PROTO_FILE, [os.path.abspath(c) for c in candidates]))


def _compiler():
    """Returns a function(args) that runs protoc with the grpc python plugin configured."""
    protoc = shutil.which("protoc")
    plugin = shutil.which("grpc_python_plugin")
    if protoc and plugin:
        def run(args):
            cmd = [protoc, "--plugin=protoc-gen-grpc_python=" + plugin] + args
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError("protoc failed (%d): %s\n%s" % (proc.returncode, " ".join(cmd), proc.stderr))
        return run
    try:
        from grpc_tools import protoc as grpc_protoc  # type: ignore
    except ImportError:
        raise RuntimeError(
            "no proto compiler: install protoc and grpc_python_plugin (Debian: protobuf-compiler "
            "protobuf-compiler-grpc) or the grpcio-tools package") from None

    def run(args):
        include = os.path.join(os.path.dirname(grpc_protoc.__file__), "_proto")
        rc = grpc_protoc.main(["grpc_tools.protoc", "-I" + include] + args)
        if rc != 0:
            raise RuntimeError("grpc_tools.protoc failed (%d)" % rc)
    return run


def generate(out_dir, proto_root=None):
    """Generates the stubs into out_dir/attnd/v1/ and returns the paths written."""
    root = find_proto_root(proto_root)
    os.makedirs(os.path.join(out_dir, "attnd", "v1"), exist_ok=True)
    _compiler()(["-I" + root, "--python_out=" + out_dir, "--grpc_python_out=" + out_dir,
                 os.path.join(root, PROTO_FILE)])
    written = [os.path.join(out_dir, "attnd", "v1", name)
               for name in ("attention_pb2.py", "attention_pb2_grpc.py")]
    for path in written:
        if not os.path.isfile(path):
            raise RuntimeError("the proto compiler did not write " + path)
    return written


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--proto-root", default=None)
    args = parser.parse_args(argv)
    for path in generate(args.out_dir, args.proto_root):
        print(path)


if __name__ == "__main__":
    sys.exit(main())
