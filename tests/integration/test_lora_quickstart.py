"""The LoRA quickstart overlay (configs/quickstart_lora_cpu.yaml) through Ray, megatron-core and vLLM: the frozen
base with trained adapters, the reference policy the actor with its adapters off, the adapters in vLLM's LoRA, a
checkpoint of the adapters only that resumes exactly, and `hybridflow export` of it as a peft adapter folder (and,
with --merged, as the merged model the trainer exports itself)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from hybridflow.config.model import LORA_TARGETS
from hybridflow.plan.model_shape import Shape, lora_params, lora_peft_params
from tests.integration.conftest import make_cfg
from tests.integration.test_checkpoint_resume import assert_same_weights, comparable, fit, weights
from tests.numerics import assert_close

pytestmark = pytest.mark.integration

RUN = ["data.batch_size=8", "actor.ppo_mini_batch_size=8", "trainer.total_steps=2", "trainer.save_every=1",
       "trainer.val_every=-1", "trainer.val_before_train=false", "trainer.max_checkpoints=null"]


@pytest.fixture(scope="module")
def straight(assets, tmp_path_factory, ray_cluster):
    out = tmp_path_factory.mktemp("lora")
    cfg = make_cfg(assets, out, *RUN, config="configs/quickstart_lora_cpu.yaml")
    assert cfg.model.lora.rank == 16 and not cfg.model.lora.merge and cfg.actor.use_kl_loss
    return Path(cfg.trainer.output_dir), fit(cfg)


def test_lora_trains_adapters_against_the_base_as_reference(straight, assets):
    """Step 1: the adapters start with B = 0, so the actor is the base model and its KL to the reference (the same
    forward with the adapters off) is 0. Step 2: one update has moved the adapters: the KL is > 0, and vLLM, which
    sampled step 2 with the adapters pushed into its LoRA after step 1 (the base only at step 1), gives the trainer's
    log-probs (a vLLM left at the base weights, or at step 1's adapters, would be off by the KL's order)."""
    _, (first, second) = straight
    shape = Shape.from_hf(json.loads((assets / "sft" / "config.json").read_text()))
    for metrics in (first, second):
        assert all(math.isfinite(v) for v in metrics.values() if isinstance(v, float)), metrics
    assert second["actor/kl_loss"] > 1e-7, second["actor/kl_loss"]
    # step 1's actor and reference are one model: its KL is rounding, a millionth of step 2's at most
    assert abs(first["actor/kl_loss"]) <= 1e-6 * second["actor/kl_loss"], (first["actor/kl_loss"], second["actor/kl_loss"])
    assert second["training/rollout_probs_diff_max"] < 1e-4, second["training/rollout_probs_diff_max"]
    # the adapters' fp32 bytes: this rank's in megatron's layout, and handed to vLLM whole in peft's (one A per
    # projection) at every sync, the frozen base only at the first
    assert second["reshard/lora_adapter_bytes"] == 4 * lora_params(shape, 16, LORA_TARGETS), second
    assert first["reshard/lora_sync_bytes"] == second["reshard/lora_sync_bytes"] == 4 * lora_peft_params(
        shape, 16, LORA_TARGETS), second


def test_lora_checkpoint_resumes_exactly(straight, assets, tmp_path):
    out, rows = straight
    cfg = make_cfg(assets, tmp_path, *RUN, "trainer.resume_mode=resume_path",
                   f"trainer.resume_from_path={out}/checkpoints/step_1", config="configs/quickstart_lora_cpu.yaml")
    resumed = fit(cfg)
    got, want = comparable(resumed, 1), comparable(rows, 1)
    assert got == want, {k: (got[2].get(k), v) for k, v in want[2].items() if got[2].get(k) != v}
    assert_same_weights(out / "actor_hf", Path(cfg.trainer.output_dir) / "actor_hf")


def test_export_of_a_lora_checkpoint(straight, tmp_path):
    """The peft adapter folder loads with peft on the base model and merges into the trainer's own export (fp32
    rounding: peft merges in another order); --merged writes that export bit for bit."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from hybridflow.cli import main

    out, _ = straight
    assert main(["export", "--checkpoint", str(out), "--out", str(tmp_path / "adapter")]) == 0
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == ["adapter_config.json",
                                                                         "adapter_model.safetensors"]
    assert main(["export", "--checkpoint", str(out), "--out", str(tmp_path / "merged"), "--merged"]) == 0
    assert_same_weights(out / "actor_hf", tmp_path / "merged")
    import yaml

    base = yaml.safe_load((out / "checkpoints" / "step_2" / "config.yaml").read_text())["model"]["path"]
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                      str(tmp_path / "adapter")).merge_and_unload()
    want = weights(out / "actor_hf")
    got = {k: v for k, v in model.state_dict().items() if k in want}
    assert got.keys() == want.keys()
    assert_close(got, want, what="peft's merge of the exported adapters vs the trainer's merged export")
