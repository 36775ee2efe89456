"""What ``model.lora`` asks of the model and of a starting adapter, checked against the model's HF config and the
safetensors headers before any worker starts (one ``ConfigError`` each, naming the key or file): the linears the
targets select on this model (megatron/lora.py's selection, over the family's declared weights), grouped-GEMM
experts among them, and a peft adapter folder (``model.lora.adapter_path``) that must be whole, of the run's rank
and alpha, hold exactly the adapters the run takes, in the base model's shapes, with one A per fused linear
(megatron_lora_peft.from_peft)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from hybridflow import families
from hybridflow.config import ConfigError
from hybridflow.megatron import lora
from hybridflow.megatron.lora_peft import PREFIX
from hybridflow.workers.common import lora_settings

log = logging.getLogger(__name__)


def header_shapes(path: str) -> tuple[dict, dict]:
    """({tensor: shape}, {tensor: file name}) of the safetensors in folder ``path``, from their headers only
    (``safe_open`` memory-maps; no tensor is loaded). A file that is not whole safetensors is named in one line."""
    from safetensors import SafetensorError, safe_open

    shapes, file_of = {}, {}
    for f in sorted(Path(path).glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt") as weights:
                for name in weights.keys():
                    shapes[name], file_of[name] = list(weights.get_slice(name).get_shape()), f.name
        except (SafetensorError, OSError) as e:
            raise ConfigError(f"{f} is not a readable safetensors file ({' '.join(str(e).split())[:200]})") from None
    return shapes, file_of


def adapted_linears(model, settings) -> list[tuple[int, str, object]]:
    """(layer, global megatron name, family weight) of every linear ``settings`` adapts on ``model``: the family's
    declared weights of each layer, a routed expert under its global index (as megatron/lora.targets names them)."""
    family = families.of(model)
    experts = [(e, e) for e in range(family.num_experts(model))]
    out = []
    for layer in range(model.num_hidden_layers):
        for w in [*family.layer_weights(model, layer), *family.layer_experts(model, layer, experts)]:
            if not w.megatron.endswith(".weight"):
                continue
            full = lora.global_name(layer, w.megatron.removesuffix(".weight"))
            if lora.selected(full, settings):
                out.append((layer, full, w))
    return out


def check_lora_targets(cfg, model) -> None:
    """model.lora's targets select at least one linear of this model, and no grouped-GEMM experts (known from the
    config and the model before megatron builds anything)."""
    c = cfg.model.lora
    if not c.rank:
        return
    settings = lora_settings(c, cfg.trainer.seed)
    grouped = cfg.actor.megatron.override_transformer_config.get("moe_grouped_gemm", False)
    try:
        for layer, sparse in enumerate(families.moe_layer_pattern(model) if families.is_moe(model) else []):
            lora.check_grouped_experts(f"decoder.layers.{layer}.", bool(grouped and sparse), settings)
    except ValueError as e:
        raise ConfigError(f"model.lora: {e}") from None
    if families.of(model).multi_latent and "linear_qkv" in c.targets:
        log.warning("model.lora.target_modules: %s's multi-latent attention has no linear_qkv: its q/kv projections "
                    "take no adapter (linear_proj and the MLPs do)", families.of(model).architecture)
    if not adapted_linears(model, settings):
        raise ConfigError(f"model.lora.target_modules: no linear of {cfg.model.path} matches {list(c.targets)} "
                          f"(exclude_modules {list(c.exclude_modules)})")


def check_adapter(cfg, model) -> None:
    """model.lora.adapter_path: a peft adapter folder of the run's rank and alpha whose tensors are exactly the run's
    adapters, in this model's shapes, with one lora_A per fused linear."""
    c = cfg.model.lora
    if not c.adapter_path:
        return
    folder = Path(c.adapter_path)
    where = f"model.lora.adapter_path: {folder}"
    if not folder.is_dir():
        raise ConfigError(f"{where} is not a folder (a peft adapter folder: adapter_config.json, "
                          "adapter_model.safetensors)")
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        if not (folder / name).is_file():
            raise ConfigError(f"{where} has no {name} (a peft adapter folder holds adapter_config.json and "
                              "adapter_model.safetensors)")
    _check_adapter_config(folder / "adapter_config.json", c)
    try:
        shapes, _ = header_shapes(str(folder))
    except ConfigError as e:
        raise ConfigError(f"model.lora.adapter_path: {e}") from None
    expected = _expected_adapter_shapes(cfg, model)
    adapters = {k: v for k, v in shapes.items() if ".lora_" in k}
    extra = sorted(set(adapters) - set(expected))
    if extra:
        raise ConfigError(f"{where}/adapter_model.safetensors holds {extra[0]}, a linear model.lora does not adapt "
                          f"(target_modules {list(c.targets)}, exclude_modules {list(c.exclude_modules)})")
    for key, (shape, why) in expected.items():
        if key not in adapters:
            raise ConfigError(f"{where}/adapter_model.safetensors lacks {key}, which model.lora adapts")
        if adapters[key] != shape:
            raise ConfigError(f"{where}/adapter_model.safetensors: {key} has shape {adapters[key]}, this model and "
                              f"rank {c.rank} take {shape} ({why})")
    _check_fused_a(folder / "adapter_model.safetensors", cfg, model)


