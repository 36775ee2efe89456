"""Whether a dist_checkpointing folder (``save_role``) is whole, judged from its files without loading it.

What megatron-core 0.16.1 writes with its default torch_dist backend (dist_checkpointing/serialization.py
``save``; strategies/common.py; strategies/filesystem_async.py on torch's FileSystemWriter):
- ``common.pt``: the non-sharded part, ``torch.save`` by rank 0 (a zip archive);
- ``__<rank>_<i>.distcp``: the tensor bytes, one or more files per rank;
- ``.metadata``: torch.distributed.checkpoint's pickled ``Metadata``; its ``storage_data`` gives every saved
  item's file, offset and length, so a file cut short is seen from its size;
- ``metadata.json``: the backend, written last by rank 0 (missing: the save never finished).
Garbage of the right size is only found when loading (``load_error``).
"""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path

COMMON_FILE = "common.pt"
TORCH_METADATA = ".metadata"
CONFIG_FILE = "metadata.json"


MEGATRON_LM_TRACKER = "latest_checkpointed_iteration.txt"  # Megatron-LM's save folder names its newest iter_* here


class DamagedCheckpoint(RuntimeError):
    """A checkpoint folder that cannot be loaded; the message names the folder and the file."""


def find_damage(folder: Path) -> str | None:
    """The first missing, cut-short or corrupt file of the dist_checkpointing ``folder``, in a few words
    naming it (``actor/__0_1.distcp is cut short: ...``); None when every file is there and whole."""
    name = folder.name
    if not folder.is_dir():
        return f"{name}/ is missing"
    for f in (CONFIG_FILE, TORCH_METADATA, COMMON_FILE):
        if not (folder / f).is_file():
            return f"{name}/{f} is missing"
    try:
        json.loads((folder / CONFIG_FILE).read_text())
    except (ValueError, UnicodeDecodeError) as e:
        return f"{name}/{CONFIG_FILE} is not valid JSON ({e})"
    if not zip_is_whole(folder / COMMON_FILE):
        return f"{name}/{COMMON_FILE} is cut short or corrupt (not a whole torch.save archive)"
    ends = _file_ends(folder)
    if isinstance(ends, str):
        return f"{name}/{TORCH_METADATA} is corrupt ({ends})"
    for file, end in sorted(ends.items()):
        path = folder / file
        if not path.is_file():
            return f"{name}/{file} is missing"
        size = path.stat().st_size
        if size < end:
            return f"{name}/{file} is cut short: {size} of {end} bytes"
    return None


def zip_is_whole(path: Path) -> bool:
    """A ``torch.save`` file (a zip archive) whose end, the central directory, is there: a file cut short
    loses it first. Reads the file's tail only."""
    return path.stat().st_size > 0 and zipfile.is_zipfile(path)


def _file_ends(folder: Path) -> dict[str, int] | str:
    """Each data file named in ``.metadata`` and the byte its last item ends at; or why ``.metadata``
    cannot be read."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(str(folder)).read_metadata()
    except Exception as e:  # a cut-short or garbled pickle raises whatever unpickling hits first
        return str(e).splitlines()[0] if str(e) else type(e).__name__
    ends: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    return ends


def load_error(folder: str, error: BaseException) -> DamagedCheckpoint:
    """The one-line error for a failed ``dist_checkpointing.load`` of ``folder``: the damaged file when the
    files show it, else the last line of the loader's own error (its message can hold a whole traceback
    per rank)."""
    damage = find_damage(Path(folder))
    if damage is None:
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        damage = f"{type(error).__name__}: {lines[-1] if lines else 'no message'}"
    return DamagedCheckpoint(f"checkpoint {os.path.dirname(os.path.abspath(folder))} cannot be loaded: {damage}")


def resolve_dist_checkpoint(path: str, key: str) -> str:
    """The megatron dist checkpoint folder a role starts from (``<role>.megatron.dist_checkpointing_path``): the folder
    itself (verl's scripts/converter_hf_to_mcore.py writes one), or a Megatron-LM save folder, whose
    latest_checkpointed_iteration.txt names its iter_NNNNNNN (or release) folder. ValueError in one line naming
    ``key`` when it is neither, or is not whole (a legacy torch.save checkpoint has no metadata.json)."""
    folder = Path(path)
    tracker = folder / MEGATRON_LM_TRACKER
    if tracker.is_file():
        iteration = tracker.read_text().strip()
        if iteration != "release" and not iteration.isdigit():
            raise ValueError(f"{key}: {tracker} names no iteration ({iteration[:40]!r})")
        folder = folder / ("release" if iteration == "release" else f"iter_{int(iteration):07d}")
    damage = find_damage(folder)
    if damage:
        raise ValueError(f"{key}: {folder} is not a whole megatron dist checkpoint ({damage})")
    return str(folder)
