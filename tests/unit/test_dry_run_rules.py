"""A dry run is a start minus the model: every rule that needs only the config refuses in
``--dry-run``, before any warm start or worker; the rules that need the model run on the quickstart's base model
before its warm start (trainer/session.py). The walk at the end holds the split: a model rule (preflight.MODEL_RULES)
given a model that cannot be read must either read it or pass; refusing without it means the rule is config-only and
runs too late."""

from __future__ import annotations

import pytest

from hybridflow.config import ConfigError
from hybridflow.plan import load_experiment
from hybridflow.trainer import preflight
from hybridflow.trainer.main import main

QUICK, MOE = "configs/quickstart_cpu.yaml", "configs/quickstart_moe_cpu.yaml"
VPP = ["resources.n_workers=2", "actor.megatron.pipeline_model_parallel_size=2",
       "actor.megatron.virtual_pipeline_model_parallel_size=2"]

# (config, our overrides, verl overrides, the one line's text): what a start refused only after a warm start or
# inside a worker (hardening 4's probe), and a few that were always config rules.
CONFIG_ONLY = [
    (MOE, [], ["actor_rollout_ref.actor.megatron.override_transformer_config.moe_grouped_gemm=True"],
     "moe_grouped_gemm: grouped-GEMM experts compute in bfloat16"),
    (QUICK, [*VPP, "actor.ppo_mini_batch_size=2", "data.batch_size=2", "actor.ppo_micro_batch_size_per_gpu=1"], [],
     "virtual pipeline stages need more than pipeline_model_parallel_size (2) micro-batches"),
    (QUICK, ["schedule.mode=colocate_async", "schedule.partial_rollout=false"], [],
     "schedule.partial_rollout=false: colocate_async always carries unfinished responses"),
    (QUICK, ["model.lora.adapter_path=/nonexistent/adapter"], [],
     "model.lora.adapter_path: no adapter rank in /nonexistent/adapter/adapter_config.json"),
    (QUICK, ["rollout.engine_kwargs={quantization: fp8}"], [], "rollout.engine_kwargs.quantization: not supported"),
    (QUICK, ["actor.optim.lr_warmup_steps=100"], [], "actor.optim.lr_warmup_steps: the warmup (100 steps) must be "
                                                    "shorter than the decay (100 steps"),
    (QUICK, ["actor.megatron.override_transformer_config={apply_rope_fusion: true}"], [],
     "apply_rope_fusion: megatron's fused rotary embedding needs Transformer Engine"),
    # a stage split other than first/last layer counts (plan/stages.py)
    (QUICK, [], ["+actor_rollout_ref.actor.megatron.override_transformer_config.account_for_loss_in_pipeline_split=True"],
     "account_for_loss_in_pipeline_split: this pipeline split is not built here"),
    (QUICK, [], ["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
                 "actor_rollout_ref.actor.megatron.context_parallel_size=1"], "both set actor.megatron.context_parallel_size"),
]


@pytest.mark.parametrize("config,ours,verl,message", CONFIG_ONLY, ids=[c[3][:40] for c in CONFIG_ONLY])
def test_a_config_only_rule_refuses_in_the_dry_run(config, ours, verl, message, capsys):
    argv = ["--config", config, *ours, "--dry-run"] + (["--verl-overrides", *verl] if verl else [])
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("config error: ") and message in err[0], err


class Unread(Exception):
    """A model rule read the model."""


class NoModel:
    def __getattr__(self, name):
        raise Unread(name)

    def to_dict(self):
        raise Unread("to_dict")


def _walk_configs():
    """Every quickstart overlay, and every trigger of the config-only refusals whose config rules were left out."""
    for config in ("configs/quickstart_cpu.yaml", "configs/quickstart_grpo_cpu.yaml", "configs/quickstart_lora_cpu.yaml",
                   MOE, "configs/quickstart_dapo_cpu.yaml", "configs/quickstart_async_cpu.yaml"):
        yield config, []
    for config, ours, verl, _ in CONFIG_ONLY:
        if not verl:
            yield config, ours
    yield MOE, ["actor.megatron.override_transformer_config={moe_grouped_gemm: true}"]


@pytest.mark.parametrize("rule", preflight.MODEL_RULES, ids=lambda r: r.__name__)
def test_the_model_rules_need_the_model(rule):
    checked = 0
    for config, overrides in _walk_configs():
        try:
            cfg = load_experiment([config], overrides)
            plan = preflight.check_config(cfg)
        except ConfigError:
            continue  # refused by the config rules alone (the dry run): the model rules never see it
        try:
            rule(cfg, NoModel(), plan)
        except Unread:
            pass
        except ConfigError as e:
            pytest.fail(f"{rule.__name__} refused {config} {overrides} without reading the model: a config-only rule "
                        f"that runs after the warm start ({e})")
        checked += 1
    assert checked >= 6
