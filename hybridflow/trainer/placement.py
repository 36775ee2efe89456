"""Placement: which worker groups run where, in which Ray resource pools, with which share of a bundle."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import cast

from hybridflow.controller import RayWorkerGroup, ResourcePool
from hybridflow.workers.interfaces import ActorRolloutRefGroup, CriticGroup, RewardModelGroup


@dataclass
class WorkerGroups:
    actor_rollout: ActorRolloutRefGroup
    critic: CriticGroup | None = None
    reward_model: RewardModelGroup | None = None
    pools: list = field(default_factory=list)

    def shutdown(self) -> None:
        try:
            self.actor_rollout.close()
        except Exception as e:  # a dead worker cannot clean up; the groups are killed regardless
            logging.getLogger(__name__).warning("rollout close failed: %s", getattr(e, "summary", e))
        for group in (self.actor_rollout, self.critic, self.reward_model):
            if group is not None:
                group.shutdown()
        for pool in self.pools:
            pool.remove()


def build_worker_groups(cfg) -> WorkerGroups:
    """Actor/rollout/ref share one pool with the colocated critic and the reward model (each taking an
    equal share of every bundle); a separate critic gets a pool of its own. Every call on a group gives up
    after ``trainer.stage_timeout_s``, naming the ranks that did not finish."""
    from hybridflow.workers.actor_rollout_ref import ActorRolloutRefWorker
    from hybridflow.workers.common import megatron_process_env
    from hybridflow.workers.critic import CriticWorker
    from hybridflow.workers.reward_model import RewardModelWorker

    res = cfg.resources
    group = functools.partial(RayWorkerGroup, call_timeout_s=cfg.trainer.stage_timeout_s)
    bundle = dict(cpus_per_bundle=res.cpus_per_worker, gpus_per_bundle=res.gpus_per_worker)
    pool = ResourcePool("actor_rollout_ref", res.n_workers, **bundle)
    colocated_critic = cfg.use_critic and cfg.critic.placement == "colocated"
    share = 1.0 / (1 + colocated_critic + cfg.reward_model.enable)
    needs_ref = cfg.algorithm.use_kl_in_reward or cfg.actor.use_kl_loss
    on_gpu = res.gpus_per_worker > 0
    actor_rollout = group(pool, ActorRolloutRefWorker, cfg, needs_ref, name_prefix="actor_rollout_ref", share=share,
                          env=megatron_process_env(cfg.actor.megatron, on_gpu))
    groups = WorkerGroups(cast(ActorRolloutRefGroup, actor_rollout), pools=[pool])
    # On GPUs, wait until the actors (and their vLLM engines) are built: vLLM measures the free device
    # memory while it starts, and a colocated role allocating at the same time would skew or break that.
    # On CPUs its KV cache has a fixed size (rollout.kv_cache_gib), so the critic starts alongside.
    if on_gpu:
        groups.actor_rollout.dispatch_infos()
    if cfg.use_critic:
        critic_pool = pool if colocated_critic else ResourcePool("critic", res.critic_n_workers, **bundle)
        if critic_pool is not pool:
            groups.pools.append(critic_pool)
        groups.critic = cast(CriticGroup, group(critic_pool, CriticWorker, cfg, name_prefix="critic",
                                                share=share if colocated_critic else 1.0,
                                                env=megatron_process_env(cfg.critic.megatron, on_gpu)))
    if cfg.reward_model.enable:
        groups.reward_model = cast(RewardModelGroup, group(pool, RewardModelWorker, cfg, name_prefix="reward_model",
                                                           share=share))
    return groups
