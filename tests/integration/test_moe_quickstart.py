"""The MoE quickstart overlay (configs/quickstart_moe_cpu.yaml): a tiny Qwen3-MoE with expert parallelism 2 in
the actor, 3 GRPO steps through Ray, megatron-core and vLLM with finite metrics and the routers'
load-balancing loss logged every step. The actor's parameters are offloaded between uses (param_offload): the
resharder is built while the experts have no storage, from their shapes alone."""

from __future__ import annotations

import math

import pytest

from tests.integration.conftest import make_cfg, run_steps

pytestmark = pytest.mark.integration


def test_moe_overlay_trains_with_expert_parallelism(assets, moe_model, tmp_path, ray_cluster):
    cfg = make_cfg(assets, tmp_path, f"model.path={moe_model}", "data.batch_size=8", "actor.ppo_mini_batch_size=8",
                   "actor.megatron.param_offload=true", config="configs/quickstart_moe_cpu.yaml")
    assert cfg.actor.megatron.expert_model_parallel_size == 2 and cfg.resources.n_workers == 2
    history = run_steps(cfg, 3)
    assert len(history) == 3
    for metrics in history:
        assert all(math.isfinite(v) for v in metrics.values() if isinstance(v, float)), metrics
        balance = [v for k, v in metrics.items() if k.endswith("moe/load_balancing_loss")]
        assert balance and all(v > 0 for v in balance), sorted(metrics)
