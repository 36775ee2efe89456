"""Every random stream of a process (python, numpy, torch CPU and devices, megatron-core's model-parallel
tracker), captured and restored together so a resumed run draws exactly what the uninterrupted run drew.

vLLM's unseeded sampling draws from torch's default generator of its device in this same process (the
engine runs in-process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so restoring torch's states restores its
sampling stream too (v1 sampler ``random_sample``: ``q.exponential_()`` without a generator).
"""

from __future__ import annotations

import random
import zlib

import numpy as np
import torch

from hybridflow import device


def seed_of(*parts) -> int:
    """A sampling seed (31 bits) named by ``parts`` (the run's seed, then what the sample is): the same wherever and
    whenever it is drawn, so a response does not depend on the engine, its batch or its replica."""
    return zlib.crc32("/".join(map(str, parts)).encode()) & 0x7FFFFFFF


def capture() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if device.has_gpu():
        state["cuda"] = torch.cuda.get_rng_state_all()
    tracker = _megatron_tracker()
    if tracker is not None:
        state["megatron"] = tracker.get_states()
    return state


def restore(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and device.has_gpu():
        torch.cuda.set_rng_state_all(state["cuda"])
    tracker = _megatron_tracker()
    if tracker is not None and "megatron" in state:
        tracker.set_states(state["megatron"])


def _megatron_tracker():
    try:
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import get_cuda_rng_tracker
    except ImportError:
        return None
    return get_cuda_rng_tracker() if ps.model_parallel_is_initialized() else None


def save(path: str) -> None:
    torch.save(capture(), path)


def load(path: str) -> None:
    restore(torch.load(path, weights_only=False))
