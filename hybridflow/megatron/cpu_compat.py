"""Run megatron-core on a machine without CUDA.

megatron-core assumes CUDA in a handful of places: tensor factories with ``device='cuda'`` or an int
device, ``Tensor.cuda()``, ``torch.cuda.current_device()``/``synchronize()``, the CUDA RNG tracker, and
the optimizer's ``p.type() == 'torch.cuda.FloatTensor'`` checks. Everything here is inert when CUDA is
present: ``enable()`` returns without patching and ``megatron_cpu_scope()`` is a null context.

Global patches are few and harmless to other libraries (vLLM runs in the same process); the
cuda->cpu device rewrite is a TorchFunctionMode scoped to megatron calls, because torch function modes
are thread-local and would otherwise leak into (or miss) other threads.
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torch.overrides import TorchFunctionMode

_CPU = torch.device("cpu")
_enabled = False
_lock = threading.Lock()

# Tensor.type() strings megatron compares against, mapped from their CPU names.
_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


def cuda_absent() -> bool:
    return not torch.cuda.is_available()


def _is_cuda_device(device) -> bool:
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True  # megatron passes torch.cuda.current_device() (an int) as a device
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class _CudaToCpu(TorchFunctionMode):
    """Rewrites CUDA devices to CPU for every torch call made inside it."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return _CUDA_TYPE_NAMES.get(name, name)
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = _CPU
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], _CPU, *args[2:])
        return func(*args, **kwargs)


class CpuRNGStatesTracker:
    """Named RNG states on the CPU generator, with the interface of megatron's CudaRNGStatesTracker."""

    def __init__(self, *_, **__):
        self.reset()
        self.use_cudagraphable_rng = False

    def reset(self):
        self._is_initialized = False
        self.states_ = {}
        self.seeds_ = set()

    def is_initialized(self):
        return self._is_initialized

    def get_states(self):
        return dict(self.states_)

    def set_states(self, states):
        self._is_initialized = True
        self.states_ = states

    def add(self, name, seed):
        self._is_initialized = True
        if seed in self.seeds_ or name in self.states_:
            raise ValueError(f"rng state {name!r} / seed {seed} already registered")
        self.seeds_.add(seed)
        saved = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(saved)

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        if name not in self.states_:
            raise KeyError(f"rng state {name!r} was not added")
        saved = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)


def enable() -> None:
    """Install the global CPU patches once per process (no-op when CUDA is available)."""
    global _enabled
    if not cuda_absent():
        return
    with _lock:
        if _enabled:
            return
        # A device, not an int: megatron passes it as `device=` and `.to()` inside autograd backward
        # functions, where the (thread-local, forward-only) device-rewriting mode is not active.
        torch.cuda.current_device = lambda: _CPU
        torch.cuda.synchronize = lambda *a, **k: None
        torch.cuda.empty_cache = lambda: None
        from megatron.core.tensor_parallel import random as mrandom

        mrandom.CudaRNGStatesTracker = CpuRNGStatesTracker
        mrandom._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
        mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
        mrandom.initialize_rng_tracker = lambda *a, **k: None
        _enabled = True


def model_parallel_seed(seed: int) -> None:
    """megatron's model_parallel_cuda_manual_seed, which also seeds the CPU generator on CPU."""
    from megatron.core import tensor_parallel

    torch.manual_seed(seed)
    if cuda_absent():
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import random as mrandom

        tracker = mrandom._CUDA_RNG_STATE_TRACKER
        tracker.reset()
        tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
        tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME,
                    seed + 2718 + ps.get_tensor_model_parallel_rank())
        tracker.add(mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024)
    else:
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def megatron_cpu_scope():
    """Context for megatron calls: rewrites CUDA devices to CPU when CUDA is absent."""
    if not cuda_absent():
        return contextlib.nullcontext()
    enable()
    return _CudaToCpu()
