"""model.path's files checked before any worker starts: a readable config whose RoPE megatron reproduces,
safetensors whose headers match it, and a tokenizer (a part of trainer/preflight.py)."""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

from hybridflow import families
from hybridflow.families import weights
from hybridflow.config import ConfigError
from hybridflow.config.schema import ExperimentConfig
from hybridflow.megatron.attention_config import check_rope_supported
from hybridflow.megatron.quantized import quantization_of, stored_names
from hybridflow.trainer.lora_checks import header_shapes


def check_model_folder(cfg: ExperimentConfig):
    """model.path holds a readable config whose RoPE megatron reproduces, safetensors weights and a
    tokenizer, and the model's context fits the longest prompt plus response; returns (HF config, tokenizer)."""
    from transformers import AutoConfig, AutoTokenizer

    path, trust = cfg.model.path, cfg.model.trust_remote_code
    if not os.path.isdir(path):
        raise ConfigError(f"model.path: not a model folder: {path}")
    try:
        model = AutoConfig.from_pretrained(path, trust_remote_code=trust,
                                           **cfg.model.config_overrides)
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.path: cannot read {path}/config.json ({_remote_code_hint(e, False)})") from None
    try:
        check_rope_supported(model)
        quantization_of(model)
    except ValueError as e:
        raise ConfigError(f"model.path: {e} in {path}/config.json") from None
    if not list(Path(path).glob("*.safetensors")):
        raise ConfigError(f"model.path: no *.safetensors weights in {path}")
    check_weight_shapes(path, model)
    # Without its files AutoTokenizer quietly builds an empty tokenizer from config.json alone (a tokenizer of the
    # folder's own code reads files of its own: Moonlight's tiktoken.model)
    files = ("tokenizer.json", "tokenizer.model", "vocab.json")
    if not _own_tokenizer_code(path) and not any((Path(path) / f).exists() for f in files):
        raise ConfigError(f"model.path: no tokenizer files (tokenizer.json, tokenizer.model or vocab.json) in {path}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust)
    except (OSError, ValueError, TypeError) as e:
        # transformers without trust_remote_code falls back to a class of its own, which fails on the files
        own = not trust and _own_tokenizer_code(path)
        raise ConfigError(f"model.path: no usable tokenizer in {path} ({_remote_code_hint(e, own)})") from None
    if len(tokenizer) < 2 or tokenizer.pad_token_id is None or tokenizer.eos_token_id is None:
        raise ConfigError(f"model.path: the tokenizer in {path} is empty or lacks pad/eos tokens (tokenizer files missing?)")
    longest = cfg.data.max_prompt_length + cfg.data.max_response_length
    if longest > model.max_position_embeddings:
        raise ConfigError(f"data.max_prompt_length + data.max_response_length ({longest}) exceeds the model's "
                          f"max_position_embeddings ({model.max_position_embeddings}) in {path}")
    return model, tokenizer


def _own_tokenizer_code(path: str) -> bool:
    """tokenizer_config.json names a tokenizer class of the folder's own code (``auto_map``)."""
    try:
        with open(Path(path) / "tokenizer_config.json", encoding="utf-8") as f:
            return "AutoTokenizer" in json.load(f).get("auto_map", {})
    except (OSError, ValueError, AttributeError):
        return False


def _remote_code_hint(e: Exception, own_code: bool) -> str:
    """transformers' reason in one line; where it asks for the folder's own code (or ``own_code``: the folder
    names its own class), the key that allows it."""
    text = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
    if own_code or "trust_remote_code" in str(e):
        return "it needs its own Python code: set model.trust_remote_code=true if you trust the folder"
    return text


def check_weight_shapes(path: str, model) -> None:
    """The safetensors headers parse and cover their files, and hold the embedding and attention shapes
    config.json implies: a vocab, hidden size or head count that disagrees with the weights (or a truncated
    or garbage file) fails here in one line, not in a worker loading them. Reads the headers only
    (``safe_open`` memory-maps; no tensor is loaded)."""
    try:
        shapes, file_of = header_shapes(path)
    except ConfigError as e:
        raise ConfigError(f"model.path: {e}") from None
    hidden = model.hidden_size
    vocab = f"[vocab_size {model.vocab_size}, hidden_size {hidden}]"
    expected = {"model.embed_tokens.weight": ([model.vocab_size, hidden], vocab)}
    if not getattr(model, "tie_word_embeddings", False):
        expected["lm_head.weight"] = ([model.vocab_size, hidden], vocab)
    family = families.FAMILIES.get(getattr(model, "model_type", None))
    attention = _latent_shapes if family and family.multi_latent else _grouped_query_shapes
    for i in range(model.num_hidden_layers):
        expected.update({f"model.layers.{i}.self_attn.{k}": v for k, v in attention(model).items()})
    for name, (shape, meaning) in expected.items():
        if name not in shapes:
            raise ConfigError(f"model.path: the safetensors in {path} lack {name}, which its config.json "
                              f"({model.num_hidden_layers} layers) needs")
        if shapes[name] != shape:
            raise ConfigError(f"model.path: {name} in {path}/{file_of[name]} has shape {shapes[name]}, but "
                              f"config.json says {meaning}")
    check_declared_weights(path, model, file_of)


def _grouped_query_shapes(model) -> dict:
    """{name in self_attn: (shape, what config.json says)} of q and k."""
    hidden, heads, kv_heads = model.hidden_size, model.num_attention_heads, model.num_key_value_heads
    head_dim = getattr(model, "head_dim", None) or hidden // heads  # as hybridflow.megatron.convert derives it
    head = f"head_dim {head_dim}" + ("" if getattr(model, "head_dim", None) else f" (hidden_size / {heads} heads)")
    return {"q_proj.weight": ([heads * head_dim, hidden], f"[num_attention_heads {heads} x {head}, hidden_size {hidden}]"),
            "k_proj.weight": ([kv_heads * head_dim, hidden],
                              f"[num_key_value_heads {kv_heads} x {head}, hidden_size {hidden}]")}


def _latent_shapes(model) -> dict:
    """The same for multi-latent attention: the kv latent and its up-projection, the q projection per head."""
    hidden, heads, kv, rope = model.hidden_size, model.num_attention_heads, model.kv_lora_rank, model.qk_rope_head_dim
    nope, v, q_lora = model.qk_nope_head_dim, model.v_head_dim, getattr(model, "q_lora_rank", None)
    q = f"[num_attention_heads {heads} x (qk_nope_head_dim {nope} + qk_rope_head_dim {rope}), "
    return {"kv_a_proj_with_mqa.weight": ([kv + rope, hidden], f"[kv_lora_rank {kv} + qk_rope_head_dim {rope}, "
                                                               f"hidden_size {hidden}]"),
            "kv_b_proj.weight": ([heads * (nope + v), kv], f"[num_attention_heads {heads} x (qk_nope_head_dim {nope} + "
                                                           f"v_head_dim {v}), kv_lora_rank {kv}]"),
            ("q_b_proj.weight" if q_lora else "q_proj.weight"): (
                [heads * (nope + rope), q_lora or hidden],
                q + (f"q_lora_rank {q_lora}]" if q_lora else f"hidden_size {hidden}]"))}


# Tensors a checkpoint may hold that no conversion reads: old rotary caches, a tied model's saved output layer.
_UNREAD = re.compile(r"(^|\.)rotary_emb\.inv_freq$|^lm_head\.weight$")
log = logging.getLogger(__name__)


def _mtp_tensors(family, model, file_of: dict) -> set[str]:
    """The tensors of the checkpoint's multi-token-prediction layers (family.mtp_layers), noted once: not read."""
    layers = family.mtp_layers(model)
    mtp = {n for n in file_of if weights.layer_index(n) in layers}
    if mtp:
        log.info("model.path: the %d tensors of its %d multi-token-prediction layer(s) (num_nextn_predict_layers) are "
                 "not read: MTP is not trained here, and exports and vLLM go without them", len(mtp), len(layers))
    return mtp


def check_declared_weights(path: str, model, file_of: dict) -> None:
    """The checkpoint holds exactly the tensors its family declares (hybridflow/families): one that no
    conversion reads (a variant such as Llama's attention_bias, whose o_proj bias megatron's layers here do
    not have) would be dropped silently, one missing would fail in every worker."""
    family = families.FAMILIES.get(getattr(model, "model_type", None))
    if family is None:  # refused by name with the supported list (megatron.model.check_architecture)
        return
    declared = stored_names(family.hf_names(model), file_of, model)  # as quantized (megatron/quantized.py)
    mtp = _mtp_tensors(family, model, file_of)
    unread = sorted(n for n in file_of if n not in declared and n not in mtp and not _UNREAD.search(n))
    if unread:
        more = f" (and {len(unread) - 1} more)" if len(unread) > 1 else ""
        raise ConfigError(f"model.path: {path}/{file_of[unread[0]]} holds {unread[0]}{more}, which hybridflow's "
                          f"{family.architecture} does not have: a variant of it (e.g. attention_bias, mlp_bias) "
                          "that conversion would drop")
    missing = sorted(declared - set(file_of))
    if missing:
        raise ConfigError(f"model.path: the safetensors in {path} lack {missing[0]}, which its config.json "
                          f"({model.num_hidden_layers} layers) needs")
