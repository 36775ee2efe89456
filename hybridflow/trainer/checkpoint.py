"""Run checkpoints on disk: ``<output_dir>/checkpoints/step_<k>``, complete or absent.

A checkpoint is written into ``.tmp_step_<k>`` (workers: roles and random streams; driver: its state,
the resolved config and the HF config/tokenizer the export needs), renamed to ``step_<k>`` once whole,
and only then named by the ``latest`` marker (replaced atomically). ``trainer_state.json`` is written
last inside the temp dir, so a folder without it is never used. A run killed mid-write leaves only a
``.tmp_*`` folder, removed by the next save; the previous checkpoint stays the latest.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Callable

STATE_FILE = "trainer_state.json"
LATEST = "latest"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def root(output_dir: str) -> Path:
    return Path(output_dir) / "checkpoints"


def is_complete(path: Path) -> bool:
    return (path / STATE_FILE).is_file()


def complete_checkpoints(output_dir: str) -> list[Path]:
    """Complete checkpoints, oldest step first."""
    base = root(output_dir)
    if not base.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in base.iterdir() if (m := _STEP_DIR.match(p.name)) and is_complete(p)]
    return [p for _, p in sorted(found)]


def latest(output_dir: str) -> Path | None:
    """The checkpoint the ``latest`` marker names when it is complete, else the newest complete one."""
    marker = root(output_dir) / LATEST
    if marker.is_file():
        named = root(output_dir) / marker.read_text().strip()
        if _STEP_DIR.match(named.name) and is_complete(named):
            return named
    found = complete_checkpoints(output_dir)
    return found[-1] if found else None


def read_state(path: Path) -> dict:
    return json.loads((path / STATE_FILE).read_text())


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save(output_dir: str, step: int, write_parts: Callable[[Path], None], state: dict, keep: int | None) -> Path:
    """Write checkpoint ``step``: ``write_parts(tmp_dir)`` writes everything but the driver state, then
    the state file, the rename and the marker; keeps the newest ``keep`` checkpoints (None: all)."""
    base = root(output_dir)
    base.mkdir(parents=True, exist_ok=True)
    for stale in base.glob(".tmp_step_*"):  # left by a run killed while saving
        shutil.rmtree(stale, ignore_errors=True)
    tmp = base / f".tmp_step_{step}"
    tmp.mkdir()
    write_parts(tmp)
    _write_atomically(tmp / STATE_FILE, json.dumps({**state, "step": step}, indent=1))
    final = base / f"step_{step}"
    if final.exists():  # the same step saved again (e.g. resumed and preempted at once): newest wins
        shutil.rmtree(final)
    os.replace(tmp, final)
    _write_atomically(base / LATEST, final.name + "\n")
    if keep:
        for old in complete_checkpoints(output_dir)[:-keep]:
            if old != final:
                shutil.rmtree(old, ignore_errors=True)
    return final
