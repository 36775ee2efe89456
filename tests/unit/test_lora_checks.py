"""model.lora's checks before start (trainer/lora_checks.py), each one line naming the key or file: targets that
select no linear of the model, grouped-GEMM experts among them, and every way a starting adapter folder
(model.lora.adapter_path) can be wrong. They were found only after Ray and the workers started (20-30 s), some with
internal messages (``RuntimeError: shape '[2, 64, 16]' is invalid``)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from hybridflow.config import ConfigError
from hybridflow.plan import load_experiment
from hybridflow.trainer import lora_checks

QUICK = "configs/quickstart_cpu.yaml"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from hybridflow.models.char_tokenizer import build_char_tokenizer
    from hybridflow.models.tiny_qwen2 import build_tiny_qwen2

    path = tmp_path_factory.mktemp("model")
    build_tiny_qwen2(path, build_char_tokenizer(path), hidden_size=64, num_layers=2, seed=1)
    return path


def _cfg(model_dir, *overrides):
    from transformers import AutoConfig

    cfg = load_experiment([QUICK], [f"model.path={model_dir}", "model.lora.rank=4", "model.lora.alpha=8", *overrides])
    return cfg, AutoConfig.from_pretrained(str(model_dir))


def _adapter(folder, cfg, model, config=None, change=None):
    """A peft adapter folder of ``cfg``'s shapes (random tensors, one A per projection as peft draws them), then
    ``change(tensors)`` applied."""
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    tensors = {k: torch.randn(shape, generator=g) for k, (shape, _) in lora_checks._expected_adapter_shapes(cfg, model).items()}
    if change is not None:
        change(tensors)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(
        config if config is not None else {"peft_type": "LORA", "r": 4, "lora_alpha": 8}))
    return folder


def _fused_a_shared(tensors):
    """q/k/v share one A, gate/up another (what megatron's fused linears take)."""
    for stem in {k.rsplit(".", 3)[0] for k in tensors}:
        for group in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
            keys = [f"{stem}.{p}.lora_A.weight" for p in group if f"{stem}.{p}.lora_A.weight" in tensors]
            for k in keys[1:]:
                tensors[k] = tensors[keys[0]].clone()


def test_a_whole_adapter_of_the_runs_rank_passes(model_dir, tmp_path):
    cfg, model = _cfg(model_dir, f"model.lora.adapter_path={tmp_path / 'a'}")
    _adapter(tmp_path / "a", cfg, model, change=_fused_a_shared)
    lora_checks.check_adapter(cfg, model)
    lora_checks.check_lora_targets(cfg, model)


def test_an_adapter_path_without_a_rank_takes_the_adapters_rank_and_alpha(model_dir, tmp_path):
    """verl's lora_adapter_path alone (grpo_trainer/run_qwen2_5-3b_gsm8k_grpo_lora_from_adapter.sh): the adapter's
    own r and lora_alpha, as peft's PeftModel.from_pretrained takes them."""
    cfg, model = _cfg(model_dir)
    _adapter(tmp_path / "a", cfg, model, change=_fused_a_shared)  # r 4, lora_alpha 8
    from_adapter = load_experiment([QUICK], [f"model.path={model_dir}", f"model.lora.adapter_path={tmp_path / 'a'}"])
    assert (from_adapter.model.lora.rank, from_adapter.model.lora.alpha) == (4, 8.0)
    lora_checks.check_adapter(from_adapter, model)
    with pytest.raises(ConfigError, match=r"^model.lora: model.lora.adapter_path: no adapter rank in .*nowhere/adapter_"):
        load_experiment([QUICK], [f"model.path={model_dir}", f"model.lora.adapter_path={tmp_path / 'nowhere'}"])


CASES = {
    "missing": (lambda d: d / "nowhere", "is not a folder"),
    "a file": (lambda d: (d / "f").write_text("x") and d / "f", "is not a folder"),
    "empty": (lambda d: (d / "e").mkdir() or d / "e", "has no adapter_config.json"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_an_adapter_path_that_is_no_adapter_folder_is_named(case, model_dir, tmp_path):
    make, message = CASES[case]
    path = make(tmp_path)
    cfg, model = _cfg(model_dir, f"model.lora.adapter_path={path}")
    with pytest.raises(ConfigError, match=f"^model.lora.adapter_path: {path} {message}"):
        lora_checks.check_adapter(cfg, model)


def _drop_config(folder):
    (folder / "adapter_config.json").unlink()


def _corrupt(folder):
    (folder / "adapter_model.safetensors").write_bytes(b"\x07" * 100)


def _truncate(folder):
    f = folder / "adapter_model.safetensors"
    f.write_bytes(f.read_bytes()[:-50])


@pytest.mark.parametrize("damage,message", [
    (_drop_config, "has no adapter_config.json"),
    (_corrupt, "adapter_model.safetensors is not a readable safetensors file"),
    (_truncate, "adapter_model.safetensors is not a readable safetensors file"),
])
def test_a_damaged_adapter_folder_names_the_file(damage, message, model_dir, tmp_path):
    cfg, model = _cfg(model_dir, f"model.lora.adapter_path={tmp_path / 'a'}")
    damage(_adapter(tmp_path / "a", cfg, model, change=_fused_a_shared))
    with pytest.raises(ConfigError, match=message) as err:
        lora_checks.check_adapter(cfg, model)
    assert "\n" not in str(err.value)


def test_an_adapter_of_another_rank_alpha_or_targets_is_named(model_dir, tmp_path):
    cfg, model = _cfg(model_dir, f"model.lora.adapter_path={tmp_path / 'a'}")
    _adapter(tmp_path / "a", cfg, model, config={"peft_type": "LORA", "r": 8, "lora_alpha": 8}, change=_fused_a_shared)
    with pytest.raises(ConfigError, match="has rank 8, model.lora.rank is 4: they must agree"):
        lora_checks.check_adapter(cfg, model)
    _adapter(tmp_path / "a", cfg, model, config={"peft_type": "LORA", "r": 4, "lora_alpha": 16}, change=_fused_a_shared)
    with pytest.raises(ConfigError, match="trained with lora_alpha 16, model.lora.alpha is 8"):
        lora_checks.check_adapter(cfg, model)
    # rank 2 tensors under a config saying 4: the shapes name the tensor
    two, _ = _cfg(model_dir, "model.lora.rank=2")
    _adapter(tmp_path / "a", two, model, config={"peft_type": "LORA", "r": 4, "lora_alpha": 8}, change=_fused_a_shared)
    with pytest.raises(ConfigError, match=r"lora_A.weight has shape \[2, 64\], this model and rank 4 take \[4, 64\]"):
        lora_checks.check_adapter(cfg, model)
    # trained on the attention only: the MLP's adapters are missing
    attn, _ = _cfg(model_dir, "model.lora.target_modules=[linear_qkv,linear_proj]")
    _adapter(tmp_path / "a", attn, model, change=_fused_a_shared)
    with pytest.raises(ConfigError, match=r"lacks base_model.model.model.layers.0.mlp.gate_proj.lora_A.weight"):
        lora_checks.check_adapter(cfg, model)
    # and the reverse: adapters the run would ignore
    attn_only, _ = _cfg(model_dir, "model.lora.target_modules=[linear_qkv]", f"model.lora.adapter_path={tmp_path / 'a'}")
    with pytest.raises(ConfigError, match="o_proj.lora_A.weight, a linear model.lora does not adapt"):
        lora_checks.check_adapter(attn_only, model)


def test_distinct_as_of_a_fused_linear_are_named(model_dir, tmp_path):
    cfg, model = _cfg(model_dir, f"model.lora.adapter_path={tmp_path / 'a'}")
    _adapter(tmp_path / "a", cfg, model)  # peft's own init: one random A per projection
    with pytest.raises(ConfigError, match="q_proj, k_proj, v_proj of layer 0 have different lora_A; megatron's fused "
                                          "decoder.layers.0.self_attention.linear_qkv takes one A"):
        lora_checks.check_adapter(cfg, model)


def test_targets_that_select_nothing_and_grouped_experts_are_named(model_dir):
    cfg, model = _cfg(model_dir, "model.lora.target_modules=['*.layers.7.*.linear_qkv']")
    with pytest.raises(ConfigError, match=r"model.lora.target_modules: no linear of .* matches \['\*.layers.7.\*"):
        lora_checks.check_lora_targets(cfg, model)
    cfg, _ = _cfg(model_dir, "model.lora.target_modules=['*.layers.1.*.linear_qkv']")
    assert [full for _, full, _ in lora_checks.adapted_linears(model, _settings(cfg))] == [
        "decoder.layers.1.self_attention.linear_qkv"]
    from transformers import Qwen3MoeConfig

    moe = Qwen3MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                         num_experts_per_tok=2)
    grouped = load_experiment(["configs/quickstart_moe_cpu.yaml"],
                              ["model.lora.rank=4", "actor.megatron.dtype=bfloat16",
                               "actor.megatron.override_transformer_config={moe_grouped_gemm: true}"])
    with pytest.raises(ConfigError, match="model.lora: LoRA: decoder.layers.0.mlp.experts are grouped-GEMM experts"):
        lora_checks.check_lora_targets(grouped, moe)


def _settings(cfg):
    from hybridflow.workers.common import lora_settings

    return lora_settings(cfg.model.lora, 1)


def test_multi_latent_attention_takes_adapters_on_its_output_and_mlps_only(model_dir, caplog):
    """DeepSeek-V3's MLA linears are no LoRA target (one line naming them); its linear_qkv target finds nothing there
    (a warning), its linear_proj and MLPs take adapters."""
    import logging

    from transformers import DeepseekV3Config

    with pytest.raises(ConfigError, match="'linear_kv_up_proj' is none of linear_qkv, linear_proj, linear_fc1, "
                                          "linear_fc2 .multi-latent attention's q/kv projections take no adapter"):
        _cfg(model_dir, "model.lora.target_modules=[linear_kv_up_proj]")
    ds = DeepseekV3Config(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                          num_experts_per_tok=2, n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=16,
                          qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)
    cfg, _ = _cfg(model_dir)
    with caplog.at_level(logging.WARNING, "hybridflow.trainer.lora_checks"):
        lora_checks.check_lora_targets(cfg, ds)
    assert "DeepseekV3ForCausalLM's multi-latent attention has no linear_qkv" in caplog.text
    adapted = {full.split(".", 3)[3] for _, full, _ in lora_checks.adapted_linears(ds, _settings(cfg))}
    assert "self_attention.linear_proj" in adapted and not any("q_" in a or "kv_" in a for a in adapted)
