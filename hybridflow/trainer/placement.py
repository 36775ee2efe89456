"""Placement: which worker groups run where, in which Ray resource pools, with which share of a bundle."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import cast

from hybridflow.controller import RayWorkerGroup, ResourcePool, get_together
from hybridflow.workers.actor_rollout_ref import ActorRolloutRefWorker
from hybridflow.workers.common import megatron_process_env
from hybridflow.workers.critic import CriticWorker
from hybridflow.workers.interfaces import ActorRolloutRefGroup, CriticGroup, RewardModelGroup, RolloutGroup
from hybridflow.workers.reward_model import RewardModelWorker
from hybridflow.workers.rollout import RolloutWorker


@dataclass
class WorkerGroups:
    actor_rollout: ActorRolloutRefGroup
    critic: CriticGroup | None = None
    reward_model: RewardModelGroup | None = None
    rollout: RolloutGroup | None = None  # separate_async's standalone vLLM pool
    pools: list = field(default_factory=list)
    weight_store: object = None  # the checkpoint engine's rendezvous (a TCPStore this process hosts)
    build_rollout: object = None  # () -> a new rollout group (rebuild_rollout)
    connect_timeout_s: float = 600.0

    @property
    def generator(self):
        """The group that generates: the standalone rollout pool, else the hybrid engine."""
        return self.rollout if self.rollout is not None else self.actor_rollout

    @property
    def all(self) -> list:
        return [g for g in (self.actor_rollout, self.critic, self.reward_model, self.rollout) if g is not None]

    def rebuild_rollout(self) -> None:
        """Replace the rollout group (one of its worker processes died): the old one is killed, a new one built in
        the same pool and connected to the checkpoint engine; it holds no weights until the next push."""
        self.rollout.shutdown()
        self.rollout = self.build_rollout()
        self.weight_store = connect_checkpoint_engine(self.actor_rollout, self.rollout, self.connect_timeout_s)

    def shutdown(self) -> None:
        for group in (self.actor_rollout, self.rollout):
            try:
                if group is not None and not group.failed:  # a dead or stuck worker cannot clean up: it is killed
                    group.close()
            except Exception as e:  # the groups are killed regardless
                logging.getLogger(__name__).warning("rollout close failed: %s", getattr(e, "summary", e))
        for group in self.all:
            group.shutdown()
        for pool in self.pools:
            pool.remove()


def build_worker_groups(cfg, plan) -> WorkerGroups:
    """The worker groups in the run plan's pools (``plan.pools``: which groups share a pool, each taking an
    equal share of every bundle). Every call on a group gives up after ``trainer.stage_timeout_s``, naming
    the ranks that did not finish; the workers' construction, which a group's first call waits for first, after
    the larger of that and ``trainer.dist_timeout_s`` (it joins the distributed world and loads the model). When
    one cannot be built, those already built are killed and the pools removed before the error goes on: a
    caller's Ray cluster (a notebook, the next run in one process) is left as it was, not holding the named pools
    a retry would clash with."""
    res = cfg.resources
    t = cfg.trainer
    build_s = max(t.stage_timeout_s, t.dist_timeout_s) if t.stage_timeout_s > 0 else None
    group = functools.partial(RayWorkerGroup, call_timeout_s=t.stage_timeout_s, build_timeout_s=build_s)
    bundle = dict(cpus_per_bundle=res.cpus_per_worker, gpus_per_bundle=res.gpus_per_worker)
    pools = {p.name: ResourcePool(p.name, p.size, **bundle) for p in plan.pools}
    built: list | None = []  # the groups built so far (None once all are: a later rebuild is the run's own)

    def placed(name: str, worker_cls, *args, env=None):
        spec = plan.pool(name)
        made = group(pools[spec.name], worker_cls, *args, name_prefix=name, share=spec.share, env=env)
        if built is not None:
            built.append(made)
        return made

    try:
        groups = _build_groups(cfg, plan, placed, list(pools.values()))
    except BaseException:
        for made in built:
            made.shutdown()
        for pool in pools.values():
            pool.remove()
        raise
    built = None
    return groups


def _build_groups(cfg, plan, placed, pools: list) -> WorkerGroups:
    """``build_worker_groups``' groups, each made by ``placed(name, worker class, spec, env=...)``."""
    on_gpu = cfg.resources.gpus_per_worker > 0
    actor_rollout = placed("actor_rollout_ref", ActorRolloutRefWorker, plan.actor_spec,
                           env=megatron_process_env(cfg.actor.megatron, on_gpu))
    groups = WorkerGroups(cast(ActorRolloutRefGroup, actor_rollout), pools=pools)
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
    if plan.rollout_spec is not None:
        groups.build_rollout = lambda: cast(RolloutGroup, placed("rollout", RolloutWorker, plan.rollout_spec))
        groups.rollout, groups.connect_timeout_s = groups.build_rollout(), cfg.trainer.dist_timeout_s
        groups.weight_store = connect_checkpoint_engine(groups.actor_rollout, groups.rollout, groups.connect_timeout_s)
    return groups


def connect_checkpoint_engine(actor: ActorRolloutRefGroup, rollout: RolloutGroup, timeout_s: float):
    """Open the checkpoint engine's feeds between the two pools (resharding/separate.py) on a TCP store this
    process hosts (the single controller is reachable from every node); returns the store, which must live as
    long as the feeds may reconnect."""
    import uuid

    import ray
    import torch.distributed as dist

    host = ray.util.get_node_ip_address()
    store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
    prefix = uuid.uuid4().hex[:8]
    get_together(actor.connect_rollout(host, store.port, prefix, timeout_s),
                 rollout.connect_rollout(host, store.port, prefix, timeout_s))
    return store
