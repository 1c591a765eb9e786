"""Tensor regions (docs/regions.md): memory shared with attnd so tensors travel as references, not bytes.

ShmRegion owns a POSIX shared-memory object (shm_open under a random name: the server's prefix for this caller,
GetServerInfo().regions.shm_name_prefix, "/attnd-" or "/attnd-<tenant>.", then 32 hex) and hands out
numpy views into it; CudaRegion shares a torch CUDA tensor's allocation through CUDA IPC. Client.prefill and
Client.decode send a RegionRef for every q/k/v that lies inside a registered region of this client (numpy views
into a ShmRegion, CUDA tensors inside a CudaRegion), and `out=` names where the output goes.
"""
import ctypes
import ctypes.util
import errno
import mmap
import os
import secrets
import weakref

import grpc
import numpy as np

from ._errors import AttndError, invalid_argument
from ._proto import pb
from . import _tensors, _wire

_ALIGN = 256  # ShmRegion.ndarray's allocations start at multiples of this


def local_boot_id():
    """Linux's boot id: equal to GetServerInfo.regions.host_boot_id when the server shares this host."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def check_can_share(client, kind, device_uuid=None, timeout=None):
    """Raises FAILED_PRECONDITION unless the server accepts `kind` regions and runs on this host (and, for
    CUDA IPC, on the GPU whose UUID is `device_uuid`): shared memory cannot cross hosts, and the server's
    own error would only say that the object or handle does not open. Returns the server's RegionSupport."""
    info = client.info(timeout=timeout).regions
    kinds = set(info.kinds)
    if kind not in kinds:
        what = "CUDA IPC" if kind == pb.REGION_KIND_CUDA_IPC else "system shm"
        raise AttndError(grpc.StatusCode.FAILED_PRECONDITION,
                         "this server accepts no %s regions (its backend or --max-regions-per-tenant); "
                         "send the bytes inline" % what)
    mine = local_boot_id()
    if info.host_boot_id and mine and info.host_boot_id != mine:
        raise AttndError(grpc.StatusCode.FAILED_PRECONDITION,
                         "attnd runs on another host (boot id %s, this host %s): shared-memory regions need "
                         "the same host; send the bytes inline" % (info.host_boot_id, mine))
    if kind == pb.REGION_KIND_CUDA_IPC and device_uuid and info.device_uuid and \
            device_uuid != info.device_uuid:
        raise AttndError(grpc.StatusCode.FAILED_PRECONDITION,
                         "this tensor is on GPU %s but attnd serves GPU %s: CUDA IPC needs the same GPU"
                         % (device_uuid, info.device_uuid))
    return info

_libc = None

# The shm name prefix of a server without authentication (and of one too old to give its own).
DEFAULT_SHM_PREFIX = "/attnd-"


def _c():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        for name in ("shm_open", "shm_unlink"):
            if not hasattr(_libc, name):  # glibc < 2.34 keeps them in librt
                _libc = ctypes.CDLL(ctypes.util.find_library("rt") or "librt.so.1", use_errno=True)
                break
        _libc.shm_open.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_uint]
        _libc.shm_open.restype = ctypes.c_int
        _libc.shm_unlink.argtypes = [ctypes.c_char_p]
        _libc.shm_unlink.restype = ctypes.c_int
    return _libc


