"""Quantized checkpoints read as unquantized weights: training, the rollout engines and exports hold the model in
its training dtype, so a checkpoint whose config.json has a ``quantization_config`` is dequantized as it is read.

Known layouts:
- FP8 block-wise (``quant_method: fp8`` with ``weight_block_size: [m, n]``: DeepSeek-V3/R1, Kimi-K2,
  Qwen3-*-FP8): each quantized ``<name>`` is float8_e4m3fn beside a float32 ``<name>_scale_inv`` holding one scale
  per [m, n] block (the grid rounded up where a dimension is not a multiple), and the weight is their product, as
  transformers' ``Fp8Dequantize`` computes it (integrations/finegrained_fp8.py).
- MXFP4 (``quant_method: mxfp4``: gpt-oss's official checkpoints): each quantized ``<name>`` (its fused experts'
  ``gate_up_proj``, ``down_proj``) is stored as ``<name>_blocks`` [experts, rows, groups, 16] (two E2M1 values a
  byte, the low nibble first) and ``<name>_scales`` [experts, rows, groups] (one power-of-two E8M0 exponent per
  32 values, biased by 127), read through transformers' own ``convert_moe_packed_tensors``
  (integrations/mxfp4.py), which also lays the result out as the bf16 checkpoints hold it ([experts, in, out]).
Any other quantization is refused in one line. What is written back (exports, checkpoints' ``hf`` folders) has no
``quantization_config``, and the vLLM engines are built without it (rollout/vllm_rollout.py)."""

from __future__ import annotations

import copy
from collections.abc import Mapping

import torch

from hybridflow.util import MappingView

SCALE_SUFFIX = "_scale_inv"


def quantization_of(hf_config) -> dict | None:
    """The checkpoint's FP8 block layout ({"weight_block_size": [m, n], ...}), None for an unquantized one;
    ValueError (one line, naming the key) for a quantization hybridflow does not read."""
    q = getattr(hf_config, "quantization_config", None)
    if q is None:
        return None
    q = q if isinstance(q, dict) else q.to_dict()
    method, block = q.get("quant_method"), q.get("weight_block_size")
    if method == "mxfp4":
        return q
    if method != "fp8" or not (isinstance(block, (list, tuple)) and len(block) == 2):
        raise ValueError(f"quantization_config: quant_method {method!r} with weight_block_size {block!r} is not "
                         "read here (supported: fp8 with weight_block_size [m, n], mxfp4); dequantize the checkpoint "
                         "first")
    return q


def folder_is_quantized(path: str) -> bool:
    """A model folder whose config.json has a ``quantization_config``."""
    import json
    from pathlib import Path

    return json.loads((Path(path) / "config.json").read_text()).get("quantization_config") is not None


