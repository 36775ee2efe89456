"""Helpers shared by the model workers: loading HF folders, micro-batching, megatron set-up."""

from __future__ import annotations

from pathlib import Path

import torch

from hybridflow.protocol import Batch

MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids")


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


def micro_batches(batch: Batch, size: int, extra_keys=()) -> list[dict]:
    """Split into dicts for megatron's schedule; ``labels`` are the next tokens (last one unused)."""
    out = []
    for mb in batch.select(tensor_keys=[*MODEL_INPUTS, *extra_keys]).split(size):
        d = {k: mb.tensors[k] for k in (*MODEL_INPUTS, *extra_keys)}
        d["labels"] = torch.roll(d["input_ids"], shifts=-1, dims=1)
        out.append(d)
    return out


def response_part(per_token: torch.Tensor, response_length: int) -> torch.Tensor:
    """Outputs at positions that predict the response tokens: [b, s] -> [b, R]."""
    return per_token[:, -response_length - 1:-1]


def concat_outputs(outputs: list[dict], key: str) -> torch.Tensor | None:
    """Concatenate one key of the schedule's per-micro-batch outputs (None off the last stage)."""
    return torch.cat([o[key] for o in outputs]) if outputs else None


def mean_metrics(all_metrics: list[dict]) -> dict:
    keys = {k for m in all_metrics for k in m}
    return {k: sum(m[k] for m in all_metrics if k in m) / sum(1 for m in all_metrics if k in m) for k in keys}
