"""The train -> generation weight transition on torch.distributed (gloo here, nccl on GPU).

``hybrid`` (the paper's 3D-HybridEngine): one broadcast per member inside each micro-DP group, so every rank
receives exactly the (d_g - 1) training shards that complete its generation shard, and never holds more than
its generation shard (M / t_g). ``gather_all`` (verl today): every tensor is all-gathered across TP and
broadcast across PP on every rank, which then keeps only its own slice.

With t_g a multiple of t, the micro-DP group is the pipeline gather alone (nothing moves at p = 1) and
``hybrid`` cuts the rank's generation shard out of its training shard, one layer at a time.

Both yield this rank's vLLM tensor-parallel shard in vLLM's parameter layout and record bytes moved and
peak extra parameter bytes. Generation pipeline parallelism is planned (plan.py) but executed only for
p_g = 1 (vLLM on CPU has no pipeline stages).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hybridflow import families
from hybridflow.families import weights
from hybridflow.megatron import convert, parallel
from hybridflow.resharding import vllm_layout
from hybridflow.resharding.plan import HybridPlan
from hybridflow.plan.stages import StageSplit


@dataclass
class TransitionStats:
    scheme: str
    bytes_received: int = 0
    bytes_sent: int = 0
    peak_extra_bytes: int = 0  # parameter bytes held beyond the training shard, at the worst moment
    own_shard_bytes: int = 0
    # The largest checkpoint-shaped copy made for vLLM's loaders (vllm_layout.to_checkpoint_names; 0 where
    # vLLM takes the shard as is), held on top of the peak above while vLLM loads it.
    staging_bytes: int = 0
    seconds: float = 0.0

    def as_metrics(self, prefix: str = "reshard") -> dict:
        return {f"{prefix}/bytes_received": float(self.bytes_received), f"{prefix}/bytes_sent": float(self.bytes_sent),
                f"{prefix}/peak_extra_bytes": float(self.peak_extra_bytes + self.staging_bytes),
                f"{prefix}/staging_bytes": float(self.staging_bytes), f"{prefix}/seconds": self.seconds}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _by_dtype(meta: list) -> list[list]:
    """A member's ``(name, shape, dtype)`` list in one list per dtype, in order: each goes as one flat tensor (the
    routers' expert bias is float32 in a bfloat16 model, families/weights.py EXPERT_BIAS)."""
    parts = {}
    for entry in meta or ():
        parts.setdefault(entry[2], []).append(entry)
    return list(parts.values())


def _local_shard(module) -> dict:
    """This rank's training shard in the local spec's names (a TE-built model's fused-norm names are
    translated), so the transition is the same whichever layer spec built the model."""
    return convert.local_state_dict(module)


