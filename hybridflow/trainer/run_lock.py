"""One run per output folder: an exclusive lock on ``<output_dir>/.hybridflow.lock`` for the run's lifetime.

Two runs started on the same ``output_dir`` would interleave their metrics and checkpoints. The lock is a
``flock`` on the file, so the kernel releases it whenever the holder ends (killed, preempted, requeued): a
stale lock file never blocks the next run. The holder writes its pid and host into the file so that the
refusal can name it.
"""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path

from hybridflow.config import ConfigError

LOCK_NAME = ".hybridflow.lock"


class RunLock:
    def __init__(self, output_dir: str | os.PathLike):
        self.path = Path(output_dir) / LOCK_NAME
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock, or raise ConfigError naming the run that holds it."""
        if self._fd is not None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 256, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise ConfigError(f"trainer.output_dir={self.path.parent} is in use by another run ({holder}); "
                              "wait for it to end or choose another output_dir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        self._fd = fd

    def ensure_free(self) -> None:
        """Raise (as ``acquire``) when another run holds the folder; hold nothing afterwards. The checks
        before start call this first, so that a folder in use is named as such rather than by what the
        other run has written there so far."""
        self.acquire()
        self.release()

    def __del__(self):  # a Trainer dropped without close() does not keep its folder locked
        self.release()

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None
