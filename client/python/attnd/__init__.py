"""attnd: Python client for the attnd dual-chunk attention daemon (see docs/python.md).

    import attnd
    with attnd.Client("127.0.0.1:50051") as c:
        seq = c.create_sequence()
        out = c.prefill(seq, layer, q, k, v)          # q [T,5,Hq,D], k/v [T,Hkv,D] -> out [T,Hq,D]
        out = c.decode(layer, [seq], q1, k1, v1)      # q [B,3|5,Hq,D], k/v [B,Hkv,D] -> out [B,Hq,D]
        c.release(seq)
"""
import pkgutil

# A source checkout gets the generated attnd/v1 stubs from another sys.path entry (client/python/generate.py).
__path__ = pkgutil.extend_path(__path__, __name__)  # noqa: F821

from ._errors import AttndError  # noqa: E402
from ._client import Client, Pending, Session  # noqa: E402
from ._regions import CudaRegion, ShmRegion  # noqa: E402
from ._tensors import bf16_to_float32, float32_to_bf16  # noqa: E402
from ._proto import pb as proto  # noqa: E402

__version__ = "0.1.0"

__all__ = ["AttndError", "Client", "CudaRegion", "Pending", "Session", "ShmRegion", "bf16_to_float32", "float32_to_bf16", "proto",
           "__version__"]
