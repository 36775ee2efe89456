"""torch.cuda on a machine without CUDA: what megatron-core calls unconditionally.

megatron-core calls ``torch.cuda.current_device()`` (communication buffers in tensor_parallel mappings,
p2p), ``torch.cuda.synchronize()`` and ``torch.cuda.empty_cache()``; without CUDA each raises. The
replacements are harmless to other libraries in the process (vLLM runs beside megatron) and are installed
only when no GPU is visible (``device.has_gpu``).
"""

from __future__ import annotations

import threading

from hybridflow.patches.registry import declare

TORCH = ">=2.13,<2.14"
CURRENT_DEVICE = declare(
    "torch.cuda.current_device", "torch", TORCH, "torch.cuda:current_device",
    "returns the CPU device: megatron passes it as `device=` and to `.to()` inside autograd backward "
    "functions, where the thread-local device-rewriting mode is not active")
SYNCHRONIZE = declare("torch.cuda.synchronize", "torch", TORCH, "torch.cuda:synchronize",
                      "a no-op: there is no device stream to wait for")
EMPTY_CACHE = declare("torch.cuda.empty_cache", "torch", TORCH, "torch.cuda:empty_cache",
                      "a no-op: there is no caching allocator")

_lock = threading.Lock()
_installed = False


def install_cpu_shims() -> None:
    """Install the three replacements once per process (callers check that no GPU is visible)."""
    global _installed
    import torch

    with _lock:
        if _installed:
            return
        cpu = torch.device("cpu")
        CURRENT_DEVICE.replace(lambda: cpu)
        SYNCHRONIZE.replace(lambda *a, **k: None)
        EMPTY_CACHE.replace(lambda: None)
        _installed = True
