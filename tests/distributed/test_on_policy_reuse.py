"""The on-policy shortcut (actor.reuse_on_policy_log_prob): an update given no old log-probs uses its own,
detached. Its gradient, the weights after the step and the entropy it reports must equal those of the
update fed the recomputed old log-probs (what verl 0.9.1 does), on one rank and split over two."""

from __future__ import annotations

import pytest

from hybridflow.spawn import run_ranks
from tests.numerics import assert_close

pytestmark = pytest.mark.distributed

ROWS = 8


def _rank_fn(rank, world, hf_dir):
    from megatron.core import parallel_state as ps

    from hybridflow.algorithms import masked_mean
    from hybridflow.config.schema import Actor
    from hybridflow.megatron import parallel
    from hybridflow.megatron.role import MegatronRole, OptimSettings
    from hybridflow.protocol import Batch
    from hybridflow.workers import role_ops
    from hybridflow.workers.common import load_hf_folder
    from tests.distributed.test_global_loss_normalization import mini_batch

    parallel.init_model_parallel(1, 1, seed=1)
    cfg, state = load_hf_folder(hf_dir)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    shard = mini_batch().chunk(dp)[dp_rank]
    actor = Actor(ppo_mini_batch_size=ROWS, ppo_micro_batch_size_per_gpu=2, use_kl_loss=True, kl_loss_coef=0.1)
    out = {}
    for reuse in (False, True):
        role = MegatronRole(cfg, state, optim=OptimSettings(lr=1e-2, eps=1e-3, clip_grad=1e9))
        recomputed = role_ops.log_probs(role, shard, ROWS, with_entropy=True)
        batch = shard if reuse else Batch(tensors={**shard.tensors, "old_log_probs": recomputed["log_probs"]})
        metrics = role_ops.update_policy(role, batch, actor, dp)
        out[reuse] = dict(grads={n: p.main_grad.detach().clone() for n, p in role.module.named_parameters()},
                          weights=role.hf_state_dict(), metrics=metrics,
                          entropy=masked_mean(recomputed["entropy"], shard.tensors["response_mask"]).item())
    return out


@pytest.mark.parametrize("dp", [1, 2])
def test_reused_log_probs_give_the_recomputed_update(tmp_path, dp):
    from hybridflow.models.char_tokenizer import build_char_tokenizer
    from hybridflow.models.tiny_qwen2 import build_tiny_qwen2

    build_tiny_qwen2(tmp_path, build_char_tokenizer(tmp_path), hidden_size=64, num_layers=2, seed=11)
    rank0 = run_ranks(_rank_fn, dp, str(tmp_path))[0]
    recomputed, reused = rank0[False], rank0[True]
    assert_close(reused["grads"], recomputed["grads"], what="gradient")
    assert_close(reused["weights"], recomputed["weights"], what="weights after the step")
    m0, m1 = recomputed["metrics"], reused["metrics"]
    for key in ("actor/pg_loss", "actor/kl_loss"):
        assert_close(m1[key], m0[key], what=key)
    assert m0["actor/kl_coef"] == m1["actor/kl_coef"] == 0.1  # verl's key with use_kl_loss
    assert m1["actor/pg_clipfrac"] == 0.0 and m1["actor/ppo_kl"] == pytest.approx(0.0, abs=1e-7)
    # one micro-batch mean per rank and micro-batch: the token mean only when their token counts agree
    assert m1["actor/entropy"] == pytest.approx(rank0[True]["entropy"], rel=0.15)
    assert "actor/entropy" not in m0
