"""Shared fixtures."""

from __future__ import annotations

import os
import time
import warnings

import pytest


class SharedRay:
    """The embedded 2-CPU Ray cluster that consecutive test modules asking for ``ray_cluster`` share: starting
    and stopping one per module cost about 7 s a module. It is stopped before a module that does not ask for
    it (test_python_api's Trainer starts its own; CLI runs start theirs; the unit tier asserts Ray is off) and
    after the last test. A module that leaves something holding the cluster's CPUs or a placement group behind
    gets the cluster replaced after it (what every module had before), with a warning naming it.

    Never `ray stop` (it kills every Ray cluster on the host): stopping ends only this cluster and checks by PID
    that its processes are gone."""

    def __init__(self):
        self.handle = None

    def get(self):
        from hybridflow.controller import start_ray

        if self.handle is None:
            os.environ.setdefault("OMP_NUM_THREADS", "1")
            self.handle = start_ray(num_cpus=2, object_store_memory=256 * 1024**2)
            assert self.handle.pids, "embedded Ray started no processes?"
        return self.handle

    def stop(self) -> None:
        handle, self.handle = self.handle, None
        if handle is None:
            return
        handle.shutdown()
        assert handle.alive_pids() == [], f"Ray processes left running: {handle.alive_pids()}"
        assert not os.path.exists(handle.temp_dir), f"temp dir left behind: {handle.temp_dir}"

    def left_behind(self, wait_s: float = 10.0) -> str | None:
        """What still holds the cluster after a module (resources come back asynchronously: waited for)."""
        import ray

        deadline = time.monotonic() + wait_s
        while True:
            free, total = ray.available_resources().get("CPU", 0.0), ray.cluster_resources().get("CPU", 0.0)
            groups = [g for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]
            if free == total and not groups:
                return None
            if time.monotonic() > deadline:
                return f"{total - free:g} of {total:g} CPUs and {len(groups)} placement group(s)"
            time.sleep(0.2)


_SHARED = SharedRay()
_RAY_MODULES: set = set()


@pytest.fixture(scope="module")
def ray_cluster():
    """The embedded Ray cluster this module shares with its neighbours (``SharedRay``)."""
    return _SHARED.get()


# The longest modules (seconds each in a fresh-clone make test), run first: make test's two xdist sessions
# (--dist loadfile --no-loadscope-reorder, the Makefile) take modules in this order as they free up, so the many
# short ones fill the end and neither session is left running a long module alone (xdist's default order, most
# tests first, put these few-test modules last: the end of the run used one core). The Slurm tests come second: they
# prepare their own warm start while the first module's session prepares the one the others share (a file lock).
LONGEST_FIRST = ("integration/test_failures.py", "cluster/test_slurm_launcher.py", "integration/test_async_modes.py",
                 "integration/test_moe_quickstart.py", "integration/test_ppo_e2e.py",
                 "integration/test_tools_quickstart.py", "integration/test_checkpoint_resume.py",
                 "integration/test_rewards_e2e.py", "integration/test_controller.py", "distributed/test_check_model.py",
                 "distributed/test_vllm_archs.py", "integration/test_reward_failures.py")


def _longest_first(item) -> int:
    where = item.path.as_posix()
    return next((i for i, name in enumerate(LONGEST_FIRST) if where.endswith("tests/" + name)), len(LONGEST_FIRST))


def pytest_collection_modifyitems(session, config, items):
    items.sort(key=_longest_first)  # stable: the other modules, and each module's tests, keep their order
    _RAY_MODULES.update(item.path for item in items if "ray_cluster" in item.fixturenames)


@pytest.hookimpl(hookwrapper=True, trylast=True)
def pytest_runtest_teardown(item, nextitem):
    yield  # the module's own fixtures (worker groups, trainers) are torn down first
    if _SHARED.handle is None or (nextitem is not None and nextitem.path == item.path):
        return
    if nextitem is None or nextitem.path not in _RAY_MODULES:
        _SHARED.stop()
        return
    try:
        leak = _SHARED.left_behind()
    except Exception as e:  # noqa: BLE001 - a cluster a module broke is replaced as well
        leak = f"a cluster that no longer answers ({type(e).__name__})"
    if leak:
        warnings.warn(f"{item.path.name} left {leak} held in the shared Ray cluster: it is replaced")
        _SHARED.stop()


# Each module's wall time (setup, calls and teardowns, module fixtures included), the slowest printed at the end:
# what `make test`'s 30-minute budget is spent on, by module rather than by test.
_MODULE_SECONDS: dict = {}


def pytest_runtest_logreport(report):
    module = report.nodeid.split("::")[0]
    _MODULE_SECONDS[module] = _MODULE_SECONDS.get(module, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    slowest = sorted(_MODULE_SECONDS.items(), key=lambda kv: -kv[1])[:25]
    if slowest:
        terminalreporter.write_sep("=", f"slowest modules (of {sum(_MODULE_SECONDS.values()):.0f} s)")
        for module, seconds in slowest:
            terminalreporter.write_line(f"{seconds:8.1f}s {module}")
