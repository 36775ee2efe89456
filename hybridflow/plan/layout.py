"""Process layouts: a megatron role's TP/CP/PP/DP/EP/expert-TP over its pool, and the generation layout of the
rollout engines. One value object per role owns the arithmetic and its checks (as torchtitan's
``ParallelDims``); nothing else divides pool sizes."""

from __future__ import annotations

from dataclasses import dataclass

from hybridflow import families
from hybridflow.config.schema import SEED_LIMIT
from hybridflow.plan.stages import StageSplit, stage_layers_of


def context_chunks(cp: int) -> int:
    """What a micro-batch's length must divide by under context parallel size ``cp``: 2 x cp equal chunks, one
    early and one late per rank, for causal attention's balance."""
    return 2 * cp if cp > 1 else 1


def mini_batch_rows(prompts: int, n: int, dp: int) -> int:
    """One data-parallel rank's rows of a mini-batch of ``prompts`` prompts with their ``n`` responses each (verl's
    meaning of ppo_mini_batch_size), split over ``dp`` ranks."""
    return prompts * n // dp


@dataclass(frozen=True)
class ParallelLayout:
    """One megatron role (actor, critic) over ``world`` ranks of the pool named by ``pool_key``."""

    role: str
    world: int
    pool_key: str  # the config key that sizes the pool (named in errors)
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1  # expert TP (resolved: the config's None is TP, or 1 when EP > 1)
    cp: int = 1  # context parallel: ranks holding the same weights, each a part of every sequence
    vpp: int = 1  # virtual pipeline stages: each stage's layers in that many chunks
    sequence_parallel: bool = False  # activations split over the TP ranks along the sequence (TP > 1 only)
    # uneven pipeline stages: override_transformer_config.num_layers_in_first/last_pipeline_stage (plan/stages.py)
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None

    @classmethod
    def of(cls, role: str, megatron, world: int, pool_key: str) -> ParallelLayout:
        mp = megatron
        tp = mp.tensor_model_parallel_size
        return cls(role, world, pool_key, tp, mp.pipeline_model_parallel_size, mp.expert_model_parallel_size,
                   mp.expert_tensor_parallel_size or tp, mp.context_parallel_size,
                   mp.virtual_pipeline_model_parallel_size or 1, bool(mp.sequence_parallel) and tp > 1,
                   *stage_layers_of(mp.override_transformer_config))

    @property
    def stages(self) -> StageSplit:
        return StageSplit(self.pp, self.vpp, self.first_stage_layers, self.last_stage_layers)

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.cp * self.pp)

    @property
    def weight_replicas(self) -> int:
        """Ranks holding the same weights (data x context parallel): the resharding planner's d, as megatron
        numbers ranks tp-cp-dp-pp (CP inside the data-parallel dimension)."""
        return self.dp * self.cp

    @property
    def expert_dp(self) -> int:
        return self.world // (self.etp * self.ep * self.pp)

    def collective_groups(self, moe: bool) -> dict[str, int]:
        """The process groups of more than one rank a rank of this role runs collectives on (megatron's
        parallel_state): TP, CP, PP (its point-to-point), data x context (gradients, the distributed optimizer);
        with experts (``moe``) also EP, expert TP and expert data parallel (the experts' gradients)."""
        groups = {"tensor": self.tp, "context": self.cp, "pipeline": self.pp, "data": self.weight_replicas}
        if moe:
            groups.update(expert=self.ep, expert_tensor=self.etp, expert_data=self.expert_dp)
        return {name: size for name, size in groups.items() if size > 1}

    @property
    def context_chunks(self) -> int:
        """A sequence's length divides by it under context parallelism (``context_chunks``)."""
        return context_chunks(self.cp)

    @property
    def sequence_multiple(self) -> int:
        """A micro-batch's length divides by it: sequence parallel splits it over the TP ranks, CP into chunks."""
        return (self.tp if self.sequence_parallel else 1) * self.context_chunks

    @property
    def least_micro_batches(self) -> int:
        """The fewest micro-batches the role's schedule runs: with virtual pipeline stages more than the pipeline
        size (megatron's interleaved schedule needs at least that many; with exactly that many, its all-warm-up
        path at pp 2 crashed a rank here, measured), else 1."""
        return self.pp + 1 if self.vpp > 1 else 1

    def mini_batch_rows(self, prompts: int, n: int) -> int:
        """A data-parallel rank's rows of a mini-batch (``mini_batch_rows``)."""
        return mini_batch_rows(prompts, n, self.dp)

    @property
    def moves_experts(self) -> bool:
        """The transition to vLLM exchanges whole experts between ranks (EP > 1 or expert TP != TP)."""
        return self.ep > 1 or self.etp != self.tp

    def check(self) -> None:
        """The pool splits into whole TP x CP x PP groups and whole expert-TP x EP x PP groups."""
        if self.world % (self.tp * self.cp * self.pp):
            raise ValueError(f"{self.pool_key} ({self.world}) is not divisible by {self.role} tensor x context x "
                             f"pipeline parallel size ({self.tp * self.cp * self.pp})")
        if self.world % (self.etp * self.ep * self.pp):
            raise ValueError(f"{self.pool_key} ({self.world}) is not divisible by {self.role} expert tensor x expert "
                             f"x pipeline parallel size ({self.etp * self.ep * self.pp})")

    def check_model(self, model, path: str, on_gpu: bool) -> None:
        """TP divides the model's (HF config's) heads, KV groups and vocab; the pipeline stages split its layers
        as megatron would (``StageSplit.check``); EP and expert TP its experts (``check_experts``)."""
        key = f"{self.role}.megatron"
        for name in ("num_attention_heads", "num_key_value_heads", "vocab_size"):
            if getattr(model, name) % self.tp:
                raise ValueError(f"{key}.tensor_model_parallel_size ({self.tp}) does not divide the model's {name} "
                                 f"({getattr(model, name)}) in {path}")
        self.stages.check(model.num_hidden_layers, key, path)
        self.check_experts(model, path, on_gpu)

    def check_experts(self, model, path: str, on_gpu: bool) -> None:
        """EP divides the model's experts, expert TP its expert width (and is 1 for biased experts: gpt-oss). On CPU, expert TP above 1 with EP above 1
        is refused for every role: megatron's all-to-all dispatcher then all-gathers uneven token counts over
        the expert-TP group (token_dispatcher.py dispatch_postprocess), which gloo cannot do (it hangs; NCCL
        can). The actor's experts must be whole per rank (expert TP 1) wherever the transition exchanges them."""
        key = f"{self.role}.megatron"
        experts = families.num_experts(model)
        if not experts:
            return
        if experts % self.ep:
            raise ValueError(f"{key}.expert_model_parallel_size ({self.ep}) does not divide the model's {experts} "
                             f"experts in {path}")
        width = families.of(model).expert_width(model)
        if width % self.etp:
            raise ValueError(f"{key}.expert_tensor_parallel_size ({self.etp}) does not divide the model's "
                             f"expert width ({width}) in {path}")
        if self.etp > 1 and families.of(model).linear_bias:
            raise ValueError(f"{key}.expert_tensor_parallel_size ({self.etp}) must be 1 for {families.of(model).architecture}:"
                             " megatron-core builds biased experts only without expert TP (TransformerConfig asserts it)")
        if self.ep > 1 and self.etp > 1 and not on_gpu:
            raise ValueError(f"{key}.expert_tensor_parallel_size ({self.etp}) must be 1 with "
                             f"expert_model_parallel_size {self.ep} on CPU: gloo cannot all-gather the uneven token "
                             "counts megatron's MoE dispatcher sends over the expert-TP group")
        # Any device: the actor's Resharder refuses it after every worker has loaded (Resharder.__init__)
        if self.role == "actor" and self.etp > 1 and self.moves_experts:
            raise ValueError(f"{key}.expert_tensor_parallel_size ({self.etp}) must be 1 with expert_model_parallel_size "
                             f"{self.ep} and tensor_model_parallel_size {self.tp}: the transition to vLLM moves "
                             "experts whole (resharding/transition.py)")

    def check_batches(self, mini_prompts: int, batch_size: int, n: int, micro: int) -> None:
        """A mini-batch of ``mini_prompts`` prompts divides the step's ``batch_size`` and its ``x n`` sequences
        split over the data-parallel ranks, then into micro-batches of ``micro`` (1 with token budgets)."""
        if batch_size % mini_prompts:
            raise ValueError(f"{self.role}.ppo_mini_batch_size ({mini_prompts} prompts) must divide "
                             f"data.batch_size ({batch_size})")
        mini, rows = mini_prompts * n, self.mini_batch_rows(mini_prompts, n)
        if mini % self.dp or rows % micro:
            raise ValueError(f"{self.role}.ppo_mini_batch_size x rollout.n ({mini} sequences) must split into the "
                             f"{self.role}'s {self.dp} data-parallel ranks and then into micro-batches of "
                             f"{self.role}.ppo_micro_batch_size_per_gpu ({micro})")
        if self.vpp > 1 and rows < self.least_micro_batches:  # a row each at least (role_ops.least_micro_batches)
            raise ValueError(f"{self.role}.ppo_mini_batch_size x rollout.n ({mini} sequences) gives each of the "
                             f"{self.role}'s {self.dp} data-parallel ranks {rows} rows: virtual pipeline "
                             f"stages need more than pipeline_model_parallel_size ({self.pp}) micro-batches, a row "
                             "each at least")


