"""Per-GPU memory of each phase of a colocated PPO/GRPO step: training, transition, generation.

    python -m hybridflow.tools.memory_plan --config configs/gsm8k_qwen2.5_7b_ppo.yaml --gpu-mem 80 [key=value ...]

Computed from the experiment config and the model's HF config.json shapes; nothing is allocated. Exit
status 0 when every phase fits in --gpu-mem GiB, 1 when one does not, 2 on a usage or config error.
Assumptions (estimates meant to err on the high side, not exact accounting):
- Bytes per element from actor.megatron.dtype, critic.megatron.dtype, rollout.dtype (16-bit 2, fp32 4).
- Parameters (Qwen2/Llama): embeddings, q/k/v (with bias for qwen2 or attention_bias), o, gate/up/down,
  two RMSNorms per layer, final norm, lm_head unless tie_word_embeddings. The critic has a value head
  (hidden x 1) instead of lm_head; the reference is the actor's parameters only, same dtype and layout.
- A role with TP t and PP p on n GPUs has d = n/(t*p). params P*bytes/(t*p); grads P*4/(t*p) (megatron
  DDP reduces grads in fp32); optimizer fp32 main params + Adam m, v = 12 B/param for 16-bit dtypes (8 for
  fp32, whose params are the main copy), /(t*p), and also /d with use_distributed_optimizer.
- Context parallelism (megatron.context_parallel_size c): the ranks hold the same weights, n = d*t*c*p, and
  the distributed optimizer shards over d*c; every sequence is split over them, so s below is s/c.
- Training activations of one micro-batch (b = ppo_micro_batch_size_per_gpu rows of s = max_prompt_length +
  max_response_length tokens), Korthikanti et al. 2022, 16-bit, no recompute: s*b*h*34/t bytes per layer
  with sequence parallel, s*b*h*(10 + 24/t) without; the 5*a*s/h attention-score term is left out (flash
  attention). A MoE layer's MLP share (19 of the 34) is its routed copies instead: every token through
  top_k experts (moe_mlp_bytes_per_token); mlp_only_layers / decoder_sparse_step layers stay dense. 1F1B
  keeps min(p, micro-batches per step) in flight on the first stage, each holding layers/p layers; with
  virtual stages v, the interleaved schedule min(m*v, 2(p-1) + (v-1)p + 1) chunks of layers/(p*v). Plus
  the logits, b*s*vocab/t*(bytes + 4*2): the model's output and two fp32 vocab-sized buffers
  (megatron/role.py: the fp32 copy the cross entropy turns into its softmax in place and keeps for
  backward, and its gradient or the entropy's temporaries), counted on every stage although only the last
  holds them (conservative); the critic's value head is 1 wide. A forward-only log-prob pass
  (log_prob_micro_batch_size_per_gpu rows) holds one layer plus the logits; a role's activation peak is
  the larger of its training and forward-only passes.
- Offload (megatron.param_offload / grad_offload / optimizer_offload): an offloaded item is on the GPU
  only while its role computes; the reference follows actor.megatron.param_offload. The roles compute one
  after another, and each gives its cached blocks back when it is done (megatron/role.py empties the
  allocator's cache after every compute, the reward model worker after scoring), so training = the
  resident items of all roles + the largest (offloaded items + activations) of a single role.
- The reward model (reward_model.enable) sits on the actor's GPUs in reward_model.dtype, its parameters
  (its own config.json: a value head hidden x 1) resident in every phase; scoring a micro-batch of
  reward_model.micro_batch_size x max_length tokens holds one layer's activations.
- vLLM takes gpu_memory_utilization x gpu_mem in generation (weights + KV cache + its own activations +
  its CUDA-graph pool, which vLLM 0.32 profiles into that budget: gpu_worker.determine_available_memory;
  its start-up check wants that much free). With rollout.free_cache_engine it sleeps outside generation:
  level 1 offloads the weights to host and discards the KV cache (device_allocator/sleep_mode_backend.py,
  CuMemBackend.suspend), but the CUDA-graph pool stays on the GPU: graphs are captured into torch's graph
  pool, outside the allocator that sleeps, unless sleep_mode_offload_cudagraph is set (off by default;
  compilation/cudagraph_pool.capture_pool). That pool is counted while vLLM sleeps unless
  rollout.enforce_eager (no graphs): --cuda-graph-gib, 2 GiB by
  default, above the 0.4-1.5 GiB vLLM reports for 7B-1T models ("Estimated CUDA graph memory" in its
  start-up log gives the real figure). Without free_cache_engine vLLM holds its whole budget in every
  phase. KV-cache budget = budget - vLLM weights (P*bytes(rollout.dtype)/t_g); it must be > 0.
- Transition (hybridflow/resharding/transition.py): vLLM weights awake, the actor params (loaded back even
  when offloaded), the engine's gathered generation shard (P*bytes/t_g in the actor's dtype, own copy
  included: DESIGN's peak M/(t_g*p_g)), the largest group assembled at a time (hybrid: a decoder layer,
  the embeddings or lm_head, /t_g; gather_all: a whole pipeline stage unsharded), every other resident item.
  On GPU vLLM takes a dense model's shard in its own layout (VLLMRollout.takes_shards): no checkpoint-shaped
  staging copy (vLLM-CPU's loaders need one; reshard/staging_bytes reports it there). A MoE model's dense weights
  go through the loaders on GPU too: the largest piece (the embedding) staged whole; its experts are written in
  place from the second sync (rollout/fused_experts.py).
- What every GPU holds whatever the model does (tools/memory_fixed.py): a CUDA context per process on it and the NCCL
  buffers of each communicator its processes use. The critic on a separate pool (critic.placement = separate)
  gets its own table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys

from hybridflow.config import ConfigError
from hybridflow.plan import ParallelLayout, load_experiment, resolve
from hybridflow.config.model import vllm_lora_rank
from hybridflow.tools import memory_fixed
from hybridflow.tools.memory_roles import (BYTES, Role, activation_bytes, make_role, moe_mlp_bytes_per_token,  # noqa: F401
                                          offloaded_fraction, reward_model_role, stages_in_flight)
from hybridflow.plan.model_shape import (Shape, count_params, expert_params, kv_bytes_per_token,  # noqa: F401
                                         largest_layer_params, layer_params, lora_base_params,
                                         lora_expert_base_params, lora_expert_params, lora_params,
                                         lora_peft_params)

GiB = 2 ** 30
CUDA_GRAPH_GIB = 2.0  # a sleeping vLLM's CUDA-graph pool (see the docstring)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _roles(cfg, run, shape: Shape, P: int, P_c: int, rm_shape: Shape | None,
           teacher_shapes: dict | None = None) -> tuple[list[Role], Role | None]:
    """Every role of the run, the actor first, and the critic's (None without a critic)."""
    seq, n = run.longest_row, run.actor.world
    lora = cfg.model.lora if cfg.model.lora.rank else None
    roles = [make_role("actor", cfg.actor, P, shape, seq, n, shape.vocab, rollout_n=cfg.rollout.n, lora=lora)]
    if run.needs.reference and lora is None:  # with LoRA the reference is the actor with its adapters off
        roles.append(make_role("ref", cfg.actor, P, shape, seq, n, shape.vocab, rollout_n=cfg.rollout.n,
                               trainable=False))
    for key, t in (teacher_shapes or {}).items():  # distillation's, forward-only at the actor's layout
        name = "teacher" if key is None else f"teacher {key}"
        roles.append(make_role(name, cfg.actor, count_params(t), t, seq, n, t.vocab, rollout_n=cfg.rollout.n,
                               trainable=False))
    critic = None
    if run.critic is not None:
        critic = make_role("critic", cfg.critic, P_c, shape, seq, run.critic.world, 1, rollout_n=cfg.rollout.n)
        critic.on_actor_gpus = run.pool("critic") is run.pool("actor_rollout_ref")
        roles.append(critic)
    if cfg.reward_model.enable:
        if rm_shape is None:
            raise ValueError("reward_model.enable: the reward model's shapes are needed (rm_shape)")
        roles.append(reward_model_role(cfg.reward_model, rm_shape))
    return roles, critic


