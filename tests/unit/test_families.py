"""Each model family declares exactly the weights transformers' model of that architecture has, and the
facts that follow from its config; adding an architecture is one module (hybridflow/families)."""

from __future__ import annotations

import importlib
import pkgutil

import pytest
import safetensors
import transformers

from hybridflow import families
from hybridflow.families import weights

_COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, tie_word_embeddings=False)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
CONFIGS = {
    "qwen2": transformers.Qwen2Config(**_COMMON),
    "qwen3": transformers.Qwen3Config(head_dim=16, **_COMMON),
    "llama": transformers.LlamaConfig(**_COMMON),
    "mistral": transformers.MistralConfig(**_COMMON),
    # a dense layer among the sparse ones (mlp_only_layers), a shared expert, a sparse step of 2
    "qwen3_moe": transformers.Qwen3MoeConfig(head_dim=16, mlp_only_layers=[0], **_MOE, **_COMMON),
    "qwen2_moe": transformers.Qwen2MoeConfig(shared_expert_intermediate_size=48, decoder_sparse_step=2, **_MOE,
                                             **_COMMON),
    # two dense layers first, then sparse ones with two ungated shared experts and the router's expert bias
    "glm4_moe": transformers.Glm4MoeConfig(head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
                                           moe_intermediate_size=32, n_shared_experts=2, first_k_dense_replace=2,
                                           use_qk_norm=True, attention_bias=True, **_COMMON),
    # every layer sparse, biases everywhere, sinks, experts fused over the experts in the checkpoint
    "gpt_oss": transformers.GptOssConfig(head_dim=16, num_local_experts=4, num_experts_per_tok=2, **_COMMON),
    # multi-latent attention with a q latent, a dense first layer, two ungated shared experts, the expert bias
    "deepseek_v3": transformers.DeepseekV3Config(
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=2, first_k_dense_replace=1,
        q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
        num_nextn_predict_layers=0, **{**_COMMON, "num_key_value_heads": 4}),
}
# Moonlight's: no q latent (one q projection per head)
MOONLIGHT = transformers.DeepseekV3Config(**{**CONFIGS["deepseek_v3"].to_dict(), "q_lora_rank": None})


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_a_family_declares_exactly_the_checkpoint_of_its_transformers_model(kind, tmp_path):
    """The names transformers writes to disk (MoE experts one by one, as checkpoints hold them; in memory
    transformers 5 fuses them)."""
    cfg = CONFIGS[kind]
    cfg.architectures = [families.FAMILIES[kind].architecture]
    getattr(transformers, cfg.architectures[0])(cfg).save_pretrained(tmp_path)
    with safetensors.safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert families.of(cfg).hf_names(cfg) == set(f.keys())


