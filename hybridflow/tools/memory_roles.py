"""What each role holds on a GPU, for the memory plan (tools/memory_plan.py): its parameters, gradients and optimizer
state split by its layout, what it offloads, and its activations at its largest micro-batch (forward-only roles:
the reference, the reward model)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import SimpleNamespace

from hybridflow.plan import ParallelLayout
from hybridflow.plan.layout import mini_batch_rows
from hybridflow.plan.model_shape import (Shape, count_params, expert_params, lora_expert_params, lora_params,
                                        non_matrix_params)

BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass
class Role:
    name: str
    items: dict  # item -> bytes per GPU
    offloaded: set
    activations: float
    act_label: str
    on_actor_gpus: bool = True
    resident: dict = field(init=False)
    loaded: dict = field(init=False)  # on the GPU only while this role computes

    def __post_init__(self):
        self.resident = {k: v for k, v in self.items.items() if k not in self.offloaded}
        self.loaded = {k: v for k, v in self.items.items() if k in self.offloaded}


# Korthikanti et al.'s 34 bytes x hidden per token and layer: 19 of them are the MLP's (a 4h GeLU MLP).
_KORTHIKANTI, _MLP_SHARE = 34, 19


def moe_mlp_bytes_per_token(s: Shape) -> float:
    """A sparse layer's MLP activations per token (16-bit), in place of the dense MLP's 19 h: each token goes
    through top_k experts, and each copy keeps its dispatched input (h), the SwiGLU fc1 output (2f), the
    activation and its product (f each, fc2's input) and the expert output the combine weights (h):
    top_k x (4h + 8f) bytes; plus the fp32 router logits (4 x experts) and a shared expert's SwiGLU
    (2h + 8 f_shared). The routed part scaled by ``routing_skew`` (--moe-routing-skew): a rank whose experts draw
    more than their share of the tokens (load balancing is off by default) holds proportionally more."""
    h, f, fs = s.hidden, s.moe_intermediate, s.shared_intermediate
    return s.routing_skew * s.top_k * (4 * h + 8 * f) + 4 * s.experts + (2 * h + 8 * fs if fs else 0)


def activation_bytes(s: Shape, b: int, seq: int, mg, out_width: int, backward: bool, in_flight: float = 1) -> float:
    t, p = mg.tensor_model_parallel_size, mg.pipeline_model_parallel_size
    # context parallel: each rank computes (and holds the logits of) 1/cp of every sequence; TE's p2p ring holds
    # one other rank's K/V chunk at a time on top, left out like the attention scores
    seq = seq / mg.context_parallel_size
    sp = mg.sequence_parallel or t == 1
    dense = seq * b * s.hidden * (_KORTHIKANTI / t if sp else 10 + 24 / t)
    # megatron requires sequence parallel for MoE at TP > 1: each TP rank routes its 1/t of the tokens
    sparse = dense - seq * b * (_MLP_SHARE * s.hidden - moe_mlp_bytes_per_token(s)) / t
    by = BYTES[mg.dtype]
    logits = b * seq * (out_width / t if out_width > 1 else 1) * (by + 8)
    if not backward:  # one layer at a time: the larger kind
        return max([dense] * (s.layers > s.moe_layers) + [sparse] * bool(s.moe_layers)) + logits
    stage = math.ceil(s.layers / p)  # a stage's layers; the sparse ones first (the stage holding the most)
    n_sparse = min(stage, s.moe_layers)
    return (sparse * n_sparse + dense * (stage - n_sparse)) * in_flight + logits


def stages_in_flight(mg, micro_batches: int) -> float:
    """The first pipeline stage's micro-batches whose activations are held at once, in whole stages: 1F1B's pp;
    megatron's interleaved schedule (virtual stages v) warms up 2(pp - 1) + (v - 1) pp chunk forwards before its
    first backward (schedules.get_pp_rank_microbatches), each chunk 1/v of the stage."""
    p, v = mg.pipeline_model_parallel_size, mg.virtual_pipeline_model_parallel_size or 1
    if v == 1:
        return min(p, micro_batches)
    return min(micro_batches * v, 2 * (p - 1) + (v - 1) * p + 1) / v


def make_role(name, cfg_role, P: int, shape: Shape, seq: int, n: int, out_width: int, *, rollout_n: int,
              trainable=True, lora=None) -> Role:
    """Per-GPU bytes of a megatron role. Dense parameters are split over TP x PP and their optimizer state
    over DP; routed experts over expert TP x EP x PP and theirs over the expert-data-parallel ranks
    (n / (etp x ep x pp)), as megatron's distributed optimizer shards each kind in its own group. ``lora``
    (model.lora with rank > 0): the adapters are added to the params and alone have gradients and optimizer state.
    ``rollout_n``: samples per prompt; a mini-batch of ``ppo_mini_batch_size`` prompts trains that many rows each."""
    mg = cfg_role.megatron
    layout = ParallelLayout.of(name, mg, n, "")
    # the groups each kind is split over; uneven pipeline stages (plan/stages.py): the most loaded stage's share
    stages = layout.stages
    heaviest = max(stages.counts(shape.layers)) * stages.pp / shape.layers if stages.uneven else 1.0
    tp, etp = layout.tp * layout.pp / heaviest, layout.etp * layout.ep * layout.pp / heaviest
    # the distributed optimizer shards over the data x context ranks (megatron's intra_dp_cp group)
    d, ed, by = max(1, layout.weight_replicas), max(1, layout.expert_dp), BYTES[mg.dtype]
    experts = expert_params(shape)
    per_gpu = (P - experts) / tp + experts / etp  # parameters on one GPU
    items = {"params": per_gpu * by}
    off = {"params"} if mg.param_offload else set()
    if not trainable:  # the reference: forward-only log-probs
        act = activation_bytes(shape, cfg_role.log_prob_micro_batch_size_per_gpu, seq, mg, out_width, False)
        return Role(name, items, off, act, f"forward {cfg_role.log_prob_micro_batch_size_per_gpu} x {seq} tokens")
    if lora is not None:  # the base frozen: gradients and optimizer state for the adapters only
        targets = lora.targets
        dense = lora_params(shape, lora.rank, targets, layout.tp) / layout.pp * heaviest  # per GPU
        experts = lora_expert_params(shape, lora.rank, targets)  # whole model, split over EP x PP (expert TP 1)
        per_gpu = dense + experts / etp
        items["params"] += per_gpu * by
        P = dense * tp + experts
    items["grads"] = per_gpu * 4
    sharded = ((P - experts) / tp / d + experts / etp / ed) if mg.use_distributed_optimizer else per_gpu
    items["optimizer"] = sharded * ((4 if by < 4 else 0) + 8 * (1 - offloaded_fraction(cfg_role.optim)))
    if cfg_role.optim.optimizer == "muon":  # the matrices' state is one momentum buffer (4 B), not Adam's m and v
        adam = 0 if lora is not None else non_matrix_params(shape, value_head=out_width == 1) / tp
        items["optimizer"] -= 4 * max(0.0, per_gpu - adam)
    off |= {k for k, flag in (("grads", mg.grad_offload), ("optimizer", mg.optimizer_offload)) if flag}
    b, fb = cfg_role.ppo_micro_batch_size_per_gpu, cfg_role.log_prob_micro_batch_size_per_gpu
    rows = mini_batch_rows(cfg_role.ppo_mini_batch_size, rollout_n, max(1, layout.dp))  # as role_ops trains them
    in_flight = stages_in_flight(mg, max(1, rows // b))
    train = activation_bytes(shape, b, seq, mg, out_width, True, in_flight)
    fwd = activation_bytes(shape, fb, seq, mg, out_width, False)
    label = f"backward {b} x {seq} tokens" if train >= fwd else f"forward {fb} x {seq} tokens"
    return Role(name, items, off, max(train, fwd), label)


def offloaded_fraction(optim) -> float:
    """The share of Adam's state (exp_avg, exp_avg_sq: 8 bytes a parameter) megatron's HybridDeviceOptimizer keeps
    and steps in host memory (optim.override_optimizer_config's optimizer_cpu_offload, optimizer_offload_fraction;
    megatron/optimizer_config.py); the fp32 main parameters of a 16-bit model stay on the GPU."""
    o = optim.override_optimizer_config
    return float(o.get("optimizer_offload_fraction", 0.0)) if o.get("optimizer_cpu_offload") else 0.0


def reward_model_role(rm, shape: Shape) -> Role:
    """The reward model: a HF model (one rank, no offload) scoring micro-batches forward-only."""
    hf = SimpleNamespace(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, context_parallel_size=1,
                         sequence_parallel=False, dtype=rm.dtype)
    act = activation_bytes(shape, rm.micro_batch_size, rm.max_length, hf, 1, False)
    return Role("reward model", {"params": count_params(shape, value_head=True) * BYTES[rm.dtype]}, set(), act,
                f"forward {rm.micro_batch_size} x {rm.max_length} tokens")
