"""The embedded Ray cluster's watcher (controller/reaper.py): it follows the cluster's process tree as it grows, and
once the driver is gone it stops every process of that tree and removes the temp dir."""

from __future__ import annotations

import subprocess
import threading
import time

import psutil

from hybridflow.controller import reaper


def _tree_of(n: int) -> subprocess.Popen:
    """A shell with ``n`` sleeping children."""
    proc = subprocess.Popen(["bash", "-c", f"for i in $(seq {n}); do sleep 60 & done; wait"])
    deadline = time.monotonic() + 10
    while len(psutil.Process(proc.pid).children()) < n and time.monotonic() < deadline:
        time.sleep(0.05)
    return proc


def test_the_tree_holds_every_descendant_and_a_new_one():
    root = _tree_of(3)
    try:
        found = reaper._tree({root.pid: psutil.Process(root.pid)})
        assert set(found) == {root.pid, *(c.pid for c in psutil.Process(root.pid).children(recursive=True))}
        assert len(found) == 4
    finally:
        for p in psutil.Process(root.pid).children(recursive=True) + [psutil.Process(root.pid)]:
            p.kill()
        root.wait()


def test_a_dead_driver_takes_the_tree_and_the_temp_dir_with_it(tmp_path):
    root, driver = _tree_of(20), subprocess.Popen(["sleep", "1"])
    procs = [psutil.Process(root.pid), *psutil.Process(root.pid).children()]
    temp_dir = tmp_path / "ray"
    temp_dir.mkdir()
    watcher = threading.Thread(target=reaper.watch, args=(driver.pid, str(temp_dir), [root.pid], 0.2))
    watcher.start()
    driver.wait()  # reaped: the watcher sees the pid gone
    watcher.join(timeout=30)
    root.wait(timeout=10)
    assert not watcher.is_alive()
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in procs)
    assert not temp_dir.exists()
