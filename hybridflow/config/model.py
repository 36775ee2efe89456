"""The experiment config's model section (model.path, model.lora), a module of its own beside config/schema.py."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from hybridflow.config.checks import check_number, check_sizes


LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")  # megatron's linears an adapter can take
# megatron's MLA linears (DeepSeek-V3): no adapter (megatron/lora.py adapts the four above; its latent projections
# are whole on every TP rank and its up-projections split by heads, which the adapter's split kinds do not describe)
MLA_PROJECTIONS = ("linear_q_proj", "linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj",
                   "linear_kv_up_proj")
LORA_INITS = ("xavier", "kaiming", "zero")
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM 0.32's max_lora_rank values (config/lora.py)


def vllm_lora_rank(rank: int) -> int:
    """The smallest max_lora_rank vLLM takes that holds ``rank`` (verl's get_vllm_max_lora_rank)."""
    return next(r for r in VLLM_LORA_RANKS if r >= rank)  # LoRA.validate refuses a larger rank with merge false


def adapter_rank_alpha(folder: str, alpha: float) -> tuple[int, float]:
    """(r, lora_alpha) of the peft adapter in ``folder`` (``alpha`` where its config names none)."""
    path = Path(folder) / "adapter_config.json"
    try:
        config = json.loads(path.read_text())
        return int(config["r"]), float(config.get("lora_alpha", alpha))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"model.lora.adapter_path: no adapter rank in {path} ({type(e).__name__}: {e}); a peft "
                         "adapter folder holds adapter_config.json (r, lora_alpha) and adapter_model.safetensors, "
                         "or set model.lora.rank") from None


@dataclass
class LoRA:
    """LoRA on the actor (verl 0.9.1's actor_rollout_ref.model.lora, Megatron-Bridge's ``lora`` type; megatron/lora.py):
    the base weights are frozen, the adapters train, the reference policy is the actor with its adapters off."""

    rank: int = 0  # 0: no LoRA (full-parameter training)
    alpha: float = 32  # the adapter's output is scaled by alpha / rank
    dropout: float = 0.0  # on the adapter's input
    # megatron's linears (fused q/k/v and gate/up share one A each); wildcards on the full name (e.g.
    # "*.layers.0.*.linear_qkv") are verl's too; linear_fc1/fc2 take a MoE model's routed experts (SequentialMLP, expert
    # TP 1) and shared expert as well (exclude them with "*.experts.*").
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    exclude_modules: list[str] = field(default_factory=list)  # with target_modules empty: every linear but these
    lora_A_init_method: str = "xavier"
    lora_B_init_method: str = "zero"
    # true: the actor's weights reach vLLM merged (W + alpha/rank B A, resharded as full weights are; every model, and
    # vLLM generates at the base model's speed). false (verl's default): the frozen base reaches vLLM once and the
    # adapters alone at every sync, into vLLM's LoRA (dense models, colocated rollout; plan/rules.check_lora).
    merge: bool = True
    adapter_path: str | None = None  # a peft adapter folder (adapter_model.safetensors) to start from

    @property
    def targets(self) -> tuple[str, ...]:
        """The linears adapters go on: target_modules, or every one (less exclude_modules) when it is empty (verl's
        meaning)."""
        return tuple(self.target_modules or LORA_TARGETS)

    def resolve_defaults(self) -> None:
        """An adapter_path without a rank: the adapter's own rank and alpha (its adapter_config.json's r and
        lora_alpha), as verl's lora_adapter_path takes them (peft's PeftModel.from_pretrained)."""
        if self.adapter_path and not self.rank:
            self.rank, self.alpha = adapter_rank_alpha(self.adapter_path, self.alpha)

    def validate(self):
        check_number("model.lora.rank", self.rank, ge=0)
        if not self.rank:
            return
        check_number("model.lora.alpha", self.alpha, gt=0)
        check_number("model.lora.dropout", self.dropout, ge=0, lt=1)
        unknown = [t for t in self.target_modules if t not in LORA_TARGETS and not any(c in t for c in "*?[")]
        if unknown:
            latent = (" (multi-latent attention's q/kv projections take no adapter here)"
                      if unknown[0] in MLA_PROJECTIONS else "")
            raise ValueError(f"model.lora.target_modules: {unknown[0]!r} is none of {', '.join(LORA_TARGETS)}{latent}")
        if self.exclude_modules and self.target_modules:
            raise ValueError("model.lora.exclude_modules needs target_modules empty (every linear but the excluded)")
        if not self.merge and self.rank > VLLM_LORA_RANKS[-1]:
            raise ValueError(f"model.lora.rank {self.rank} with merge=false: vLLM's LoRA takes ranks up to "
                             f"{VLLM_LORA_RANKS[-1]}; set model.lora.merge=true")
        for key in ("lora_A_init_method", "lora_B_init_method"):
            if getattr(self, key) not in LORA_INITS:
                raise ValueError(f"model.lora.{key} must be one of {', '.join(LORA_INITS)}, not {getattr(self, key)!r}")


def config_overrides(max_position_embeddings: int | None) -> dict:
    """The policy config's values set over its folder's config.json (``Model.config_overrides``)."""
    return {} if max_position_embeddings is None else {"max_position_embeddings": max_position_embeddings}


@dataclass
class Model:
    path: str = "outputs/quickstart/sft_model"  # HF folder (config, safetensors, tokenizer) of the policy
    # run the folder's own Python where its config.json / tokenizer_config.json name it (auto_map: Moonlight's
    # tiktoken tokenizer, Kimi-K2's config class) in transformers and vLLM; conversion still needs one of
    # hybridflow's families (verl's actor_rollout_ref.model.trust_remote_code)
    trust_remote_code: bool = False
    # replaces the folder's config.json max_position_embeddings wherever the policy's config is read (megatron,
    # vLLM, the preflight's length check); verl's actor_rollout_ref.model.override_config.model_config.<same>
    max_position_embeddings: int | None = None
    lora: LoRA = field(default_factory=LoRA)

    @property
    def config_overrides(self) -> dict:
        """What replaces the folder's config.json values (transformers' ``AutoConfig.from_pretrained(path,
        **overrides)``, vLLM's ``hf_overrides``)."""
        return config_overrides(self.max_position_embeddings)

    def validate(self):
        check_sizes(self, "max_position_embeddings")