def _resident(roles: list[Role], skip=()) -> list:
    """The items the roles keep on the GPU in every phase, less ``skip`` ((role name, item) pairs)."""
    return [(f"{r.name} {k}", v) for r in roles for k, v in r.resident.items() if (r.name, k) not in skip]


def _vllm_outside_generation(ro, budget: float, graphs: float) -> tuple:
    """What vLLM holds while the roles train: its whole budget unless it sleeps, else its CUDA-graph pool."""
    if not ro.free_cache_engine:
        return ("vLLM (awake: free_cache_engine false)", budget)
    return ("vLLM (asleep: its CUDA-graph pool stays)", graphs) if graphs else ("vLLM (asleep, eager)", 0)


def _training(here: list[Role], ctx: list, vllm_idle: tuple) -> list:
    """The training phase: every resident item, plus the offloaded items and activations of the role that
    needs the most while it computes (the roles compute one after another)."""
    busy = max(here, key=lambda r: sum(r.loaded.values()) + r.activations)
    training = ctx + [vllm_idle]
    training += _resident(here) + [(f"{busy.name} {k} (loaded while it computes)", v) for k, v in busy.loaded.items()]
    training.append((f"{busy.name} activations ({busy.act_label})", busy.activations))
    return training


def _resharding_buffers(cfg, shape: Shape, P: int, t_g: int | None = None) -> list:
    """What resharding holds on top of the actor's params: the gathered shard, the largest piece assembled at a
    time and, for an expert exchange, the experts in generation form. ``t_g``: the transition's generation TP
    (default the rollout's; separate_async's training-pool leg uses gcd(t, t_g))."""
    ro, mg_a = cfg.rollout, cfg.actor.megatron
    t_g, by_a = t_g or ro.tensor_model_parallel_size, BYTES[mg_a.dtype]
    t, p = mg_a.tensor_model_parallel_size, mg_a.pipeline_model_parallel_size
    if ro.resharding == "hybrid":  # assembles one layer (or the embeddings / lm_head) of its t_g shard at a time
        layer = largest_layer_params(shape)
        piece = ("largest piece assembled (hybrid)", max(layer, shape.vocab * shape.hidden) * by_a / t_g)
    else:  # gather_all holds a whole pipeline stage unsharded while converting it
        piece = ("one stage gathered in full (gather_all)", P * by_a / p)
    if t_g % t == 0 and t_g > t:  # each shard is cut from the rank's own: only the pipeline gather's buffers
        gathered = ("resharding: pipeline-gathered training shard", P * by_a / t if p > 1 else 0)
    else:
        gathered = ("resharding: gathered generation shard", P * by_a / t_g)
    buffers = [gathered, (f"resharding: {piece[0]}", piece[1])]
    if shape.experts and t_g > 1:
        # a MoE model's dense weights reach vLLM through its loaders (VLLMRollout.takes_shards), one piece at a time
        # staged checkpoint-shaped, t_g times its shard (vllm_layout.to_checkpoint_names): at most the embedding;
        # its experts too at the first sync only (then in place: rollout/fused_experts.py)
        widest = max(shape.vocab, shape.heads * shape.head_dim, shape.moe_intermediate)
        buffers.append(("resharding: one piece staged for vLLM's loaders (MoE)", widest * shape.hidden * by_a))
    lora = cfg.model.lora
    if lora.rank and not lora.merge:  # adapter-only: the base unmerged, then one stage's whole adapters (peft format)
        whole = lora_peft_params(shape, lora.rank, lora.targets) / p
        buffers.append(("resharding: adapters gathered whole (adapter-only LoRA)", whole * by_a))
    elif lora.rank:  # LoRA: the adapted weights merged (W + BA) for vLLM, a copy of this rank's shard of them
        merged = (lora_base_params(shape, lora.targets) / (t * p)
                  + lora_expert_base_params(shape, lora.targets) / (mg_a.expert_model_parallel_size * p))
        buffers.append(("resharding: LoRA-merged weights", merged * by_a))
    if shape.experts and ParallelLayout.of("actor", mg_a, 1, "").moves_experts:
        # the expert all-to-all (transition.Resharder._exchange_experts): every expert's 1/t_g slice of the stage
        buffers.append(("resharding: experts in generation form", expert_params(shape) * by_a / (p * t_g)))
    return buffers


