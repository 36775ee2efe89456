"""One run per output folder: a second holder is refused in one line naming the first; the lock goes with
its holder, even when the holder is killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from hybridflow.config import ConfigError
from hybridflow.trainer.run_lock import LOCK_NAME, RunLock


def test_second_lock_is_refused_naming_the_holder(tmp_path):
    first = RunLock(tmp_path)
    first.acquire()
    with pytest.raises(ConfigError, match=rf"^trainer.output_dir={tmp_path} is in use by another run "
                                          rf"\(pid {os.getpid()} on \S+\); wait for it to end or choose another"):
        RunLock(tmp_path).acquire()
    with pytest.raises(ConfigError, match="is in use by another run"):
        RunLock(tmp_path).ensure_free()
    first.release()
    RunLock(tmp_path).ensure_free()
    second = RunLock(tmp_path)
    second.acquire()  # released: free again (the file stays)
    assert second.held and (tmp_path / LOCK_NAME).exists()
    second.release()


def test_a_killed_holder_leaves_no_lock(tmp_path):
    code = (f"from hybridflow.trainer.run_lock import RunLock; lock = RunLock({str(tmp_path)!r}); lock.acquire(); "
            "print('held', flush=True); import time; time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        with pytest.raises(ConfigError, match=f"pid {proc.pid} on"):
            RunLock(tmp_path).acquire()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    lock = RunLock(tmp_path)
    lock.acquire()
    lock.release()
