"""A model's shapes (from its HF config) and what they cost: parameters per layer and in all, the KV cache per
token, one step's batch in host memory. Torch-free; the memory-plan tool and preflight count with these."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

from hybridflow import families


@dataclass(frozen=True)
class Shape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    qkv_bias: bool
    experts: int = 0  # MoE: routed experts per sparse layer, each this wide
    moe_intermediate: int = 0
    shared_intermediate: int = 0  # the shared expert's width: Qwen2-MoE's, GLM-4.5's (n_shared_experts of them)
    qk_norm: bool = False  # Qwen3's per-head q_norm/k_norm
    top_k: int = 0  # MoE: experts each token goes through
    sparse_layers: int | None = None  # MoE layers (None: every layer); the rest dense (mlp_only_layers)
    # MoE, an assumption rather than a shape: the routed tokens the busiest expert-parallel rank computes, over an
    # even share (1.0: balanced routing). RL runs without a load-balancing loss (verl's moe_router_load_balancing_type
    # none), where a few hot experts draw several times their share: the plan assumes twice (--moe-routing-skew).
    routing_skew: float = 2.0
    shared_gate: bool = False  # Qwen2-MoE's sigmoid gate on it
    expert_bias: bool = False  # GLM-4.5's / DeepSeek-V3's router bias, one float32 per expert (counted as a parameter)
    linear_bias: bool = False  # gpt-oss: a bias on the attention output, the router and every expert projection
    sinks: bool = False  # gpt-oss: one sink logit per attention head
    # DeepSeek-V3's multi-latent attention (kv_lora 0: none): latent ranks (q_lora 0: one q projection per head) and
    # each head's parts (q and k: nope + rope, v: v_head)
    q_lora: int = 0
    kv_lora: int = 0
    qk_nope: int = 0
    qk_rope: int = 0
    v_head: int = 0

    @classmethod
    def from_hf(cls, c: dict) -> Shape:
        h, a = c["hidden_size"], c["num_attention_heads"]
        hf = SimpleNamespace(**{"model_type": None, **c})
        experts = families.num_experts(hf)
        # which layers are sparse: Qwen-MoE's decoder_sparse_step and mlp_only_layers, as the model builder reads them
        sparse = sum(families.moe_layer_pattern(hf))
        return cls(h, c["intermediate_size"], c["num_hidden_layers"], a, c.get("num_key_value_heads", a),
                   c.get("head_dim") or h // a, c["vocab_size"], bool(c.get("tie_word_embeddings", False)),
                   families.qkv_bias(hf), experts, families.of(hf).expert_width(hf) if experts else 0,
                   families.shared_expert_width(hf), families.qk_layernorm(hf),
                   c.get("num_experts_per_tok") or 0, sparse if experts else None,
                   shared_gate=families.of(hf).shared_expert_gate, expert_bias=families.of(hf).expert_bias,
                   linear_bias=families.of(hf).linear_bias, sinks=families.of(hf).attention_sinks,
                   **(_latent_shape(c) if families.of(hf).multi_latent else {}))

    @property
    def moe_layers(self) -> int:
        if not self.experts:
            return 0
        return self.layers if self.sparse_layers is None else self.sparse_layers


def _latent_shape(c: dict) -> dict:
    return dict(q_lora=c.get("q_lora_rank") or 0, kv_lora=c["kv_lora_rank"], qk_nope=c["qk_nope_head_dim"],
                qk_rope=c["qk_rope_head_dim"], v_head=c["v_head_dim"])


def attention_params(s: Shape) -> int:
    """One layer's attention (its norms inside it: MLA's latent norms, Qwen3's q/k norms)."""
    if s.kv_lora:  # q (down, norm, up per head, or one projection), kv (down to latent + rope, norm, up), output
        q_head = s.heads * (s.qk_nope + s.qk_rope)
        q = s.q_lora * (s.hidden + 1 + q_head) if s.q_lora else s.hidden * q_head
        kv = s.hidden * (s.kv_lora + s.qk_rope) + s.kv_lora + s.kv_lora * s.heads * (s.qk_nope + s.v_head)
        return q + kv + s.heads * s.v_head * s.hidden
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    attn = s.hidden * (q + 2 * kv) + (q + 2 * kv) * s.qkv_bias + q * s.hidden + s.hidden * s.linear_bias
    return attn + s.heads * s.sinks + 2 * s.head_dim * s.qk_norm


