"""attnd: Python client for the attnd dual-chunk attention daemon (see docs/python.md).

    import attnd
    with attnd.Client("127.0.0.1:50051") as c:
        seq = c.create_sequence()
        out = c.prefill(seq, layer, q, k, v)          # q [T,5,Hq,D], k/v [T,Hkv,D] -> out [T,Hq,D]
        out = c.decode(layer, [seq], q1, k1, v1)      # q [B,3|5,Hq,D], k/v [B,Hkv,D] -> out [B,Hq,D]
        with c.ring() as ring:                        # same host: through shared memory, no gRPC call per request
            out = ring.decode(layer, [seq], q1, k1, v1)
        c.release(seq)

    with attnd.FleetClient(["10.0.0.1:50051", "10.0.0.2:50051"]) as f:   # or "dns:///attnd-headless:50051"
        seq = f.create_sequence()                     # "<instance>.<32 hex>": placed on the least loaded daemon
        out = f.prefill(seq, layer, q, k, v)          # routed to the daemon the id names
"""
import pkgutil

# A source checkout gets the generated attnd/v1 stubs from another sys.path entry (client/python/generate.py).
__path__ = pkgutil.extend_path(__path__, __name__)  # noqa: F821

from ._errors import AttndError  # noqa: E402
from ._client import Client, Pending, Session  # noqa: E402
from ._fleet import FleetClient  # noqa: E402
from ._regions import CudaRegion, ShmRegion  # noqa: E402
from ._ring import Ring, RingPending  # noqa: E402
from ._tensors import bf16_to_float32, float32_to_bf16  # noqa: E402
from ._proto import pb as proto  # noqa: E402

__version__ = "0.1.0"

__all__ = ["AttndError", "Client", "CudaRegion", "FleetClient", "Pending", "Ring", "RingPending", "Session", "ShmRegion", "bf16_to_float32", "float32_to_bf16", "proto",
           "__version__"]
