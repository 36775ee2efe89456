"""Move a role's parameters, gradients and optimizer state to host memory and back, by storage.

This is verl's ``offload_megatron_model_to_cpu`` / ``offload_megatron_optimizer`` (verl/utils/
megatron_utils.py) done once for every kind of tensor: each storage is copied into a host buffer and resized
to 0, and later resized back and refilled in place. Views into a storage stay valid (megatron DDP's params
and ``main_grad`` are views of its contiguous buffers) and the optimizer keeps its references, so nothing
needs re-wiring. On the CPU the host buffer and the device are both RAM and the same code runs, so the CPU
tests exercise the bookkeeping the GPU path relies on.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch


def _unique_storages(tensors: Iterable[torch.Tensor], exclude: set[int]) -> list[torch.UntypedStorage]:
    seen, out = set(exclude), []
    for t in tensors:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if storage.nbytes() and key not in seen:
            seen.add(key)
            out.append(storage)
    return out


class Offloader:
    """Offloads the storages of the tensors ``tensors()`` returns at the time of the call (optimizer
    state appears only after the first step); ``exclude()`` names storages owned by another offloader."""

    def __init__(self, tensors: Callable[[], Iterable[torch.Tensor]],
                 exclude: Callable[[], Iterable[torch.Tensor]] = lambda: ()):
        self._tensors, self._exclude = tensors, exclude
        self._held: list[tuple[torch.UntypedStorage, torch.Tensor]] = []

    @property
    def host_bytes(self) -> int:
        return sum(host.numel() for _, host in self._held)

    def offload(self) -> None:
        if self._held:
            return
        exclude = {t.untyped_storage().data_ptr() for t in self._exclude()}
        pin = torch.cuda.is_available()  # pinned host memory makes the copies back asynchronous
        for storage in _unique_storages(self._tensors(), exclude):
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, device="cpu", pin_memory=pin)
            host.untyped_storage().copy_(storage)
            storage.resize_(0)
            self._held.append((storage, host))

    def reload(self) -> None:
        for storage, host in self._held:
            storage.resize_(host.numel())
            storage.copy_(host.untyped_storage(), non_blocking=True)
        if self._held and torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()  # the host buffers are freed below
        self._held = []


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
