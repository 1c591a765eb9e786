"""Build hook: generate attnd/v1/attention_pb2{,_grpc}.py from proto/attnd/v1/attention.proto.

Metadata lives in pyproject.toml. The stubs are written into the build directory (never the source tree), so
`pip install ./client/python` from the repository root always ships stubs matching the checked-out proto.
"""
import os
import sys

from setuptools import setup
from setuptools.command.build_py import build_py

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import generate  # noqa: E402  (client/python/generate.py)


class BuildPyWithStubs(build_py):
    def run(self):
        super().run()
        if not self.dry_run:
            for path in generate.generate(self.build_lib):
                self.announce("generated " + path, level=2)

    def get_outputs(self, include_bytecode=1):
        outs = super().get_outputs(include_bytecode)
        return outs + [os.path.join(self.build_lib, "attnd", "v1", n)
                       for n in ("attention_pb2.py", "attention_pb2_grpc.py")]


setup(cmdclass={"build_py": BuildPyWithStubs})
