"""The training CLI as a user runs it, in its own process (signals, kills): launch, wait, inspect."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil

from tests.integration.conftest import SMALL


# What the failure tests do not need: a critic and a reference (GRPO, no KL) and the step-0 validation; each
# launch builds fewer workers and reaches its first step sooner.
NO_CRITIC = ("algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=false", "actor.use_kl_loss=false")
LIGHT = (*NO_CRITIC, "trainer.val_before_train=false")


def launch(assets, out: Path, *overrides, env: dict | None = None, own_group: bool = False) -> subprocess.Popen:
    """``env``: variables set for the run on top of this process's environment; ``own_group``: the run
    leads a process group of its own (as under `timeout`), which its Ray cluster joins."""
    args = [sys.executable, "-m", "hybridflow.trainer.main", "--config", "configs/quickstart_cpu.yaml",
            "prepare.enable=false", f"model.path={assets}/sft", f"data.train_files=[{assets}/data/train.parquet]",
            f"data.val_files=[{assets}/data/val.parquet]", f"trainer.output_dir={out}", *SMALL, *overrides]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=None if env is None else {**os.environ, **env}, start_new_session=own_group)


def wait_for(condition, timeout_s: float, what: str, proc: subprocess.Popen | None = None, poll_s: float = 0.005):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the run ended (status {proc.returncode}) before {what}:\n{proc.stderr.read()[-3000:]}")
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def logged_steps(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


def process_tree(pid: int) -> list[psutil.Process]:
    me = psutil.Process(pid)
    return [me, *me.children(recursive=True)]


def alive(procs: list[psutil.Process]) -> list[str]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{p.pid} {' '.join(p.cmdline())[:80]}")
        except psutil.NoSuchProcess:
            pass
    return out


def wait_gone(procs: list[psutil.Process], timeout_s: float = 30) -> list[str]:
    """The processes still running after ``timeout_s`` (killed then, so no test leaves them behind)."""
    deadline = time.monotonic() + timeout_s
    while alive(procs) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = alive(procs)
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    return left


def disturbed_run(assets, out: Path, disturb, *overrides, wait_s: float = 120, **launch_kw):
    """A 50-step run checkpointing every step: once its first checkpoint exists, ``disturb(tree)`` (the
    driver's process tree; the driver first) acts on it, and the run is waited for. Returns the exit
    status, stderr, the tree, and the seconds from the disturbance to the end."""
    proc = launch(assets, out, *LIGHT, "trainer.total_steps=50", "trainer.save_every=1", "trainer.val_every=100",
                  *overrides, **launch_kw)
    try:
        wait_for(lambda: (out / "checkpoints" / "latest").exists(), 180, "the first checkpoint", proc)
        tree = process_tree(proc.pid)
        disturb(tree)
        start = time.monotonic()
        _, err = proc.communicate(timeout=wait_s)
        return proc.returncode, err, tree, time.monotonic() - start
    finally:
        if proc.poll() is None:
            proc.kill()


def error_lines(err: str) -> list[str]:
    """The run's one-line failure reports (what `hybridflow train` prints after "error: ")."""
    return [line for line in err.splitlines() if line.startswith("error: ")]


def worker(tree, name: str = "ActorRolloutRefWorker"):
    return next(p for p in tree if name in " ".join(p.cmdline()))
