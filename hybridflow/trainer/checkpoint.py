"""Run checkpoints on disk: ``<output_dir>/checkpoints/step_<k>``, complete or absent, and whole or damaged.

A checkpoint is written into ``.tmp_step_<k>`` (workers: roles and random streams; driver: its state,
the resolved config and the HF config/tokenizer the export needs), renamed to ``step_<k>`` once whole,
and only then named by the ``latest`` marker (replaced atomically). ``trainer_state.json`` is written
last inside the temp dir, so a folder without it is never used. A run killed mid-write leaves only a
``.tmp_*`` folder, removed by the next save; the previous checkpoint stays the latest.

A complete checkpoint can still be damaged afterwards (a full disk, a copy cut short, a file removed):
``find_damage`` names the file from sizes and the small files alone, before anything starts, and
``resume: auto`` passes over a damaged newest checkpoint to the one before it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Callable

from hybridflow.config import ConfigError
from hybridflow.megatron.checkpoint_files import find_damage as role_damage, zip_is_whole
from hybridflow.util import write_atomically

log = logging.getLogger(__name__)
STATE_FILE = "trainer_state.json"
LATEST = "latest"
CONFIG_FILE = "config.yaml"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")  # one of them: the tokenizer is there
_STEP_DIR = re.compile(r"^step_(\d+)$")
DATA_BATCHES = "data_batches"  # the state's count of prompt batches the run had taken from its data stream


class CheckpointWriteError(OSError):
    """The driver could not write a checkpoint (a full disk, a quota, a read-only folder); one line naming
    the checkpoint, the file and why. The half-written folder is removed; the previous checkpoint stays."""

    def __str__(self) -> str:
        return self.strerror


def root(output_dir: str) -> Path:
    return Path(output_dir) / "checkpoints"


def is_complete(path: Path) -> bool:
    return (path / STATE_FILE).is_file()


def _step(path: Path) -> int:
    return int(_STEP_DIR.match(path.name).group(1))


def complete_checkpoints(output_dir: str) -> list[Path]:
    """Complete checkpoints, oldest step first."""
    base = root(output_dir)
    if not base.is_dir():
        return []
    return sorted((p for p in base.iterdir() if _STEP_DIR.match(p.name) and is_complete(p)), key=_step)


def _newest_first(output_dir: str) -> list[Path]:
    """Complete checkpoints, newest first, from the one the ``latest`` marker names when it is complete: a
    higher step beside it was left by a run this one resumed from an earlier checkpoint."""
    found = complete_checkpoints(output_dir)
    marker = root(output_dir) / LATEST
    if marker.is_file():
        named = root(output_dir) / marker.read_text().strip()
        if named in found:
            found = [p for p in found if _step(p) <= _step(named)]
    return found[::-1]


def latest(output_dir: str) -> Path | None:
    """The checkpoint the ``latest`` marker names when it is complete, else the newest complete one."""
    found = _newest_first(output_dir)
    return found[0] if found else None


def newest_whole(output_dir: str) -> Path | None:
    """``resume: auto``: the latest checkpoint when it is whole, else the newest whole one before it, with a
    one-line warning naming each damaged one and why; ConfigError when every checkpoint is damaged."""
    damaged = []
    for path in _newest_first(output_dir):
        damage = find_damage(path)
        if damage is None:
            for bad, why in damaged:
                log.warning("checkpoint %s is damaged (%s); resuming from %s instead", bad, why, path)
            return path
        damaged.append((path, damage))
    if damaged:
        bad, why = damaged[0]
        raise ConfigError(f"trainer.resume_mode=auto: every checkpoint in {root(output_dir)} is damaged; the newest, "
                          f"{bad}: {why}")
    return None


def read_state(path: Path) -> dict:
    return json.loads((path / STATE_FILE).read_text())


def data_batches(state: dict) -> int:
    """Prompt batches taken from the data stream up to the checkpoint (with dynamic sampling, more than one
    per step); a checkpoint written before the count was kept took one per step."""
    return state.get(DATA_BATCHES, state["step"])


def find_damage(path: Path, roles: tuple[str, ...] = ("actor", "critic"), rng: bool = True) -> str | None:
    """The first missing, cut-short or corrupt file of checkpoint ``path`` that resuming (or, with
    ``roles=("actor",), rng=False``, exporting) reads, in a few words naming it; None when whole. Reads the
    small files and the data files' sizes only. A role other than the actor is checked when it was saved."""
    try:
        state = read_state(path)
    except FileNotFoundError:
        return f"{STATE_FILE} is missing"
    except (ValueError, UnicodeDecodeError) as e:
        return f"{STATE_FILE} is not valid JSON ({e})"
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        return f"{STATE_FILE} holds no step"
    if not isinstance(data_batches(state), int) or data_batches(state) < state["step"]:
        return f"{STATE_FILE} holds no valid {DATA_BATCHES} (a whole number >= step)"
    if (damage := _yaml_damage(path / CONFIG_FILE)) is not None:
        return damage
    if (damage := _hf_damage(path / "hf")) is not None:
        return damage
    saved = [r for r in roles if r == "actor" or (path / r).is_dir()]
    for role in saved:
        if (damage := role_damage(path / role)) is not None:
            return damage
        if rng:  # the random streams each rank saved beside its role (workers.common.save_role_checkpoint)
            files = sorted((path / "rng").glob(f"{role}_rank*.pt"))
            if not files:
                return f"rng/{role}_rank0.pt is missing"
            for f in files:
                if not zip_is_whole(f):
                    return f"rng/{f.name} is cut short or corrupt"
    return None