def layer_params(s: Shape, sparse: bool | None = None) -> int:
    """One decoder layer's dense parameters (its routed experts: expert_params); ``sparse``: a MoE layer
    (None: whether the model has any)."""
    sparse = bool(s.moe_layers) if sparse is None else sparse
    attn = attention_params(s)
    if sparse:  # router (and its expert bias or its bias), shared expert (and its gate), no dense MLP
        mlp = (s.experts * (s.hidden + s.expert_bias + s.linear_bias) + 3 * s.hidden * s.shared_intermediate
               + s.hidden * s.shared_gate)
    else:
        mlp = 3 * s.hidden * s.intermediate  # gate/up/down
    return attn + mlp + 2 * s.hidden  # + two RMSNorms


def decoder_params(s: Shape) -> int:
    """Every decoder layer's dense parameters: the sparse layers' and the dense ones' (mlp_only_layers)."""
    sparse = s.moe_layers
    return sparse * layer_params(s, True) + (s.layers - sparse) * layer_params(s, False)


def expert_params(s: Shape) -> int:
    """The routed experts of the whole model (sharded over expert_model_parallel x expert TP, not TP x DP)."""
    return s.moe_layers * s.experts * one_expert_params(s)


def one_expert_params(s: Shape) -> int:
    """One routed expert: [gate; up] and down (and gpt-oss's biases on both)."""
    return 3 * s.hidden * s.moe_intermediate + (2 * s.moe_intermediate + s.hidden) * s.linear_bias


def lora_params(s: Shape, rank: int, targets, t: int = 1) -> float:
    """LoRA adapters' parameters on one of ``t`` TP ranks for the dense linears of the whole model (megatron/lora.py:
    a column-parallel linear's A [r, in] whole and B [out/t, r] split, a row-parallel one's A [r, in/t] split and B
    [out, r] whole), a MoE layer's shared expert included; the routed experts': ``lora_expert_params``. ``targets``:
    megatron's linear names (a wildcard pattern counts as its last name on every layer: an upper bound)."""
    return _per_adapted_linear(s, targets, lambda fan_in, fan_out, column, _: rank * (
        fan_in + fan_out / t if column else fan_in / t + fan_out))


def lora_peft_params(s: Shape, rank: int, targets) -> float:
    """The same adapters in peft's format, whole (lora_peft.to_peft: one A per HF projection, the fused q/k/v's three
    and gate/up's two equal): what an adapter-only sync hands vLLM's LoRA, whose slots hold them so."""
    return _per_adapted_linear(s, targets, lambda fan_in, fan_out, _, parts: rank * (fan_in * parts + fan_out))


def lora_base_params(s: Shape, targets) -> float:
    """The weights of the dense linears LoRA adapts (whole model): what merging W + BA rewrites."""
    return _per_adapted_linear(s, targets, lambda fan_in, fan_out, *_: fan_in * fan_out)


def lora_expert_params(s: Shape, rank: int, targets) -> float:
    """LoRA adapters of the routed experts (whole model; each expert's whole: expert TP 1)."""
    return _per_adapted_expert(s, targets, lambda fan_in, fan_out: rank * (fan_in + fan_out))


def lora_expert_base_params(s: Shape, targets) -> float:
    """The routed experts' weights LoRA adapts (whole model): what merging rewrites of them."""
    return _per_adapted_expert(s, targets, lambda fan_in, fan_out: fan_in * fan_out)


def _lora_leaves(targets) -> set[str]:
    return {str(x).rsplit(".", 1)[-1] for x in targets}


