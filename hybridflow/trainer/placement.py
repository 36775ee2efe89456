"""Placement: which worker groups run where, in which Ray resource pools, with which share of a bundle."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import cast

from hybridflow.controller import RayWorkerGroup, ResourcePool
from hybridflow.workers.actor_rollout_ref import ActorRolloutRefWorker
from hybridflow.workers.common import megatron_process_env
from hybridflow.workers.critic import CriticWorker
from hybridflow.workers.interfaces import ActorRolloutRefGroup, CriticGroup, RewardModelGroup
from hybridflow.workers.reward_model import RewardModelWorker


@dataclass
class WorkerGroups:
    actor_rollout: ActorRolloutRefGroup
    critic: CriticGroup | None = None
    reward_model: RewardModelGroup | None = None
    pools: list = field(default_factory=list)

    def shutdown(self) -> None:
        try:
            if not self.actor_rollout.failed:  # a dead or stuck worker cannot clean up: it is killed
                self.actor_rollout.close()
        except Exception as e:  # the groups are killed regardless
            logging.getLogger(__name__).warning("rollout close failed: %s", getattr(e, "summary", e))
        for group in (self.actor_rollout, self.critic, self.reward_model):
            if group is not None:
                group.shutdown()
        for pool in self.pools:
            pool.remove()


def build_worker_groups(cfg, plan) -> WorkerGroups:
    """The worker groups in the run plan's pools (``plan.pools``: which groups share a pool, each taking an
    equal share of every bundle). Every call on a group gives up after ``trainer.stage_timeout_s``, naming
    the ranks that did not finish."""
    res = cfg.resources
    group = functools.partial(RayWorkerGroup, call_timeout_s=cfg.trainer.stage_timeout_s)
    bundle = dict(cpus_per_bundle=res.cpus_per_worker, gpus_per_bundle=res.gpus_per_worker)
    pools = {p.name: ResourcePool(p.name, p.size, **bundle) for p in plan.pools}

    def placed(name: str, worker_cls, *args, env=None):
        spec = plan.pool(name)
        return group(pools[spec.name], worker_cls, *args, name_prefix=name, share=spec.share, env=env)

    on_gpu = res.gpus_per_worker > 0
    actor_rollout = placed("actor_rollout_ref", ActorRolloutRefWorker, plan.actor_spec,
                           env=megatron_process_env(cfg.actor.megatron, on_gpu))
    groups = WorkerGroups(cast(ActorRolloutRefGroup, actor_rollout), pools=list(pools.values()))
    # On GPUs, wait until the actors (and their vLLM engines) are built: vLLM measures the free device
    # memory while it starts, and a colocated role allocating at the same time would skew or break that.
    # On CPUs its KV cache has a fixed size (rollout.kv_cache_gib), so the critic starts alongside.
    if on_gpu:
        groups.actor_rollout.dispatch_infos()
    if plan.critic is not None:
        groups.critic = cast(CriticGroup, placed("critic", CriticWorker, plan.critic_spec,
                                                 env=megatron_process_env(cfg.critic.megatron, on_gpu)))
    if plan.reward_model_spec is not None:
        groups.reward_model = cast(RewardModelGroup, placed("reward_model", RewardModelWorker, plan.reward_model_spec))
    return groups
