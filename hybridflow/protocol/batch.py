"""``Batch``: the column store passed between the Ray driver and workers.

Rows share a leading dimension across ``tensors`` (torch) and ``non_tensors``
(numpy, typically object arrays of strings/dicts). ``meta`` is free-form and
is carried along unchanged by row operations. Row operations return new
``Batch`` objects; like torch slicing, a slice may share memory with its
parent, while fancy indexing copies.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from .serde import FORMAT_VERSION, pack_tensor, unpack_array, unpack_tensor

Index = int | slice | Sequence[int] | Sequence[bool] | np.ndarray | torch.Tensor


def _to_object_array(values: Sequence[Any]) -> np.ndarray:
    # Assign element-wise: np.array(list_of_lists) would build a 2-D array.
    arr = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        arr[i] = v
    return arr


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        b = b.to(a.device)
        if a.is_floating_point():  # NaN padding must not count as a conflict
            return torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)
        return torch.equal(a, b)
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        try:
            return a.shape == b.shape and bool(np.array_equal(a, b))
        except (TypeError, ValueError):  # e.g. object cells holding arrays
            return False
    try:
        return bool(a == b)
    except (TypeError, ValueError):
        return False


class Batch:
    def __init__(
        self,
        tensors: dict[str, torch.Tensor] | None = None,
        non_tensors: dict[str, np.ndarray] | None = None,
        meta: dict[str, Any] | None = None,
    ) -> None:
        # Copy the dicts so later edits by the caller cannot bypass validation.
        self.tensors: dict[str, torch.Tensor] = dict(tensors or {})
        self.non_tensors: dict[str, np.ndarray] = dict(non_tensors or {})
        self.meta: dict[str, Any] = dict(meta or {})
        self._validate()

    @classmethod
    def from_dict(cls, tensors=None, non_tensors=None, meta=None) -> Batch:
        """Like the constructor, but lists/tuples become 1-D object arrays."""
        nt = {
            k: _to_object_array(v) if isinstance(v, (list, tuple)) else v
            for k, v in (non_tensors or {}).items()
        }
        return cls(tensors, nt, meta)

    def _validate(self) -> None:
        ref_key, ref_len = None, None
        columns = [("tensor", k, v) for k, v in self.tensors.items()]
        columns += [("non-tensor", k, v) for k, v in self.non_tensors.items()]
        for kind, key, value in columns:
            want = torch.Tensor if kind == "tensor" else np.ndarray
            if not isinstance(value, want):
                raise TypeError(
                    f"Batch {kind} {key!r} must be a {want.__module__}.{want.__name__}, "
                    f"got {type(value).__name__}"
                )
            if value.ndim == 0:
                raise ValueError(f"Batch {kind} {key!r} is 0-d; it needs a leading batch dim")
            if ref_len is None:
                ref_key, ref_len = key, value.shape[0]
            elif value.shape[0] != ref_len:
                raise ValueError(
                    f"Batch {kind} {key!r} has leading dim {value.shape[0]}, "
                    f"expected {ref_len} (from {ref_key!r})"
                )
        both = self.tensors.keys() & self.non_tensors.keys()
        if both:
            raise ValueError(f"Batch keys {sorted(both)} are both tensor and non-tensor")

    # ----------------------------------------------------------------- access
    def __len__(self) -> int:
        for col in (*self.tensors.values(), *self.non_tensors.values()):
            return int(col.shape[0])
        return 0

    def keys(self) -> list[str]:
        return [*self.tensors, *self.non_tensors]

    def __contains__(self, key: str) -> bool:
        return key in self.tensors or key in self.non_tensors

    def _normalize(self, idx: Index) -> slice | np.ndarray:
        n = len(self)
        if isinstance(idx, (int, np.integer)) and not isinstance(idx, (bool, np.bool_)):
            i = int(idx)
            if not -n <= i < n:
                raise IndexError(f"Batch index {i} out of range for length {n}")
            i %= n
            return slice(i, i + 1)  # keep the leading dim: b[i] is a 1-row Batch
        if isinstance(idx, slice):
            return idx
        if isinstance(idx, torch.Tensor):
            idx = idx.detach().cpu().numpy()
        elif isinstance(idx, (list, tuple)):
            idx = np.asarray(idx) if len(idx) else np.zeros(0, dtype=np.int64)
        if not isinstance(idx, np.ndarray) or idx.ndim != 1:
            raise TypeError(f"unsupported Batch index {type(idx).__name__}")
        if idx.dtype == np.bool_:
            if idx.shape[0] != n:
                raise IndexError(f"Batch bool mask has length {idx.shape[0]}, batch has {n}")
            return np.flatnonzero(idx)
        if not np.issubdtype(idx.dtype, np.integer):
            raise TypeError(f"Batch index array must be int or bool, got {idx.dtype}")
        return idx.astype(np.int64, copy=False)

    def __getitem__(self, idx: Index | str):
        if isinstance(idx, str):  # column access, convenient in workers
            if idx in self.tensors:
                return self.tensors[idx]
            if idx in self.non_tensors:
                return self.non_tensors[idx]
            raise KeyError(f"Batch has no key {idx!r}; keys: {self.keys()}")
        sel = self._normalize(idx)
        if isinstance(sel, slice):
            tensors = {k: v[sel] for k, v in self.tensors.items()}
        else:
            tensors = {k: v[torch.from_numpy(sel).to(v.device)] for k, v in self.tensors.items()}
        non_tensors = {k: v[sel] for k, v in self.non_tensors.items()}
        return Batch(tensors, non_tensors, self.meta)

    # ------------------------------------------------------------ key subsets
    def _check_keys(self, tensor_keys, non_tensor_keys) -> None:
        for keys, store, kind in ((tensor_keys, self.tensors, "tensor"),
                                  (non_tensor_keys, self.non_tensors, "non-tensor")):
            missing = [k for k in keys if k not in store]
            if missing:
                raise KeyError(f"Batch has no {kind} key(s) {missing}; has {list(store)}")

    def select(self, tensor_keys: Iterable[str] | None = None,
               non_tensor_keys: Iterable[str] | None = None) -> Batch:
        """Keep only the given keys; ``None`` keeps all keys of that kind."""
        tk = list(self.tensors) if tensor_keys is None else list(tensor_keys)
        nk = list(self.non_tensors) if non_tensor_keys is None else list(non_tensor_keys)
        self._check_keys(tk, nk)
        return Batch({k: self.tensors[k] for k in tk},
                     {k: self.non_tensors[k] for k in nk}, self.meta)

    def pop(self, tensor_keys: Iterable[str] | None = None,
            non_tensor_keys: Iterable[str] | None = None) -> Batch:
        """Remove the given keys and return them; ``None`` pops none (as in verl)."""
        tk, nk = list(tensor_keys or ()), list(non_tensor_keys or ())
        self._check_keys(tk, nk)  # all-or-nothing: check before mutating
        return Batch({k: self.tensors.pop(k) for k in tk},
                     {k: self.non_tensors.pop(k) for k in nk}, self.meta)

    def replace(self, tensors: dict | None = None, non_tensors: dict | None = None, meta: dict | None = None
                ) -> Batch:
        """New Batch with these entries set (added, or replacing those of the same key); unlike ``union``, a
        key may change its value (e.g. the response mask after rejection)."""
        return Batch({**self.tensors, **(tensors or {})}, {**self.non_tensors, **(non_tensors or {})},
                     {**self.meta, **(meta or {})})

    def union(self, other: Batch) -> Batch:
        """New Batch with the keys of both; a shared key must hold equal values."""
        if len(self) != len(other) and self.keys() and other.keys():
            raise ValueError(f"cannot union Batches of length {len(self)} and {len(other)}")
        out = []
        for kind, mine, theirs in (("tensor", self.tensors, other.tensors),
                                   ("non-tensor", self.non_tensors, other.non_tensors),
                                   ("meta", self.meta, other.meta)):
            merged = dict(mine)
            for k, v in theirs.items():
                if k in merged and not _same(merged[k], v):
                    raise ValueError(f"cannot union Batches: {kind} key {k!r} differs")
                merged[k] = v
            out.append(merged)
        return Batch(*out)

    # --------------------------------------------------------- row operations
    def split(self, chunk_size: int) -> list[Batch]:
        if chunk_size < 1:
            raise ValueError(f"split chunk_size must be >= 1, got {chunk_size}")
        return [self[i:i + chunk_size] for i in range(0, len(self), chunk_size)]

    def chunk(self, n: int) -> list[Batch]:
        """Split into ``n`` equal parts (one per worker)."""
        if n < 1:
            raise ValueError(f"chunk count must be >= 1, got {n}")
        if len(self) % n:
            raise ValueError(
                f"cannot chunk a Batch of length {len(self)} into {n} equal parts; "
                f"use pad_to_divisor({n}) first"
            )
        size = len(self) // n
        return [self[i * size:(i + 1) * size] for i in range(n)]

    @staticmethod
    def concat(batches: Sequence[Batch]) -> Batch:
        """Row-wise concatenation; ``meta`` is taken from the first batch."""
        if not batches:
            raise ValueError("Batch.concat needs at least one Batch")
        first = batches[0]
        for i, b in enumerate(batches[1:], 1):
            if set(b.tensors) != set(first.tensors) or set(b.non_tensors) != set(first.non_tensors):
                raise ValueError(
                    f"Batch.concat: batch {i} has keys {sorted(b.keys())}, "
                    f"batch 0 has {sorted(first.keys())}"
                )
        tensors, non_tensors = {}, {}
        for k in first.tensors:
            try:
                tensors[k] = torch.cat([b.tensors[k] for b in batches])
            except RuntimeError as e:
                raise ValueError(f"Batch.concat: tensor {k!r}: {e}") from e
        for k in first.non_tensors:
            try:
                non_tensors[k] = np.concatenate([b.non_tensors[k] for b in batches])
            except ValueError as e:
                raise ValueError(f"Batch.concat: non-tensor {k!r}: {e}") from e
        return Batch(tensors, non_tensors, first.meta)

    def repeat(self, n: int, interleave: bool = True) -> Batch:
        """interleave: a,a,b,b (rollout.n samples per prompt); else a,b,a,b."""
        if n < 1:
            raise ValueError(f"repeat count must be >= 1, got {n}")
        if interleave:
            tensors = {k: v.repeat_interleave(n, dim=0) for k, v in self.tensors.items()}
            non_tensors = {k: np.repeat(v, n, axis=0) for k, v in self.non_tensors.items()}
        else:
            tensors = {k: v.repeat(n, *([1] * (v.ndim - 1))) for k, v in self.tensors.items()}
            non_tensors = {k: np.tile(v, (n,) + (1,) * (v.ndim - 1))
                           for k, v in self.non_tensors.items()}
        return Batch(tensors, non_tensors, self.meta)

    def pad_to_divisor(self, divisor: int) -> tuple[Batch, int]:
        """Pad by repeating rows from the start so ``len % divisor == 0``."""
        if divisor < 1:
            raise ValueError(f"divisor must be >= 1, got {divisor}")
        pad = -len(self) % divisor
        if pad == 0:
            return self, 0
        # Cycles when pad > len (tiny batches on many workers).
        return Batch.concat([self, self[np.arange(pad) % len(self)]]), pad

    def unpad(self, pad_size: int) -> Batch:
        if not 0 <= pad_size <= len(self):
            raise ValueError(f"pad_size {pad_size} out of range for Batch of length {len(self)}")
        return self[:len(self) - pad_size]

    def to(self, device: str | torch.device, non_blocking: bool = False) -> Batch:
        tensors = {k: v.to(device, non_blocking=non_blocking) for k, v in self.tensors.items()}
        return Batch(tensors, self.non_tensors, self.meta)

    # ---------------------------------------------------------------- pickling
    def __getstate__(self) -> dict[str, Any]:
        # Tensors always arrive on CPU: the receiver picks its own device.
        return {
            "v": FORMAT_VERSION,
            "tensors": {k: pack_tensor(v) for k, v in self.tensors.items()},
            "non_tensors": self.non_tensors,
            "meta": self.meta,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        if state.get("v") != FORMAT_VERSION:
            raise ValueError(f"pickled Batch format {state.get('v')} != {FORMAT_VERSION}")
        self.tensors = {k: unpack_tensor(*p) for k, p in state["tensors"].items()}
        self.non_tensors = {k: unpack_array(v) for k, v in state["non_tensors"].items()}
        self.meta = state["meta"]

    def __repr__(self) -> str:
        def fmt(v):
            dtype = str(v.dtype).removeprefix("torch.")
            return f"{dtype}{list(v.shape)}"
        cols = [f"{k}: {fmt(v)}" for k, v in (*self.tensors.items(), *self.non_tensors.items())]
        return f"Batch(len={len(self)}, {{{', '.join(cols)}}}, meta_keys={list(self.meta)})"
