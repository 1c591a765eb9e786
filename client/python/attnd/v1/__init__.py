"""attnd.v1: the generated protobuf/gRPC modules (attention_pb2, attention_pb2_grpc).

The modules are generated from proto/attnd/v1/attention.proto when the package is built (setup.py) or, in a
source checkout, by client/python/generate.py into a directory on sys.path; they are never committed.
extend_path lets such a directory (OUT_DIR/attnd/v1) supply them to the in-tree package.
"""
import pkgutil

__path__ = pkgutil.extend_path(__path__, __name__)  # noqa: F821
