"""CUDA IPC for KV pools: a process exports a CUDA tensor's memory as a handle of bytes, and
another process on the same host opens it and writes into it, device to device.

This is the device half of the CUDA IPC KV channel (issue 41; never run on a GPU): a
decode worker exports its GPU pools (shared_pools.py), a same-host prefill worker copies
each block straight into its destination block, and only headers travel over the Push
stream, as with the shared-memory pools on CPU. ``bench/cuda_ipc.py`` times such a copy.
The handle is plain bytes (``IpcHandle.to_bytes``): no pickle crosses a process boundary.

It calls the CUDA driver (``libcuda.so.1``, which torch's CUDA build loads) through ctypes:
``cuMemGetAddressRange`` finds the allocation a tensor lies in (torch's caching allocator
may put several tensors in one), ``cuIpcGetMemHandle`` exports that allocation, and
``cuIpcOpenMemHandle`` maps it in the other process, which sees the tensor at the same
offset. The GPU is named by its PCI bus id, not its number: two processes with different
``CUDA_VISIBLE_DEVICES`` number the same GPU differently. A process cannot open its own
handles; the exporting process must keep the tensor alive while others have it open.

On a machine without CUDA every entry point raises ``CudaIpcUnavailable``, saying so: the
shared-memory channel is what runs there.
"""

from __future__ import annotations

import ctypes
import functools
import struct
from dataclasses import dataclass
from typing import Any

import torch

_HANDLE_BYTES = 64  # CU_IPC_HANDLE_SIZE
_LAZY_ENABLE_PEER_ACCESS = 1  # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
_BUS_ID_BYTES = 16  # "0000:19:00.0" and its NUL
_WIRE = struct.Struct(f"<{_HANDLE_BYTES}s{_BUS_ID_BYTES}sQQ")  # handle, bus id, offset, size


class CudaIpcUnavailable(RuntimeError):
    """CUDA IPC cannot run here (no CUDA device, or the driver refused)."""


class _IpcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * _HANDLE_BYTES)]


_driver: Any = None


def unavailable_reason() -> str | None:
    """Why CUDA IPC cannot run in this process, or None when it can."""
    if not torch.cuda.is_available():
        return "no CUDA device: KV moves through the shared-memory channel on this machine"
    try:
        _cuda()
    except OSError as e:
        return f"the CUDA driver library could not be loaded: {e}"
    return None


def _cuda() -> Any:
    """libcuda with the prototypes used here (loaded once)."""
    global _driver
    if _driver is None:
        lib = ctypes.CDLL("libcuda.so.1")
        ptr, size = ctypes.c_uint64, ctypes.c_size_t
        lib.cuIpcGetMemHandle.argtypes = [ctypes.POINTER(_IpcMemHandle), ptr]
        lib.cuIpcOpenMemHandle_v2.argtypes = [ctypes.POINTER(ptr), _IpcMemHandle, ctypes.c_uint]
        lib.cuIpcCloseMemHandle.argtypes = [ptr]
        lib.cuMemGetAddressRange_v2.argtypes = [ctypes.POINTER(ptr), ctypes.POINTER(size), ptr]
        lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        lib.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
        lib.cuDeviceGetPCIBusId.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_int]
        lib.cuDeviceGetByPCIBusId.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_char_p]
        _driver = lib
    return _driver


def _check(result: int, what: str) -> None:
    if result != 0:
        message = ctypes.c_char_p()
        _cuda().cuGetErrorString(result, ctypes.byref(message))
        text = message.value.decode() if message.value else "unknown error"
        raise CudaIpcUnavailable(f"{what}: CUDA error {result} ({text})")


def _require() -> None:
    reason = unavailable_reason()
    if reason is not None:
        raise CudaIpcUnavailable(f"CUDA IPC: {reason}")


def _bus_id(index: int) -> bytes:
    """The PCI bus id of this process's CUDA device ``index``."""
    lib, device = _cuda(), ctypes.c_int()
    _check(lib.cuDeviceGet(ctypes.byref(device), index), "cuDeviceGet")
    name = ctypes.create_string_buffer(_BUS_ID_BYTES)
    _check(lib.cuDeviceGetPCIBusId(name, _BUS_ID_BYTES, device.value), "cuDeviceGetPCIBusId")
    return name.value


def _index_of(bus_id: bytes) -> int:
    """This process's number for the CUDA device at ``bus_id``."""
    device = ctypes.c_int()
    found = _cuda().cuDeviceGetByPCIBusId(ctypes.byref(device), bus_id)
    _check(found, f"cuDeviceGetByPCIBusId({bus_id.decode(errors='replace')}: not visible here?)")
    return device.value


