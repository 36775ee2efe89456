"""Which sample source (trainer/sources.py, trainer/agent_source.py) a run's schedule mode and agent program
make: chosen once, from the run plan."""

from __future__ import annotations

from hybridflow.trainer.placement import WorkerGroups
from hybridflow.trainer.pool_lookahead import look_ahead
from hybridflow.trainer.sources import CarriedGeneration, HybridEngine, Prepare, RolloutPool, SampleSource


def make_source(cfg, plan, workers: WorkerGroups, prepare: Prepare, tokenizer) -> SampleSource:
    """The sample source of ``schedule.mode`` (with ``agent.entrypoint``: the agent program's episodes); ``prepare``
    makes a step's rows from its prompts."""
    sc = cfg.schedule

    def groups_per_replica() -> int:  # one batch's worth of complete groups from each generation replica
        return cfg.data.batch_size // plan.generation.replicas

    if cfg.agent.enable:
        from hybridflow.trainer.agent_source import agent_source  # the endpoint's web stack, imported when served

        return agent_source(cfg, plan, workers, prepare, tokenizer)
    if sc.mode == "separate_async":
        return RolloutPool(workers, prepare, groups_per_replica, look_ahead(sc.num_warmup_batches,
                           sc.max_off_policy_threshold), serving=plan.rollout_spec.partial_rollout)
    if sc.mode == "colocate_async":
        return CarriedGeneration(workers, prepare, groups_per_replica, int(sc.num_warmup_batches))
    return HybridEngine(workers, prepare)
