"""Tensor conversion between numpy arrays / torch tensors and attnd.v1.Tensor.

numpy: float32 -> DTYPE_FP32, float16 -> DTYPE_FP16, uint16 (or int16) -> DTYPE_BF16 taken as raw bfloat16
bits (numpy has no bfloat16), and an ml_dtypes ``bfloat16`` array -> DTYPE_BF16. Outputs come back in the
input's representation: a bf16 request given as uint16 answers uint16 bits.
torch: float32, float16 and bfloat16 map to their DTypes; outputs are torch tensors of the same dtype on the
device of the request's q.
"""
import sys

import numpy as np

import grpc

from ._errors import AttndError, invalid_argument
from ._proto import pb

_NP_BY_DTYPE = {pb.DTYPE_FP32: np.dtype("<f4"), pb.DTYPE_FP16: np.dtype("<f2"), pb.DTYPE_BF16: np.dtype("<u2")}
_DTYPE_NAME = {pb.DTYPE_FP32: "fp32", pb.DTYPE_FP16: "fp16", pb.DTYPE_BF16: "bf16"}


def _torch():
    """torch if it is already imported or importable; None otherwise. Never imports it for numpy input."""
    return sys.modules.get("torch")


def is_torch_tensor(x):
    torch = _torch()
    return torch is not None and isinstance(x, torch.Tensor)


class Like:
    """How to hand an output back: as the request's q was given."""
    __slots__ = ("kind", "np_dtype", "torch_dtype", "device")

    def __init__(self, kind, np_dtype=None, torch_dtype=None, device=None):
        self.kind, self.np_dtype, self.torch_dtype, self.device = kind, np_dtype, torch_dtype, device


# The numpy dtypes taken as they are (what a decode loop passes call after call): looked up by dtype, which
# is cheaper than the general path's dtype.name / kind checks.
_FAST_NP = {np.dtype("<f4"): pb.DTYPE_FP32, np.dtype("<f2"): pb.DTYPE_FP16, np.dtype("<u2"): pb.DTYPE_BF16}
_U2 = np.dtype("<u2")


def to_numpy(x, name):
    """Returns (little-endian C-contiguous numpy array, DType, Like)."""
    if type(x) is np.ndarray and x.flags.c_contiguous:
        dtype = _FAST_NP.get(x.dtype)
        if dtype is not None:
            return x, dtype, Like("numpy", np_dtype=x.dtype)
    if is_torch_tensor(x):
        torch = _torch()
        t = x.detach()
        like = Like("torch", torch_dtype=t.dtype, device=t.device)
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(np.uint16), pb.DTYPE_BF16, like
        if t.dtype == torch.float16:
            return t.numpy(), pb.DTYPE_FP16, like
        if t.dtype == torch.float32:
            return t.numpy(), pb.DTYPE_FP32, like
        raise invalid_argument("%s: unsupported torch dtype %s (use float32, float16 or bfloat16)" % (name, t.dtype))
    try:
        a = np.asarray(x)
    except Exception as err:  # noqa: BLE001
        raise invalid_argument("%s: not an array: %s" % (name, err)) from None
    like = Like("numpy", np_dtype=a.dtype)
    if a.dtype.name == "bfloat16":  # ml_dtypes / jax bfloat16: same bits as uint16.
        a = np.ascontiguousarray(a).view(np.uint16)
        dtype = pb.DTYPE_BF16
    elif a.dtype.kind == "f" and a.dtype.itemsize == 4:
        dtype = pb.DTYPE_FP32
    elif a.dtype.kind == "f" and a.dtype.itemsize == 2:
        dtype = pb.DTYPE_FP16
    elif a.dtype.kind in "ui" and a.dtype.itemsize == 2:
        dtype = pb.DTYPE_BF16
        a = a.view(a.dtype.str.replace("i", "u"))  # same bits, read as unsigned
    else:
        raise invalid_argument(
            "%s: unsupported numpy dtype %s (use float32, float16, or uint16 holding bfloat16 bits)" % (name, a.dtype))
    want = _NP_BY_DTYPE[dtype]
    if a.dtype != want:
        a = a.astype(want)  # byte order only: same kind and size
    return np.ascontiguousarray(a), dtype, like


