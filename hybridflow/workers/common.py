"""Helpers shared by the model workers."""

from __future__ import annotations

from pathlib import Path


def load_hf_folder(path: str) -> tuple:
    """(HF config, full state dict) of a HF model folder with safetensors weights."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in model folder {path}")
    state = {}
    for f in files:
        state.update(load_file(str(f)))
    return AutoConfig.from_pretrained(path), state
