"""MoE rules. Routing replay's config (actor.megatron.router_replay.mode, rollout.enable_rollout_routing_replay):
verl's keys translate, and what cannot work is refused before start in one line naming the keys; plus vLLM's routes
laid on the batch's token grid (workers/generation.py routes_grid). And grouped-GEMM experts' one rule (bf16)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from hybridflow.config import ConfigError
from hybridflow.config.verl import translate
from hybridflow.plan import load_experiment, resolve

MOE = "configs/quickstart_moe_cpu.yaml"  # R3 on
DENSE = SimpleNamespace(model_type="qwen2", num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                        hidden_size=64, intermediate_size=128, vocab_size=128)
SEPARATE = ["schedule.mode=separate_async", "resources.rollout_n_workers=1", "schedule.parameter_sync_step=1",
            "data.batch_size=32", "actor.ppo_mini_batch_size=32"]


def test_verl_keys_translate():
    t = translate(["actor_rollout_ref.actor.megatron.router_replay.mode=R3",
                   "actor_rollout_ref.rollout.enable_rollout_routing_replay=True",
                   "actor_rollout_ref.ref.megatron.router_replay.mode=R3",
                   "critic.megatron.router_replay.mode=disabled"])
    assert [o for o in t.overrides] == ["actor.megatron.router_replay.mode=R3",
                                        "rollout.enable_rollout_routing_replay=True"]
    assert set(t.agree.values()) == {"actor.megatron.router_replay.mode", "disabled"}


def test_the_moe_overlay_replays_vllms_routes():
    plan = resolve(load_experiment([MOE], []))
    assert plan.actor_spec.actor.megatron.router_replay.mode == "R3"
    assert plan.actor_spec.rollout.enable_rollout_routing_replay


@pytest.mark.parametrize("overrides,message", [
    (["actor.megatron.router_replay.mode=R9"], "router_replay.mode"),
    (["rollout.enable_rollout_routing_replay=false"],
     "R3 replays vLLM's routes: set rollout.enable_rollout_routing_replay"),
    (["actor.megatron.router_replay.mode=R2"], "R2 replays the old-log-prob forward's routes"),
    (["actor.megatron.router_replay.mode=disabled"], "enable_rollout_routing_replay returns vLLM's routes"),
    (["actor.megatron.override_transformer_config.moe_router_fusion=true"], "moe_router_fusion's TE router"),
    (["actor.megatron.pipeline_model_parallel_size=2", "actor.megatron.expert_model_parallel_size=1",
      "actor.megatron.override_transformer_config.recompute_granularity=full",
      "actor.megatron.override_transformer_config.recompute_method=uniform",
      "actor.megatron.override_transformer_config.recompute_num_layers=1"],
     "R3 is not supported with actor.megatron.pipeline_model_parallel_size > 1 and activation recompute"),
])
def test_what_cannot_replay_is_refused_in_one_line(overrides, message):
    with pytest.raises((ValueError, ConfigError), match=message):
        resolve(load_experiment([MOE], overrides))


def test_async_modes_replay_and_a_dense_model_has_nothing_to_replay():
    for overrides in (SEPARATE, [*SEPARATE, "schedule.partial_rollout=false"], ["schedule.mode=colocate_async"]):
        resolve(load_experiment([MOE], overrides))
    with pytest.raises(ValueError, match="is not a mixture-of-experts model"):
        resolve(load_experiment([MOE], []), DENSE)


def test_vllms_routes_land_on_the_prompt_and_the_kept_response_cells():
    from hybridflow.megatron.routing import NO_ROUTE
    from hybridflow.protocol import Batch
    from hybridflow.workers.generation import routes_grid

    P, R = 4, 3
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    prompts = Batch.from_dict(tensors={"input_ids": mask * 5, "attention_mask": mask})
    response_mask = torch.tensor([[1, 1, 1], [1, 0, 0]])  # row 1: cut at EOS after one token
    routes = [np.arange(3 + 3 - 1)[:, None, None].repeat(2, 1).repeat(2, 2).astype(np.int16),  # 5 tokens fed
              np.arange(4 + 2 - 1)[:, None, None].repeat(2, 1).repeat(2, 2).astype(np.int16)]  # it sampled 2
    grid = routes_grid(prompts, response_mask, routes)
    assert grid.shape == (2, P + R, 2, 2) and grid.dtype == torch.int16
    assert grid[0, :, 0, 0].tolist() == [NO_ROUTE, 0, 1, 2, 3, 4, NO_ROUTE]  # the last response token: never fed
    assert grid[1, :, 0, 0].tolist() == [0, 1, 2, 3, 4, NO_ROUTE, NO_ROUTE]  # only the kept token's


def test_grouped_gemm_experts_need_bf16_in_one_line():
    """Known from the config alone: refused in the dry run (tests/unit/test_dry_run_rules.py) and before any build."""
    from hybridflow.config.schema import Megatron
    from hybridflow.megatron.model import check_grouped_gemm_dtype

    key = "actor.megatron.override_transformer_config"
    grouped = {"moe_grouped_gemm": True}
    with pytest.raises(ValueError, match="moe_grouped_gemm: grouped-GEMM experts compute in bfloat16.*"
                                         "actor.megatron.dtype=bfloat16"):
        check_grouped_gemm_dtype(Megatron(dtype="float32", override_transformer_config=grouped), key)
    check_grouped_gemm_dtype(Megatron(dtype="bfloat16", override_transformer_config=grouped), key)

GLM = dict(model_type="glm4_moe", architectures=["Glm4MoeForCausalLM"], num_hidden_layers=2, n_routed_experts=8,
           num_experts_per_tok=2, norm_topk_prob=True, n_group=1, topk_group=1)


@pytest.mark.parametrize("change,message", [
    (dict(norm_topk_prob=False), "norm_topk_prob False with num_experts_per_tok 2: megatron's sigmoid router renorm"),
    (dict(n_group=3), "n_group 3 must divide the 8 experts"),
    # 4 groups of 2, top 2 experts from 2 groups: megatron ranks groups by their top 1, transformers by their top 2
    (dict(n_group=4, topk_group=2), "n_group 4 with num_experts_per_tok 2 / topk_group 2 != 2: megatron ranks the "
                                    "groups by their top 1 scores, transformers and vLLM by their top 2"),
])
def test_a_deepseek_router_megatron_would_route_otherwise_is_refused_in_one_line(change, message):
    from hybridflow.megatron.model import check_architecture

    with pytest.raises(ValueError, match=message):
        check_architecture(SimpleNamespace(**{**GLM, **change}))


def test_deepseek_v3s_groups_route_alike():
    """DeepSeek-V3's 8 of 256 experts from 4 of 8 groups: top 8/4 = 2 per group, as transformers ranks them."""
    from hybridflow.megatron.model import check_architecture

    check_architecture(SimpleNamespace(**{**GLM, "n_routed_experts": 256, "num_experts_per_tok": 8, "n_group": 8,
                                          "topk_group": 4}))


