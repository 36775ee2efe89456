"""The planner's separate-placement case: the actor's training pool feeds a rollout pool of its own (vLLM only)
through the checkpoint engine. Pure Python, no processes.

Training layout (p, t, d) over N ranks; rollout pool of R ranks, R / t_g vLLM replicas of TP t_g (p_g = 1).
Two legs:

1. Inside the training pool, the hybrid transition (plan.HybridPlan) with t_s = gcd(t, t_g) gives every
   training rank vLLM TP shard k_s of t_s (nothing moves when p = 1 and t_s = t, the usual t_g = t case).
2. Each rollout rank (replica j, TP rank k) receives exactly its vLLM shard k of t_g: slice k mod m
   (m = t_g / t_s) of the shard k div m held by the training rank of source replica j mod n_s (the n_s
   training generation replicas take the rollout replicas in turn, spreading the sending). One broadcast
   group ("feed") per (source rank, slice): the source and every rollout rank it sends that slice to.

Bytes received per rollout rank, with M = S + X + W (TP-split dense bytes, expert bytes, replicated bytes:
norms, routers, in the rollout dtype): its shard, (S + X) / t_g + W. verl 0.9.1's checkpoint engine sends
every rollout rank the whole model (M, checkpoint_engine/base.py: trainer rank 0 gathers each bucket and
broadcasts it), and vLLM keeps its slice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

from hybridflow.resharding.plan import HybridPlan, Layout


@dataclass(frozen=True)
class Feed:
    """One broadcast group of the checkpoint engine: ``source`` (a training rank) sends slice ``part`` of its
    vLLM shard of t_s to ``receivers`` (rollout ranks). Group rank 0 is the source."""

    index: int
    source: int
    part: int
    receivers: tuple[int, ...]

    @property
    def size(self) -> int:
        return 1 + len(self.receivers)


class SeparatePlan:
    def __init__(self, train: Layout, rollout_world: int, t_g: int):
        if rollout_world % t_g:
            raise ValueError(f"the rollout pool ({rollout_world} ranks) does not split into vLLM replicas of "
                             f"tensor-parallel size {t_g}")
        self.train, self.rollout_world, self.t_g = train, rollout_world, t_g
        self.t_s = math.gcd(train.t, t_g)
        self.m = t_g // self.t_s
        self.trainer = HybridPlan(train, p_g=1, t_g=self.t_s)
        sources = self.trainer.replicas  # each: t_s training ranks in generation TP order
        feeds: dict[tuple[int, int], list[int]] = {}
        for rank in range(rollout_world):
            j, k = divmod(rank, t_g)
            source = sources[j % len(sources)][k // self.m]
            feeds.setdefault((source, k % self.m), []).append(rank)
        self.feeds = tuple(Feed(i, source, part, tuple(ranks)) for i, ((source, part), ranks) in enumerate(sorted(feeds.items())))

    @property
    def replicas(self) -> list[tuple[int, ...]]:
        """The rollout pool's vLLM replicas (consecutive ranks, in TP rank order)."""
        return [tuple(range(j * self.t_g, (j + 1) * self.t_g)) for j in range(self.rollout_world // self.t_g)]

    def feeds_of_trainer(self, rank: int) -> list[Feed]:
        return [f for f in self.feeds if f.source == rank]

    def feed_of_rollout(self, rank: int) -> Feed:
        return next(f for f in self.feeds if rank in f.receivers)

    def dispatch_info(self, rollout_rank: int) -> dict:
        """For the controller: one shard of prompts per rollout replica, returned by its TP rank 0."""
        return dict(dp_rank=rollout_rank // self.t_g, dp_size=self.rollout_world // self.t_g,
                    collect=rollout_rank % self.t_g == 0)

    def rollout_bytes_received(self, split: int, experts: int, replicated: int) -> Fraction:
        """Bytes each rollout rank receives (its vLLM shard): (S + X) / t_g + W."""
        return Fraction(split + experts, self.t_g) + replicated

    def trainer_bytes_received(self) -> Fraction:
        """Leg 1's bytes per training rank as a fraction of M (dense; the hybrid transition's formula at t_s)."""
        return self.trainer.hybrid_bytes_received()

    def describe(self) -> dict:
        return {"t_s": self.t_s, "slices_per_shard": self.m,
                "feeds": [{"source": f.source, "part": f.part, "receivers": list(f.receivers)} for f in self.feeds]}
