"""The one place that decides a worker's device and dtypes, and moves tensors across the host/device line.

A worker binds its device once (``bind``); every tensor handed to megatron, a collective, a loss or vLLM
goes through ``to_device`` and every result for Ray through ``to_host``. On a machine without CUDA the
device is the CPU and both are no-ops, so the CPU tests run exactly these code paths.

ROCm builds of torch expose HIP devices through ``torch.cuda`` (``torch.version.hip`` is set), so nothing
here is NVIDIA-only: "cuda" below means either.
"""

from __future__ import annotations

import os

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
CPU = torch.device("cpu")

_bound: torch.device | None = None


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(DTYPES)}")
    return DTYPES[name]


def accelerator_count() -> int:
    """Accelerators this process can see (Ray's isolation leaves each GPU actor only its own)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def has_gpu() -> bool:
    """The one answer to "is there a GPU" (CUDA or ROCm) for this process."""
    return accelerator_count() > 0


def device_index(local_rank: int, visible: int) -> int:
    """Which visible accelerator a process with this node-local rank uses.

    Under Ray's GPU isolation every actor sees exactly its own GPU(s) (CUDA_VISIBLE_DEVICES, or
    HIP_VISIBLE_DEVICES on ROCm), so the index is 0 whatever its local rank; where all of a node's GPUs
    are visible (torchrun, or Ray with RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES) the local rank picks.
    vLLM's GPU worker applies the same rule to its LOCAL_RANK (gpu_worker.init_device sets
    ``cuda:{local_rank}`` and asserts ``local_rank < torch.cuda.device_count()``), so this is also the
    LOCAL_RANK vLLM must see.
    """
    if visible < 1:
        raise ValueError("no accelerator is visible")
    if visible == 1:
        return 0
    if local_rank >= visible:
        raise RuntimeError(f"local rank {local_rank} has no GPU: only {visible} are visible to this process")
    return local_rank


def local_ranks(node_of_rank: list) -> list[int]:
    """Node-local rank of each global rank, given the node each rank runs on (pool bundle order)."""
    return [node_of_rank[:rank].count(node) for rank, node in enumerate(node_of_rank)]


def worker_device(local_rank: int = 0, visible: int | None = None) -> torch.device:
    visible = accelerator_count() if visible is None else visible
    return CPU if visible == 0 else torch.device("cuda", device_index(local_rank, visible))


def bind(local_rank: int | None = None) -> torch.device:
    """Decide this process's device once (node-local rank from LOCAL_RANK when not given) and make it
    the current CUDA device, so that megatron's ``torch.cuda.current_device()`` and nccl agree with it."""
    global _bound
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
    _bound = worker_device(local_rank)
    if _bound.type == "cuda":
        torch.cuda.set_device(_bound)
    return _bound


def bind_thread() -> None:
    """Make the bound device current in a thread of the caller's (CUDA's current device is per host thread:
    cudaSetDevice, which torch.cuda.set_device calls; a new thread starts on device 0)."""
    if current().type == "cuda":
        torch.cuda.set_device(current())


def current() -> torch.device:
    """The bound device (binding from LOCAL_RANK on first use)."""
    return _bound if _bound is not None else bind()


def on_accelerator() -> bool:
    return current().type != "cpu"


def _map(obj, fn):
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _map(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map(v, fn) for v in obj)
    return obj


def to_device(obj, dtype: torch.dtype | None = None):
    """Tensors in ``obj`` (a tensor, or dicts/lists of them) on this worker's device; floating tensors
    cast to ``dtype`` when given (integer ids and masks keep theirs)."""
    device = current()

    def move(t: torch.Tensor) -> torch.Tensor:
        if dtype is not None and t.is_floating_point():
            return t.to(device=device, dtype=dtype, non_blocking=True)
        return t.to(device, non_blocking=True)

    return _map(obj, move)


def to_host(obj):
    """Detached host copies for Ray (a no-op for tensors already on the CPU)."""
    return _map(obj, lambda t: t.detach().cpu())


def memory_stats(prefix: str) -> dict:
    """Peak memory: on GPU allocated/reserved device memory since the last call (then reset); on CPU the
    process's RSS high-water mark since it started (the kernel keeps no resettable one)."""
    if on_accelerator():
        stats = {f"{prefix}/peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
                 f"{prefix}/peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30}
        torch.cuda.reset_peak_memory_stats()
        return stats
    import resource

    return {f"{prefix}/peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
