"""The experiment config's actor and critic sections: their megatron layout, optimizer and policy loss."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from hybridflow.config.checks import check_number, check_numbers, check_sizes


# Adam moves every weight by about lr per step whatever the gradient's scale, and a transformer's weights are
# O(0.01-1): an lr above 1 replaces the model in one step (RL fine-tuning uses 1e-7 .. 1e-4; the tiny
# quickstart's warm start 1e-3).
MAX_LR = 1.0


@dataclass
class RouterReplay:
    """MoE routing replay (verl 0.9.1's megatron.router_replay; megatron/routing.py): ``R3`` trains with the
    experts vLLM routed each sampled token to (rollout.enable_rollout_routing_replay returns them), ``R2`` with
    those the old-log-prob forward chose; the routers' gates still give the probabilities (and gradients)."""

    mode: Literal["disabled", "R2", "R3"] = "disabled"


@dataclass
class Megatron:
    """A megatron-core role's layout, precision and memory phases (verl's actor.megatron.* names)."""

    tensor_model_parallel_size: int = 1  # TP: splits heads, MLP and vocab across ranks
    pipeline_model_parallel_size: int = 1  # PP: splits the layers into consecutive stages
    # CP: splits each sequence over ranks (megatron's load-balanced chunks; attention gathers K/V across them)
    # that hold the same weights, like data-parallel ranks: the pool divides by tp x cp x pp
    context_parallel_size: int = 1
    # VPP: each pipeline stage holds its layers in this many chunks (megatron's interleaved schedule: a smaller
    # bubble); null or 1 = none. Each stage's layers must divide by vpp; needs pp > 1. Stages split the layers
    # evenly unless override_transformer_config sets num_layers_in_first/last_pipeline_stage (plan/stages.py)
    virtual_pipeline_model_parallel_size: int | None = None
    sequence_parallel: bool = True  # shard activations along the sequence inside TP regions (only when TP > 1)
    # MoE models: EP splits the experts over ranks of the data-parallel dimension (world % (etp*ep*pp) == 0);
    # each expert's weights are split over expert_tensor_parallel_size ranks (None: 1 when EP > 1, as verl's
    # MoE examples set it, and the only expert split the transition reshards; else the TP size, megatron's
    # default). Dense models ignore both.
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None
    use_distributed_optimizer: bool = True  # shard optimizer state across data-parallel ranks
    # Parameter and activation dtype; the optimizer keeps fp32 main params and grads for 16-bit types.
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    # Move to host memory while the role is idle (e.g. during generation) and back before it computes.
    # The actor's param_offload also covers the reference model, which lives in the actor's processes.
    param_offload: bool = False
    grad_offload: bool = False
    optimizer_offload: bool = False
    # Fields of megatron-core's TransformerConfig set as given (verl's override_transformer_config), e.g.
    # recompute_granularity: full | selective, recompute_method: uniform | block, recompute_num_layers,
    # recompute_modules; a name TransformerConfig lacks is an error before start.
    override_transformer_config: dict = field(default_factory=dict)
    router_replay: RouterReplay = field(default_factory=RouterReplay)  # the actor's (and its reference's)
    # Start from a megatron dist checkpoint at any layout (verl's converter_hf_to_mcore output, or a Megatron-LM save
    # folder) instead of converting model.path's HF weights, which still give the config and tokenizer (verl's keys)
    use_dist_checkpointing: bool = False
    dist_checkpointing_path: str | None = None
    dist_checkpointing_prefix: str = ""  # what the checkpoint's keys start with (megatron's sharded_state_dict prefix)

    def validate(self):
        if self.tensor_model_parallel_size < 1 or self.pipeline_model_parallel_size < 1:
            raise ValueError("tensor_model_parallel_size and pipeline_model_parallel_size must be >= 1")
        check_sizes(self, "context_parallel_size", "virtual_pipeline_model_parallel_size")
        if (self.virtual_pipeline_model_parallel_size or 1) > 1 and self.pipeline_model_parallel_size < 2:
            raise ValueError(f"virtual_pipeline_model_parallel_size {self.virtual_pipeline_model_parallel_size} needs "
                             "pipeline_model_parallel_size > 1 (virtual stages interleave the pipeline's stages)")
        if self.use_dist_checkpointing and not self.dist_checkpointing_path:
            raise ValueError("use_dist_checkpointing needs dist_checkpointing_path (the megatron checkpoint folder)")
        check_sizes(self, "expert_model_parallel_size", "expert_tensor_parallel_size")

    def resolve_defaults(self) -> None:
        if self.expert_tensor_parallel_size is None and self.expert_model_parallel_size > 1:
            # verl 0.9.1 hands None to megatron (expert TP = TP); its MoE examples all set 1 explicitly
            self.expert_tensor_parallel_size = 1


@dataclass
class Optim:
    """Adam or Muon and the learning-rate schedule (verl's optim.* names and meanings, megatron's scheduler)."""

    # muon: megatron-core's TensorParallelMuon on the 2D weights, Adam (betas, weight_decay) on embeddings, the output
    # layer, norms and biases (megatron/optimizer_config.py); the muon_* keys below are verl 0.9.1's
    optimizer: Literal["adam", "muon"] = "adam"
    lr: float = 1e-6  # in (0, MAX_LR]
    weight_decay: float = 0.01
    clip_grad: float = 1.0  # global grad-norm clip (0: none)
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # Adam's
    # Linear warmup from lr_warmup_init to lr over lr_warmup_steps PPO steps (<= 0: take
    # lr_warmup_steps_ratio x the decay steps instead); the schedule advances once per PPO step, as verl's.
    lr_warmup_steps: int = -1
    lr_warmup_steps_ratio: float = 0.0
    lr_warmup_init: float = 0.0
    # After warmup: constant | linear | cosine | inverse-square-root decay towards the floor, over
    # lr_decay_steps PPO steps (None: the whole run).
    lr_decay_style: Literal["constant", "linear", "cosine", "inverse-square-root"] = "constant"
    lr_decay_steps: int | None = None
    min_lr: float = 0.0  # the decay's floor
    min_lr_ratio: float | None = None  # the floor as a fraction of lr (verl's FSDP name); replaces min_lr when set
    # Fields of megatron-core's OptimizerConfig set as given (verl's override_optimizer_config), e.g. the distributed
    # optimizer's CPU offload on GPUs: optimizer_cpu_offload, optimizer_offload_fraction (of the Adam state, to host),
    # overlap_cpu_optimizer_d2h_h2d; use_precision_aware_optimizer (TE's FusedAdam). Checked before start.
    override_optimizer_config: dict = field(default_factory=dict)
    # Muon (optimizer=muon; verl 0.9.1's names, megatron-core 0.16.1's OptimizerConfig.muon_* fields)
    muon_momentum: float = 0.95  # the momentum EMA of the gradients Muon orthogonalizes
    muon_nesterov: bool = False
    muon_split_qkv: bool = True  # Q, K and V orthogonalized apart (per query group), not as one fused matrix
    muon_scale_mode: Literal["spectral", "unit_rms_norm", "shape_scaling"] = "spectral"
    # megatron-core 0.16.1 always iterates with the quintic coefficients (TensorParallelMuon's default)
    muon_coefficient_type: Literal["quintic"] = "quintic"
    muon_num_ns_steps: int = 5  # Newton-Schulz iterations
    # a tensor-parallel weight: each rank's shard orthogonalized alone (blockwise: another TP size gives another
    # update), or the whole matrix (duplicated on every rank; distributed: the iteration's products split)
    muon_tp_mode: Literal["blockwise", "duplicated", "distributed"] = "blockwise"
    # torch's float32 matmul precision inside the iteration; on CPU "medium"/"high" may let oneDNN use bf16 (CPUs
    # with AVX512-BF16/AMX), so the update differs by CPU: the layout tests use "highest"
    muon_fp32_matmul_prec: Literal["highest", "high", "medium"] = "medium"
    muon_extra_scale_factor: float = 1.0  # the update x this (lr x this is Muon's step)
    # the extra scale factor from betas[0]: sqrt((1 - beta1) / (1 + beta1)), AdamW's update RMS (verl's convenience)
    muon_match_adamw_update_rms: bool = False
    muon_scalar_optimizer: Literal["adam"] = "adam"  # megatron-core reads no other (verl: the same)

    def validate(self):
        check_numbers(self, lr=dict(gt=0, le=MAX_LR), weight_decay=dict(ge=0), clip_grad=dict(ge=0),
                       lr_warmup_steps_ratio=dict(ge=0, le=1), lr_warmup_init=dict(ge=0), min_lr=dict(ge=0),
                       min_lr_ratio=dict(ge=0, le=1), muon_momentum=dict(ge=0, lt=1), muon_num_ns_steps=dict(ge=1),
                       muon_extra_scale_factor=dict(gt=0))
        if self.muon_match_adamw_update_rms and self.muon_extra_scale_factor != 1.0:
            raise ValueError("muon_match_adamw_update_rms derives muon_extra_scale_factor from betas[0]; set one of "
                             f"them, not both (muon_extra_scale_factor={self.muon_extra_scale_factor})")
        check_sizes(self, "lr_decay_steps")
        if len(self.betas) != 2:
            raise ValueError(f"betas needs 2 values, got {self.betas}")
        for i, beta in enumerate(self.betas):
            check_number(f"betas[{i}]", beta, ge=0, lt=1)


@dataclass
class PolicyLoss:
    """verl 0.9.1's ``actor.policy_loss`` (workers/config/actor.py PolicyLossConfig), same names and defaults."""

    loss_mode: str = "vanilla"  # a name in algorithms.registry.POLICY_LOSSES (verl's: vanilla, gspo, sapo, gpg, ...)
    clip_cov_ratio: float = 0.0002  # clip_cov: share of tokens whose gradient is cut
    clip_cov_lb: float = 1.0  # clip_cov: covariance band of the tokens eligible for the cut
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002  # kl_cov: share of tokens given the KL penalty
    ppo_kl_coef: float = 0.1  # kl_cov: that penalty's coefficient
    dro_beta: float | None = None  # dro: quadratic log-ratio penalty (required for loss_mode dro)

    def validate(self):
        check_numbers(self, clip_cov_ratio=dict(ge=0, le=1), kl_cov_ratio=dict(ge=0, le=1), ppo_kl_coef=dict(ge=0),
                       dro_beta=dict(gt=0))
        if self.loss_mode == "dro" and self.dro_beta is None:
            raise ValueError("actor.policy_loss.dro_beta must be set (> 0) for loss_mode 'dro'")
        # clip_cov cuts tokens whose covariance lies strictly between lb and ub (verl's compute_policy_loss_clip_cov):
        # lb >= ub selects none, and the loss is vanilla PPO without a word
        check_numbers(self, clip_cov_lb={}, clip_cov_ub={})
        if self.clip_cov_lb >= self.clip_cov_ub:
            raise ValueError(f"actor.policy_loss.clip_cov_lb ({self.clip_cov_lb}) must be below clip_cov_ub "
                             f"({self.clip_cov_ub}): clip_cov cuts tokens whose covariance lies between them")
        for mode, key in (("clip_cov", "clip_cov_ratio"), ("kl_cov", "kl_cov_ratio")):
            if self.loss_mode == mode and not getattr(self, key) > 0:
                raise ValueError(f"actor.policy_loss.{key} must be > 0 for loss_mode '{mode}'")


@dataclass
class Actor:
    megatron: Megatron = field(default_factory=Megatron)
    optim: Optim = field(default_factory=Optim)
    # Prompts per optimizer step, all data-parallel ranks together: x rollout.n sequences (verl's meaning).
    ppo_mini_batch_size: int = 16
    ppo_micro_batch_size_per_gpu: int = 8  # sequences per forward/backward on each rank (gradient accumulation)
    ppo_epochs: int = 1  # passes over each rollout batch
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0  # dual-clip bound for negative advantages (> 1)
    policy_loss: PolicyLoss = field(default_factory=PolicyLoss)
    tau_pos: float = 1.0  # sapo: the soft gate's temperature for positive advantages (verl's actor.tau_pos)
    tau_neg: float = 1.05  # sapo: ... for negative advantages
    entropy_coeff: float = 0.0  # entropy bonus: loss -= entropy_coeff x entropy, aggregated like the policy loss
    # The entropy over so many response tokens at a time (the same values; a smaller peak of the fp32 softmax
    # over the vocabulary shard, as verl's vocab_parallel_entropy_with_chunking)
    entropy_from_logits_with_chunking: bool = False
    entropy_from_logits_chunk_size: int = 2048
    loss_agg_mode: str = "token-mean"  # token-mean | token-sum | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm
    loss_scale_factor: float | None = None  # seq-mean-token-sum-norm divisor (None: the padded response length)
    use_kl_loss: bool = False  # KL to the reference as a loss term (GRPO style) instead of in the reward
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"  # k1/kl, abs, k2/mse, k3/low_var_kl, each with optional '+'
    log_prob_micro_batch_size_per_gpu: int = 16  # sequences per forward on each rank when computing log-probs
    # the reference model's log-prob forward (None: log_prob_micro_batch_size_per_gpu)
    ref_log_prob_micro_batch_size_per_gpu: int | None = None
    # Dynamic batch size: micro-batches formed by a token budget per rank (rows packed end to end, no
    # padding computed) instead of a row count; the *_micro_batch_size_per_gpu keys are then unused.
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 16384  # tokens per update micro-batch on a rank
    log_prob_use_dynamic_bsz: bool | None = None  # log-prob/reference forwards (None: use_dynamic_bsz)
    log_prob_max_token_len_per_gpu: int | None = None  # (None: ppo_max_token_len_per_gpu)
    # The reference model's own offload while idle (None: as megatron.param_offload)
    ref_param_offload: bool | None = None
    # When the update is exactly on-policy (one epoch, the whole rollout in one mini-batch, no KL in the
    # reward), the old log-probs equal the update's own: use those (detached) and skip the separate
    # forward, as TRL does with num_iterations=1. verl 0.9.1 always recomputes them. False: recompute.
    reuse_on_policy_log_prob: bool = True

    # The defaults that are another key's value: the one place each is worked out (resolve_defaults writes them in).
    @property
    def log_prob_dynamic(self) -> bool:
        return self.use_dynamic_bsz if self.log_prob_use_dynamic_bsz is None else self.log_prob_use_dynamic_bsz

    @property
    def log_prob_token_key(self) -> str:
        """The key holding the log-prob forwards' token budget."""
        return "log_prob_max_token_len_per_gpu" if self.log_prob_max_token_len_per_gpu else "ppo_max_token_len_per_gpu"

    @property
    def ref_offloads_params(self) -> bool:
        return self.megatron.param_offload if self.ref_param_offload is None else self.ref_param_offload

    @property
    def entropy_chunk(self) -> int | None:
        """Response tokens per entropy computation (None: all at once)."""
        return self.entropy_from_logits_chunk_size if self.entropy_from_logits_with_chunking else None

    def resolve_defaults(self) -> None:
        self.log_prob_use_dynamic_bsz = self.log_prob_dynamic
        self.log_prob_max_token_len_per_gpu = getattr(self, self.log_prob_token_key)
        self.ref_param_offload = self.ref_offloads_params

    def validate(self):
        check_sizes(self, "ppo_mini_batch_size", "ppo_micro_batch_size_per_gpu", "ppo_epochs",
                     "log_prob_micro_batch_size_per_gpu", "ref_log_prob_micro_batch_size_per_gpu",
                     "ppo_max_token_len_per_gpu", "log_prob_max_token_len_per_gpu", "entropy_from_logits_chunk_size")
        # tau_pos/tau_neg: sapo's gate sigmoid(tau (r - 1)) 4 / tau (verl's compute_policy_loss_sapo) is a
        # temperature: 0 divides by zero, and a negative one gives |tau|'s gradient under another name
        check_numbers(self, clip_ratio_low=dict(ge=0), clip_ratio_high=dict(ge=0), clip_ratio_c=dict(gt=1),
                       kl_loss_coef=dict(ge=0), loss_scale_factor=dict(gt=0), entropy_coeff={},
                       tau_pos=dict(gt=0), tau_neg=dict(gt=0))


@dataclass
class Critic:
    enable: bool | None = None  # None: on when the advantage estimator needs values (gae)
    placement: Literal["colocated", "separate"] = "colocated"  # share the actor's pool, or a pool of its own
    megatron: Megatron = field(default_factory=Megatron)
    optim: Optim = field(default_factory=lambda: Optim(lr=1e-5))
    ppo_mini_batch_size: int | None = None  # prompts per optimizer step (x rollout.n sequences); None: the actor's
    ppo_micro_batch_size_per_gpu: int = 8
    ppo_epochs: int | None = None  # None: the actor's
    cliprange_value: float = 0.5
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: float | None = None  # seq-mean-token-sum-norm divisor (None: the padded response length)
    log_prob_micro_batch_size_per_gpu: int = 16
    use_dynamic_bsz: bool | None = None  # None: the actor's
    ppo_max_token_len_per_gpu: int = 32768
    forward_max_token_len_per_gpu: int | None = None  # value forwards (None: ppo_max_token_len_per_gpu)

    @property
    def forward_token_key(self) -> str:
        """The key holding the value forwards' token budget (the one place its default is worked out)."""
        return "forward_max_token_len_per_gpu" if self.forward_max_token_len_per_gpu else "ppo_max_token_len_per_gpu"

    def resolve_defaults(self) -> None:
        self.forward_max_token_len_per_gpu = getattr(self, self.forward_token_key)

    def validate(self):
        check_sizes(self, "ppo_mini_batch_size", "ppo_micro_batch_size_per_gpu", "ppo_epochs",
                     "log_prob_micro_batch_size_per_gpu", "ppo_max_token_len_per_gpu", "forward_max_token_len_per_gpu")
        check_numbers(self, cliprange_value=dict(ge=0), loss_scale_factor=dict(gt=0))