def test_moonlight_declares_its_q_projection_and_kimi_k2_is_deepseek_v3(tmp_path):
    MOONLIGHT.architectures = ["DeepseekV3ForCausalLM"]
    transformers.DeepseekV3ForCausalLM(MOONLIGHT).save_pretrained(tmp_path)
    with safetensors.safe_open(tmp_path / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert families.of(MOONLIGHT).hf_names(MOONLIGHT) == names
    assert "model.layers.0.self_attn.q_proj.weight" in names and not any("q_a_proj" in k for k in names)
    kimi = families.FAMILIES["kimi_k2"]
    assert kimi.architecture == "DeepseekV3ForCausalLM" and kimi.multi_latent and kimi.expert_bias
    assert kimi.attention == families.of(CONFIGS["deepseek_v3"]).attention


def test_each_declared_weight_has_one_name_per_side_and_a_split():
    for name in ("decoder.layers.7.self_attention.linear_qkv.bias", "decoder.layers.0.mlp.router.weight",
                 "module.decoder.layers.2.mlp.experts.local_experts.5.linear_fc2.weight"):
        assert weights.megatron_weight(name).split in weights.Split
    prefix, w = weights.vllm_weight("model.layers.3.mlp.experts.12.gate_up_proj.weight")
    assert prefix == "model.layers.3." and w.hf == ("mlp.experts.12.gate_proj.weight", "mlp.experts.12.up_proj.weight")
    assert weights.hf_weight("model.layers.1.self_attn.k_proj.weight").split is weights.Split.QKV
    assert weights.local_expert("decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight") == (
        "decoder.layers.1.mlp.experts.", 3, "linear_fc1.weight")
    assert weights.keeps_float32("model.layers.3.mlp.gate.e_score_correction_bias")  # the expert bias
    assert not weights.keeps_float32("model.layers.3.mlp.gate.weight") and not weights.keeps_float32("a")
    with pytest.raises(KeyError, match="model.layers.0.self_attn.rotary.weight is not a weight"):
        weights.vllm_weight("model.layers.0.self_attn.rotary.weight")


def test_the_facts_follow_from_the_family():
    assert [families.is_moe(CONFIGS[k]) for k in ("qwen2", "qwen3_moe", "qwen2_moe")] == [False, True, True]
    assert families.moe_layer_pattern(CONFIGS["qwen3_moe"]) == [0, 1, 1, 1]
    assert families.moe_layer_pattern(CONFIGS["qwen2_moe"]) == [0, 1, 0, 1]
    assert [families.qk_layernorm(CONFIGS[k]) for k in ("qwen3", "qwen3_moe", "llama")] == [True, True, False]
    assert [families.qkv_bias(CONFIGS[k]) for k in ("qwen2", "qwen2_moe", "qwen3", "llama")] == [True, True, False, False]
    assert families.of(CONFIGS["qwen2_moe"]).shared_expert and not families.of(CONFIGS["qwen3_moe"]).shared_expert
    glm = CONFIGS["glm4_moe"]
    assert families.moe_layer_pattern(glm) == [0, 0, 1, 1] and families.num_experts(glm) == 4
    assert families.shared_expert_width(glm) == 64 and not families.of(glm).shared_expert_gate
    assert families.qk_layernorm(glm) and families.qkv_bias(glm) and families.of(glm).expert_bias
    no_norms = transformers.Glm4MoeConfig(**{**glm.to_dict(), "use_qk_norm": False, "attention_bias": False})
    assert not families.qk_layernorm(no_norms) and not families.qkv_bias(no_norms)
    oss = families.of(CONFIGS["gpt_oss"])
    assert families.moe_layer_pattern(CONFIGS["gpt_oss"]) == [1] * 4 and oss.expert_width(CONFIGS["gpt_oss"]) == 64
    assert oss.linear_bias and oss.attention_sinks and oss.experts_fused and not oss.expert_bias
    assert not (families.of(glm).linear_bias or families.of(glm).attention_sinks or families.of(glm).experts_fused)
    ds = families.of(CONFIGS["deepseek_v3"])
    assert ds.multi_latent and ds.expert_bias and not families.of(glm).multi_latent
    assert families.moe_layer_pattern(CONFIGS["deepseek_v3"]) == [0, 1, 1, 1]
    assert families.shared_expert_width(CONFIGS["deepseek_v3"]) == 64
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        families.of(transformers.GPT2Config())


def test_adding_an_architecture_is_one_module():
    """Every module of hybridflow/families besides the shared ones declares a FAMILY, and each is registered."""
    shared = {"family", "weights", "stacked_experts"}
    modules = [importlib.import_module(f"hybridflow.families.{m.name}") for m in pkgutil.iter_modules(families.__path__)
               if m.name not in shared]
    declared = {f.model_type for m in modules for f in (m.FAMILY, *getattr(m, "ALIASES", ()))}
    assert declared == set(families.FAMILIES)
    assert set(families.SUPPORTED_ARCHS) == {f.architecture for f in families.FAMILIES.values()}


def test_a_config_json_written_by_transformers_5_names_its_experts_num_local_experts():
    """transformers 5 saves Qwen3-MoE's expert count as ``num_local_experts`` (its config's attribute_map); read as
    is (vLLM's engine set-up, the memory plan) it must still count 8 experts, or a MoE model passes for dense."""
    from types import SimpleNamespace

    from hybridflow import families

    raw = SimpleNamespace(model_type="qwen3_moe", num_local_experts=8, num_hidden_layers=2)
    assert families.num_experts(raw) == 8 and families.is_moe(raw)
    assert families.num_experts(SimpleNamespace(model_type="qwen3_moe", num_experts=4)) == 4


def test_a_checkpoints_multi_token_prediction_layers_are_skipped_with_a_note(caplog):
    """GLM-4.5's and DeepSeek-V3's checkpoints hold num_nextn_predict_layers MTP layers after the decoder's (layer
    46 of GLM-4.5-Air's 46); transformers builds none and nothing reads them. Without the config's count the same
    tensors are refused as a variant that conversion would drop."""
    import logging

    from hybridflow.config import ConfigError
    from hybridflow.trainer.model_files import check_declared_weights

    cfg = transformers.Glm4MoeConfig(**{**CONFIGS["glm4_moe"].to_dict(), "num_nextn_predict_layers": 1})
    mtp = ["model.layers.4.eh_proj.weight", "model.layers.4.enorm.weight", "model.layers.4.shared_head.norm.weight",
           "model.layers.4.mlp.experts.0.up_proj.weight"]
    file_of = {n: "model.safetensors" for n in [*families.of(cfg).hf_names(cfg), *mtp]}
    with caplog.at_level(logging.INFO, "hybridflow.trainer.model_files"):
        check_declared_weights("/m", cfg, file_of)
    assert "the 4 tensors of its 1 multi-token-prediction layer(s) (num_nextn_predict_layers) are not read" in caplog.text
    cfg.num_nextn_predict_layers = 0
    with pytest.raises(ConfigError, match="holds model.layers.4.eh_proj.weight .and 3 more., which hybridflow's "
                                          "Glm4MoeForCausalLM does not have"):
        check_declared_weights("/m", cfg, file_of)


@pytest.mark.parametrize("form", list(weights.HFForm))
def test_a_checkpoint_form_round_trips_and_a_tp_block_of_it_is_megatrons_tp_shard(form):
    """gpt-oss's expert tensors (gate/up interleaved, transposed): the checkpoint's block k of t along hf_dim is, in
    megatron's form, megatron's TP shard k ([gate_k; up_k] for GATED, input columns k for ROW)."""
    import torch

    split = weights.Split.ROW if form is weights.HFForm.TRANSPOSED else weights.Split.GATED
    full = torch.randn(12, 8) if form is not weights.HFForm.INTERLEAVED else torch.randn(12)
    hf = form.to_hf(full)
    assert torch.equal(form.to_megatron(hf), full)
    for k, block in enumerate(torch.chunk(hf, 2, dim=form.hf_dim(split))):
        if split is weights.Split.GATED:
            want = torch.cat([torch.chunk(h, 2)[k] for h in torch.chunk(full, 2)])
        else:
            want = torch.chunk(full, 2, dim=1)[k]
        assert torch.equal(form.to_megatron(block), want)
    if form is weights.HFForm.INTERLEAVED_T:  # transformers' own reading: gate_up[..., ::2] is the gate
        assert torch.equal(hf[:, ::2], full[:6].t()) and torch.equal(hf[:, 1::2], full[6:].t())


def test_fused_experts_read_one_by_one_and_are_stacked_back_on_write(tmp_path):
    """A gpt-oss checkpoint's [experts, ...] tensors read as the declared per-expert names (from the file one slice at
    a time) and written back fused, bit for bit; an expert missing on write is refused in one line."""
    import torch
    from safetensors.torch import save_file

    from hybridflow.families import stacked_experts
    from hybridflow.megatron.hf_weights import HFWeights

    cfg = CONFIGS["gpt_oss"]
    model = transformers.GptOssForCausalLM(cfg)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    save_file(sd, str(tmp_path / "model.safetensors"))
    view = stacked_experts.readable(HFWeights(str(tmp_path)), cfg)
    assert set(view) == {n for n in families.of(cfg).hf_names(cfg) if "mlp.experts." not in n} | {
        f"model.layers.{i}.mlp.experts.{e}.{p}" for i in range(4) for e in range(4)
        for p in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")}
    assert torch.equal(view["model.layers.2.mlp.experts.3.down_proj"], sd["model.layers.2.mlp.experts.down_proj"][3])
    assert view.raw.bytes_read == sd["model.layers.2.mlp.experts.down_proj"][3].numel() * 4  # one slice read
    again = dict(stacked_experts.stacked_items(reversed(list(view.items())), cfg))
    assert set(again) == set(sd) and all(torch.equal(again[k], sd[k]) for k in sd)
    partial = [(k, v) for k, v in view.items() if ".experts.1." not in k]
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.experts.(gate_up_proj|down_proj)(_bias)?: 3 of the 4 "):
        dict(stacked_experts.stacked_items(partial, cfg))
