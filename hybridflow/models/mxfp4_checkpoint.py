"""An MXFP4 copy of a gpt-oss model folder, laid out as openai/gpt-oss-20b's checkpoint is (``quant_method: mxfp4``;
each layer's fused experts ``gate_up_proj`` / ``down_proj`` as ``_blocks`` uint8 [experts, rows, groups, 16], two E2M1
values a byte, the low nibble first, and ``_scales`` uint8 [experts, rows, groups], a power-of-two exponent per 32
values biased by 127; the rows are the bf16 checkpoint's last dim): what the import's tests read
(megatron/quantized.py), the inverse of transformers' convert_moe_packed_tensors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # the magnitudes of the 4-bit codes 0..7 (8..15: negative)


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks, scales) of a bf16 checkpoint's [experts, in, out] expert tensor: along ``in`` in groups of 32, each
    group scaled by the power of two that brings its largest magnitude to at most 6, every value rounded to the
    nearest E2M1 one (ties to the lower code)."""
    rows = weight.float().transpose(1, 2)  # [experts, out, in]: one row per output
    experts, n_rows, width = rows.shape
    groups = rows.reshape(experts, n_rows, width // 32, 32)
    amax = groups.abs().amax(-1, keepdim=True)
    exponent = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6.0)), torch.zeros_like(amax)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent)
    code = (scaled.abs()[..., None] - E2M1).abs().argmin(-1) + 8 * (scaled < 0)
    packed = (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8)
    return packed, (exponent[..., 0] + 127).to(torch.uint8)


def write_mxfp4_checkpoint(src: str | Path, dst: str | Path) -> None:
    """``dst``: ``src`` (a gpt-oss folder with safetensors weights) with its fused expert weights MXFP4 and
    config.json saying so; tokenizer files copied."""
    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        for name, t in load_file(str(f)).items():
            if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
                tensors[name + "_blocks"], tensors[name + "_scales"] = quantize_mxfp4(t)
            else:
                tensors[name] = t
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, dst / f.name)
