"""The 3D-HybridEngine planner: training layout (p, t, d) -> generation layout (p_g, t_g).

Pure Python, no processes. Ranks are numbered as megatron-core numbers them (order tp-dp-pp, tp fastest):
``rank = tp + t * (dp + d * pp)``.

t_g divides t (the paper's case). Inside each training data-parallel replica (t*p ranks), generation TP
groups take ranks at a stride of t/t_g (and stages at a stride of p/p_g), and micro-DP groups take
consecutive ranks: the d_g = t*p/(t_g*p_g) members of a micro-DP group hold the training shards that make
up one generation shard, so each rank's generation shard already contains its own training shard and one
all-gather inside the micro-DP group finishes the transition. Bytes received per rank:
(d_g - 1) shards of M/(t*p) = (t*p - t_g*p_g) / (t_g*p_g*t*p) * M (the paper's formula).

t_g a multiple of t (m = t_g/t generation shards per training TP shard). The micro-DP group is the
pipeline gather alone (the p/p_g stages of one training TP rank that one generation stage spans); after
it every rank holds its training TP shard of the whole generation stage, and its generation shard is a
slice of that, cut locally (vllm_layout.slice_shard): no TP all-gather. For that, the planner puts in
each generation TP group, at generation TP ranks j*m .. j*m+m-1, m ranks holding training TP shard j:
the ranks of TP shard j (indexed q = dp + d * (pp mod p/p_g)) form groups of m consecutive q, so a
generation TP group spans training DP ranks (and, with p > 1, stages) that hold the same shard. With
p_g = 1 the groups are blocks of t_g consecutive ranks. Bytes received per rank: the pipeline gather's
(p/p_g - 1) shards of M/(t*p), i.e. the formula above with t_g replaced by t; zero when p = p_g. Its
buffers then hold the rank's training TP shard of the generation stage, M/(t*p_g), more than the M/t_g it
keeps. (Sending each receiver only its slice would cut the bytes to (p/p_g - 1)/(t_g*p) * M: a broadcast
of slice r when all members of a pipeline group cut the same slice r, which this numbering gives when m
divides d, else an all-to-all; not done.) The whole world must divide into generation groups:
world % (t_g*p_g) == 0.

Mixture of experts (training EP e, expert TP 1; vLLM's TP layout for experts: every generation rank holds
every expert, sliced 1/t_g like a dense MLP). Experts do not follow the micro-DP groups: within each
expert-parallel group (the e ranks that together hold one copy of a stage's experts), every member sends
every other member exactly the 1/t_g slice of its own E/e whole experts that the receiver's generation
rank needs (an all-to-all per MoE layer). Then, like the norms, the stage's experts (now identical on the
members of one micro-DP group) cross the pipeline gather. Per rank, with M = S + X + R (TP-split dense
bytes, expert bytes, replicated bytes: norms, routers):

    hybrid:      S (d_g - 1)/(t p)  +  X/(p t_g) ((e - 1)/e + p/p_g - 1)  +  R/p (p/p_g - 1)
    gather_all:  S (t p - 1)/(t p)  +  X (e p - 1)/(e p)                   +  R (p - 1)/p

(gather_all = every rank gathers whole tensors: the experts of all EP ranks and stages.) Held after the
transition: the generation shard, (S + X)/(t_g p_g) + R/p_g. With one EP rank and expert TP = TP, experts
are TP-split tensors like the dense MLP and belong to S.

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
        if train.p % p_g or (train.t % t_g and t_g % train.t):
            raise ValueError(f"generation layout (p_g={p_g}, t_g={t_g}) must divide the training layout "
                             f"(p={train.p}, t={train.t}), or t_g be a multiple of t")
        if train.world % (t_g * p_g):
            raise ValueError(f"{train.world} ranks do not form generation groups of t_g*p_g = {t_g * p_g}")
        self.train, self.p_g, self.t_g = train, p_g, t_g
        self.tp_block, self.pp_block = max(1, train.t // t_g), train.p // p_g  # training shards per gen shard
        self.tp_split = max(1, t_g // train.t)  # generation shards cut from one training TP shard
        # micro-DP size; with t_g <= t it is also the number of generation replicas per training replica
        self.d_g = self.tp_block * self.pp_block
        self.ranks = [self._plan(r) for r in range(train.world)]

    def _plan(self, rank: int) -> RankPlan:
        tr, bt, bp, m = self.train, self.tp_block, self.pp_block, self.tp_split
        tp, dp, pp = tr.coords(rank)
        sg = pp // bp
        offset = (tp % bt) + bt * (pp % bp)  # position in micro-DP group
        micro = tuple(sorted(tr.rank(tp - tp % bt + j, dp, sg * bp + s) for s in range(bp) for j in range(bt)))
        if m == 1:
            k = tp // bt
            j0, s0 = offset % bt, offset // bt
            group = tuple(tr.rank(kk * bt + j0, dp, ss * bp + s0) for ss in range(self.p_g) for kk in range(self.t_g))
            replica = dp * self.d_g + offset
        else:
            replica, r = divmod(dp + tr.d * (pp % bp), m)  # q = dp + d * (pp mod p/p_g), in groups of m
            k = tp * m + r

            def member(ss: int, kk: int) -> int:  # the rank at generation (stage ss, TP rank kk)
                q = replica * m + kk % m
                return tr.rank(kk // m, q % tr.d, ss * bp + q // tr.d)

            group = tuple(member(ss, kk) for ss in range(self.p_g) for kk in range(self.t_g))
        receives = tuple((r, *(lambda c: (c[0], c[2]))(tr.coords(r))) for r in micro if r != rank)
        return RankPlan(rank, (tp, dp, pp), k, sg, replica, micro, group, receives)

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
        """The generation shard each rank holds."""
        return Fraction(1, self.t_g * self.p_g)

    def stage_bytes_received(self, stage: int, split: list[int], experts: list[int], replicated: list[int],
                             whole: list[int], e: int) -> Fraction:
        """Bytes a rank of training stage ``stage`` receives in the hybrid transition, from each training stage's
        own bytes (lists indexed by stage): TP-split dense, expert (exchanged over e expert-parallel ranks; 0 at
        e = 1, where experts are TP-split and belong to ``split``) and replicated (norms, routers). It gets the
        other t/t_g - 1 TP shards of its stage and every shard of the other stages of its generation stage, its
        stage's experts' generation slices from the e - 1 other expert ranks, the other stages' ones whole, and
        their replicated tensors; an expert's replicated pieces (``whole``: gpt-oss's down_proj_bias) come as the
        experts do but uncut by t_g. With even stages this is the module docstring's formula; stages differ where
        layers do (GLM-4.5's and DeepSeek-V3's first dense layers; the embedding and the final norm)."""
        t, bt, bp, s = self.train.t, self.tp_block, self.pp_block, stage
        others = [o for o in range(s - s % bp, s - s % bp + bp) if o != s]
        return (Fraction(split[s] * (bt - 1), t) + sum(Fraction(split[o] * bt, t) for o in others)
                + Fraction(experts[s] * (e - 1), e * self.t_g) + sum(Fraction(experts[o], self.t_g) for o in others)
                + Fraction(whole[s] * (e - 1), e) + sum(whole[o] for o in others)
                + sum(replicated[o] for o in others))

    def moe_gather_all_bytes_received(self, split: int, experts: int, replicated: int, e: int) -> Fraction:
        """The same for gathering every tensor whole on every rank (all experts of all EP ranks and stages)."""
        p = self.train.p
        return (split * self.gather_all_bytes_received() + experts * Fraction(e * p - 1, e * p)
                + replicated * Fraction(p - 1, p))

    def formula_bytes(self) -> Fraction:
        """The paper's (t*p - t_g*p_g) / (t_g*p_g*t*p), with t_g capped at t (a larger t_g is cut locally
        from the pipeline-gathered training shard); equals hybrid_bytes_received()."""
        t, p = self.train.t, self.train.p
        t_g = min(self.t_g, t)
        return Fraction(t * p - t_g * self.p_g, t_g * self.p_g * t * p)
