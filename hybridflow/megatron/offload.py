"""Move a role's parameters and optimizer state to host memory and back, by storage.

This is verl's ``offload_megatron_model_to_cpu`` / ``offload_megatron_optimizer`` (verl/utils/
megatron_utils.py) done once for every kind of tensor: each storage is copied into a host buffer and resized
to 0, and later resized back and refilled in place. Views into a storage stay valid (megatron DDP's params
are views of its contiguous buffers) and the optimizer keeps its references, so nothing needs re-wiring.

Each storage gets its host buffer once and keeps it, as megatron-core keeps one persistent
``param_data_cpu`` per buffer (distributed/param_and_grad_buffer.py, ``offload_to_cpu``): an offload
allocates nothing after the first. On GPU the buffers are page-locked at their exact size; torch's pinned
allocator would round every request up to a power of two and cache it for the life of the process
(ATen/core/CachingHostAllocator.h, torch 2.13).

Gradients are not handled here: every step zeroes them first, so they are freed and given back zeroed,
never copied (megatron-core's ``DistributedDataParallel.offload_grad_buffers`` / ``restore_grad_buffers``,
see role.py). On the CPU the host buffer and the device are both RAM and the same code runs, so the CPU
tests exercise the bookkeeping the GPU path relies on.
"""

from __future__ import annotations

import mmap
import weakref
from typing import Callable, Iterable

import torch

from hybridflow import device


def _identity(storage: torch.UntypedStorage) -> int:
    """The storage itself (its StorageImpl), unchanged by resize_ (unlike data_ptr, which is 0 when freed)."""
    return storage._cdata


def _unique_storages(tensors: Iterable[torch.Tensor], exclude: set[int]) -> list[torch.UntypedStorage]:
    """The distinct non-empty storages on this worker's device (state already on the host stays there)."""
    seen, out, on = set(exclude), [], device.current().type
    for t in tensors:
        storage = t.untyped_storage()
        key = _identity(storage)
        if storage.nbytes() and storage.device.type == on and key not in seen:
            seen.add(key)
            out.append(storage)
    return out


def _unregister(pages: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(pages.data_ptr())


class HostBuffer:
    """``nbytes`` of host memory in pages of its own, page-locked in place on an accelerator so that
    copies to the device run asynchronously, and unlocked before the pages are unmapped. Pages of its own:
    the driver refuses to register a page twice, which two small heap allocations sharing a page would ask."""

    def __init__(self, nbytes: int):
        self.tensor = torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)
        if device.on_accelerator():
            # Named cuda* on ROCm builds too (torch/csrc/cuda/shared/cudart.cpp); errors come back as codes.
            cudart = torch.cuda.cudart()
            err = cudart.cudaHostRegister(self.tensor.data_ptr(), nbytes, 0)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister of {nbytes} bytes of host memory failed: {err}")
            # Runs when this holder dies, while its tensor (an argument here) still holds the pages.
            weakref.finalize(self, _unregister, self.tensor)


class Offloader:
    """Offloads the storages of the tensors ``tensors()`` returns at the time of the call (optimizer
    state appears only after the first step); ``exclude()`` names storages owned by another offloader.

    ``host_allocations`` counts the host buffers allocated so far and ``reloads`` the moves back to the
    device: what a step costs, for the tests."""

    def __init__(self, tensors: Callable[[], Iterable[torch.Tensor]],
                 exclude: Callable[[], Iterable[torch.Tensor]] = lambda: ()):
        self._tensors, self._exclude = tensors, exclude
        self._buffers: dict[int, HostBuffer] = {}  # by storage identity, kept across offloads
        self._held: list[tuple[torch.UntypedStorage, torch.Tensor]] = []  # offloaded now
        self.host_allocations = 0
        self.reloads = 0

    @property
    def host_bytes(self) -> int:
        """Bytes whose only copy is in host memory now."""
        return sum(host.numel() for _, host in self._held)

    def offload(self) -> None:
        if self._held:
            return
        exclude = {_identity(t.untyped_storage()) for t in self._exclude()}
        buffers = {}
        for storage in _unique_storages(self._tensors(), exclude):
            key = _identity(storage)
            buffer = self._buffers.get(key)
            if buffer is None or buffer.tensor.numel() != storage.nbytes():
                buffer = HostBuffer(storage.nbytes())
                self.host_allocations += 1
            buffers[key] = buffer
            buffer.tensor.untyped_storage().copy_(storage)
            storage.resize_(0)
            self._held.append((storage, buffer.tensor))
        # Storages that are gone (optimizer state replaced by a checkpoint load) release their buffers.
        self._buffers = buffers

    def reload(self) -> None:
        if not self._held:
            return
        for storage, host in self._held:
            storage.resize_(host.numel())
            storage.copy_(host.untyped_storage(), non_blocking=True)
        if device.on_accelerator():
            torch.cuda.current_stream().synchronize()  # done before any other stream reads the params
        self._held = []
        self.reloads += 1


def optimizer_tensors(optimizer) -> list[torch.Tensor]:
    """Adam moments and fp32 main params of a megatron optimizer (chained or not)."""
    out = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = opt.optimizer
        for state in inner.state.values():
            out.extend(v for v in state.values() if isinstance(v, torch.Tensor))
        # For 16-bit models these are the fp32 main params; for fp32 models they are the model's own
        # params, which the params offloader owns (excluded by storage).
        out.extend(p for group in inner.param_groups for p in group["params"])
    return out
