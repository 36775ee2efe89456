"""The MoE quickstart overlay (configs/quickstart_moe_cpu.yaml): a tiny Qwen3-MoE with expert parallelism 2 in
the actor, 3 GRPO steps through Ray, megatron-core and vLLM with finite metrics and the routers'
load-balancing loss logged every step. The actor's parameters are offloaded between uses (param_offload): the
resharder is built while the experts have no storage, from their shapes alone."""

from __future__ import annotations

import math

import pytest

from tests.integration.conftest import SMALL, make_cfg, run_steps

pytestmark = pytest.mark.integration


def test_moe_overlay_trains_with_expert_parallelism(assets, tmp_path, ray_cluster):
    from hybridflow.plan import load_experiment
    from hybridflow.trainer.prepare import prepare_quickstart

    model = tmp_path / "moe"
    prep = load_experiment(["configs/quickstart_moe_cpu.yaml"], [
        f"prepare.data_dir={assets}/data", f"prepare.base_model_dir={model}/base", f"model.path={model}/sft",
        "prepare.vocab_multiple=128", *SMALL, "prepare.sft_steps=20", "prepare.sft_target_accuracy=null"])
    prepare_quickstart(prep)  # a short warm start: this checks the mechanics, the closing note the learning
    cfg = make_cfg(assets, tmp_path, f"model.path={model}/sft", "data.batch_size=8", "actor.ppo_mini_batch_size=8",
                   "actor.megatron.param_offload=true", config="configs/quickstart_moe_cpu.yaml")
    assert cfg.actor.megatron.expert_model_parallel_size == 2 and cfg.resources.n_workers == 2
    history = run_steps(cfg, 3)
    assert len(history) == 3
    for metrics in history:
        assert all(math.isfinite(v) for v in metrics.values() if isinstance(v, float)), metrics
        balance = [v for k, v in metrics.items() if k.endswith("moe/load_balancing_loss")]
        assert balance and all(v > 0 for v in balance), sorted(metrics)