def _yaml_damage(path: Path) -> str | None:
    import yaml

    try:
        if not isinstance(yaml.safe_load(path.read_text()), dict):
            return f"{path.name} holds no config"
    except FileNotFoundError:
        return f"{path.name} is missing"
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        return f"{path.name} is corrupt ({str(e).splitlines()[0]})"
    return None


def _hf_damage(hf: Path) -> str | None:
    """The HF config and tokenizer the export (and the resume's architecture check) read."""
    if not (hf / "config.json").is_file():
        return "hf/config.json is missing"
    if not any((hf / f).is_file() for f in TOKENIZER_FILES):
        return f"hf/ has no tokenizer ({', '.join(TOKENIZER_FILES[:-1])} or {TOKENIZER_FILES[-1]})"
    for f in sorted(hf.glob("*.json")):
        try:
            json.loads(f.read_text())
        except (ValueError, UnicodeDecodeError) as e:
            return f"hf/{f.name} is not valid JSON ({e})"
    return None


def save(output_dir: str, step: int, write_parts: Callable[[Path], None], state: dict, keep: int | None) -> Path:
    """Write checkpoint ``step``: ``write_parts(tmp_dir)`` writes everything but the driver state, then
    the state file, the rename and the marker; keeps the newest ``keep`` checkpoints up to ``step`` (None:
    all). Higher steps, left by the run this one resumed from an earlier checkpoint, are replaced as the
    run reaches them, never counted as the newest."""
    base = root(output_dir)
    tmp, final = base / f".tmp_step_{step}", base / f"step_{step}"
    try:
        base.mkdir(parents=True, exist_ok=True)
        for stale in base.glob(".tmp_step_*"):  # left by a run killed while saving
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
        write_parts(tmp)
        write_atomically(tmp / STATE_FILE, json.dumps({**state, "step": step}, indent=1))
        if final.exists():  # the same step saved again (e.g. resumed and preempted at once): newest wins
            shutil.rmtree(final)
        os.replace(tmp, final)
        write_atomically(base / LATEST, final.name + "\n")
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)  # frees what the failed save took (a full disk)
        if isinstance(e, OSError) and not isinstance(e, CheckpointWriteError):
            where = f" ({e.filename})" if e.filename else ""
            raise CheckpointWriteError(e.errno, f"checkpoint {final} could not be written{where}: "
                                                f"{e.strerror or e}") from e
        raise
    if keep:
        for old in [p for p in complete_checkpoints(output_dir) if _step(p) <= step][:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final
