"""`sbatch -N2 launchers/ppo_multinode.sh configs/quickstart_cpu.yaml <overrides>` on a real Slurm with two
nodes on this machine: the job completes, its Ray cluster spans both nodes and workers ran on both; a
failing driver fails the job with its status; a node that never registers is named within the timeout;
scancel leaves nothing behind."""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

from tests.cluster.local_slurm import LocalSlurm, ensure_installed

pytestmark = pytest.mark.cluster
ROOT = Path(__file__).resolve().parents[2]
SBATCH = ["-N2", "--cpus-per-task=2", "--gpus-per-node=0", "--partition=gpu", "--time=15"]


def short_run(tmp: Path, assets: Path, steps: int = 2) -> list[str]:
    """The README's short-run overrides: a small warm start and a few PPO steps on both nodes. The warm start and
    its data go to ``assets``, which the module's jobs share: the first job prepares them, the others find them
    made (prepare skips what exists)."""
    return [f"prepare.data_dir={assets}/data", f"prepare.base_model_dir={assets}/base", f"model.path={assets}/sft_model",
            f"data.train_files=[{assets}/data/train.parquet]", f"data.val_files=[{assets}/data/val.parquet]",
            "prepare.sft_steps=30", "prepare.sft_target_accuracy=null", "prepare.num_layers=2", "prepare.n_val=32",
            "data.batch_size=16", "data.val_batch_size=32", "actor.ppo_mini_batch_size=16",
            "actor.ppo_micro_batch_size_per_gpu=8", "critic.ppo_mini_batch_size=16",
            "critic.ppo_micro_batch_size_per_gpu=8", f"trainer.total_steps={steps}", "trainer.val_every=2",
            f"trainer.output_dir={tmp}/run"]


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("slurm_assets")


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    ensure_installed()
    cluster = LocalSlurm(tmp_path_factory.mktemp("slurm")).start()
    try:
        yield cluster
    finally:
        cluster.stop()


def submit(slurm, tmp: Path, *overrides, env=None) -> int:
    # The job's Ray temp dirs: short (Unix socket paths) and unique (job ids restart with each test Slurm).
    job_dir = tmp / "job_dir"
    job_dir.write_text(f"/tmp/hfc_{uuid.uuid4().hex[:8]}")
    return slurm.sbatch(*SBATCH, f"--output={tmp}/job-%j.out", f"--chdir={ROOT}",
                        "launchers/ppo_multinode.sh", "configs/quickstart_cpu.yaml", *overrides,
                        env={"HYBRIDFLOW_PYTHON": sys.executable, "HYBRIDFLOW_SHARED_DIR": str(tmp / "shared"),
                             "HYBRIDFLOW_JOB_DIR": job_dir.read_text(), **(env or {})})


def job_log(tmp: Path, job: int) -> str:
    return (tmp / f"job-{job}.out").read_text()


def new_processes(slurm, before: set[int]) -> list[str]:
    """This Slurm's processes (their environment names its slurm.conf: daemons, steps and the job's own, Ray
    included) started since ``before``; another test's Ray running beside this one (make test's two workers)
    is not this job's leftover."""
    out = []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        if p.info["pid"] in before or p.info["status"] == psutil.STATUS_ZOMBIE or not p.info["cmdline"]:
            continue
        cmd = " ".join(p.info["cmdline"])
        if any(k in cmd for k in ("ray", "hybridflow", "srun", "slurmstepd")) and ours(slurm, p):
            out.append(f"{p.info['pid']} {cmd[:100]}")
    return out


def ours(slurm, p: psutil.Process) -> bool:
    """Started by this Slurm: its environment or an ancestor's names our slurm.conf (Ray's agents are started
    with environments of their own, under a raylet that is ours), or, for slurmstepd (run by init with an empty
    environment), it holds a file in this Slurm's folder (its slurmd's log)."""
    try:
        lineage = [p, *p.parents()]
        if any(f.path.startswith(f"{slurm.dir}/") for f in p.open_files()):
            return True
    except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
        return False
    for q in lineage:
        try:
            if q.environ().get("SLURM_CONF") == str(slurm.conf):
                return True
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            pass
    return False