def _gpt_oss(**change):
    import transformers

    return transformers.GptOssConfig(**{**dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                               num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                               num_local_experts=4, num_experts_per_tok=2), **change})


def test_gpt_oss_settings_megatron_cannot_take_are_refused_in_one_line():
    """Grouped-GEMM experts (megatron's GroupedMLP refuses biases), an activation other than quick_gelu's 1.702, a
    YaRN attention factor given outright, and an expert TP above 1 (megatron builds biased experts only whole)."""
    from hybridflow.megatron.model import transformer_config_from_hf
    from hybridflow.plan.layout import ParallelLayout

    key = "actor.megatron.override_transformer_config"
    with pytest.raises(ValueError, match=f"{key}.moe_grouped_gemm: GptOssForCausalLM's experts have biases"):
        transformer_config_from_hf(_gpt_oss(), overrides={"moe_grouped_gemm": True}, key=key)
    with pytest.raises(ValueError, match="swiglu_alpha 1.5: megatron's clamped SwiGLU uses quick_gelu's 1.702"):
        transformer_config_from_hf(_gpt_oss(swiglu_alpha=1.5))
    yarn = {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, "attention_factor": 1.2}
    with pytest.raises(ValueError, match="rope_parameters.attention_factor: a YaRN attention factor given explicitly"):
        transformer_config_from_hf(_gpt_oss(rope_parameters=yarn))
    with pytest.raises(ValueError, match=r"actor.megatron.expert_tensor_parallel_size \(2\) must be 1 for "
                                         "GptOssForCausalLM"):
        ParallelLayout("actor", 2, "resources.n_workers", tp=2, etp=2).check_experts(_gpt_oss(), "m", on_gpu=True)


