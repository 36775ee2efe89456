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
    sliding_window_by_default: bool = False  # Mistral: config.json's use_sliding_window absent means on

    @property
    def has_experts(self) -> bool:
        return bool(self.expert)

    @property
    def qk_layernorm(self) -> bool:
        """Per-head q/k norms before RoPE: megatron's qk_layernorm."""
        return all(n in self.attention for n in w.QK_NORM)

    @property
    def shared_expert(self) -> bool:
        return all(n in self.sparse_mlp for n in w.SHARED_EXPERT)

    def qkv_bias(self, hf_config) -> bool:
        return all(n in self.attention for n in w.QKV_BIAS) or bool(
            self.qkv_bias_if and getattr(hf_config, self.qkv_bias_if, False))

    def num_experts(self, hf_config) -> int:
        """Routed experts per sparse layer. A config.json read as is may name them ``num_local_experts``:
        transformers 5 writes Qwen3-MoE's so (its config's attribute_map turns num_experts into it)."""
        if not self.has_experts:
            return 0
        return getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", None) or 0

    def moe_layer_pattern(self, hf_config) -> list[int]:
        """1 for each decoder layer with a sparse MoE block, 0 for a dense MLP (Qwen-MoE's decoder_sparse_step
        and mlp_only_layers, as transformers' Qwen2MoeDecoderLayer/Qwen3MoeDecoderLayer decide)."""
        n = hf_config.num_hidden_layers
        if not self.num_experts(hf_config):
            return [0] * n
        step = getattr(hf_config, "decoder_sparse_step", 1) or 1
        dense = set(getattr(hf_config, "mlp_only_layers", None) or [])
        return [int(i not in dense and (i + 1) % step == 0) for i in range(n)]

    def layer_weights(self, hf_config, layer: int) -> tuple[w.Weight, ...]:
        """Decoder layer ``layer``'s weights besides its routed experts (layer_experts)."""
        attention = self.attention
        if self.qkv_bias(hf_config) and not all(n in attention for n in w.QKV_BIAS):
            attention = attention + w.QKV_BIAS
        sparse = self.moe_layer_pattern(hf_config)[layer]
        return attention + (self.sparse_mlp if sparse else self.mlp)

    def layer_experts(self, hf_config, layer: int, local_to_global=None) -> tuple[w.Weight, ...]:
        """The routed experts' weights of decoder layer ``layer``: ``local_to_global`` maps the experts held
        (megatron's local indices) to their global index; None: every expert, at its global index."""
        if not self.moe_layer_pattern(hf_config)[layer]:
            return ()
        if local_to_global is None:
            local_to_global = [(e, e) for e in range(self.num_experts(hf_config))]
        return tuple(t.expert(i, e) for i, e in local_to_global for t in self.expert)

    def hf_names(self, hf_config) -> set[str]:
        """Every tensor name of this model's HF checkpoint (experts one by one, as checkpoints hold them)."""
        names = {w.EMBEDDING.hf[0], w.FINAL_NORM.hf[0]}
        if not getattr(hf_config, "tie_word_embeddings", False):
            names.add(w.LM_HEAD.hf[0])
        for layer in range(hf_config.num_hidden_layers):
            for weight in self.layer_weights(hf_config, layer) + self.layer_experts(hf_config, layer):
                names.update(f"model.layers.{layer}.{h}" for h in weight.hf)
        return names
