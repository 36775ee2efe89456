"""model.lora.merge false (the adapters into vLLM's LoRA, workers/generation.load_adapters): resolved where it is
built (a dense model, the colocated rollout), refused before start in one line elsewhere; the engine's max_lora_rank."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hybridflow.config.model import vllm_lora_rank
from hybridflow.plan import load_experiment, resolve
from hybridflow.workers.generation import adapter_rank
from tests.unit.test_moe_rules import DENSE, MOE, SEPARATE

LORA = "configs/quickstart_lora_cpu.yaml"
MOE_MODEL = SimpleNamespace(**{**vars(DENSE), "model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2,
                               "moe_intermediate_size": 32, "head_dim": 16})


def test_a_dense_colocated_run_takes_adapters_into_vllm():
    plan = resolve(load_experiment([LORA], ["model.lora.merge=false"]), DENSE)
    assert adapter_rank(plan.actor_spec) == 16
    assert adapter_rank(resolve(load_experiment([LORA], ["model.lora.merge=true"]), DENSE).actor_spec) == 0
    assert [vllm_lora_rank(r) for r in (1, 4, 8, 9, 64, 300, 512)] == [1, 8, 8, 16, 64, 320, 512]


@pytest.mark.parametrize("config,overrides,model,message", [
    (MOE, ["model.lora.rank=8"], MOE_MODEL, "is a mixture-of-experts model, whose adapters reach vLLM merged here"),
    (LORA, SEPARATE, DENSE, "the rollout pool of schedule.mode separate_async receives merged weights"),
])
def test_adapter_only_sync_elsewhere_is_refused_in_one_line(config, overrides, model, message):
    with pytest.raises(ValueError, match=message) as err:
        resolve(load_experiment([config], [*overrides, "model.lora.merge=false"]), model)
    assert "\n" not in str(err.value)
