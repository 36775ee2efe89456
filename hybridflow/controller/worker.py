"""Base class for the Ray actors a `RayWorkerGroup` creates.

The group passes rank layout through environment variables (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT, LOCAL_RANK, LOCAL_WORLD_SIZE) so the same worker
code also runs under torchrun-style launchers without Ray.
"""

from __future__ import annotations

import functools
import os
import time
from datetime import timedelta

from hybridflow import device
from hybridflow.util import free_port
from hybridflow.controller.decorator import get_register_spec


def _timed(fn):
    """``fn`` adding its wall seconds to the worker's per-method compute time (``Worker.compute_seconds``)."""
    @functools.wraps(fn)  # keeps the @register spec
    def timed(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(self, *args, **kwargs)
        finally:
            spent = self.__dict__.setdefault("_compute_s", {})
            spent[fn.__name__] = spent.get(fn.__name__, 0.0) + time.perf_counter() - start
    return timed


class Worker:
    def __init_subclass__(cls, **kwargs):
        # Every @register-ed method is timed inside the worker, so the controller's cost (dispatch,
        # serialization, Ray, waiting) is the rest of a step: benchmarks/overhead.py.
        super().__init_subclass__(**kwargs)

        for name, fn in list(vars(cls).items()):
            if callable(fn) and get_register_spec(fn) is not None and not hasattr(fn, "__wrapped__"):
                setattr(cls, name, _timed(fn))

    def compute_seconds(self) -> dict[str, float]:
        """Seconds each registered method has run in this worker since the last call; resets them."""
        spent, self._compute_s = self.__dict__.get("_compute_s", {}), {}
        return spent

    def __init__(self, *args, **kwargs):
        # Ray leaves torch at one thread per core; on shared nodes that
        # oversubscribes, so follow OMP_NUM_THREADS (the group sets it to the bundle's CPUs).
        import torch

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", 1)))

    # Properties read the env each time so subclasses that forget
    # super().__init__() still see their rank.
    @property
    def rank(self) -> int:
        return int(os.environ.get("RANK", 0))

    @property
    def world_size(self) -> int:
        return int(os.environ.get("WORLD_SIZE", 1))

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", 0))

    @property
    def master_addr(self) -> str:
        return os.environ.get("MASTER_ADDR", "127.0.0.1")

    @property
    def master_port(self) -> int:
        return int(os.environ.get("MASTER_PORT", 29500))

    def init_distributed(self, backend: str | None = None, timeout_s: float = 300) -> str:
        """Join the group's torch.distributed world; returns the backend.

        All ranks must call this together (ONE_TO_ALL does), otherwise the
        rendezvous waits until `timeout_s`. Calling it again is a no-op.
        """
        import torch.distributed as dist

        if dist.is_initialized():
            return dist.get_backend()

        bound = device.bind(self.local_rank)  # before nccl: its communicators live on the current device
        if backend is None:
            backend = "gloo" if bound.type == "cpu" else "nccl"  # nccl is rccl on ROCm builds of torch
        dist.init_process_group(
            backend=backend,
            init_method=f"tcp://{self.master_addr}:{self.master_port}",
            rank=self.rank,
            world_size=self.world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        return backend

    def dispatch_info(self, mesh: str = "train") -> dict:  # noqa: ARG002 (one mesh here)
        """Layout used by Dispatch.DP_COMPUTE_3D for methods registered on ``mesh``; override
        for TP/PP.

        Pure data parallel by default: every rank is its own dp rank and
        returns its own results.
        """
        return {"dp_rank": self.rank, "dp_size": self.world_size, "collect": True}

    def alive(self) -> bool:
        """A call that only answers (``RayWorkerGroup.dead_ranks``)."""
        return True

    @staticmethod
    def find_free_port() -> int:
        """A TCP port free on this node now, outside the range outgoing connections take (util.free_port)."""
        return free_port()
