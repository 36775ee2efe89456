"""Checkpoints that hold a layer's routed experts fused over the experts (gpt-oss: ``mlp.experts.gate_up_proj``
[experts, hidden, 2 x width], ``gate_up_proj_bias``, ``down_proj``, ``down_proj_bias``, as transformers'
GptOssExperts keeps them and writes them), seen one expert at a time: expert e's slice is
``mlp.experts.{e}.gate_up_proj`` and so on, the names the family declares (weights.FUSED_EXPERT) and the names
vLLM's gpt-oss loader takes one expert at a time. Reading presents the slices (``PerExpertWeights``), writing
stacks them back (``stacked_items``): nothing else sees the fused tensors."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

from hybridflow import families
from hybridflow.util import MappingView
from hybridflow.families.weights import FUSED_SLICE as _SLICE
from hybridflow.families.weights import FUSED_TENSOR as _FUSED


def _experts_of(weights: Mapping, name: str) -> int:
    """The leading (experts) dim of ``name``, read from the file's header where the mapping can."""
    shape = getattr(weights, "shape_of", None)
    return (shape(name) if shape else weights[name].shape)[0]


class PerExpertWeights(MappingView):
    """{HF name: tensor} of ``weights`` (a mapping, read lazily where it is) with each fused expert tensor
    replaced by its per-expert slices; a slice is read alone where the mapping can (``HFWeights.expert``), else its
    fused tensor is read whole once for its experts read in turn (a dequantized MXFP4 one: megatron/quantized.py)."""

    def __init__(self, weights: Mapping):
        self.raw = weights
        self._last = (None, None)  # the fused tensor last read whole
        self._slices = {}
        for name in weights:
            m = _FUSED.match(name)
            if m:
                self._slices.update({f"{m[1]}{e}.{m[2]}": (name, e) for e in range(_experts_of(weights, name))})
        self._names = [n for n in weights if not _FUSED.match(n)] + list(self._slices)

    def __getitem__(self, name: str):
        if name not in self._slices:
            return self.raw[name]
        fused, e = self._slices[name]
        read = getattr(self.raw, "expert", None)
        if read:
            return read(fused, e)
        if self._last[0] != fused:  # read whole (dequantized, say): once while its experts are read in turn
            self._last = (fused, self.raw[fused])
        return self._last[1][e].clone()

    def __contains__(self, name) -> bool:
        return name in self._slices or (name in self.raw and not _FUSED.match(str(name)))


def readable(weights: Mapping, hf_config) -> Mapping:
    """``weights`` under the family's declared names: per expert where the checkpoint fuses the experts."""
    return PerExpertWeights(weights) if families.of(hf_config).experts_fused else weights


def stacked_items(items: Iterable, hf_config) -> Iterator:
    """(HF name, tensor) pairs as the checkpoint holds them: where the family fuses its experts, each layer's
    per-expert slices (which may come in any order, interleaved with other tensors) are held until the last
    of them arrives and go out as one [experts, ...] tensor."""
    if not families.of(hf_config).experts_fused:
        yield from items
        return
    experts, pending = families.num_experts(hf_config), {}
    for name, t in items:
        m = _SLICE.match(name)
        if not m:
            yield name, t
            continue
        held = pending.setdefault(m[1] + m[3], {})
        held[int(m[2])] = t
        if len(held) == experts:
            import torch

            yield m[1] + m[3], torch.stack([held[e] for e in range(experts)])
            del pending[m[1] + m[3]]
    if pending:
        name, held = next(iter(pending.items()))
        raise ValueError(f"{name}: {len(held)} of the {experts} experts were written, the checkpoint needs all")