def _transition(cfg, shape: Shape, P: int, actor: Role, here: list[Role], ctx: list, budget: float,
                vllm_weights: float, graphs: float) -> list:
    """The weight sync: vLLM awake, the actor's params loaded back, resharding's buffers and every other
    resident item."""
    asleep = cfg.rollout.free_cache_engine
    vllm = ("vLLM weights (awake)", vllm_weights) if asleep else ("vLLM (awake, whole budget)", budget)
    transition = ctx + [vllm]
    if asleep and graphs:
        transition.append(("vLLM CUDA-graph pool", graphs))
    transition.append(("actor params (loaded for the sync)", actor.items["params"]))
    transition += _resharding_buffers(cfg, shape, P)
    return transition + _resident(here, skip={("actor", "params")})


def plan(cfg, shape: Shape, gpu_mem_gib: float, *, rm_shape: Shape | None = None,
         cuda_graph_gib: float = CUDA_GRAPH_GIB, teacher_shapes: dict | None = None) -> dict:
    """{phase: [(item, bytes)]} per GPU, plus 'params', 'kv_cache' (bytes) and 'critic_params'.
    ``rm_shape``: the reward model's shapes (required when reward_model.enable); ``teacher_shapes``: {routing key:
    Shape} of distillation's teachers."""
    run = resolve(cfg)
    P = count_params(shape)
    P_c = count_params(shape, value_head=True) if run.critic is not None else 0
    roles, critic = _roles(cfg, run, shape, P, P_c, rm_shape, teacher_shapes)
    here = [r for r in roles if r.on_actor_gpus]
    ro = cfg.rollout
    budget = ro.gpu_memory_utilization * gpu_mem_gib * GiB
    vllm_weights = P * BYTES[ro.dtype] / ro.tensor_model_parallel_size
    lora = cfg.model.lora
    if lora.rank and not lora.merge:  # vLLM's LoRA slots: one adapter at its max_lora_rank
        vllm_weights += (lora_peft_params(shape, vllm_lora_rank(lora.rank), lora.targets) * BYTES[ro.dtype]
                         / ro.tensor_model_parallel_size)
    graphs = 0.0 if ro.enforce_eager else cuda_graph_gib * GiB  # held while vLLM sleeps
    moe = shape.experts > 0
    ctx = memory_fixed.trainer_gpu(run, moe, critic is not None and critic.on_actor_gpus, cfg.reward_model.enable)

    if run.rollout_spec is not None:  # separate_async: no vLLM on the trainer's GPUs
        return _separate(cfg, shape, P, P_c, roles[0], here, ctx, memory_fixed.rollout_gpu(run), budget, vllm_weights)
    training = _training(here, ctx, _vllm_outside_generation(ro, budget, graphs))
    transition = _transition(cfg, shape, P, roles[0], here, ctx, budget, vllm_weights, graphs)
    vllm = (f"vLLM ({ro.gpu_memory_utilization:g} x {gpu_mem_gib:g} GiB: weights + KV cache)", budget)
    generation = ctx + [vllm] + _resident(here)
    out = {"training": training, "transition": transition, "generation": generation,
           "params": P, "critic_params": P_c, "kv_cache": budget - vllm_weights, "vllm_weights": vllm_weights}
    if critic is not None and not critic.on_actor_gpus:  # its own GPUs: it trains there, nothing else does
        out["critic GPUs (separate pool)"] = memory_fixed.critic_gpu(run, moe) + \
            [(f"critic {k}", v) for k, v in critic.items.items()] + \
            [(f"critic activations ({critic.act_label})", critic.activations)]
    return out