@dataclass(frozen=True)
class GenerationLayout:
    """The rollout engines over their pool (the actor's, or the standalone rollout pool of separate_async):
    ``replicas`` engines of generation TP ``tp`` each."""

    tp: int
    world: int
    pool_key: str = "resources.n_workers"
    colocated: bool = True  # on the actor's ranks: each generation shard is cut from what its training rank holds

    @property
    def replicas(self) -> int:
        return self.world // self.tp

    def check(self, actor_tp: int, seed: int, rollout_batch: int) -> None:
        """t_g divides or is a multiple of the actor's TP (each generation shard is then a slice of what its
        training rank holds), splits the pool, and each replica (sampling with seed + r) gets whole rows."""
        if self.colocated and actor_tp % self.tp and self.tp % actor_tp:
            raise ValueError(f"rollout.tensor_model_parallel_size ({self.tp}) must divide "
                             f"actor.megatron.tensor_model_parallel_size ({actor_tp}) or be a multiple of it")
        if self.world % self.tp:
            raise ValueError(f"{self.pool_key} ({self.world}) is not divisible by "
                             f"rollout.tensor_model_parallel_size ({self.tp})")
        if seed + self.replicas - 1 >= SEED_LIMIT:  # generation replica r samples with seed + r
            raise ValueError(f"trainer.seed ({seed}) + {self.replicas - 1} (the last generation replica's "
                             "offset) must stay below 2**32 (vLLM seeds numpy with it)")
        if rollout_batch % self.replicas:
            raise ValueError(f"data.batch_size x rollout.n ({rollout_batch}) must divide across the "
                             f"{self.replicas} generation replicas ({self.pool_key} / "
                             "rollout.tensor_model_parallel_size)")
