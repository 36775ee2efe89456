"""hybridflow: RL post-training for LLMs (PPO family) on megatron-core + vLLM + Ray.

    from hybridflow import load_config, Trainer
    cfg = load_config("configs/quickstart_cpu.yaml", ["trainer.total_steps=20"])
    with Trainer(cfg) as trainer:
        trainer.fit()
"""

__all__ = ["Trainer", "load_config"]


def __getattr__(name):  # lazy: `import hybridflow` stays cheap (no torch, Ray or vLLM import)
    if name == "Trainer":
        from hybridflow.trainer.session import Trainer

        return Trainer
    if name == "load_config":
        from hybridflow.trainer.session import load

        return load
    raise AttributeError(f"module 'hybridflow' has no attribute {name!r}")
