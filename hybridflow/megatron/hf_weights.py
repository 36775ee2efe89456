"""A Hugging Face model folder's safetensors weights, read lazily.

Every rank used to load the whole checkpoint into host memory (7B bf16: 15 GB in each of 16 processes).
``HFWeights`` opens the files (``safetensors.safe_open``, memory-mapped) and reads a tensor only when it is
asked for, and a tensor-parallel chunk of one alone (``get_slice``): a rank reads its pipeline stage's
layers and its TP shard of them, nothing more.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch


class HFWeights(Mapping):
    """{HF name: tensor} of a model folder, each tensor read when it is looked up. ``bytes_read`` counts
    what was read so far."""

    def __init__(self, folder: str):
        from safetensors import safe_open

        files = sorted(Path(folder).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors weights in model folder {folder}")
        self._file_of = {}
        for f in files:
            handle = safe_open(str(f), framework="pt", device="cpu")
            self._file_of.update((name, handle) for name in handle.keys())
        self.bytes_read = 0

    def _count(self, t: torch.Tensor) -> torch.Tensor:
        self.bytes_read += t.numel() * t.element_size()
        return t

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._count(self._file_of[name].get_tensor(name))

    def __contains__(self, name) -> bool:  # Mapping's default would read the tensor
        return name in self._file_of

    def __iter__(self):
        return iter(self._file_of)

    def __len__(self) -> int:
        return len(self._file_of)

    def shape_of(self, name: str) -> list[int]:
        """The tensor's shape, from the file's header (nothing is read)."""
        return self._file_of[name].get_slice(name).get_shape()

    def expert(self, name: str, e: int) -> torch.Tensor:
        """``self[name][e]``, reading only that slice (a checkpoint's experts fused in one tensor:
        families/stacked_experts.py)."""
        return self._count(self._file_of[name].get_slice(name)[e:e + 1][0])

    def chunk(self, name: str, dim: int, parts: int, index: int) -> torch.Tensor:
        """``torch.chunk(self[name], parts, dim)[index]``, reading only that chunk."""
        piece = self._file_of[name].get_slice(name)
        n = piece.get_shape()[dim]
        size = -(-n // parts)
        return self._count(piece[(slice(None),) * dim + (slice(index * size, min(n, (index + 1) * size)),)])


def tp_chunk(weights: Mapping, name: str, dim: int | None, tp_size: int, tp_rank: int) -> torch.Tensor:
    """This TP rank's chunk of HF tensor ``name`` along ``dim`` (the whole tensor for None), as a tensor of
    its own: read alone from an ``HFWeights``, cut from the full tensor of a plain dict."""
    if isinstance(weights, HFWeights):
        return weights[name] if dim is None else weights.chunk(name, dim, tp_size, tp_rank)
    t = weights[name]
    return (t if dim is None else torch.chunk(t, tp_size, dim=dim)[tp_rank]).clone()
