"""hybridflow: RL post-training for LLMs (PPO family) on megatron-core + vLLM + Ray.

    from hybridflow import load_config, Trainer
    cfg = load_config("configs/quickstart_cpu.yaml", ["trainer.total_steps=20"])
    with Trainer(cfg) as trainer:
        trainer.fit()
"""

from hybridflow.patches import check_versions as _check_patch_versions

# A megatron-core, vLLM, torch or transformers outside the range a patch was written for fails here, in
# one line naming the patch (hybridflow/patches), not deep inside a run.
_check_patch_versions()

__all__ = ["Trainer", "load_config"]


def __getattr__(name):  # lazy: `import hybridflow` stays cheap (no torch, Ray or vLLM import)
    if name == "Trainer":
        from hybridflow.trainer.session import Trainer

        return Trainer
    if name == "load_config":
        from hybridflow.plan import load_experiment

        return load_experiment
    raise AttributeError(f"module 'hybridflow' has no attribute {name!r}")