def shm_create(size, prefix=DEFAULT_SHM_PREFIX):
    """-> (name, fd) of a fresh shm object of `size` bytes (O_CREAT | O_EXCL, mode 0600), named `prefix` and
    32 random hex characters. attnd maps only names under the caller's prefix (the default is that of a
    server without authentication; with tokens it is "/attnd-<tenant>.")."""
    for _ in range(8):
        name = prefix + secrets.token_hex(16)
        fd = _c().shm_open(name.encode(), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        if fd >= 0:
            try:
                os.ftruncate(fd, size)
            except OSError:
                os.close(fd)
                shm_unlink(name)
                raise
            return name, fd
        err = ctypes.get_errno()
        if err != errno.EEXIST:
            raise OSError(err, "shm_open %s: %s" % (name, os.strerror(err)))
    raise OSError(errno.EEXIST, "shm_open: no free name after 8 attempts")


def shm_unlink(name):
    _c().shm_unlink(name.encode())


def _numpy_wire_dtype(a):
    """The DType a numpy array's bytes already are (no conversion needed), or None."""
    dt = a.dtype
    if dt.name == "bfloat16":
        return pb.DTYPE_BF16
    if dt.byteorder == ">":
        return None
    if dt.kind == "f" and dt.itemsize == 4:
        return pb.DTYPE_FP32
    if dt.kind == "f" and dt.itemsize == 2:
        return pb.DTYPE_FP16
    if dt.kind in "ui" and dt.itemsize == 2:
        return pb.DTYPE_BF16
    return None


class ShmRegion:
    """A shared-memory object registered with attnd; use as a context manager (or call close()).

        with client.register_shm(64 << 20) as region:
            q = region.ndarray((T, 5, H, D), np.float32)    # views into the shared memory
            q[...] = ...
            out = region.ndarray((T, H, D), np.float32)
            client.prefill(seq, layer, q, k, v, out=out)   # q/k/v/out travel as references

    Attributes: id (the region id), name (the shm object's name), size, fd (open until close()).
    """

    def __init__(self, client, size, timeout=None):
        size = int(size)
        if size <= 0:
            raise invalid_argument("register_shm: size must be positive, got %d" % size)
        info = check_can_share(client, pb.REGION_KIND_SYSTEM_SHM, None, timeout)
        self._client = client
        self.size = size
        self.name, self.fd = shm_create(size, info.shm_name_prefix or DEFAULT_SHM_PREFIX)
        # A region never closed still loses its name at exit (the server keeps its own mapping).
        self._unlink_at_exit = weakref.finalize(self, shm_unlink, self.name)
        self.id = None
        try:
            self._mmap = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            self._bytes = np.frombuffer(self._mmap, dtype=np.uint8)
            self.address = self._bytes.ctypes.data
            self._next = 0
            self.id = client._register(pb.RegisterRegionRequest(
                system_shm=pb.SystemShmRegion(name=self.name, offset=0, byte_size=size)), timeout)
        except BaseException:
            self._free()
            raise
        client._regions.append(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def buf(self):
        """The whole region as a writable uint8 numpy array."""
        return self._bytes

    def ndarray(self, shape, dtype, offset=None):
        """A numpy view of `shape` and `dtype` into the region: at `offset`, or the next free aligned bytes."""
        dtype = np.dtype(dtype)
        shape = tuple(int(d) for d in (shape if isinstance(shape, (tuple, list)) else (shape,)))
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if offset is None:
            offset = self._next
        offset = int(offset)
        if offset < 0 or offset + nbytes > self.size:
            raise invalid_argument("ndarray: %d bytes at offset %d do not fit the %d-byte region"
                                   % (nbytes, offset, self.size))
        self._next = max(self._next, (offset + nbytes + _ALIGN - 1) // _ALIGN * _ALIGN)
        return self._bytes[offset:offset + nbytes].view(dtype).reshape(shape)

    def offset_of(self, a):
        """The byte offset of numpy array `a` in this region, or None when it is not inside it."""
        if not isinstance(a, np.ndarray) or self.id is None:
            return None
        addr = a.__array_interface__["data"][0]
        if addr < self.address or addr + a.nbytes > self.address + self.size:
            return None
        return addr - self.address

    def ref(self, x):
        """A RegionTensor for `x` when it is a C-contiguous numpy array inside this region in a wire dtype."""
        off = self.offset_of(x)
        if off is None or not x.flags.c_contiguous:
            return None
        dtype = _numpy_wire_dtype(x)
        if dtype is None:
            return None
        return _wire.RegionTensor(dtype, x.shape, self.id, off, x.nbytes)

    def like(self, x):
        return _tensors.Like("numpy", np_dtype=x.dtype)

    def sync(self):
        pass

    def unregister(self, timeout=None):
        """UnregisterRegion now; the memory stays mapped (and named) until close()."""
        if self.id is not None:
            rid, self.id = self.id, None
            if self in self._client._regions:
                self._client._regions.remove(self)
            self._client._unregister(rid, timeout)

    def close(self):
        """Unregisters (if still registered), unlinks the name and unmaps (once no numpy view is left)."""
        try:
            if self.id is not None:
                try:
                    self.unregister()
                except AttndError:
                    pass  # the server may have reclaimed it or gone away; the memory is ours to free anyway
        finally:
            self._free()

    def _free(self):
        if getattr(self, "name", None):
            self._unlink_at_exit()  # shm_unlink, once
            self.name = None
        if getattr(self, "fd", -1) >= 0:
            os.close(self.fd)
            self.fd = -1
        m = getattr(self, "_mmap", None)
        if m is not None:
            self._bytes = None
            try:
                m.close()
            except BufferError:
                pass  # numpy views still exist: the mapping goes when the last of them does
            self._mmap = None


def cuda_device_of(torch, device_uuid):
    """The torch CUDA device whose UUID is `device_uuid` (attnd's GPU, "GPU-..."), else the current one."""
    for i in range(torch.cuda.device_count()):
        try:
            if device_uuid and "GPU-" + str(torch.cuda.get_device_properties(i).uuid) == device_uuid:
                return torch.device("cuda", i)
        except (AttributeError, RuntimeError):
            break
    return torch.device("cuda", torch.cuda.current_device())


class CudaRegion:
    """A torch CUDA tensor's allocation shared with attnd by CUDA IPC (CUDA backend, same host and GPU).

        buf = torch.empty(n, dtype=torch.bfloat16, device="cuda")
        with client.register_cuda(buf) as region:
            q = buf[:m].view(T, 5, H, D); ...
            client.prefill(seq, layer, q, k, v, out=o)     # tensors inside buf travel as references

    The region covers the tensor's whole storage (from the start of its CUDA allocation, as the IPC handle
    does); any contiguous CUDA tensor whose bytes lie in it is sent by reference. The current stream of the
    device is synchronized before each request that names the region, so attnd reads finished data.
    """

    def __init__(self, client, tensor, timeout=None):
        torch = _tensors._torch()
        if torch is None or not isinstance(tensor, torch.Tensor) or tensor.device.type != "cuda":
            raise invalid_argument("register_cuda needs a torch CUDA tensor")
        uuid = None
        try:
            uuid = "GPU-" + str(torch.cuda.get_device_properties(tensor.device).uuid)
        except (AttributeError, RuntimeError):
            pass
        check_can_share(client, pb.REGION_KIND_CUDA_IPC, uuid, timeout)
        self.id = None
        storage = tensor.untyped_storage()
        try:
            shared = storage._share_cuda_()
        except RuntimeError as err:  # torch itself refuses some memory (older torch: expandable segments)
            if "expandable" in str(err):
                raise _expandable_segment_error() from None
            raise invalid_argument("register_cuda: torch cannot share this tensor's memory: %s" % err) from None
        handle = cuda_ipc_mem_handle(shared[1])
        storage_size, storage_offset = int(shared[2]), int(shared[3])
        self._client = client
        self._tensor = tensor  # keeps the allocation alive while registered
        self.device = tensor.device
        # The handle names the allocation; the storage starts storage_offset bytes into it.
        self.address = storage.data_ptr() - storage_offset
        self.size = storage_offset + storage_size
        self.id = client._register(pb.RegisterRegionRequest(
            cuda_ipc=pb.CudaIpcRegion(handle=handle, byte_size=self.size)), timeout)
        client._regions.append(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def offset_of(self, t):
        torch = _tensors._torch()
        if self.id is None or not isinstance(t, torch.Tensor) or t.device != self.device:
            return None
        addr = t.data_ptr()
        nbytes = t.numel() * t.element_size()
        if addr < self.address or addr + nbytes > self.address + self.size:
            return None
        return addr - self.address

    def ref(self, t):
        off = self.offset_of(t)
        if off is None or not t.is_contiguous():
            return None
        torch = _tensors._torch()
        dtype = {torch.float32: pb.DTYPE_FP32, torch.float16: pb.DTYPE_FP16,
                 torch.bfloat16: pb.DTYPE_BF16}.get(t.dtype)
        if dtype is None:
            return None
        return _wire.RegionTensor(dtype, tuple(t.shape), self.id, off, t.numel() * t.element_size())

    def like(self, t):
        return _tensors.Like("torch", torch_dtype=t.dtype, device=t.device)

    def sync(self):
        _tensors._torch().cuda.current_stream(self.device).synchronize()

    def unregister(self, timeout=None):
        if self.id is not None:
            rid, self.id = self.id, None
            if self in self._client._regions:
                self._client._regions.remove(self)
            self._client._unregister(rid, timeout)

    def close(self):
        try:
            self.unregister()
        except AttndError:
            pass
        self._tensor = None


_IPC_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)
# torch's shareable handle (newer torch, 2.11 for one): a version byte, a type byte, then the type's payload; type 'c' is
# memory from cudaMalloc (the payload is its cudaIpcMemHandle_t), 'e' an expandable segment (a header and
# exported allocation handles, which CUDA IPC cannot open).
_TORCH_HANDLE_VERSION = 2
_TORCH_CUDA_MALLOC = ord("c")
_TORCH_EXPANDABLE_SEGMENT = ord("e")


def _expandable_segment_error():
    return invalid_argument(
        "register_cuda: this tensor's memory is in a torch expandable segment "
        "(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True), which CUDA IPC cannot share: allocate the region's "
        "buffer with expandable segments off, e.g. torch.cuda.memory._set_allocator_settings("
        "'expandable_segments:False') before allocating it (and back on after), or in a process started "
        "without expandable_segments:True")


def cuda_ipc_mem_handle(handle):
    """The 64-byte cudaIpcMemHandle_t in the handle torch's `untyped_storage()._share_cuda_()` returns.

    Older torch returns the 64 bytes themselves; newer torch (2.11 for one) returns 66: version 2, type 'c', then those 64
    bytes. Memory torch allocated in an expandable segment (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)
    has no cudaIpcMemHandle_t: INVALID_ARGUMENT says how to allocate the region's buffer instead, as does
    any other form."""
    handle = bytes(handle)
    if len(handle) == _IPC_HANDLE_BYTES:
        return handle
    if len(handle) >= 2 and handle[0] == _TORCH_HANDLE_VERSION:
        if handle[1] == _TORCH_CUDA_MALLOC and len(handle) == 2 + _IPC_HANDLE_BYTES:
            return handle[2:]
        if handle[1] == _TORCH_EXPANDABLE_SEGMENT:
            raise _expandable_segment_error()
    raise invalid_argument(
        "register_cuda: torch gave a %d-byte CUDA IPC handle%s; expected a cudaIpcMemHandle_t (64 bytes) or "
        "torch's shareable handle for cudaMalloc memory (66 bytes: version 2, type 'c', then the "
        "cudaIpcMemHandle_t)" % (len(handle), " starting %r" % handle[:2] if len(handle) >= 2 else ""))


def find_ref(regions, x):
    """(RegionTensor, region) for x when it lies in one of `regions`, else (None, None)."""
    for r in regions:
        ref = r.ref(x)
        if ref is not None:
            return ref, r
    return None, None


def row_refs(ref, n):
    """Splits a [n, ...] RegionTensor into n per-row references."""
    if len(ref.shape) < 1 or ref.shape[0] != n:
        raise invalid_argument("expected a leading batch dimension of %d (one per sequence), got shape %s"
                               % (n, list(ref.shape)))
    step = ref.nbytes // n if n else 0
    return [_wire.RegionTensor(ref.dtype, tuple(ref.shape[1:]), ref.region_id, ref.offset + i * step, step)
            for i in range(n)]
