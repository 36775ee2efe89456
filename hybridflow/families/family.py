"""What a model family is: the HF architecture it reads, the weights its decoder layers are made of, and the
config facts megatron-core and the plans need (torch-free). One instance per family module."""

from __future__ import annotations

from dataclasses import dataclass

from hybridflow.families import weights as w


@dataclass(frozen=True)
class Family:
    architecture: str  # config.json's architectures[0]
    model_type: str  # config.json's model_type
    attention: tuple[w.Weight, ...]  # each layer's norms and attention
    mlp: tuple[w.Weight, ...] = w.DENSE_MLP  # a dense layer's MLP
    sparse_mlp: tuple[w.Weight, ...] = ()  # a sparse (MoE) layer's weights besides its experts: router, shared expert
    expert: tuple[w.Weight, ...] = ()  # each routed expert's (names hold {e})
    qkv_bias_if: str | None = None  # the config flag that adds QKV_BIAS where the family does not always have it
    qk_norm_if: str | None = None  # the config flag that adds QK_NORM where the family does not always have it
    sliding_window_by_default: bool = False  # Mistral, gpt-oss: config.json's use_sliding_window absent means on
    experts_fused: bool = False  # the checkpoint holds each layer's experts as [experts, ...] tensors (gpt-oss)
    layer_windows: bool = False  # a window on the layers layer_types names only (vLLM's model honours it: gpt-oss)
    yarn: bool = False  # its RoPE may be YaRN (gpt-oss's always is): megatron's YarnRotaryEmbedding reproduces it
    # the top-k router's chosen scores renormalized where config.json has no norm_topk_prob (gpt-oss: softmax of the
    # top-k logits, GptOssTopKRouter; vLLM's FusedMoE renormalize=True)
    norm_topk_by_default: bool = False
    # config.json keys vLLM's model reads for a router transformers' has fixed (DeepSeek-V3: vLLM's DeepseekV2MoE
    # defaults to softmax and no expert bias without scoring_func sigmoid and topk_method noaux_tc)
    router_config: tuple[tuple[str, str], ...] = ()
    clamped_swiglu: bool = False  # gpt-oss's (up + 1) * gate * sigmoid(alpha gate), gate and up clamped at swiglu_limit

    @property
    def attention_sinks(self) -> bool:
        """gpt-oss's learned sink logit per head (megatron's learnable softmax offset)."""
        return all(n in self.attention for n in w.SINKS)

    @property
    def linear_bias(self) -> bool:
        """Biases on every linear (attention output, router, experts): megatron's add_bias_linear."""
        return all(n in self.attention for n in w.OUT_BIAS)

    @property
    def multi_latent(self) -> bool:
        """DeepSeek-V3's multi-latent attention (megatron's MLATransformerConfig and MLASelfAttention)."""
        return all(n in self.attention for n in w.MLA_KV)

    def attention_weights(self, hf_config) -> tuple[w.Weight, ...]:
        """Each layer's norms and attention: MLA's q latent and its norm only where config.json has a
        q_lora_rank (Moonlight, DeepSeek-V2-Lite: one q projection instead)."""
        attention = self.attention
        if self.multi_latent and not getattr(hf_config, "q_lora_rank", None):
            attention = tuple(n for n in attention if n not in w.MLA_Q_LORA) + w.MLA_Q
        if self.qkv_bias(hf_config) and not all(n in attention for n in w.QKV_BIAS):
            attention = attention + w.QKV_BIAS
        if self.qk_layernorm(hf_config) and not all(n in attention for n in w.QK_NORM):
            attention = attention + w.QK_NORM
        return attention

    @property
    def has_experts(self) -> bool:
        return bool(self.expert)

    def qk_layernorm(self, hf_config) -> bool:
        """Per-head q/k norms before RoPE: megatron's qk_layernorm."""
        return all(n in self.attention for n in w.QK_NORM) or bool(
            self.qk_norm_if and getattr(hf_config, self.qk_norm_if, False))

    @property
    def shared_expert(self) -> bool:
        """A shared expert beside the routed ones: Qwen2-MoE's (gated) or DeepSeek-V3's (ungated)."""
        return self.shared_expert_gate or all(n in self.sparse_mlp for n in w.SHARED_EXPERTS)

    @property
    def shared_expert_gate(self) -> bool:
        """Qwen2-MoE's sigmoid gate on its shared expert's output."""
        return all(n in self.sparse_mlp for n in w.SHARED_EXPERT)

    def shared_expert_width(self, hf_config) -> int:
        """The shared expert's intermediate size (0: none): Qwen2-MoE's shared_expert_intermediate_size, or
        DeepSeek-V3's n_shared_experts experts of moe_intermediate_size as one MLP (transformers' DeepseekV3MoE)."""
        if not self.shared_expert:
            return 0
        if self.shared_expert_gate:
            return hf_config.shared_expert_intermediate_size
        return hf_config.moe_intermediate_size * hf_config.n_shared_experts

    @property
    def expert_bias(self) -> bool:
        """DeepSeek-V3's router: sigmoid scores, an expert bias added to choose the experts, group-limited top-k,
        the chosen scores renormalized and scaled (routed_scaling_factor); otherwise Qwen-MoE's softmax router."""
        return all(n in self.sparse_mlp for n in w.EXPERT_BIAS)

    def qkv_bias(self, hf_config) -> bool:
        return all(n in self.attention for n in w.QKV_BIAS) or bool(
            self.qkv_bias_if and getattr(hf_config, self.qkv_bias_if, False))

    def num_experts(self, hf_config) -> int:
        """Routed experts per sparse layer. A config.json read as is may name them ``num_local_experts``:
        transformers 5 writes Qwen3-MoE's so (its config's attribute_map turns num_experts into it)."""
        if not self.has_experts:
            return 0
        return (getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", None)
                or getattr(hf_config, "n_routed_experts", None) or 0)

    def expert_width(self, hf_config) -> int:
        """A routed expert's intermediate size: ``moe_intermediate_size``, or gpt-oss's ``intermediate_size`` (its
        layers are all sparse)."""
        return getattr(hf_config, "moe_intermediate_size", None) or hf_config.intermediate_size

    def moe_layer_pattern(self, hf_config) -> list[int]:
        """1 for each decoder layer with a sparse MoE block, 0 for a dense MLP (Qwen-MoE's decoder_sparse_step
        and mlp_only_layers, as transformers' Qwen2MoeDecoderLayer/Qwen3MoeDecoderLayer decide; DeepSeek-V3's and
        GLM-4.5's first_k_dense_replace dense layers first)."""
        n = hf_config.num_hidden_layers
        if not self.num_experts(hf_config):
            return [0] * n
        step = getattr(hf_config, "decoder_sparse_step", 1) or 1
        dense = set(getattr(hf_config, "mlp_only_layers", None) or [])
        first = getattr(hf_config, "first_k_dense_replace", 0) or 0
        return [int(i not in dense and i >= first and (i + 1) % step == 0) for i in range(n)]

    def layer_weights(self, hf_config, layer: int) -> tuple[w.Weight, ...]:
        """Decoder layer ``layer``'s weights besides its routed experts (layer_experts)."""
        sparse = self.moe_layer_pattern(hf_config)[layer]
        return self.attention_weights(hf_config) + (self.sparse_mlp if sparse else self.mlp)

    def layer_experts(self, hf_config, layer: int, local_to_global=None) -> tuple[w.Weight, ...]:
        """The routed experts' weights of decoder layer ``layer``: ``local_to_global`` maps the experts held
        (megatron's local indices) to their global index; None: every expert, at its global index."""
        if not self.moe_layer_pattern(hf_config)[layer]:
            return ()
        if local_to_global is None:
            local_to_global = [(e, e) for e in range(self.num_experts(hf_config))]
        return tuple(t.expert(i, e) for i, e in local_to_global for t in self.expert)

    def mtp_layers(self, hf_config) -> range:
        """The checkpoint's multi-token-prediction layers (DeepSeek-V3's and GLM-4.5's num_nextn_predict_layers),
        numbered after the decoder's (``model.layers.{num_hidden_layers}.``): transformers builds none, and
        nothing here reads them (MTP is not trained)."""
        n = hf_config.num_hidden_layers
        return range(n, n + (getattr(hf_config, "num_nextn_predict_layers", 0) or 0))

    def hf_names(self, hf_config) -> set[str]:
        """Every tensor name of this model's HF checkpoint (experts one by one, as checkpoints hold them, or
        fused over the experts: ``experts_fused``)."""
        names = {w.EMBEDDING.hf[0], w.FINAL_NORM.hf[0]}
        if not getattr(hf_config, "tie_word_embeddings", False):
            names.add(w.LM_HEAD.hf[0])
        for layer in range(hf_config.num_hidden_layers):
            for weight in self.layer_weights(hf_config, layer) + self.layer_experts(hf_config, layer):
                names.update(f"model.layers.{layer}.{h}" for h in weight.hf)
        return {w.fused_name(n) for n in names} if self.experts_fused else names
