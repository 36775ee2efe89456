"""Activation recompute through ``megatron.override_transformer_config`` (megatron-core's own
``recompute_granularity`` / ``recompute_method`` / ``recompute_modules``): an update's gradients with full
and selective recompute equal those without it, policy and value model, at TP1 and TP2 (sequence parallel),
in fp32. Dropout is on, so the recomputed forwards must replay the random streams of the first ones (the
CPU RNG tracker and the recompute patches in patches/megatron_core.py); and the recompute is seen to run
(the recomputed modules' forwards run twice per micro-batch).

The override checks that need no process group (unknown or hybridflow-owned fields, megatron's own
``__post_init__`` checks) are here too, as plain tests."""

from __future__ import annotations

import pytest

from hybridflow.spawn import run_ranks
from tests.numerics import assert_close

DROPOUT = {"attention_dropout": 0.1, "hidden_dropout": 0.1}
CONFIGS = {
    "none": {},
    "full_uniform": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
    "full_block": {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 1},
    "selective": {"recompute_granularity": "selective"},  # megatron's default module: core_attn
    "selective_mlp": {"recompute_granularity": "selective", "recompute_modules": ["core_attn", "mlp"]},
}
# The module whose forward a config recomputes (its forward calls per micro-batch double).
RECOMPUTED = {"none": "self_attention.core_attention", "full_uniform": "", "full_block": "",
              "selective": "self_attention.core_attention", "selective_mlp": "mlp"}


def _rank_fn(rank, world, hf_dir, critic_dir):
    from hybridflow.config.schema import Actor, Critic
    from hybridflow.megatron import parallel
    from hybridflow.megatron.role import MegatronRole, ModelBuild, OptimSettings
    from hybridflow.patches import megatron_core
    from hybridflow.workers import role_ops
    from hybridflow.workers.common import load_hf_folder
    from tests.distributed.test_padding_free_and_offload import uneven_batch

    parallel.init_model_parallel(world, 1, seed=1)
    cfg, state = load_hf_folder(hf_dir)
    _, critic_state = load_hf_folder(critic_dir)
    batch = uneven_batch()
    # The whole batch is one mini-batch (one optimizer step) of three micro-batches.
    actor_cfg = Actor(ppo_mini_batch_size=6, ppo_micro_batch_size_per_gpu=2)
    critic_cfg = Critic(ppo_mini_batch_size=6, ppo_micro_batch_size_per_gpu=2, ppo_epochs=1, use_dynamic_bsz=False)
    optim = OptimSettings(lr=1e-3, clip_grad=0.0)  # no clipping: main_grad keeps the raw gradient
    out = {}
    for name, overrides in CONFIGS.items():
        megatron_core.model_parallel_seed(1)  # every config draws the same dropout masks
        actor = MegatronRole(cfg, state,
                             ModelBuild(sequence_parallel=True, transformer_overrides={**overrides, **DROPOUT}),
                             optim=optim)
        build = ModelBuild(value_head=True, sequence_parallel=True, transformer_overrides={**overrides, **DROPOUT})
        critic = MegatronRole(cfg, critic_state, build, optim=optim)
        layer = actor.module.decoder.layers[0]
        calls = []
        layer.get_submodule(RECOMPUTED[name]).register_forward_hook(lambda *_: calls.append(1))
        metrics = {**role_ops.update_policy(actor, batch, actor_cfg, dp_size=1),
                   **role_ops.update_value(critic, batch, critic_cfg, dp_size=1)}
        out[name] = {
            "granularity": actor.tf_config.recompute_granularity,
            "forwards": len(calls),
            "metrics": {k: v for k, v in metrics.items() if k.endswith("loss")},
            "actor_grads": {n: p.main_grad.detach().clone() for n, p in actor.module.named_parameters()},
            "critic_grads": {n: p.main_grad.detach().clone() for n, p in critic.module.named_parameters()},
        }
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from tests.distributed.test_padding_free_and_offload import write_policy_and_critic

    return write_policy_and_critic(tmp_path_factory.mktemp("recompute"))