def to_proto(x, name):
    """Returns (attnd.v1.Tensor, Like)."""
    a, dtype, like = to_numpy(x, name)
    return pb.Tensor(dtype=dtype, shape=a.shape, data=a.tobytes()), like


def split_arrays(x, name, batch):
    """Splits a [B, ...] batch into B C-contiguous views. Returns ([(array_i, DType)], Like)."""
    a, dtype, like = to_numpy(x, name)
    if a.ndim < 1 or a.shape[0] != batch:
        raise invalid_argument("%s: expected a leading batch dimension of %d (one per sequence), got shape %s"
                               % (name, batch, list(a.shape)))
    return [(a[i], dtype) for i in range(batch)], like


def split_batch(x, name, batch):
    """Splits a [B, ...] batch into B attnd.v1.Tensors (one per decode entry). Returns (tensors, Like)."""
    a, dtype, like = to_numpy(x, name)
    if a.ndim < 1 or a.shape[0] != batch:
        raise invalid_argument("%s: expected a leading batch dimension of %d (one per sequence), got shape %s"
                               % (name, batch, list(a.shape)))
    data = a.tobytes()
    step = len(data) // batch if batch else 0
    shape = a.shape[1:]
    return [pb.Tensor(dtype=dtype, shape=shape, data=data[i * step:(i + 1) * step]) for i in range(batch)], like


def _bad_response(message):
    return AttndError(grpc.StatusCode.INTERNAL, message)


def _check(t):
    """t: an attnd.v1.Tensor or a _wire.TensorView."""
    if t.dtype not in _NP_BY_DTYPE:
        raise _bad_response("server returned a tensor of unknown dtype %d" % t.dtype)
    want = int(np.prod(t.shape, dtype=np.int64)) * _NP_BY_DTYPE[t.dtype].itemsize
    if want != len(t.data):
        raise _bad_response("server returned %d bytes for shape %s %s" % (len(t.data), list(t.shape),
                                                                              _DTYPE_NAME[t.dtype]))


def from_bytes(data, dtype, shape, like):
    """Builds the output array/tensor of `like`'s kind from raw little-endian bytes (any buffer).

    numpy outputs are read-only views of `data` (no copy); torch outputs own a copy."""
    if like.kind == "torch":
        torch = _torch()
        tdt = {pb.DTYPE_FP32: torch.float32, pb.DTYPE_FP16: torch.float16, pb.DTYPE_BF16: torch.bfloat16}[dtype]
        if len(data) == 0:
            out = torch.empty(tuple(shape), dtype=tdt)
        else:
            out = torch.frombuffer(bytearray(data), dtype=tdt).reshape(tuple(shape))
        if like.device is not None and like.device.type != "cpu":
            out = out.to(like.device)
        return out
    a = np.frombuffer(data, dtype=_NP_BY_DTYPE[dtype]).reshape(tuple(shape))
    if dtype == pb.DTYPE_BF16 and like.np_dtype is not None and like.np_dtype != _U2:
        if like.np_dtype.name == "bfloat16":
            a = a.view(like.np_dtype)
        elif like.np_dtype.kind == "i":
            a = a.view(np.int16)
    return a


def from_proto(t, like):
    """t: an attnd.v1.Tensor or a _wire.TensorView."""
    _check(t)
    return from_bytes(t.data, t.dtype, list(t.shape), like)


def from_protos(tensors, like):
    """Stacks per-entry outputs ([Hq, D] each) into one [B, Hq, D] array/tensor."""
    if not tensors:
        raise _bad_response("server returned no outputs")
    first = tensors[0]
    for t in tensors:
        _check(t)
        if t.dtype != first.dtype or list(t.shape) != list(first.shape):
            raise _bad_response("server returned outputs of different dtype/shape in one batch")
    data = b"".join(t.data for t in tensors)
    return from_bytes(data, first.dtype, [len(tensors)] + list(first.shape), like)


def bf16_to_float32(bits):
    """numpy uint16 array of bfloat16 bits -> float32 array (exact)."""
    bits = np.asarray(bits)
    return (bits.astype(np.uint32) << 16).view(np.float32)


def float32_to_bf16(x):
    """numpy float32 array -> uint16 bfloat16 bits, rounded to nearest even (NaN stays NaN)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    u = x.view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        rounded = np.where(nan, ((u >> 16) | 0x40).astype(np.uint16), rounded)
    return rounded