def _separate(cfg, shape: Shape, P: int, P_c: int, actor: Role, here: list[Role], ctx: list, rollout_ctx: list,
              budget: float, vllm_weights: float) -> dict:
    """separate_async: the trainer's GPUs train and push (the training-pool leg of the checkpoint engine to vLLM TP
    gcd(t, t_g), one bucket being sent); the rollout pool's GPUs hold vLLM's budget and one bucket received."""
    ro = cfg.rollout
    bucket = ("checkpoint engine: one bucket", ro.checkpoint_engine.update_weights_bucket_megabytes * 2**20)
    t_s = math.gcd(cfg.actor.megatron.tensor_model_parallel_size, ro.tensor_model_parallel_size)
    training = _training(here, ctx, ("vLLM (none: a pool of its own)", 0))
    push = ctx + [("actor params (loaded for the push)", actor.items["params"])]
    push += _resharding_buffers(cfg, shape, P, t_s) + [bucket] + _resident(here, skip={("actor", "params")})
    rollout = rollout_ctx + [(f"vLLM ({ro.gpu_memory_utilization:g} x GPU: weights + KV cache)", budget), bucket]
    return {"training": training, "weight push (trainer GPUs)": push, "rollout GPUs (separate pool)": rollout,
            "params": P, "critic_params": P_c, "kv_cache": budget - vllm_weights, "vllm_weights": vllm_weights}


def phases(result: dict) -> dict:
    return {k: v for k, v in result.items() if isinstance(v, list)}


def peaks(result: dict) -> dict:
    return {k: sum(b for _, b in rows) for k, rows in phases(result).items()}


def find_shapes(model_path: str, explicit: str | None, key: str = "model.path", flag: str = "--model-config") -> str:
    if explicit:
        if not os.path.isfile(explicit):
            raise FileNotFoundError(f"{flag}: no such file: {explicit}")
        return explicit
    name = os.path.basename(os.path.normpath(model_path)).lower() + ".json"
    tried = [os.path.join(model_path, "config.json"), os.path.join("configs", "models", name),
             os.path.join(REPO, "configs", "models", name)]
    for path in tried:
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(f"no model shapes for {key} {model_path}: none of {', '.join(tried[:2])} "
                            f"exists (pass {flag} FILE, a HF config.json)")


