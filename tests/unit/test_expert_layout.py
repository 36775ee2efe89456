"""MoE expert layouts that every worker would refuse only after loading the model are settled before start:
expert TP defaults to 1 when EP > 1 (as verl's MoE examples set it), and an explicit expert TP the
transition cannot reshard is one line on every device."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hybridflow.plan import ParallelLayout, load_experiment

MOE = SimpleNamespace(model_type="qwen3_moe", num_experts=8, moe_intermediate_size=64)


def _actor(*overrides):
    cfg = load_experiment(["configs/quickstart_moe_cpu.yaml"], ["actor.megatron.tensor_model_parallel_size=2", *overrides])
    return cfg.actor.megatron


def check_expert_layout(mp, model, on_gpu):
    ParallelLayout.of("actor", mp, 4, "resources.n_workers").check_experts(model, "m", on_gpu)


@pytest.fixture(params=[False, True], ids=["cpu", "gpu"])
def on_gpu(request):
    return request.param


def test_expert_tp_defaults_to_1_with_ep_above_1(on_gpu):
    mp = _actor("actor.megatron.expert_model_parallel_size=2")
    assert mp.expert_tensor_parallel_size == 1
    check_expert_layout(mp, MOE, on_gpu)  # passes: the layout the workers can run


def test_without_ep_expert_tp_stays_megatrons_default():
    mp = _actor("actor.megatron.expert_model_parallel_size=1")
    assert mp.expert_tensor_parallel_size is None  # None: the TP size (megatron's default)


def test_an_explicit_expert_tp_the_transition_cannot_move_is_one_line_on_every_device(on_gpu):
    mp = _actor("actor.megatron.expert_model_parallel_size=2", "actor.megatron.expert_tensor_parallel_size=2",
                "resources.n_workers=4")
    with pytest.raises(ValueError, match=r"^actor\.megatron\.expert_tensor_parallel_size \(2\) must be 1"):
        check_expert_layout(mp, MOE, on_gpu)
