"""Imports the generated stubs, with a message that says how to get them when they are missing."""
try:
    from attnd.v1 import attention_pb2 as pb  # noqa: F401
    from attnd.v1 import attention_pb2_grpc as pb_grpc  # noqa: F401
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError(
        "attnd's generated gRPC stubs are missing (%s). Install the package (pip install "
        "./client/python) or, in a source checkout, run `python3 client/python/generate.py OUT_DIR` and put "
        "OUT_DIR on sys.path after client/python." % err) from err
