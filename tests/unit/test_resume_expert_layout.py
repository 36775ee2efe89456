"""A MoE checkpoint resumes only at the expert-parallel size it was saved at (megatron-core 0.16.1 chains a second
optimizer for the experts where EP > 1 and cannot load one chain into the other: KeyError 'pre_wd_mult' at EP 2 -> 1,
'Expected 2 entries in state dict' at EP 1 -> 2, inside the workers). Refused in one line before start, both ways."""

from __future__ import annotations

import pytest
import yaml

from hybridflow.config import ConfigError
from hybridflow.plan import load_experiment
from hybridflow.trainer.preflight import run_plan
from hybridflow.trainer.resume_checks import check_checkpoint_fits
from hybridflow.trainer import checkpoint


MOE = "configs/quickstart_moe_cpu.yaml"  # actor EP 2 over 2 workers
ONE = ["actor.megatron.expert_model_parallel_size=1"]


def _model():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(hidden_size=64, num_attention_heads=2, num_key_value_heads=2, head_dim=32,
                          num_hidden_layers=2, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                          vocab_size=128)


def _check(path, overrides):
    """The resume check of a run with ``overrides`` on the MoE quickstart against the checkpoint at ``path``."""
    cfg, model = load_experiment([MOE], overrides), _model()
    check_checkpoint_fits(cfg, model, run_plan(cfg, model, 512), path)


def _saved_at(tmp_path, ep):
    """A checkpoint's config and HF config (what the resume check reads) saved at actor EP ``ep``."""
    _model().save_pretrained(tmp_path / "hf")
    (tmp_path / checkpoint.CONFIG_FILE).write_text(yaml.safe_dump({"actor": {"megatron": {
        "expert_model_parallel_size": ep}}}))
    return tmp_path


@pytest.mark.parametrize("saved,overrides,now", [(1, [], 2), (2, ONE, 1)], ids=["ep1_to_ep2", "ep2_to_ep1"])
def test_resuming_at_another_expert_parallel_size_is_one_line(tmp_path, saved, overrides, now):
    path = _saved_at(tmp_path, saved)
    with pytest.raises(ConfigError) as e:
        _check(path, overrides)
    assert str(e.value) == (
        f"resume: {path} was saved at actor.megatron.expert_model_parallel_size {saved}, this run has {now}: the "
        f"experts' optimizer state resumes only at the EP size it was saved at; resume with "
        f"actor.megatron.expert_model_parallel_size={saved}, or start a new output_dir from an export of it (model.path)")


@pytest.mark.parametrize("saved,overrides", [(2, []), (1, ONE)])
def test_resuming_at_the_saved_expert_parallel_size_passes(tmp_path, saved, overrides):
    _check(_saved_at(tmp_path, saved), overrides)
