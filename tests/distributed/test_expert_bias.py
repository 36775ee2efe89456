"""GLM-4.5's expert bias (DeepSeek-V3's aux-loss-free balancing) when it trains: with
``override_transformer_config.moe_router_bias_update_rate`` set, megatron moves it after an optimizer step by the sign
of each expert's load (finalize_model_grads), and the moved bias is what export, the weight sync and a checkpoint
carry; by default it stays at the checkpoint's values. One process: the bias is replicated (the all-reduce of the
loads over the data-parallel ranks is megatron's own)."""

from __future__ import annotations

import pytest
import torch

from hybridflow.spawn import run_ranks

pytestmark = pytest.mark.distributed

BIAS = "model.layers.1.mlp.gate.e_score_correction_bias"


def _rank_fn(rank, world, hf_dir, ckpt):
    from hybridflow.families.weights import EXPERT_BIAS
    from hybridflow.megatron import convert, parallel
    from hybridflow.megatron.checkpoint import load_role, save_role
    from hybridflow.megatron.role import MegatronRole, ModelBuild, OptimSettings
    from hybridflow.workers import role_ops
    from hybridflow.workers.common import open_hf_folder
    from tests.distributed.test_layouts import _settings, rollout_batch

    parallel.init_model_parallel(1, 1, seed=1)
    cfg, weights = open_hf_folder(hf_dir)
    actor_cfg, _ = _settings()
    out = {"initial": weights[BIAS].clone()}
    for rate in (0.0, 0.01):
        build = ModelBuild(transformer_overrides={"moe_router_bias_update_rate": rate} if rate else None)
        role = MegatronRole(cfg, weights, build, optim=OptimSettings(lr=1e-3))
        role_ops.update_policy(role, rollout_batch(), actor_cfg, 1)
        local = convert.local_state_dict(role.module)  # what the weight sync sends
        sync = local[f"decoder.layers.1.{EXPERT_BIAS[0].megatron}"]
        out[rate] = dict(exported=role.hf_state_dict()[BIAS].clone(), synced=sync.clone())
        if rate:
            save_role(role, ckpt)
            again = MegatronRole(cfg, weights, build, optim=OptimSettings(lr=1e-3))
            load_role(again, ckpt)
            out["resumed"] = again.hf_state_dict()[BIAS].clone()
    return out


def test_the_expert_bias_is_frozen_by_default_and_when_it_trains_it_is_synced_exported_and_resumed(tmp_path):
    from hybridflow.models.char_tokenizer import build_char_tokenizer
    from hybridflow.models.tiny_arch import build_tiny

    build_tiny(tmp_path / "glm", build_char_tokenizer(tmp_path / "glm"), "glm4_moe", seed=21)
    (r,) = run_ranks(_rank_fn, 1, str(tmp_path / "glm"), str(tmp_path / "ckpt"))
    assert torch.equal(r[0.0]["exported"], r["initial"]) and torch.equal(r[0.0]["synced"], r["initial"])
    moved = r[0.01]["exported"]
    assert moved.dtype == torch.float32 and not torch.equal(moved, r["initial"])
    # megatron's rule: each expert's bias +/- the rate by the sign of (mean load - its load), 0 at the mean
    steps = (moved - r["initial"]).abs() / 0.01
    assert (((steps - 1).abs() < 1e-3) | (steps < 1e-3)).all() and (steps > 0.5).any(), steps
    assert torch.equal(r[0.01]["synced"], moved) and torch.equal(r["resumed"], moved)
