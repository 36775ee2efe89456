"""An FP8 block-quantized copy of a model folder, laid out as DeepSeek-V3's and transformers' FP8 checkpoints are
(``quant_method: fp8``, ``weight_block_size``, a float32 ``<name>_scale_inv`` per block beside each float8_e4m3fn
linear weight of the decoder layers): what the import's tests read (megatron/quantized.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value


def quantize_fp8(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 scale_inv [ceil(rows / m), ceil(cols / n)]): each block divided by its
    max |w| / 448, as transformers' Fp8Quantize does, the grid rounded up where a dimension is not a multiple."""
    rows, cols = weight.shape
    m, n = block
    grid = (-(-rows // m), -(-cols // n))
    padded = torch.zeros(grid[0] * m, grid[1] * n)
    padded[:rows, :cols] = weight.float()
    amax = padded.reshape(grid[0], m, grid[1], n).abs().amax(dim=(1, 3))
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    full = scale_inv.repeat_interleave(m, 0)[:rows].repeat_interleave(n, 1)[:, :cols]
    return (weight.float() / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale_inv


def write_fp8_checkpoint(src: str | Path, dst: str | Path, block: tuple[int, int] = (128, 128)) -> None:
    """``dst``: ``src`` (a model folder with safetensors weights) with its decoder layers' projection weights
    FP8 block-quantized and config.json saying so; tokenizer files copied."""
    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        for name, t in load_file(str(f)).items():
            if ".layers." in name and name.endswith("_proj.weight") and t.dim() == 2:
                tensors[name], tensors[name + "_scale_inv"] = quantize_fp8(t, block)
            else:
                tensors[name] = t
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                     "weight_block_size": list(block)}
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, dst / f.name)
