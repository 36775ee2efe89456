"""The 3D-HybridEngine planner: training layout (p, t, d) -> generation layout (p_g, t_g).

Pure Python, no processes. Ranks are numbered as megatron-core numbers them (order tp-dp-pp, tp fastest):
``rank = tp + t * (dp + d * pp)``.

Inside each training data-parallel replica (t*p ranks), generation TP groups take ranks at a stride of
t/t_g (and stages at a stride of p/p_g), and micro-DP groups take consecutive ranks: the d_g = t*p/(t_g*p_g)
members of a micro-DP group hold the training shards that make up one generation shard, so each rank's
generation shard already contains its own training shard and one all-gather inside the micro-DP group
finishes the transition.

``python -m hybridflow.tools.reshard_plan`` prints a plan or the paper's Table-2 style comparison.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

@dataclass(frozen=True)
class Layout:
    p: int  # pipeline stages
    t: int  # tensor-parallel size
    d: int = 1  # data-parallel size

    @property
    def world(self) -> int:
        return self.p * self.t * self.d

    def rank(self, tp: int, dp: int, pp: int) -> int:
        return tp + self.t * (dp + self.d * pp)

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(tp, dp, pp) of a rank."""
        return rank % self.t, (rank // self.t) % self.d, rank // (self.t * self.d)


@dataclass(frozen=True)
class RankPlan:
    rank: int
    train: tuple[int, int, int]  # (tp, dp, pp)
    gen_tp_rank: int  # k: which generation TP shard this rank holds
    gen_pp_stage: int
    replica: int  # global generation replica index (one per generation TP x PP group)
    micro_dp_group: tuple[int, ...]  # ranks all-gathering with this one (this one included)
    gen_group: tuple[int, ...]  # ranks of this rank's generation replica, ordered by (pp_g, tp_g)
    # Training shards this rank receives: (source rank, its train TP rank, its train PP stage).
    receives: tuple[tuple[int, int, int], ...]


class HybridPlan:
    """Groups and per-rank sends/receives for one train -> generation transition."""

    def __init__(self, train: Layout, p_g: int, t_g: int):
        if train.t % t_g or train.p % p_g:
            raise ValueError(f"generation layout (p_g={p_g}, t_g={t_g}) must divide the training "
                             f"layout (p={train.p}, t={train.t})")
        self.train, self.p_g, self.t_g = train, p_g, t_g
        self.tp_block, self.pp_block = train.t // t_g, train.p // p_g  # training shards per gen shard
        self.d_g = self.tp_block * self.pp_block  # micro-DP size = generation replicas per train replica
        self.ranks = [self._plan(r) for r in range(train.world)]

    def _plan(self, rank: int) -> RankPlan:
        tr = self.train
        tp, dp, pp = tr.coords(rank)
        k, sg = tp // self.tp_block, pp // self.pp_block
        offset = (tp % self.tp_block) + self.tp_block * (pp % self.pp_block)  # position in micro-DP group
        micro = tuple(sorted(tr.rank(k * self.tp_block + j, dp, sg * self.pp_block + s)
                             for s in range(self.pp_block) for j in range(self.tp_block)))
        j0, s0 = offset % self.tp_block, offset // self.tp_block
        group = tuple(tr.rank(kk * self.tp_block + j0, dp, ss * self.pp_block + s0)
                      for ss in range(self.p_g) for kk in range(self.t_g))
        receives = tuple((r, *(lambda c: (c[0], c[2]))(tr.coords(r))) for r in micro if r != rank)
        return RankPlan(rank, (tp, dp, pp), k, sg, dp * self.d_g + offset, micro, group, receives)

    @property
    def replicas(self) -> list[tuple[int, ...]]:
        """Generation replicas (each a TP x PP group serving its own prompts), by replica index."""
        seen = {}
        for rp in self.ranks:
            seen.setdefault(rp.replica, rp.gen_group)
        return [seen[i] for i in sorted(seen)]

    def dispatch_info(self, rank: int) -> dict:
        """For the controller: one shard per replica, returned by its first generation rank."""
        rp = self.ranks[rank]
        return dict(dp_rank=rp.replica, dp_size=len(self.replicas), collect=rp.gen_group[0] == rank)

    # --- byte accounting (M = model parameter bytes, sharded evenly) --------------------------------

    def hybrid_bytes_received(self) -> Fraction:
        """Per-rank receive volume as a fraction of M: (d_g - 1) training shards of M/(t*p)."""
        return Fraction(self.d_g - 1, self.train.t * self.train.p)

    def gather_all_bytes_received(self) -> Fraction:
        """verl today: every tensor all-gathered across TP and PP on every rank."""
        tp = self.train.t * self.train.p
        return Fraction(tp - 1, tp)

    def naive_bytes_received(self) -> Fraction:
        """DeepSpeed-Chat row of the paper: all-gather across all ranks."""
        n = self.train.world
        return Fraction(n - 1, n)

    def hybrid_peak(self) -> Fraction:
        return Fraction(1, self.t_g * self.p_g)

    def formula_bytes(self) -> Fraction:
        """The paper's (t*p - t_g*p_g) / (t_g*p_g*t*p); equals hybrid_bytes_received()."""
        t, p = self.train.t, self.train.p
        return Fraction(t * p - self.t_g * self.p_g, self.t_g * self.p_g * t * p)
