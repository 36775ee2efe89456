"""Failures end clearly: a killed worker, a stopped one (after trainer.stage_timeout_s) or a killed raylet
ends the run in one line naming the worker and the last good checkpoint; a driver killed mid-checkpoint
leaves the previous checkpoint as the one `resume: auto` picks; SIGINT ends with 130 and SIGTERM to the
whole process group with 75 (preempted); a second run on a folder in use is refused; nothing started by
the run keeps running. A step that would never end (DAPO without a generation limit) is given up
signals.STOP_GRACE_S after SIGTERM by every worker-group wait and call (test_controller.py), and says how
far it is after each generation batch (tests/unit/test_overlong_and_dynamic_sampling.py)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from hybridflow.trainer import checkpoint
from tests.integration.cli_run import (LIGHT, disturbed_run, error_lines, launch, logged_steps,
                                      process_tree, wait_for, wait_gone, worker)

pytestmark = pytest.mark.integration


def test_killed_worker_ends_the_run_naming_it(assets, tmp_path):
    out = tmp_path / "run"
    status, err, tree, took = disturbed_run(assets, out, lambda tree: worker(tree).kill(), wait_s=60)
    assert status == 1, err[-3000:]
    assert took < 60
    line = error_lines(err)
    assert line, err[-3000:]
    assert "worker group 'actor_rollout_ref'" in line[0] and "rank 0 of 1 on node" in line[0], line[0]
    assert "its worker process died" in line[0] and f"last good checkpoint: {out}/checkpoints/step_" in line[0], line[0]
    assert wait_gone(tree) == []


def test_driver_killed_while_saving_keeps_the_previous_checkpoint(assets, tmp_path):
    out = tmp_path / "run"
    args = (*LIGHT, "trainer.total_steps=4", "trainer.save_every=1", "trainer.val_every=100")
    proc = launch(assets, out, *args)
    try:
        wait_for(lambda: (out / "checkpoints" / ".tmp_step_2").exists(), 240, "the second checkpoint to begin", proc)
        tree = process_tree(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    # Ray's processes share the driver's fate (they die with it); the test cleans up what does not.
    assert wait_gone(tree) == []
    assert checkpoint.latest(str(out)) == out / "checkpoints" / "step_1"
    resumed = launch(assets, out, *args, "trainer.total_steps=2")
    _, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err[-3000:]
    assert logged_steps(out) == [1, 2], "resumed at step 1: the rows the killed run wrote after it are gone"
    assert checkpoint.latest(str(out)) == out / "checkpoints" / "step_2"
    assert not list((out / "checkpoints").glob(".tmp_*")), "the interrupted save is cleaned up"


def test_stopped_worker_ends_the_run_within_the_stage_timeout(assets, tmp_path):
    """A worker that is stuck rather than dead (SIGSTOP) ends the run after trainer.stage_timeout_s, naming
    the stage, the group, the rank and its node, and the last good checkpoint; the stuck group is killed,
    not asked to clean up (which waited a second stage timeout)."""
    out = tmp_path / "run"
    status, err, tree, took = disturbed_run(assets, out, lambda tree: worker(tree).suspend(),
                                            "trainer.stage_timeout_s=10")
    assert status == 1, err[-3000:]
    assert took < 10 + 60, took
    assert "rollout close failed" not in err, "the stuck group was asked to clean up: a second stage timeout"
    line = error_lines(err)
    assert line, err[-3000:]
    assert line[0].startswith("error: stage step/"), line[0]
    assert "worker group 'actor_rollout_ref'" in line[0] and "rank(s) 0 of 1 on node(s)" in line[0], line[0]
    assert "did not finish within 10 s" in line[0], line[0]
    assert f"last good checkpoint: {out}/checkpoints/step_" in line[0], line[0]
    assert wait_gone(tree) == []


def test_one_run_per_folder_and_sigint_ends_with_130(assets, tmp_path):
    """A second run on a folder in use is refused in one line; Ctrl-C ends the first with 130, and nothing
    it started keeps running or stays behind in its TMPDIR (the workers' scratch lies in Ray's temp dir)."""
    out, scratch = tmp_path / "run", tmp_path / "tmpdir"
    scratch.mkdir()
    # long enough to outlast the second launch (a step of the test model takes ~0.15 s)
    first = launch(assets, out, *LIGHT, "trainer.total_steps=2000", "trainer.val_every=-1", env={"TMPDIR": str(scratch)})
    try:
        wait_for(lambda: 1 in logged_steps(out), 180, "the first step", first)
        tree = process_tree(first.pid)
        second = launch(assets, out, "trainer.total_steps=50")
        _, err = second.communicate(timeout=120)
        assert second.returncode == 2, err[-3000:]
        assert err.strip().splitlines()[-1] == (f"config error: trainer.output_dir={out} is in use by another run "
                                                f"(pid {first.pid} on {os.uname().nodename}); wait for it to end "
                                                "or choose another output_dir"), err[-2000:]
        first.send_signal(signal.SIGINT)
        _, err = first.communicate(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 130, err[-3000:]
    assert wait_gone(tree) == []
    assert sorted(p.name for p in scratch.iterdir()) == [], "left behind in TMPDIR"


def test_sigterm_to_the_whole_process_group_exits_promptly(assets, tmp_path):
    """SIGTERM to the run's whole process group (what `timeout` sends: its Ray cluster's processes are in
    the group too) ends the run within seconds as preempted, resumable from its last checkpoint, leaving
    nothing behind."""
    out = tmp_path / "run"
    status, err, tree, took = disturbed_run(assets, out, lambda tree: os.killpg(tree[0].pid, signal.SIGTERM),
                                            own_group=True)
    assert status == 75, "\n".join(x for x in err.splitlines() if "pid=" not in x)[-3000:]
    assert took < 30, took
    last = err.strip().splitlines()[-1]
    assert last.startswith("preempted: stopped by SIGTERM after step ") and f"checkpoint {out}/checkpoints/step_" in last, last
    assert wait_gone(tree) == []


def test_killed_raylet_ends_the_run_in_one_line(assets, tmp_path):
    """kill -9 of the node's raylet: the workers go with it, and the run ends (status 1) in one hybridflow
    line naming what failed and the last good checkpoint; nothing is left running."""
    out = tmp_path / "run"
    # long enough that only the detection of the dead node ends it (controller/cluster.py HEALTH_CHECKS: 3 missed
    # checks a second apart), not the run's end
    status, err, tree, took = disturbed_run(assets, out, lambda tree: worker(tree, "/raylet/raylet").kill(),
                                            "trainer.total_steps=2000")
    assert status == 1, err[-3000:]
    line = error_lines(err)
    assert len(line) == 1, err[-3000:]
    assert "its worker process died" in line[0] and f"last good checkpoint: {out}/checkpoints/step_" in line[0], line[0]
    assert took < 15, f"the dead node took {took:.0f} s to end the run (Ray's default health checks: about 15 s)"
    assert wait_gone(tree) == []


SEPARATE = ("schedule.mode=separate_async", "resources.rollout_n_workers=1", "schedule.parameter_sync_step=1",
            "resources.cpus_per_worker=1")


def test_killed_rollout_worker_is_rebuilt_and_a_stopped_one_ends_the_run(assets, tmp_path):
    """separate_async: kill -9 of the standalone rollout worker does not end the run; the pool is rebuilt, given
    the current weights, the in-flight batch is generated again, one warning line says so, and the run goes on. The
    rebuilt worker then stopped (SIGSTOP) ends the run after trainer.stage_timeout_s, naming the rollout group."""
    out = tmp_path / "run"
    proc = launch(assets, out, *LIGHT, *SEPARATE, "trainer.total_steps=50", "trainer.save_every=1",
                  "trainer.val_every=100", "trainer.stage_timeout_s=10")
    try:
        wait_for(lambda: (out / "checkpoints" / "latest").exists(), 180, "the first checkpoint", proc)
        killed = worker(process_tree(proc.pid), "RolloutWorker")
        killed.kill()
        after = max(logged_steps(out), default=0) + 2  # a step generated by the rebuilt pool is done
        wait_for(lambda: max(logged_steps(out), default=0) >= after, 180, f"step {after} after the rebuild", proc)
        tree = process_tree(proc.pid)
        rebuilt = worker(tree, "RolloutWorker")
        assert rebuilt.pid != killed.pid
        rebuilt.suspend()
        start = time.monotonic()
        _, err = proc.communicate(timeout=120)
        took = time.monotonic() - start
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err[-3000:]
    assert took < 10 + 60, took
    rebuilt_lines = [line for line in err.splitlines() if "the rollout pool is rebuilt" in line]
    assert len(rebuilt_lines) == 1, err[-3000:]
    assert "Unhandled error" not in err, "the failed send's error was left for Ray to print: " + err[-3000:]
    assert "worker group 'rollout'" in rebuilt_lines[0] and "its worker process died" in rebuilt_lines[0], rebuilt_lines
    line = error_lines(err)
    assert line and "worker group 'rollout'" in line[0] and "did not finish within 10 s" in line[0], err[-3000:]
    assert wait_gone(tree) == []