def _check_adapter_config(path: Path, c) -> None:
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.lora.adapter_path: {path} is not JSON ({e})") from None
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise ConfigError(f"model.lora.adapter_path: {path} is not a LoRA adapter's config (peft_type "
                          f"{config.get('peft_type') if isinstance(config, dict) else None!r})")
    if config.get("r") != c.rank:
        raise ConfigError(f"model.lora.adapter_path: the adapter in {path.parent} has rank {config.get('r')}, "
                          f"model.lora.rank is {c.rank}: they must agree")
    if config.get("lora_alpha", c.alpha) != c.alpha:
        raise ConfigError(f"model.lora.adapter_path: the adapter in {path.parent} was trained with lora_alpha "
                          f"{config['lora_alpha']}, model.lora.alpha is {c.alpha:g}: they must agree (the adapter's "
                          "output is scaled by alpha / rank)")


def _expected_adapter_shapes(cfg, model) -> dict:
    """{peft tensor name: (shape, why)}: for each HF projection of each adapted linear, lora_A [rank, in] and
    lora_B [out, rank], the base weight being [out, in] in model.path's safetensors."""
    base, _ = header_shapes(cfg.model.path)
    r, out = cfg.model.lora.rank, {}
    for layer, _, w in adapted_linears(model, lora_settings(cfg.model.lora, cfg.trainer.seed)):
        for hf in w.hf:
            name = f"model.layers.{layer}.{hf}"
            fan_out, fan_in = base[name]
            stem = PREFIX + name.removesuffix(".weight")
            out[f"{stem}.lora_A.weight"] = ([r, fan_in], f"{name} is {[fan_out, fan_in]}")
            out[f"{stem}.lora_B.weight"] = ([fan_out, r], f"{name} is {[fan_out, fan_in]}")
    return out


def _check_fused_a(file: Path, cfg, model) -> None:
    """A fused megatron linear (q/k/v, gate/up) takes one A for all its HF projections (Megatron-Bridge's lora): an
    adapter trained with one A per projection cannot start it. Reads the A tensors only (rank x fan-in each)."""
    import torch
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as f:
        for layer, full, w in adapted_linears(model, lora_settings(cfg.model.lora, cfg.trainer.seed)):
            if len(w.hf) < 2:
                continue
            stems = [f"{PREFIX}model.layers.{layer}.{hf.removesuffix('.weight')}" for hf in w.hf]
            a = [f.get_tensor(f"{s}.lora_A.weight") for s in stems]
            if any(not torch.equal(a[0], x) for x in a[1:]):
                raise ConfigError(f"model.lora.adapter_path: {file}: {', '.join(s.rsplit('.', 1)[-1] for s in stems)} "
                                  f"of layer {layer} have different lora_A; megatron's fused {full} takes one A for "
                                  "all (Megatron-Bridge's lora type)")
