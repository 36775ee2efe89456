"""The run plan: every fact derived from an experiment config, computed and checked once (torch-free code;
the algorithm registries it reads fill in as the algorithms import). config/ holds the dataclasses and
their per-field checks; this floor holds the rules across sections and the arithmetic of layouts and pools."""

from __future__ import annotations

from hybridflow.config import ConfigError, config_to_dict, load_config
from hybridflow.config.schema import ExperimentConfig
from hybridflow.plan.layout import GenerationLayout, ParallelLayout
from hybridflow.plan.needs import Needs
from hybridflow.plan.pools import Pool
from hybridflow.plan.run_plan import RunPlan, resolve, total_steps

__all__ = ["GenerationLayout", "Needs", "ParallelLayout", "Pool", "RunPlan", "load_experiment", "resolve",
           "total_steps"]


def load_experiment(config, overrides=(), *, sources: dict | None = None) -> ExperimentConfig:
    """An ExperimentConfig from a YAML path, a list of paths, a dict, or a config (copied) — plus overrides —
    with every rule of the run plan checked (``ConfigError``: one line naming the keys)."""
    if isinstance(config, ExperimentConfig):
        config = config_to_dict(config)
    cfg = load_config(ExperimentConfig, config, list(overrides), sources=sources)
    try:
        resolve(cfg)
    except ValueError as e:
        raise ConfigError(" ".join(str(e).split())) from None
    return cfg