def unquantized_config(hf_config):
    """A copy of ``hf_config`` without ``quantization_config`` (the weights it describes are dequantized)."""
    if getattr(hf_config, "quantization_config", None) is None:
        return hf_config
    plain = copy.deepcopy(hf_config)
    del plain.quantization_config
    return plain


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], name: str = "weight"
                   ) -> torch.Tensor:
    """float32 ``weight`` x its block's scale; ``scale_inv`` [ceil(rows / m), ceil(cols / n)]."""
    rows, cols = weight.shape[-2:]
    m, n = block
    grid = (-(-rows // m), -(-cols // n))
    if tuple(scale_inv.shape[-2:]) != grid:
        raise ValueError(f"{name}{SCALE_SUFFIX} has shape {list(scale_inv.shape)}, but {name} {list(weight.shape)} "
                         f"in blocks of {list(block)} needs {list(grid)}")
    scale = scale_inv.float().repeat_interleave(m, -2)[..., :rows, :].repeat_interleave(n, -1)[..., :cols]
    return weight.float() * scale


class DequantizedWeights(MappingView):
    """{HF name: float32 tensor} of an FP8 block-quantized checkpoint's ``weights`` (a mapping read lazily): the
    scale tensors are not names of their own, each quantized tensor comes back dequantized."""

    def __init__(self, weights: Mapping, block):
        self.raw, self.block = weights, tuple(block)
        self._names = [n for n in weights if not n.endswith(SCALE_SUFFIX)]
        orphans = [n for n in weights if n.endswith(SCALE_SUFFIX) and n.removesuffix(SCALE_SUFFIX) not in weights]
        if orphans:
            raise ValueError(f"the checkpoint holds {orphans[0]} but no {orphans[0].removesuffix(SCALE_SUFFIX)}")

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self.raw[name]
        if t.dtype != torch.float8_e4m3fn:
            return t
        if name + SCALE_SUFFIX not in self.raw:
            raise ValueError(f"{name} is float8_e4m3fn but the checkpoint has no {name}{SCALE_SUFFIX}")
        return dequantize_fp8(t, self.raw[name + SCALE_SUFFIX], self.block, name)

    def __contains__(self, name) -> bool:
        return name in self.raw and not str(name).endswith(SCALE_SUFFIX)


MXFP4_SUFFIXES = ("_blocks", "_scales")


class MXFP4Weights(MappingView):
    """{HF name: float32 tensor} of an MXFP4 checkpoint's ``weights`` (a mapping read lazily): each quantized tensor
    under its own name (its ``_blocks`` and ``_scales`` no names of their own), dequantized as it is read."""

    def __init__(self, weights: Mapping):
        self.raw = weights
        blocks = {n.removesuffix("_blocks") for n in weights if n.endswith("_blocks")}
        scales = {n.removesuffix("_scales") for n in weights if n.endswith("_scales")}
        if blocks != scales:
            odd = sorted(blocks ^ scales)[0]
            raise ValueError(f"the checkpoint holds {odd}{'_blocks' if odd in blocks else '_scales'} without "
                             f"{odd}{'_scales' if odd in blocks else '_blocks'}")
        self._quantized = blocks
        self._names = [n for n in weights if not n.endswith(MXFP4_SUFFIXES)] + sorted(blocks)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._quantized:
            return self.raw[name]
        from transformers.integrations.mxfp4 import convert_moe_packed_tensors

        return convert_moe_packed_tensors(self.raw[name + "_blocks"], self.raw[name + "_scales"], dtype=torch.float32)

    def shape_of(self, name: str) -> list[int]:
        """The tensor's shape as read (dequantized: [experts, groups x 32, rows]), from the file's header."""
        if name not in self._quantized:
            return list(self.raw.shape_of(name) if hasattr(self.raw, "shape_of") else self.raw[name].shape)
        experts, rows, groups, _ = (self.raw.shape_of(name + "_blocks") if hasattr(self.raw, "shape_of")
                                    else self.raw[name + "_blocks"].shape)
        return [experts, groups * 32, rows]

    def __contains__(self, name) -> bool:
        return name in self._quantized or (name in self.raw and not str(name).endswith(MXFP4_SUFFIXES))


def readable(weights: Mapping, hf_config) -> Mapping:
    """``weights`` as the training dtype reads them: dequantized where config.json says they are quantized."""
    q = quantization_of(hf_config)
    if q is None:
        return weights
    return MXFP4Weights(weights) if q["quant_method"] == "mxfp4" else DequantizedWeights(weights, q["weight_block_size"])


def stored_names(declared: set, file_names, hf_config) -> set:
    """The checkpoint's tensor names for the ``declared`` ones: with each FP8 weight's scales beside it, an MXFP4
    weight's blocks and scales in its place."""
    q = quantization_of(hf_config)
    if q is None:
        return set(declared)
    files = set(file_names)
    if q["quant_method"] == "mxfp4":
        packed = {n for n in declared if n + "_blocks" in files}
        return (set(declared) - packed) | {n + s for n in packed for s in MXFP4_SUFFIXES}
    return set(declared) | {n for n in files if n.endswith(SCALE_SUFFIX) and n.removesuffix(SCALE_SUFFIX) in declared}
