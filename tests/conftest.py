"""Shared fixtures."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="module")
def ray_cluster():
    """One embedded 2-CPU Ray cluster per test module, in its own temp dir.

    Never `ray stop` (it kills every Ray cluster on the host): teardown stops
    only this cluster and checks by PID that its processes are gone.
    """
    from hybridflow.controller import start_ray

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    handle = start_ray(num_cpus=2, object_store_memory=256 * 1024**2)
    pids = handle.pids
    assert pids, "embedded Ray started no processes?"
    try:
        yield handle
    finally:
        handle.shutdown()
        assert handle.alive_pids() == [], f"Ray processes left running: {handle.alive_pids()}"
        assert not os.path.exists(handle.temp_dir), f"temp dir left behind: {handle.temp_dir}"
