"""The real experiment schema and shipped YAML: good configs load, bad ones fail in one line naming the key."""

from __future__ import annotations

import pytest

from hybridflow.config import ConfigError
from hybridflow.plan import load_experiment, resolve
from hybridflow.trainer.main import main

QUICKSTART = "configs/quickstart_cpu.yaml"


def load(*overrides):
    return load_experiment([QUICKSTART], list(overrides))


def test_quickstart_and_base_load():
    cfg = load()
    assert cfg.prepare.enable and cfg.data.batch_size == 128 and resolve(cfg).needs.critic
    base = load_experiment(["configs/ppo_megatron.yaml"])
    assert base.rollout.dtype == "bfloat16" and base.resources.n_workers == 8


def test_overrides_are_typed():
    cfg = load("actor.optim.lr=3e-4", "rollout.n=4", "trainer.total_steps=7", "algorithm.use_kl_in_reward=false")
    assert cfg.actor.optim.lr == pytest.approx(3e-4)
    assert (cfg.rollout.n, cfg.trainer.total_steps, cfg.algorithm.use_kl_in_reward) == (4, 7, False)


@pytest.mark.parametrize("override, message", [
    ("actor.optim.lrr=1e-4", "unknown key 'actor.optim.lrr' in override 'actor.optim.lrr=1e-4'; did you mean 'actor.optim.lr'?"),
    ("data.batch_size=abc", "key 'data.batch_size' expects int, got str 'abc'"),
    ("actor.ppo_micro_batch_size_per_gpu=48", "actor.ppo_mini_batch_size x rollout.n (128 sequences) must split into "
     "the actor's 1 data-parallel ranks and then into micro-batches of actor.ppo_micro_batch_size_per_gpu (48)"),
    ("data.batch_size=48", "actor.ppo_mini_batch_size (128 prompts) must divide data.batch_size (48)"),
    ("actor.ppo_micro_batch_size_per_gpu=0", "actor: ppo_micro_batch_size_per_gpu must be >= 1, got 0"),
    ("critic.placement=elsewhere", "key 'critic.placement' expects one of ['colocated', 'separate']"),
    ("algorithm.adv_estimator=gaee", "algorithm: unknown advantage estimator 'gaee'; known:"),
    ("actor.loss_agg_mode=mean", "actor: unknown loss aggregation mode 'mean'; known:"),
    ("actor.megatron.tensor_model_parallel_size=2", "resources.n_workers (1) is not divisible by actor tensor x context x pipeline parallel size (2)"),
    ("reward.name=gsm9k", "reward: unknown reward scorer 'gsm9k'; known: arithmetic"),
    ("rollout.temperature=-1", "rollout: temperature must be >= 0, got -1"),
    ("actor.clip_ratio_c=1.0", "actor: clip_ratio_c must be > 1, got 1.0"),
    ("actor.optim=3", "key 'actor.optim' expects a mapping"),
    ("trainer.total_steps", "bad override 'trainer.total_steps': expected key.sub=value"),
    ("actor.use_kl_loss=1", "key 'actor.use_kl_loss' expects bool, got int 1"),
])
def test_bad_config_is_one_clear_line(override, message):
    with pytest.raises(ConfigError) as err:
        load(override)
    text = str(err.value)
    assert message in text, text
    assert "\n" not in text


def test_unknown_key_in_file_names_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"defaults: [{__import__('os').path.abspath(QUICKSTART)}]\ntrainer:\n  totl_steps: 3\n")
    with pytest.raises(ConfigError, match=r"unknown key 'trainer.totl_steps' in .*bad.yaml; did you mean 'trainer.total_steps'\?"):
        load_experiment([str(bad)])


def test_cli_reports_config_errors_before_starting_anything(capsys):
    assert main(["--config", QUICKSTART, "data.max_response_length=zero"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("config error: key 'data.max_response_length' expects int")


def test_cli_reports_missing_data_file(capsys, tmp_path):
    assert main(["--config", QUICKSTART, "prepare.enable=false", f"model.path={tmp_path}",
                 f"data.train_files=[{tmp_path}/nope.parquet]"]) == 2
    assert f"data.train_files: file not found: {tmp_path}/nope.parquet" in capsys.readouterr().err


@pytest.mark.parametrize("path", sorted(__import__("glob").glob("configs/*.yaml")))
def test_every_shipped_config_loads(path):
    cfg = load_experiment([path])
    assert cfg.data.batch_size > 0


def test_dry_run_takes_overrides_after_it(capsys):
    """`--dry-run key=value ...` was `unrecognized arguments`: overrides come anywhere, in their order."""
    assert main(["--config", QUICKSTART, "trainer.seed=3", "--dry-run", "trainer.total_steps=2", "trainer.seed=4"]) == 0
    out = capsys.readouterr().out
    assert "trainer.total_steps = 2 " in out and "# override 'trainer.total_steps=2'" in out
    assert "# override 'trainer.seed=4'" in out
    with pytest.raises(SystemExit):
        main(["--config", QUICKSTART, "--dry-run", "--bogus"])
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_an_empty_section_plus_an_override_keeps_the_base_values(tmp_path, capsys):
    """A file with `trainer:` and nothing under it, over the quickstart, plus a trainer override: the base's
    trainer section was wiped (its 100 steps became the default epochs' thousands) while the dry run still
    named the base file as the source of the values."""
    top = tmp_path / "top.yaml"
    top.write_text(f"defaults: [{__import__('os').path.abspath(QUICKSTART)}]\ntrainer:\ndata:\n  batch_size: 128\n")
    assert main(["--config", str(top), "--dry-run", "trainer.seed=5"]) == 0
    lines = {line.split(" = ")[0]: line for line in capsys.readouterr().out.splitlines() if " = " in line}
    assert lines["trainer.total_steps"].startswith("trainer.total_steps = 100 ")
    assert lines["trainer.total_steps"].endswith(f"# {__import__('os').path.abspath(QUICKSTART)}")
    assert lines["trainer.experiment_name"].startswith("trainer.experiment_name = quickstart_cpu ")
    assert lines["trainer.seed"].endswith("# override 'trainer.seed=5'") and lines["data.batch_size"].endswith(str(top))