@pytest.mark.distributed
@pytest.mark.parametrize("tp", [1, 2])
def test_recompute_gradients_equal_no_recompute(models, tp):
    ranks = run_ranks(_rank_fn, tp, str(models / "policy"), str(models / "critic"))
    for rank, out in enumerate(ranks):
        plain = out["none"]
        micro_batches = plain["forwards"]
        assert plain["granularity"] is None and micro_batches == 3
        for name in CONFIGS:
            if name == "none":
                continue
            got = out[name]
            assert got["granularity"] == CONFIGS[name]["recompute_granularity"]
            assert got["forwards"] == 2 * micro_batches, f"{name}: the recomputed module ran {got['forwards']} times"
            # Same kernels on both sides, only re-run: tolerance for fp32's rounding at most.
            assert_close(got["metrics"], plain["metrics"], what=f"TP{tp} rank {rank} {name} losses")
            for role in ("actor_grads", "critic_grads"):
                assert_close(got[role], plain[role], what=f"TP{tp} rank {rank} {name} {role}")


# --- the override checks before start (no process group) -------------------------------------------------

def _hf_config():
    from transformers import Qwen2Config

    return Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=64, architectures=["Qwen2ForCausalLM"])


@pytest.mark.parametrize("overrides, words", [
    ({"recompute_granularty": "full"}, "megatron.override_transformer_config.recompute_granularty: megatron-core's "
                                       "TransformerConfig has no field"),
    ({"tensor_model_parallel_size": 2}, "megatron.override_transformer_config.tensor_model_parallel_size: set by "
                                        "hybridflow from megatron.tensor_model_parallel_size"),
    ({"hidden_size": 32}, "megatron.override_transformer_config.hidden_size: set by hybridflow from the model's"),
    ({"params_dtype": "float16"}, "override_transformer_config.params_dtype: set by hybridflow from megatron.dtype"),
    ({"attention_backend": "flashy"}, "override_transformer_config.attention_backend: 'flashy' is not one of"),
])
def test_override_names_are_checked(overrides, words):
    from hybridflow.megatron.overrides import check_transformer_overrides

    with pytest.raises(ValueError) as e:
        check_transformer_overrides(overrides, "megatron.override_transformer_config")
    msg = str(e.value)
    assert msg.startswith("megatron.override_transformer_config.") and words in msg and "\n" not in msg, msg


def test_megatrons_own_checks_of_the_overrides_run_before_start():
    from hybridflow.config.schema import Megatron
    from hybridflow.megatron.model import check_transformer_config

    key = "actor.megatron.override_transformer_config"
    ok = Megatron(dtype="float32", override_transformer_config={**CONFIGS["full_block"], "attention_backend": "flash"})
    check_transformer_config(_hf_config(), ok, key)
    bad = Megatron(dtype="float32", override_transformer_config={"recompute_granularity": "full"})  # no method
    with pytest.raises(ValueError) as e:
        check_transformer_config(_hf_config(), bad, key)
    msg = str(e.value)
    assert msg.startswith(f"{key}: ") and "recompute_method" in msg and "\n" not in msg, msg


def test_layernorm_recompute_without_transformer_engine_is_refused_before_start():
    from megatron.core.tensor_parallel import random as mrandom

    from hybridflow.megatron.overrides import check_transformer_overrides

    if mrandom.HAVE_TE:
        pytest.skip("Transformer Engine is installed: megatron's layernorm recompute runs")
    key = "actor.megatron.override_transformer_config"
    with pytest.raises(ValueError, match=rf"^{key}\.recompute_modules: 'layernorm' needs Transformer Engine"):
        check_transformer_overrides({"recompute_granularity": "selective", "recompute_modules": ["layernorm"]}, key)


def test_rope_fusion_without_transformer_engine_is_refused_before_start():
    """megatron's fused rotary embedding is TE's: without TE it asserts at the first forward (rope_utils)."""
    from megatron.core.models.common.embeddings import rope_utils

    from hybridflow.megatron.overrides import check_transformer_overrides

    if rope_utils.fused_apply_rotary_pos_emb is not None:
        pytest.skip("Transformer Engine is installed: megatron's fused rotary embedding runs")
    key = "critic.megatron.override_transformer_config"
    with pytest.raises(ValueError, match=rf"^{key}\.apply_rope_fusion: megatron's fused rotary embedding needs "
                                         "Transformer Engine"):
        check_transformer_overrides({"apply_rope_fusion": True}, key)
    assert check_transformer_overrides({"apply_rope_fusion": False}, key) == {"apply_rope_fusion": False}
