"""Small helpers with no dependencies on the rest of the package."""

from __future__ import annotations

import contextlib
import os
import random
import socket
from pathlib import Path
from collections.abc import Mapping
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


# Ray's worker processes listen on ports 10002-19999 by default (ray start --min/max-worker-port)
_RENDEZVOUS_PORTS_FROM = 20000


def free_port(host: str = "") -> int:
    """A TCP port free on this node now, for a rendezvous that a process binds seconds later (a worker's
    torch.distributed store). Drawn below the kernel's ephemeral range (/proc/sys/net/ipv4/ip_local_port_range)
    and above Ray's worker ports: a port from bind(0) is ephemeral, and an outgoing connection opened before
    the rendezvous binds (Ray, gloo, vLLM) may be given it: EADDRINUSE, seen in CI. bind(0) where no such range
    is left."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_from = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_from = _RENDEZVOUS_PORTS_FROM
    draw = random.SystemRandom()  # not the seeded global generator: processes seeded alike would collide
    for _ in range(64):
        port = draw.randrange(_RENDEZVOUS_PORTS_FROM, ephemeral_from) if ephemeral_from > _RENDEZVOUS_PORTS_FROM else 0
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise OSError(f"no free TCP port in {_RENDEZVOUS_PORTS_FROM}-{ephemeral_from - 1}")


class MappingView(Mapping):
    """A read-only view of another mapping of tensors (``raw``, e.g. a checkpoint read lazily) under names of its own
    (``_names``, in order), which a subclass reads (``__getitem__``, ``__contains__``); ``bytes_read`` is the
    underlying reader's."""

    raw: Mapping
    _names: list

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    @property
    def bytes_read(self) -> int:
        return self.raw.bytes_read
