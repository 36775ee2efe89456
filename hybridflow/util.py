"""Small helpers with no dependencies on the rest of the package."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator


def mean_by_key(dicts: list[dict]) -> dict[str, float]:
    """Key-wise mean of metric dicts; a key counts only the dicts that have it (e.g. a metric that
    only the last pipeline stage reports)."""
    keys = {k for d in dicts for k in d}
    return {k: sum(float(d[k]) for d in dicts if k in d) / sum(1 for d in dicts if k in d) for k in keys}


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary file name beside ``path`` for the block to write; when the block ends without error the
    file is flushed to disk and renamed over ``path``, else removed. Readers see the old file or the whole
    new one, never half of one (a crash, a full disk, a second signal)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # per process: two writers never share one
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def environ(**values: str) -> Iterator[None]:
    """These environment variables set inside the block, restored (or removed) after it."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def write_atomically(path: str | os.PathLike, content: str | bytes) -> None:
    """Write ``content`` to ``path`` through ``atomic_path``."""
    with atomic_path(path) as tmp:
        if isinstance(content, bytes):
            tmp.write_bytes(content)
        else:
            tmp.write_text(content)