def test_gpt_oss_maps_to_megatrons_settings():
    """The window on layer_types' sliding layers (megatron reads the list by layer), sinks, biases, the clamped
    SwiGLU, top-k then softmax (no pre-softmax), and YaRN's attributes from its rope_parameters (truncate false:
    the correction range not rounded)."""
    from hybridflow.megatron.model import transformer_config_from_hf

    c = transformer_config_from_hf(_gpt_oss(sliding_window=8))
    assert (c.window_size, c.window_attn_skip_freq, c.softmax_type) == ((7, 0), [1, 0], "learnable")
    assert c.add_bias_linear and c.activation_func_clamp_value == 7.0 and c.glu_linear_offset == 1.0
    assert c.activation_func.__name__ == "quick_gelu" and not c.moe_router_pre_softmax
    assert (c.yarn_rotary_scaling_factor, c.yarn_original_max_position_embeddings, c.yarn_mscale,
            c.yarn_correction_range_round_to_int) == (32.0, 4096, None, False)


def _deepseek(**change):
    import transformers

    return transformers.DeepseekV3Config(**{**dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
        topk_group=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
        scoring_func="sigmoid", topk_method="noaux_tc"), **change})


YARN = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0,
        "mscale_all_dim": 1.0, "rope_theta": 10000.0}


def test_deepseek_v3_maps_to_megatrons_latent_attention():
    """MLATransformerConfig with the latent ranks and head parts, the core attention sized by v_head_dim with one
    query group per head, the latents' norms, and YaRN's factor and both mscales (DeepSeek-V3's own rope_scaling)."""
    from megatron.core.transformer import MLATransformerConfig

    from hybridflow.megatron.model import transformer_config_from_hf

    c = transformer_config_from_hf(_deepseek(rope_parameters=YARN))
    assert isinstance(c, MLATransformerConfig) and c.multi_latent_attention and c.qk_layernorm
    assert (c.q_lora_rank, c.kv_lora_rank, c.qk_head_dim, c.qk_pos_emb_head_dim, c.v_head_dim) == (16, 16, 8, 8, 8)
    assert (c.kv_channels, c.num_query_groups, c.rope_type) == (8, 4, "yarn")
    assert (c.rotary_scaling_factor, c.original_max_position_embeddings, c.mscale, c.mscale_all_dim) == (40.0, 4096,
                                                                                                        1.0, 1.0)
    plain = transformer_config_from_hf(_deepseek(q_lora_rank=None))
    assert plain.q_lora_rank is None and plain.rope_type == "rope"


@pytest.mark.parametrize("change,message", [
    (dict(rope_interleave=False), "rope_interleave false: megatron's MLA rotates the interleaved rope part only"),
    (dict(scoring_func="softmax"), "scoring_func 'softmax': transformers' router computes as scoring_func 'sigmoid'"),
    (dict(topk_method=None), "topk_method None: transformers' router computes as topk_method 'noaux_tc'"),
    (dict(rope_parameters={**YARN, "mscale": None}), "rope_parameters: mscale and mscale_all_dim are given together"),
    (dict(rope_parameters={**YARN, "truncate": False}), "rope_parameters.truncate false: megatron's MLA rounds"),
])
def test_a_deepseek_v3_config_megatron_or_vllm_would_compute_otherwise_is_refused_in_one_line(change, message):
    from hybridflow.megatron.model import transformer_config_from_hf

    with pytest.raises(ValueError, match=message):
        transformer_config_from_hf(_deepseek(**change))


def test_latent_attention_layouts_megatron_cannot_train_are_refused_in_one_line():
    """Context parallelism (MLA rotates by its own per-layer table), and a trained role at TP 2 without sequence
    parallelism (the rope key's gradient summed over TP only in the sequence-parallel gather)."""
    from hybridflow.megatron.model import check_trained_layout, transformer_config_from_hf

    with pytest.raises(ValueError, match="megatron.context_parallel_size=2: multi-latent attention runs without"):
        transformer_config_from_hf(_deepseek(), cp=2)
    key = "actor.megatron"
    with pytest.raises(ValueError, match=f"{key}.sequence_parallel: multi-latent attention trains at "
                                         "tensor_model_parallel_size 2 with sequence parallelism only"):
        check_trained_layout(_deepseek(), SimpleNamespace(tensor_model_parallel_size=2, sequence_parallel=False), key)
    check_trained_layout(_deepseek(), SimpleNamespace(tensor_model_parallel_size=2, sequence_parallel=True), key)
    check_trained_layout(_gpt_oss(), SimpleNamespace(tensor_model_parallel_size=2, sequence_parallel=False), key)