class Resharder:
    """Per rank; build it on every rank of the actor's world together (it creates process groups)."""

    def __init__(self, module, hf_config, plan: HybridPlan, scheme: str = "hybrid", stages: StageSplit | None = None):
        """``stages``: which layers each training stage holds (the role's ``shard.stages``; None: megatron's even
        split of this process's pipeline)."""
        if scheme not in ("hybrid", "gather_all"):
            raise ValueError(f"rollout.resharding must be 'hybrid' or 'gather_all', got {scheme!r}")
        vllm_layout.check_supported(hf_config, plan.t_g)
        self.module, self.cfg, self.scheme, self.plan = module, hf_config, scheme, plan
        train = plan.train
        self.rank = dist.get_rank()
        self.me = self.plan.ranks[self.rank]
        from megatron.core import parallel_state as ps

        self._check_experts(hf_config, scheme)
        # the plan's d counts context-parallel ranks too (same weights; megatron's order tp-cp-dp-pp)
        actual = (ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank(with_context_parallel=True),
                  ps.get_pipeline_model_parallel_rank())
        if train.coords(self.rank) != actual:  # the plan's groups are only right if they are megatron's
            raise RuntimeError(f"rank {self.rank}: the resharding plan places it at (tp, dp, pp) "
                               f"{train.coords(self.rank)} but megatron's groups at {actual}")
        self.tie = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.stages = stages or StageSplit(train.p, ps.get_virtual_pipeline_model_parallel_world_size() or 1)
        self._new_groups()
        local = _local_shard(module)
        self.device = next(iter(local.values())).device
        meta = self._meta(local)
        split = [(k, *meta[k]) for k in sorted(meta) if self._split_dim(k) is not None]
        replicated = [(k, *meta[k]) for k in sorted(meta) if self._split_dim(k) is None]
        metas = [None] * len(self.me.micro_dp_group)
        dist.all_gather_object(metas, split, group=self.micro_group)
        self.split_meta = dict(zip(self.me.micro_dp_group, metas))
        metas = [None] * len(self.slice_members)
        dist.all_gather_object(metas, replicated, group=self.slice_group)
        self.replicated_meta = dict(zip(self.slice_members, metas))

    def _check_experts(self, hf_config, scheme: str) -> None:
        """Whether a MoE model's experts take their own exchange, and the layouts that exchange refuses."""
        from megatron.core import parallel_state as ps

        layout = parallel.current_layout()
        ep, etp = layout.ep, layout.etp
        self.num_experts = families.num_experts(hf_config)
        # (megatron suffix, vLLM suffix, split) of each weight of one routed expert (``...local_experts.{i}.`` and
        # ``...experts.{e}.`` removed): what the exchange sends, in the family's declared order
        self.expert_weights = [(w.megatron.split("{e}.")[1], w.vllm.split("{e}.")[1], w.split)
                               for w in families.of(hf_config).expert]
        # Experts reach the generation layout through their own exchange (see _exchange_experts) wherever
        # they are not split like a dense MLP over the TP group alone (one EP rank, expert TP = TP).
        self.expert_exchange = bool(self.num_experts) and layout.moves_experts
        if self.expert_exchange and etp > 1:
            raise ValueError(f"resharding a MoE model with expert_model_parallel_size {ep} needs "
                             f"expert_tensor_parallel_size 1 (got {etp})")
        if self.expert_exchange and scheme == "gather_all":
            raise ValueError("rollout.resharding 'gather_all' does not gather experts across expert-parallel "
                             "ranks; use 'hybrid'")
        self.ep_group = ps.get_expert_model_parallel_group() if self.expert_exchange else None

    def _new_groups(self) -> None:
        """Two group sets, created by all ranks in the same order (new_group is collective): the micro-DP groups
        exchange TP-split tensors; inside them, "stage slices" (members at the same TP offset, one per stage)
        exchange the tensors megatron replicates across TP (norms), which only members of other stages need."""
        self.micro_group = self.slice_group = None
        for members in sorted({rp.micro_dp_group for rp in self.plan.ranks}):
            group = dist.new_group(list(members))
            if self.rank in members:
                self.micro_group = group
        self.slice_members = tuple(r for r in self.me.micro_dp_group if self._offset(r) == self._offset(self.rank))
        for members in sorted({tuple(r for r in rp.micro_dp_group if self._offset(r) == self._offset(rp.rank))
                               for rp in self.plan.ranks}):
            group = dist.new_group(list(members))
            if self.rank in members:
                self.slice_group = group

    def _offset(self, rank: int) -> int:
        return self.plan.train.coords(rank)[0] % self.plan.tp_block

    # --- experts ----------------------------------------------------------------------------------

    @staticmethod
    def _generation_expert(name: str) -> bool:
        """An expert already in its generation form (every stage member holds the same one)."""
        return weights.is_expert(name) and weights.local_expert(name) is None

    def _split_dim(self, name: str) -> int | None:
        return None if self._generation_expert(name) else convert.tp_split_dim(name)

    def _meta(self, local: dict) -> dict:
        """``{name: (shape, dtype)}`` of what the transition exchanges: ``local``'s tensors, its experts in
        their generation form (what _exchange_experts returns) where they are exchanged. Shapes only: the
        Resharder is built while parameters may be offloaded (``param_offload``: no storage to read), and
        nothing of an expert's generation form is allocated before the first sync."""
        meta = {k: (tuple(v.shape), v.dtype) for k, v in local.items()
                if not (self.expert_exchange and convert.is_expert_param(k))}
        if not self.expert_exchange:
            return meta
        for prefix in sorted({m[0] for m in map(weights.local_expert, local) if m}):
            for megatron, vllm, split in self.expert_weights:
                t = local[f"{prefix}local_experts.0.{megatron}"]
                shape = vllm_layout.expert_generation_shape(split, t.shape, self.plan.t_g)
                meta.update({f"{prefix}{x}.{vllm}": (shape, t.dtype) for x in range(self.num_experts)})
        return meta

    def _exchange_experts(self, local: dict, stats: TransitionStats) -> dict:
        """Every expert of this rank's stage as its vLLM TP shard k (``expert_generation_shard``), from the
        expert-parallel group: each member sends each other member exactly the slice that member's
        generation rank k needs of its own whole experts (one all-to-all per MoE layer). Bytes received per
        rank: (e - 1)/e of the stage's expert bytes / t_g; nothing else of an expert moves."""
        if not self.expert_exchange:
            return local
        group = self.ep_group
        members = dist.get_process_group_ranks(group)
        ks = [self.plan.ranks[r].gen_tp_rank for r in members]
        e, t_g = len(members), self.plan.t_g
        per_rank = self.num_experts // e
        out = {k: v for k, v in local.items() if not convert.is_expert_param(k)}
        layers = sorted({m[0] for m in map(weights.local_expert, local) if m})
        for prefix in layers:
            pieces = []  # per receiver: my experts' slices for its k, flat
            for k in ks:
                pieces.append(torch.cat([
                    vllm_layout.expert_generation_shard(split, local[f"{prefix}local_experts.{i}.{megatron}"], k,
                                                        t_g).reshape(-1)
                    for i in range(per_rank) for megatron, _, split in self.expert_weights]))
            send = torch.cat(pieces)
            recv = torch.empty_like(send) if e > 1 else send  # same shapes from every member
            if e > 1:
                dist.all_to_all_single(recv, send, group=group)
                n = _nbytes(pieces[0])
                stats.bytes_received += n * (e - 1)
                stats.bytes_sent += n * (e - 1)
            shapes = [vllm_layout.expert_generation_shape(split, local[f"{prefix}local_experts.0.{megatron}"].shape,
                                                          t_g) for megatron, _, split in self.expert_weights]
            offset = 0
            for q in range(e):
                for i in range(per_rank):
                    for (_, vllm, _), shape in zip(self.expert_weights, shapes):
                        n = math.prod(shape)
                        out[f"{prefix}{q * per_rank + i}.{vllm}"] = recv[offset:offset + n].view(shape)
                        offset += n
        return out

    # --- hybrid -----------------------------------------------------------------------------------

    def _hybrid(self, stats: TransitionStats):
        """Broadcast every member's flat shard inside the micro-DP group; returns a lazy iterator over
        this rank's vLLM-layout tensors (assembled one layer at a time)."""
        local = _local_shard(self.module)
        stats.own_shard_bytes = sum(_nbytes(v) for v in local.values())
        local = self._exchange_experts(local, stats)
        expert_bytes = sum(_nbytes(v) for k, v in local.items() if self._generation_expert(k))
        shards = {r: {} for r in self.me.micro_dp_group}  # member -> {name: view into a received buffer}
        own_sent = 0
        exchanges = []  # a micro-DP group of one (d_g = 1) exchanges nothing: no copy of the own shard
        if len(self.me.micro_dp_group) > 1:
            exchanges.append((self.me.micro_dp_group, self.split_meta, self.micro_group))
        if len(self.slice_members) > 1:
            exchanges.append((self.slice_members, self.replicated_meta, self.slice_group))
        for members, metas, group in exchanges:
            for member, meta in ((m, part) for m in members for part in _by_dtype(metas[m])):
                if member == self.rank:
                    flat = torch.cat([local[k].reshape(-1) for k, _, _ in meta])
                    stats.bytes_sent += _nbytes(flat) * (len(members) - 1)
                    own_sent += _nbytes(flat)
                else:  # on the shard's device: nccl rejects host buffers
                    flat = torch.empty(sum(torch.Size(s).numel() for _, s, _ in meta), dtype=meta[0][2],
                                       device=self.device)
                dist.broadcast(flat, src=member, group=group)
                if member != self.rank:
                    stats.bytes_received += _nbytes(flat)
                offset = 0
                for name, shape, _ in meta:
                    n = torch.Size(shape).numel()
                    shards[member][name] = flat[offset:offset + n].view(shape)
                    offset += n
        shards[self.rank] = {**local, **shards[self.rank]}  # own replicated tensors need no transfer
        # Generation shard buffers (own copy + received, the experts' generation form) plus the largest
        # layer assembled at a time.
        stats.peak_extra_bytes = own_sent + stats.bytes_received + expert_bytes
        return self._assemble(shards, stats)

    def _assemble(self, shards: dict, stats: TransitionStats):
        """vLLM shard k from the members' megatron shards (keyed by member rank), one layer at a time."""
        tr, block = self.plan.train, self.plan.tp_block
        by_pos = {tr.coords(r)[0] % block + block * tr.coords(r)[2]: s for r, s in shards.items()}
        base, transient = stats.peak_extra_bytes, 0
        for s in range(tr.p):
            members = [by_pos[j + block * s] for j in range(block)]  # consecutive TP shards of stage s
            replicated = next(m for m in members if "decoder.layers.0." + weights.NORMS[0].megatron in m)
            members = [{**replicated, **m} for m in members]  # norms from whichever member holds them
            pieces = []
            if s == 0:
                pieces.append(vllm_layout.from_megatron_shards([weights.EMBEDDING], members, self.cfg, tr.t))
            for local, index in enumerate(self.stages.layers(self.cfg.num_hidden_layers, s)):
                pre = f"decoder.layers.{local}."
                layer = [{k[len(pre):]: v for k, v in m.items() if k.startswith(pre)} for m in members]
                pieces.append(vllm_layout.layer_from_megatron_shards(layer, index, self.cfg, tr.t))
            if s == tr.p - 1:
                last = [weights.FINAL_NORM] + ([] if self.tie else [weights.LM_HEAD])
                pieces.append(vllm_layout.from_megatron_shards(last, members, self.cfg, tr.t))
            for piece in pieces:
                held = sum(_nbytes(t) for t in piece.values())
                if self.plan.tp_split > 1:  # t_g a multiple of t: cut this rank's slice of training shard k // m
                    cut = {n: t for n, t in piece.items() if not (self.expert_exchange and weights.is_expert(n))}
                    sliced = {**piece, **vllm_layout.slice_shard(cut, self.cfg, self.me.gen_tp_rank, self.plan.t_g, tr.t)}
                    held += sum(_nbytes(t) for n, t in sliced.items() if t._base is None and t is not piece[n])
                    piece = sliced
                transient = max(transient, held)
                stats.peak_extra_bytes = base + transient
                yield from piece.items()

    # --- gather-all baseline ----------------------------------------------------------------------

    def _gather_all(self, stats: TransitionStats) -> dict:
        from megatron.core import parallel_state as ps

        tr = self.plan.train
        local = _local_shard(self.module)
        stats.own_shard_bytes = sum(_nbytes(v) for v in local.values())
        tp_group, pp_group = ps.get_tensor_model_parallel_group(), ps.get_pipeline_model_parallel_group()
        stages = [None] * tr.p  # every stage's parameter list, so all ranks walk the same tensors
        dist.all_gather_object(stages, [(k, tuple(v.shape), v.dtype) for k, v in sorted(local.items())], group=pp_group)
        pp_ranks = dist.get_process_group_ranks(pp_group)
        k_gen, t_g = self.me.gen_tp_rank, self.plan.t_g
        out, kept, biggest = {}, 0, 0
        for stage, meta in enumerate(stages):
            full_stage = {}
            for name, shape, dtype in meta:
                dim = convert.tp_split_dim(name)
                if stage == tr.coords(self.rank)[2]:
                    t = local[name]
                    if tr.t > 1 and dim is not None:
                        parts = [torch.empty_like(t) for _ in range(tr.t)]
                        dist.all_gather(parts, t.contiguous(), group=tp_group)
                        stats.bytes_received += _nbytes(t) * (tr.t - 1)
                        stats.bytes_sent += _nbytes(t) * (tr.t - 1)
                        t = torch.cat(parts, dim=dim)
                    else:
                        t = t.clone()
                else:
                    full = list(shape)
                    if dim is not None:
                        full[dim] *= tr.t
                    t = torch.empty(full, dtype=dtype, device=self.device)
                if tr.p > 1:
                    dist.broadcast(t, src=pp_ranks[stage], group=pp_group)
                    if stage != tr.coords(self.rank)[2]:
                        stats.bytes_received += _nbytes(t)
                biggest = max(biggest, _nbytes(t))
                full_stage[name] = t
            at = convert.Shard(0, tr.t, stage, tr.p, vpp_size=self.stages.vpp, first_stage_layers=self.stages.first,
                               last_stage_layers=self.stages.last)
            hf = convert.megatron_to_hf(full_stage, self.cfg, at)
            for name, tensor in vllm_layout.hf_to_vllm_shard(hf, self.cfg, k_gen, t_g).items():
                out[name] = tensor.clone()  # vLLM keeps its own slice; the full tensors are dropped
                kept += _nbytes(out[name])
        stats.peak_extra_bytes = kept + biggest
        return out

    def to_generation(self) -> tuple[dict, TransitionStats]:
        """This rank's vLLM-layout generation shard {vLLM param name: tensor} and the transition's stats."""
        stats = TransitionStats(self.scheme)
        start = time.perf_counter()
        with torch.no_grad():
            shard = dict(self.stream(stats))
        stats.seconds = time.perf_counter() - start
        return shard, stats

    def stream(self, stats: TransitionStats):
        """(vLLM name, tensor) pairs of this rank's generation shard, produced as the consumer asks
        (hybrid assembles one layer at a time); ``stats`` is complete once the iterator is exhausted."""
        if self.scheme == "hybrid":
            return self._hybrid(stats)
        return iter(self._gather_all(stats).items())
