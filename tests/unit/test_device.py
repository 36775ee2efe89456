"""The device helper: which accelerator each rank uses, the LOCAL_RANK vLLM must see, dtypes, moves."""

from __future__ import annotations

import pytest
import torch

from hybridflow import device
from hybridflow.resharding.plan import HybridPlan, Layout


def test_device_index_under_ray_isolation_and_all_visible():
    # Ray's isolation: each actor sees one GPU, whatever its rank on the node.
    assert [device.device_index(r, visible=1) for r in range(8)] == [0] * 8
    # All of a node's GPUs visible (torchrun, RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES): local rank picks.
    assert [device.device_index(r, visible=8) for r in range(8)] == list(range(8))
    with pytest.raises(RuntimeError, match="local rank 4 has no GPU: only 4 are visible"):
        device.device_index(4, visible=4)
    with pytest.raises(ValueError, match="no accelerator"):
        device.device_index(0, visible=0)


def test_worker_device_with_fake_device_counts():
    assert device.worker_device(3, visible=0) == torch.device("cpu")
    assert device.worker_device(3, visible=1) == torch.device("cuda", 0)
    assert device.worker_device(3, visible=4) == torch.device("cuda", 3)


def test_local_ranks_follow_bundle_nodes():
    assert device.local_ranks(["a"] * 4) == [0, 1, 2, 3]
    assert device.local_ranks(["a", "a", "b", "b"]) == [0, 1, 0, 1]
    assert device.local_ranks(["a", "b", "a", "b"]) == [0, 0, 1, 1]  # interleaved placement


@pytest.mark.parametrize("nodes", [1, 2])
@pytest.mark.parametrize("t_g", [1, 2, 4])
def test_vllm_local_rank_for_rollout_tp(nodes, t_g):
    """Training TP 4 x DP `nodes`, 4 GPUs per node, generation TP t_g: every generation TP group stays on
    one node, and the LOCAL_RANK vLLM sees is a GPU that rank can actually use."""
    gpus_per_node = 4
    node_of_rank = [n for n in range(nodes) for _ in range(gpus_per_node)]
    local = device.local_ranks(node_of_rank)
    plan = HybridPlan(Layout(1, 4, nodes), p_g=1, t_g=t_g)
    for group in plan.replicas:
        assert len(group) == t_g and len({node_of_rank[r] for r in group}) == 1, group
    # Under Ray each actor sees its own GPU only: vLLM's local rank must be 0 on every rank (the old
    # bundle-index LOCAL_RANK made gpu_worker.init_device assert on all but the first rank of a node).
    assert [device.device_index(local[r], visible=1) for r in range(len(local))] == [0] * len(local)
    # With every GPU visible, the ranks of a node use distinct GPUs.
    for n in range(nodes):
        on_node = [device.device_index(local[r], visible=gpus_per_node) for r in range(len(local)) if node_of_rank[r] == n]
        assert sorted(on_node) == list(range(gpus_per_node))


def test_dtypes_and_moves_on_cpu():
    assert device.torch_dtype("bfloat16") is torch.bfloat16 and device.torch_dtype(torch.float16) is torch.float16
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        device.torch_dtype("fp8")
    device.bind(0)
    batch = {"ids": torch.arange(3), "x": [torch.ones(2, dtype=torch.float64)], "name": "keep"}
    moved = device.to_device(batch, dtype=torch.bfloat16)
    assert moved["ids"].dtype == torch.long and moved["x"][0].dtype == torch.bfloat16 and moved["name"] == "keep"
    assert device.to_host(moved)["x"][0].device == torch.device("cpu")
    assert set(device.memory_stats("m")) == {"m/peak_rss_gib"}