def _per_adapted_expert(s: Shape, targets, count) -> float:
    """Sum of ``count(fan_in, fan_out)`` over the adapted linears (fc1 = [gate; up], fc2) of every routed expert."""
    leaves, f = _lora_leaves(targets), s.moe_intermediate
    per_expert = count(s.hidden, 2 * f) * ("linear_fc1" in leaves) + count(f, s.hidden) * ("linear_fc2" in leaves)
    return s.moe_layers * s.experts * per_expert


def _per_adapted_linear(s: Shape, targets, count) -> float:
    """Sum of ``count(fan_in, fan_out, column_parallel, HF projections)`` over the adapted dense linears of every
    layer."""
    leaves = _lora_leaves(targets)
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim

    def layer(inter: int) -> float:
        sizes = {"linear_qkv": (s.hidden, q + 2 * kv, True, 3), "linear_proj": (q, s.hidden, False, 1),
                 "linear_fc1": (s.hidden, 2 * inter, True, 2), "linear_fc2": (inter, s.hidden, False, 1)}
        return sum(count(*size) for name, size in sizes.items() if name in leaves and size[0] and size[1])

    sparse = s.moe_layers
    return sparse * layer(s.shared_intermediate) + (s.layers - sparse) * layer(s.intermediate)


def largest_layer_params(s: Shape) -> int:
    """The largest single decoder layer, experts included."""
    sizes = [layer_params(s, False)] if s.layers > s.moe_layers else []
    if s.moe_layers:
        sizes.append(layer_params(s, True) + s.experts * one_expert_params(s))
    return max(sizes)


def kv_bytes_per_token(s: Shape, dtype_bytes: int, t_g: int = 1) -> int:
    """KV cache per token on one generation rank: K and V of every layer for its share of the KV heads
    (vLLM replicates a KV head on ranks beyond their number); MLA's latent and rope key, whole on every rank
    (vLLM's MLA cache: kv_lora_rank + qk_rope_head_dim per layer, attention/backends MLACommon)."""
    if s.kv_lora:
        return s.layers * (s.kv_lora + s.qk_rope) * dtype_bytes
    return 2 * s.layers * max(s.kv_heads // t_g, 1) * s.head_dim * dtype_bytes


# Bytes per token of one sequence's columns in a step's batch: ids, masks and positions (int64) over the
# whole row; responses, their mask (int64) and ~8 float32 columns (log-probs, reference, values, scores,
# rewards, advantages, returns, entropy) over the response. The driver, Ray's object store and the workers
# each hold such a batch at once.
_ROW_BYTES_PER_TOKEN, _RESPONSE_BYTES_PER_TOKEN, _BATCH_COPIES = 24, 48, 3


def step_batch_host_bytes(cfg) -> int:
    """Host memory one step's rollout batch takes (driver, object store, workers)."""
    d = cfg.data
    rows = d.batch_size * cfg.rollout.n
    per_row = (d.max_prompt_length + d.max_response_length) * _ROW_BYTES_PER_TOKEN \
        + d.max_response_length * _RESPONSE_BYTES_PER_TOKEN
    return rows * per_row * _BATCH_COPIES


def non_matrix_params(s: Shape, value_head: bool = False) -> int:
    """What Muon leaves to Adam (megatron-core 0.16.1's get_megatron_muon_optimizer: embeddings, the output layer and
    every parameter that is not 2D): the embeddings, lm_head (the critic's value head), the norms and the q/k/v
    biases. gpt-oss's other biases and sinks, the expert bias and MLA's latent norms (a few thousand numbers a
    layer) are left with the matrices."""
    head = s.hidden if value_head else (0 if s.tied else s.vocab * s.hidden)
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    per_layer = 2 * s.hidden + (q + 2 * kv) * s.qkv_bias + 2 * s.head_dim * s.qk_norm
    return s.vocab * s.hidden + head + s.hidden + s.layers * per_layer


def count_params(s: Shape, value_head: bool = False) -> int:
    """The causal LM's parameters, or the critic's (value head hidden x 1 in place of lm_head)."""
    head = s.hidden if value_head else (0 if s.tied else s.vocab * s.hidden)
    return s.vocab * s.hidden + decoder_params(s) + s.hidden + head + expert_params(s)
