"""TRL's own pinned, cached venv for the hybridflow-vs-TRL GRPO benchmark.

    python benchmarks/trl_env.py            # builds benchmarks/.cache/trl-venv if needed, prints its python

    from benchmarks.trl_env import trl_python
    py = trl_python()                       # Path to the venv's python

TRL lives in its own venv so its pins (benchmarks/trl-requirements.txt) never touch hybridflow's. The venv
is rebuilt from scratch when it is missing or when the requirements file (or the python building it)
changed: a stamp file holds a hash of both, and is written only after a successful install and import check.

torch stays the CPU wheel: it is installed first, alone, then everything else is installed in one command
that also pins torch (the requirements file holds `torch==...+cpu`), so no dependency can swap in a CUDA
build. torchvision/torchaudio/torchcodec/triton are removed afterwards if anything pulled them in (on a CPU
box they break `import transformers`).
"""

from __future__ import annotations

import fcntl
import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
REQUIREMENTS = HERE / "trl-requirements.txt"
DEFAULT_CACHE = HERE / ".cache"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
UNWANTED = ("torchvision", "torchaudio", "torchcodec", "triton")
STAMP_NAME = ".hybridflow-trl-stamp"


def _base_python() -> str:
    """A python 3.11 outside any venv: sys.executable's base interpreter when it is 3.11, else python3.11."""
    if sys.version_info[:2] == (3, 11):
        base = getattr(sys, "_base_executable", None) or sys.executable
        if base and Path(base).exists():
            return base
    found = shutil.which("python3.11")
    if not found:
        raise RuntimeError("python3.11 not found: it is needed to build the TRL venv")
    return found


def _requirement_lines() -> list[str]:
    return [ln.split("#", 1)[0].strip() for ln in REQUIREMENTS.read_text().splitlines()
            if ln.split("#", 1)[0].strip()]


def _stamp(base_python: str) -> str:
    h = hashlib.sha256()
    h.update(REQUIREMENTS.read_bytes())
    ver = subprocess.run([base_python, "-c", "import sys; print(sys.version)"], check=True,
                         capture_output=True, text=True).stdout.strip()
    h.update(ver.encode())
    return h.hexdigest()


def _pip(py: Path, *args: str) -> None:
    cmd = [str(py), "-m", "pip", "--disable-pip-version-check", *args]
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True)


def _build(venv: Path, base_python: str) -> Path:
    if venv.exists():
        shutil.rmtree(venv)
    subprocess.run([base_python, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    reqs = _requirement_lines()
    torch_pin = [r for r in reqs if r.replace(" ", "").startswith("torch==")]
    if len(torch_pin) != 1:
        raise RuntimeError(f"{REQUIREMENTS} must pin torch exactly once (torch==X+cpu)")
    torch_pin = torch_pin[0]
    # 1) torch alone: the local find-links wheel first, else PyTorch's CPU index.
    try:
        _pip(py, "install", torch_pin)
        extra: tuple[str, ...] = ()
    except subprocess.CalledProcessError:
        extra = ("--extra-index-url", TORCH_CPU_INDEX)
        _pip(py, "install", *extra, torch_pin)
    # 2) everything, torch pin included in the same command, so nothing replaces the CPU build.
    _pip(py, "install", *extra, "-r", str(REQUIREMENTS))
    # 3) drop packages that break `import transformers` on a CPU-only torch.
    present = subprocess.run([str(py), "-m", "pip", "list", "--format=freeze"], check=True, capture_output=True,
                             text=True).stdout
    names = {ln.split("==")[0].lower() for ln in present.splitlines()}
    drop = [u for u in UNWANTED if u in names]
    if drop:
        _pip(py, "uninstall", "-y", *drop)
    # 4) check the result really is what was pinned.
    check = ("import torch, transformers, trl, accelerate, datasets, pyarrow;"
             "print(torch.__version__, transformers.__version__, trl.__version__)")
    out = subprocess.run([str(py), "-c", check], check=True, capture_output=True, text=True).stdout.split()
    want = {r.split("==")[0].strip(): r.split("==")[1].strip() for r in reqs if "==" in r}
    for name, got in zip(("torch", "transformers", "trl"), out):
        if name in want and got != want[name]:
            raise RuntimeError(f"TRL venv has {name} {got}, pinned {want[name]}")
    return py


def trl_python(cache_dir: Path = DEFAULT_CACHE) -> Path:
    """Path to the python of the pinned TRL venv under cache_dir, building it first if absent or stale."""
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    venv = cache_dir / "trl-venv"
    stamp_file = venv / STAMP_NAME
    base_python = _base_python()
    with open(cache_dir / ".trl-venv.lock", "w") as lock:  # one builder at a time
        fcntl.flock(lock, fcntl.LOCK_EX)
        want = _stamp(base_python)
        py = venv / "bin" / "python"
        if py.exists() and stamp_file.exists() and stamp_file.read_text().strip() == want:
            return py
        print(f"building the TRL venv at {venv} (pins: {REQUIREMENTS})", file=sys.stderr, flush=True)
        py = _build(venv, base_python)
        stamp_file.write_text(want + "\n")
        return py


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    a = ap.parse_args(argv)
    print(trl_python(a.cache_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