def render(result: dict, gpu_mem_gib: float) -> tuple[str, bool]:
    lines = [f"total params: {result['params']:,}" +
             (f" (critic {result['critic_params']:,})" if result["critic_params"] else "")]
    w = max([62] + [len(item) + 1 for rows in phases(result).values() for item, _ in rows])
    for phase, rows in phases(result).items():
        lines += ["", f"{phase}", f"  {'item':<{w}}{'GiB':>8}"]
        lines += [f"  {item:<{w}}{b / GiB:8.2f}" for item, b in rows]
        lines.append(f"  {'peak':<{w}}{sum(b for _, b in rows) / GiB:8.2f}")
    kv = result["kv_cache"]
    lines += ["", f"KV-cache budget in generation: {kv / GiB:.2f} GiB (vLLM budget - weights "
                  f"{result['vllm_weights'] / GiB:.2f} GiB)"]
    pk = peaks(result)
    worst = max(pk, key=pk.get)
    over = [f"{p} needs {b / GiB:.1f} GiB" for p, b in pk.items() if b > gpu_mem_gib * GiB]
    if kv <= 0:
        over.append("no room left for vLLM's KV cache (raise gpu_memory_utilization or rollout TP)")
    fits = not over
    detail = f"peak {pk[worst] / GiB:.1f} GiB in {worst}" if fits else "; ".join(over)
    lines.append(f"fits on {gpu_mem_gib:g} GiB: {'yes' if fits else 'no'} ({detail})")
    return "\n".join(lines), fits


def _read_shape(path: str) -> Shape:
    try:
        with open(path) as f:
            return Shape.from_hf(json.load(f))
    except (OSError, ValueError, KeyError, TypeError) as e:  # ValueError covers bad JSON
        raise ValueError(f"{path}: not a HF config.json ({type(e).__name__}: {e})") from e


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hybridflow.tools.memory_plan", description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, help="experiment YAML")
    ap.add_argument("--gpu-mem", type=float, default=80.0, help="GiB per GPU (default 80)")
    ap.add_argument("--model-config", help="HF config.json with the model's shapes (default: see docstring)")
    ap.add_argument("--reward-model-config", help="HF config.json of the reward model's shapes (default: found "
                                                  "from reward_model.path as --model-config is from model.path)")
    ap.add_argument("--cuda-graph-gib", type=float, default=CUDA_GRAPH_GIB,
                    help=f"a sleeping vLLM's CUDA-graph pool, GiB (default {CUDA_GRAPH_GIB:g}; vLLM logs its own "
                         "estimate at start-up)")
    ap.add_argument("--moe-routing-skew", type=float, default=Shape.routing_skew,
                    help="MoE: the routed tokens of the busiest expert-parallel rank over an even share (default "
                         f"{Shape.routing_skew:g}; 1: balanced routing)")
    ap.add_argument("overrides", nargs="*", help="key.sub=value config overrides")
    args = ap.parse_args(argv)
    if args.moe_routing_skew < 1:
        print("memory_plan: --moe-routing-skew must be >= 1 (the busiest rank draws at least an even share)",
              file=sys.stderr)
        return 2

    try:
        cfg = load_experiment([args.config], args.overrides)
        shapes = find_shapes(cfg.model.path, args.model_config)
        rm_shapes = (find_shapes(cfg.reward_model.path, args.reward_model_config, "reward_model.path",
                                 "--reward-model-config") if cfg.reward_model.enable else None)
    except (ConfigError, OSError) as e:
        print(f"memory_plan: {e}", file=sys.stderr)
        return 2
    try:
        shape = dataclasses.replace(_read_shape(shapes), routing_skew=args.moe_routing_skew)
        rm_shape = _read_shape(rm_shapes) if rm_shapes else None
        teachers = {key: _read_shape(find_shapes(path, None, "distillation teacher"))
                    for key, path in cfg.distillation.teachers().items()}
    except (ValueError, OSError) as e:
        print(f"memory_plan: {e}", file=sys.stderr)
        return 2
    print(f"{args.config}: {cfg.model.path} (shapes from {shapes}), {cfg.resources.n_workers} GPUs, per GPU:")
    result = plan(cfg, shape, args.gpu_mem, rm_shape=rm_shape, cuda_graph_gib=args.cuda_graph_gib,
                  teacher_shapes=teachers)
    text, fits = render(result, args.gpu_mem)
    print(text)
    return 0 if fits else 1


if __name__ == "__main__":
    sys.exit(main())
