"""Write a HF model folder atomically (a crash never leaves a half-written checkpoint), streamed into
safetensors shards with the index file transformers and vLLM read. A folder holding a training run is
never replaced."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from hybridflow.families import stacked_experts
from hybridflow.megatron.quantized import unquantized_config

MAX_SHARD_BYTES = 4 * 2**30  # transformers' default shard size for save_pretrained is 5 GB
# What a training run writes into its output_dir and checkpoints (trainer/session.py, trainer/checkpoint.py):
# a folder holding one of these belongs to a run.
RUN_FILES = ("checkpoints", "metrics.jsonl", "trainer_state.json", "latest")


def run_file_in(folder: Path) -> str | None:
    """The file that marks ``folder`` as a run's output_dir, its checkpoints/ or a checkpoint; None if none."""
    return next((f for f in RUN_FILES if (folder / f).exists()), None)


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


def save_hf_folder(out_dir: str, hf_config, weights, tokenizer=None, max_shard_bytes: int = MAX_SHARD_BYTES,
                   replace: bool = True) -> None:
    """``weights``: a state dict, or an iterable of (HF name, tensor) consumed as it is produced, under the
    family's declared names (experts the checkpoint fuses are stacked back: families/stacked_experts.py). An
    existing ``out_dir`` (a folder or a file) is replaced once the new folder is whole; one holding a run's
    files is refused (FileExistsError) before anything is written."""
    def fill(tmp: Path) -> None:
        unquantized_config(hf_config).save_pretrained(str(tmp))  # the weights written are not quantized
        items = weights.items() if isinstance(weights, dict) else weights
        _write_shards(tmp, stacked_experts.stacked_items(items, hf_config), max_shard_bytes)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))

    _write_folder(out_dir, fill, replace)


def save_peft_folder(out_dir: str, tensors: dict, adapter_config: dict, replace: bool = True) -> None:
    """A peft adapter folder (``adapter_model.safetensors`` under peft's saved names, ``adapter_config.json``),
    written as ``save_hf_folder`` writes."""
    from safetensors.torch import save_file

    def fill(tmp: Path) -> None:
        save_file({k: v.detach().to("cpu", copy=True) for k, v in tensors.items()}, str(tmp / "adapter_model.safetensors"),
                  metadata={"format": "pt"})
        (tmp / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))

    _write_folder(out_dir, fill, replace)


def _write_folder(out_dir: str, fill, replace: bool = True) -> None:
    """``fill(tmp)`` writes a new folder beside ``out_dir``, which replaces it once whole (never a run's folder), its
    modes as the umask says (mkdtemp makes it 0700). Without ``replace`` it only takes the place of nothing or of an
    empty folder, atomically: an export that wrote ``out_dir`` meanwhile is never replaced (FileExistsError)."""
    out = Path(out_dir)
    if out.is_dir() and (marker := run_file_in(out)) is not None:
        raise FileExistsError(f"{out} holds a training run ({marker}); a run folder is never replaced")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        fill(tmp)
        _modes_of_umask(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if not replace:
        try:
            os.rename(tmp, out)  # fails where out is a file or a folder with anything in it
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise FileExistsError(f"{out} was written by another export meanwhile; pass --force to replace it") from e
        return
    if out.exists() or out.is_symlink():
        old = out.with_name(f".{out.name}.old")
        _remove(old)
        os.replace(out, old)
        os.replace(tmp, out)
        _remove(old)
    else:
        os.replace(tmp, out)


def _modes_of_umask(folder: Path) -> None:
    """The folder and its files readable as new files and folders are (0777 / 0666 less the umask), for the group
    that serves them."""
    mask = os.umask(0)
    os.umask(mask)
    folder.chmod(0o777 & ~mask)
    for path in folder.rglob("*"):
        path.chmod((0o777 if path.is_dir() else 0o666) & ~mask)


def _remove(path: Path) -> None:
    """A folder with its files, or a file or link (never what a link points to)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