@dataclass(frozen=True)
class IpcHandle:
    """What a receiver announces: the allocation's handle, its GPU's PCI bus id, and where
    the exported tensor's bytes lie in the allocation."""

    handle: bytes
    bus_id: bytes
    offset: int
    num_bytes: int

    def __post_init__(self) -> None:
        if len(self.handle) != _HANDLE_BYTES:
            raise ValueError(f"CUDA IPC handle: {len(self.handle)} bytes, not {_HANDLE_BYTES}")
        if not 0 < len(self.bus_id) < _BUS_ID_BYTES:
            raise ValueError(f"CUDA IPC bus id: {self.bus_id!r} is not a PCI bus id")

    def to_bytes(self) -> bytes:
        return _WIRE.pack(self.handle, self.bus_id, self.offset, self.num_bytes)

    @classmethod
    def from_bytes(cls, data: bytes) -> IpcHandle:
        if len(data) != _WIRE.size:
            raise ValueError(f"CUDA IPC handle: {len(data)} bytes, expected {_WIRE.size}")
        handle, bus_id, offset, num_bytes = _WIRE.unpack(data)
        return cls(handle, bus_id.rstrip(b"\0"), offset, num_bytes)


@functools.cache
def visible_bus_ids() -> tuple[str, ...]:
    """The PCI bus ids of the GPUs this process sees (and could open handles on); none
    where CUDA IPC cannot run here (asked once a process)."""
    if unavailable_reason() is not None:
        return ()
    try:
        return tuple(_bus_id(index).decode() for index in range(torch.cuda.device_count()))
    except CudaIpcUnavailable:
        return ()


def export_refusal(device: torch.device) -> str | None:
    """Why memory on ``device`` cannot be exported here, or None when it can: found by
    exporting a byte of it, before a caller moves anything there to export it."""
    if device.type != "cuda":
        return f"CUDA IPC: {device} is not a GPU"
    if (reason := unavailable_reason()) is not None:
        return f"CUDA IPC: {reason}"
    try:
        export(torch.zeros(1, dtype=torch.uint8, device=device))
    except CudaIpcUnavailable as e:
        return str(e)
    return None


def export(tensor: torch.Tensor) -> IpcHandle:
    """The handle of a contiguous CUDA tensor's bytes, for another process to open."""
    if tensor.device.type != "cuda":
        raise CudaIpcUnavailable(f"CUDA IPC: the tensor is on {tensor.device}, not a GPU")
    if not tensor.is_contiguous():
        raise ValueError("CUDA IPC: export a contiguous tensor")
    _require()
    lib, index = _cuda(), tensor.device.index or 0
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    handle = _IpcMemHandle()
    with torch.cuda.device(index):  # the driver calls use the device's current context
        torch.cuda.synchronize()
        found = lib.cuMemGetAddressRange_v2(
            ctypes.byref(base), ctypes.byref(size), tensor.data_ptr()
        )
        _check(found, "cuMemGetAddressRange")
        _check(lib.cuIpcGetMemHandle(ctypes.byref(handle), base.value), "cuIpcGetMemHandle")
        bus_id = _bus_id(index)
    num_bytes = tensor.numel() * tensor.element_size()
    raw = ctypes.string_at(ctypes.addressof(handle), _HANDLE_BYTES)  # NULs included
    return IpcHandle(raw, bus_id, tensor.data_ptr() - base.value, num_bytes)


class _DeviceBytes:
    """Device memory torch can wrap without copying (the CUDA array interface)."""

    def __init__(self, address: int, num_bytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (num_bytes,),
            "typestr": "|u1",
            "data": (address, False),
            "version": 3,
            "strides": None,
        }


class OpenedTensor:
    """Another process's exported memory, mapped here: ``bytes`` is a uint8 CUDA tensor
    over it; ``close`` unmaps it (after which ``bytes`` must not be used)."""

    def __init__(self, handle: IpcHandle) -> None:
        _require()
        lib = _cuda()
        self.device = torch.device("cuda", _index_of(handle.bus_id))
        raw = _IpcMemHandle()
        ctypes.memmove(ctypes.addressof(raw), handle.handle, _HANDLE_BYTES)
        base = ctypes.c_uint64()
        with torch.cuda.device(self.device):
            torch.cuda.synchronize()
            opened = lib.cuIpcOpenMemHandle_v2(ctypes.byref(base), raw, _LAZY_ENABLE_PEER_ACCESS)
            _check(opened, "cuIpcOpenMemHandle (a process cannot open its own handle)")
        self._base: int | None = base.value
        address = base.value + handle.offset
        memory = _DeviceBytes(address, handle.num_bytes)
        self.bytes = torch.as_tensor(memory, device=self.device)
        if self.bytes.data_ptr() != address:  # a copy: writes would never reach the pool
            self.close()
            raise CudaIpcUnavailable(f"CUDA IPC: torch copied the memory onto {self.device}")

    def close(self) -> None:
        if self._base is not None:
            base, self._base = self._base, None
            with torch.cuda.device(self.device):
                torch.cuda.synchronize()  # no copy may still be writing
                _check(_cuda().cuIpcCloseMemHandle(base), "cuIpcCloseMemHandle")


__all__ = [
    "CudaIpcUnavailable",
    "IpcHandle",
    "OpenedTensor",
    "export",
    "unavailable_reason",
    "visible_bus_ids",
]
