"""optim.override_optimizer_config (verl's key: fields of megatron-core's OptimizerConfig set as given): verl's
spelling translates; a field megatron lacks, one hybridflow sets, the CPU offload on CPU workers and what megatron-core
itself refuses (the precision-aware optimizer without TE's FusedAdam) are one line before start; the memory plan keeps
the offloaded share of Adam's state off the GPU."""

from __future__ import annotations

import pytest
import torch

from hybridflow.megatron.optimizer_config import check_optimizer_overrides
from tests.unit.test_memory_plan import TINY, TINY_P, mp, rows, tiny  # noqa: F401 (the tiny fixture)
from tests.unit.test_verl_overrides import resolve

KEY = "actor.optim.override_optimizer_config"
OFFLOAD = {"optimizer_cpu_offload": True, "optimizer_offload_fraction": 0.5, "overlap_cpu_optimizer_d2h_h2d": True}


def check(overrides, on_gpu=True, distributed=True):
    return check_optimizer_overrides(overrides, KEY, dtype=torch.bfloat16, use_distributed_optimizer=distributed,
                                     on_gpu=on_gpu)


def test_verl_keys_translate_and_offload_is_taken_on_gpus():
    o = "actor_rollout_ref.actor.optim.override_optimizer_config."
    cfg = resolve([f"+{o}optimizer_cpu_offload=True", f"+{o}optimizer_offload_fraction=0.5",
                   f"+{o}overlap_cpu_optimizer_d2h_h2d=True", "trainer.n_gpus_per_node=8"])
    assert cfg.actor.optim.override_optimizer_config == OFFLOAD
    assert check(OFFLOAD) == OFFLOAD


@pytest.mark.parametrize("overrides,kwargs,message", [
    ({"adam_typo": 1}, {}, f"{KEY}.adam_typo: megatron-core's OptimizerConfig has no field 'adam_typo'"),
    ({"lr": 1.0}, {}, f"{KEY}.lr: set by hybridflow from optim.lr, not overridable"),
    (OFFLOAD, {"on_gpu": False}, f"{KEY}.optimizer_cpu_offload: megatron's HybridDeviceOptimizer offloads a GPU's"),
    (OFFLOAD, {"distributed": False}, f"{KEY}.optimizer_cpu_offload needs megatron.use_distributed_optimizer"),
    ({"use_precision_aware_optimizer": True}, {}, f"{KEY}.use_precision_aware_optimizer needs Transformer Engine"),
    ({**OFFLOAD, "optimizer_offload_fraction": 2.0}, {}, f"{KEY}.optimizer_offload_fraction must be in [0, 1], got 2.0"),
    ({"main_grads_dtype": "bfloat16"}, {}, f"{KEY}: megatron-core refuses it: main_grads_dtype can only be fp32"),
])
def test_what_megatron_or_hybridflow_refuses_is_one_line(overrides, kwargs, message):
    with pytest.raises(ValueError) as err:
        check(overrides, **kwargs)
    assert str(err.value).startswith(message) and "\n" not in str(err.value), err.value


def test_the_memory_plan_keeps_the_offloaded_adam_state_off_the_gpu(tiny):  # noqa: F811
    """bf16 with the distributed optimizer over d = 2: fp32 main params stay (4 bytes), half of Adam's 8 goes."""
    o = "actor.optim.override_optimizer_config"
    r = mp.plan(tiny(f"{o}.optimizer_cpu_offload=true", f"{o}.optimizer_offload_fraction=0.5"), mp.Shape.from_hf(TINY),
                gpu_mem_gib=1)
    assert rows(r, "training")["actor optimizer"] == TINY_P * (4 + 8 * 0.5) / 2
