"""slurm/common.sh without Slurm: which Python the launchers default to, and which variables reach every Ray
process and the driver (by prefix, in container mode too; device visibility stays each node's own)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def bash(script: str, env: dict[str, str], cwd: Path) -> str:
    base = {k: os.environ[k] for k in ("PATH", "HOME") if k in os.environ}
    return subprocess.run(["bash", "-c", f'set -euo pipefail; source "{ROOT}/slurm/common.sh"; {script}'],
                          env={**base, **env}, cwd=cwd, capture_output=True, text=True, check=True).stdout


def fake_repo(tmp_path: Path, with_venv: bool) -> Path:
    repo = tmp_path / "repo"
    (repo / "slurm").mkdir(parents=True)
    (repo / "slurm" / "common.sh").symlink_to(ROOT / "slurm" / "common.sh")
    if with_venv:
        (repo / ".venv" / "bin").mkdir(parents=True)
        (repo / ".venv" / "bin" / "python").symlink_to("/bin/true")
    return repo


@pytest.mark.parametrize("with_venv,container,want", [
    (True, "", "{repo}/.venv/bin/python"),  # what `make run` installed, on every node
    (False, "", "python3"),
    (True, "podman", "python3"),  # the image's python (its venv is first on its PATH)
])
def test_default_python_is_the_repository_venv(tmp_path, with_venv, container, want):
    repo = fake_repo(tmp_path, with_venv)
    env = {"HYBRIDFLOW_ROOT": str(repo), "HYBRIDFLOW_CONTAINER": container}
    assert bash('echo "$HYBRIDFLOW_PYTHON"', env, tmp_path).strip() == want.format(repo=repo)
    assert bash('echo "$HYBRIDFLOW_PYTHON"', {**env, "HYBRIDFLOW_PYTHON": "/opt/py"}, tmp_path).strip() == "/opt/py"


def test_root_defaults_to_the_repository_of_common_sh(tmp_path):
    venv_python = ROOT / ".venv/bin/python"
    out = bash('echo "$HYBRIDFLOW_ROOT $HYBRIDFLOW_PYTHON"', {}, tmp_path).split()
    assert out == [str(ROOT), str(venv_python) if venv_python.exists() else "python3"]


USER_ENV = {
    "NCCL_IB_GID_INDEX": "5", "NCCL_NET_GDR_LEVEL": "PHB", "RCCL_MSCCL_ENABLE": "0", "UCX_TLS": "rc",
    "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "CUDA_DEVICE_MAX_CONNECTIONS": "1",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "VLLM_ATTENTION_BACKEND": "FLASH_ATTN", "HF_HOME": "/data/hf",
    "HF_TOKEN": "tok", "WANDB_MODE": "offline", "RAY_DEBUG": "1", "HYBRIDFLOW_SOCKET_IFNAME": "ib0",
    "PYTHONPATH": "/x", "NCCL_ALGO": "Ring\nTree",  # a value with a newline survives
}
PER_NODE = {"CUDA_VISIBLE_DEVICES": "0,1", "ROCR_VISIBLE_DEVICES": "0,1"}


def env_prefix(tmp_path, container: str) -> list[str]:
    env = {**USER_ENV, **PER_NODE, "SOME_OTHER": "x", "HYBRIDFLOW_CONTAINER": container, "SLURM_JOB_ID": "42"}
    out = bash("hybridflow_env_prefix", env, tmp_path)
    return out.split("\0")[:-1]


def test_forwarded_variables_without_container(tmp_path):
    words = env_prefix(tmp_path, "")
    assert words[0] == "env"
    forwarded = dict(w.split("=", 1) for w in words[1:])
    assert {k: forwarded.get(k) for k in USER_ENV} == USER_ENV  # NCCL_IB_GID_INDEX: the user's, none of ours
    assert "SOME_OTHER" not in forwarded
    assert not forwarded.keys() & PER_NODE.keys()  # Slurm sets them on each node's job step


def test_forwarded_variables_into_the_container(tmp_path):
    words = env_prefix(tmp_path, "podman")
    assert words[:2] == ["podman", "exec"] and words[-1] == "hybridflow_42"
    flags = words[2:-1]
    assert all(f.startswith("--env=") for f in flags)
    forwarded = dict(f[len("--env="):].split("=", 1) for f in flags if "=" in f[len("--env="):])
    assert forwarded["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert forwarded["CUDA_DEVICE_MAX_CONNECTIONS"] == "1" and forwarded["NCCL_IB_GID_INDEX"] == "5"
    # by name only: the engine takes the value of the process calling it, i.e. that node's job step
    by_name = [f[len("--env="):] for f in flags if "=" not in f[len("--env="):]]
    assert set(PER_NODE) <= set(by_name)


def test_comm_env_sets_socket_interfaces_and_no_gid_index(tmp_path):
    out = bash('hybridflow_comm_env; echo "${NCCL_IB_GID_INDEX-unset} $NCCL_SOCKET_IFNAME $GLOO_SOCKET_IFNAME"',
               {"HYBRIDFLOW_SOCKET_IFNAME": "ib0"}, tmp_path)
    assert out.split() == ["unset", "ib0", "ib0"]
