"""How a generation shard reaches vLLM: checkpoint-shaped staging copies (vLLM-CPU's loaders) are counted
in the transition's reported peak; where vLLM takes its own layout nothing is staged."""

import pytest

from hybridflow.resharding.transition import TransitionStats
from hybridflow.resharding.vllm_layout import hf_to_vllm_shard, to_checkpoint_names
from tests.unit.test_vllm_layout import model  # noqa: F401 (the same one-layer Qwen2)


def _nbytes(t):
    return t.numel() * t.element_size()


@pytest.mark.parametrize("t_g", [2, 4])
def test_staging_is_counted_at_the_largest_checkpoint_tensor(model, t_g):
    cfg, hf = model
    stats = TransitionStats("hybrid", peak_extra_bytes=1000)
    shard = hf_to_vllm_shard(hf, cfg, 1, t_g)
    for _ in to_checkpoint_names(shard.items(), cfg, 1, t_g, stats):
        pass
    # One staged tensor at a time, each t_g times its shard piece: the largest is a whole checkpoint tensor
    # (the 128 x 64 embedding and lm_head here).
    assert stats.staging_bytes == max(_nbytes(t) for t in hf.values()) == 128 * 64 * 4
    assert stats.staging_bytes > max(_nbytes(t) for t in shard.values())
    metrics = stats.as_metrics()
    assert metrics["reshard/peak_extra_bytes"] == 1000 + stats.staging_bytes
    assert metrics["reshard/staging_bytes"] == stats.staging_bytes


def test_nothing_is_staged_at_generation_tp_1(model):
    cfg, hf = model
    stats = TransitionStats("hybrid")
    out = dict(to_checkpoint_names(hf_to_vllm_shard(hf, cfg, 0, 1).items(), cfg, 0, 1, stats))
    assert stats.staging_bytes == 0 and set(out) == set(hf)
