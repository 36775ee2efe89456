"""Which worker groups share which Ray resource pool, and each one's share of a bundle."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Pool:
    name: str
    size: int  # bundles (processes; one GPU each on GPU machines)
    size_key: str  # the config key that sets ``size`` (named in errors)
    groups: tuple[str, ...]  # worker groups placed on it, each taking an equal share of every bundle

    @property
    def share(self) -> float:
        return 1.0 / len(self.groups)


def pool_of(pools: tuple[Pool, ...], group: str) -> Pool:
    """The pool a worker group runs in."""
    return next(p for p in pools if group in p.groups)


def plan_pools(cfg, critic: bool) -> tuple[Pool, ...]:
    """The actor/rollout/ref pool holds the colocated critic and the reward model too; a separate critic
    gets a pool of its own, and so does the standalone rollout of schedule.mode separate_async."""
    colocated = critic and cfg.critic.placement == "colocated"
    groups = ("actor_rollout_ref",) + (("critic",) if colocated else ()) + (
        ("reward_model",) if cfg.reward_model.enable else ())
    pools = (Pool("actor_rollout_ref", cfg.resources.n_workers, "resources.n_workers", groups),)
    if critic and not colocated:
        pools += (Pool("critic", cfg.resources.critic_n_workers, "resources.critic_n_workers", ("critic",)),)
    if cfg.schedule.mode == "separate_async":
        pools += (Pool("rollout", cfg.resources.rollout_n_workers, "resources.rollout_n_workers", ("rollout",)),)
    return pools
