"""Tensor <-> numpy packing used by ``Batch.__getstate__``/``__setstate__``.

Pickling numpy arrays is much faster than pickling torch tensors (torch goes
through its storage-sharing reducer) and lets Ray hand large arrays over
zero-copy. numpy has no dtype for bfloat16/float8/complex32, so those travel
as a same-width integer view and are viewed back on arrival.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

# Integer dtype with the same element size, used to carry dtypes numpy lacks.
_CARRIER = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

# Bump when the packed layout changes so stale payloads fail loudly.
FORMAT_VERSION = 1


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"unknown torch dtype {name!r} in pickled Batch")
    return dtype


def pack_tensor(t: torch.Tensor) -> tuple[str, Any, str]:
    """Return ``(kind, payload, dtype_name)``; kind is 'np', 'view' or 'torch'."""
    if t.layout != torch.strided or t.is_quantized:
        # Sparse/quantized tensors have no flat numpy form; let torch pickle them.
        return "torch", t, _dtype_name(t.dtype)
    # Ray workers may not share the sender's device, so ship host memory.
    t = t.detach().cpu().contiguous()
    try:
        return "np", t.numpy(), _dtype_name(t.dtype)
    except TypeError:
        carrier = _CARRIER.get(t.element_size())
        if carrier is None:
            return "torch", t, _dtype_name(t.dtype)
        return "view", t.view(carrier).numpy(), _dtype_name(t.dtype)


def unpack_tensor(kind: str, payload: Any, dtype_name: str) -> torch.Tensor:
    if kind == "torch":
        return payload
    arr: np.ndarray = payload
    # Arrays deserialised zero-copy from Ray's object store are read-only;
    # torch.from_numpy would alias that memory and in-place ops would crash.
    if not arr.flags.writeable:
        arr = arr.copy()
    t = torch.from_numpy(arr)
    if kind == "view":
        t = t.view(_dtype_from_name(dtype_name))
    return t


def unpack_array(a: np.ndarray) -> np.ndarray:
    # Same read-only concern as tensors: consumers append/assign into columns.
    return a if a.flags.writeable else a.copy()
