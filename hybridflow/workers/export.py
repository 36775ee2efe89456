"""Write a HF model folder atomically (a crash never leaves a half-written checkpoint), streamed into
safetensors shards with the index file transformers and vLLM read."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

MAX_SHARD_BYTES = 4 * 2**30  # transformers' default shard size for save_pretrained is 5 GB


def _write_shards(tmp: Path, items, max_shard_bytes: int) -> None:
    """Fill shard files from (name, tensor) pairs as they come: at most one shard is held in memory."""
    from safetensors.torch import save_file

    shards, current, size, total = [], {}, 0, 0

    def flush():
        nonlocal current, size
        if current:
            name = f"shard-{len(shards):05d}.safetensors"
            save_file(current, str(tmp / name), metadata={"format": "pt"})
            shards.append((name, list(current)))
            current, size = {}, 0

    for name, tensor in items:
        nbytes = tensor.numel() * tensor.element_size()
        if size and size + nbytes > max_shard_bytes:
            flush()
        current[name] = tensor.detach().cpu().contiguous()
        size += nbytes
        total += nbytes
    flush()
    if len(shards) == 1:
        os.replace(tmp / shards[0][0], tmp / "model.safetensors")
        return
    weight_map = {}
    for i, (name, keys) in enumerate(shards, 1):
        final = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        os.replace(tmp / name, tmp / final)
        weight_map.update(dict.fromkeys(keys, final))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def save_hf_folder(out_dir: str, hf_config, weights, tokenizer=None, max_shard_bytes: int = MAX_SHARD_BYTES) -> None:
    """``weights``: a state dict, or an iterable of (HF name, tensor) consumed as it is produced."""
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        hf_config.save_pretrained(str(tmp))
        _write_shards(tmp, weights.items() if isinstance(weights, dict) else weights, max_shard_bytes)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        old = out.with_name(f".{out.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out)