def settle(slurm, before: set[int], timeout_s: float = 30) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while (left := new_processes(slurm, before)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def test_ppo_runs_across_two_nodes(slurm, assets, tmp_path):
    before = {p.pid for p in psutil.process_iter()}
    job = submit(slurm, tmp_path, *short_run(tmp_path, assets))
    done = slurm.wait(job, timeout_s=600)
    log = job_log(tmp_path, job)
    assert (done["JobState"], done["ExitCode"]) == ("COMPLETED", "0:0"), log[-4000:]
    assert "ray: 2 nodes up: node1, node2" in log, log[-4000:]
    placement = json.loads((tmp_path / "run" / "placement.json").read_text())
    assert sorted(placement["actor_rollout_ref"]) == ["node1", "node2"], placement
    steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2]
    assert settle(slurm, before) == [], "processes left after the job"
    assert not os.path.exists((tmp_path / "job_dir").read_text()), "the job's Ray temp dirs are removed"
    assert not (tmp_path / "shared" / "jobs" / str(job)).exists(), "the job's token is removed"


def test_failing_driver_fails_the_job_with_its_status(slurm, assets, tmp_path):
    job = submit(slurm, tmp_path, *short_run(tmp_path, assets), "trainer.total_steps=0")  # a config error: exit 2
    done = slurm.wait(job, timeout_s=300)
    log = job_log(tmp_path, job)
    assert (done["JobState"], done["ExitCode"]) == ("FAILED", "2:0"), log[-3000:]
    assert "config error: trainer: total_steps must be >= 1" in log


def test_node_that_never_registers_is_named(slurm, assets, tmp_path):
    # node2's Ray never comes up: a python that hangs instead of starting it there.
    wrapper = tmp_path / "python"
    wrapper.write_text("#!/bin/bash\n"
                       'if [[ $SLURMD_NODENAME == node2 && "$*" == *"ray.scripts.scripts start"* ]]; then sleep 600; fi\n'
                       f'exec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    before = {p.pid for p in psutil.process_iter()}
    start = time.monotonic()
    job = submit(slurm, tmp_path, *short_run(tmp_path, assets), env={"HYBRIDFLOW_PYTHON": str(wrapper), "HYBRIDFLOW_NODE_WAIT_S": "12"})
    done = slurm.wait(job, timeout_s=240)
    log = job_log(tmp_path, job)
    assert done["JobState"] == "FAILED" and time.monotonic() - start < 120, log[-3000:]
    assert "error: nodes node2 did not register with the Ray head" in log and "within 12s" in log, log[-3000:]
    assert settle(slurm, before) == []


def test_scancel_leaves_nothing_behind(slurm, assets, tmp_path):
    before = {p.pid for p in psutil.process_iter()}
    # no critic, no reference, no step-0 validation: the job is cancelled once its first step is logged
    light = ["algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=false", "trainer.val_before_train=false"]
    job = submit(slurm, tmp_path, *short_run(tmp_path, assets, steps=200), *light)
    deadline = time.monotonic() + 400
    metrics = tmp_path / "run" / "metrics.jsonl"
    while not (metrics.exists() and metrics.read_text().count("\n") >= 1):
        assert time.monotonic() < deadline and slurm.completion(job) is None, job_log(tmp_path, job)[-3000:]
        time.sleep(0.5)
    slurm.run(["scancel", str(job)])
    done = slurm.wait(job, timeout_s=120)
    assert done["JobState"] == "CANCELLED"
    assert settle(slurm, before, timeout_s=60) == [], "processes left after scancel"
    assert not os.path.exists((tmp_path / "job_dir").read_text()), "the job's Ray temp dirs are removed"
