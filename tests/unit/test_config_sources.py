"""One source of config defaults: the schema. The base YAML holds only commented, deliberate overrides;
`hybridflow config show` tells where each resolved value came from."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from hybridflow.config import config_to_dict, flat_items
from hybridflow.config.schema import ExperimentConfig
from hybridflow.tools.config_show import main, show
from hybridflow.plan import load_experiment

BASE = "configs/ppo_megatron.yaml"


def test_base_yaml_only_overrides_defaults_and_says_why():
    defaults = dict(flat_items(config_to_dict(ExperimentConfig())))
    base = flat_items(yaml.safe_load(open(BASE)))
    assert base, "the base config sets nothing"
    restated = [k for k, v in base if k in defaults and defaults[k] == v]
    assert not restated, f"{BASE} restates schema defaults (drift waiting to happen): {restated}"
    unknown = [k for k, _ in base if k not in defaults]
    assert not unknown, unknown
    for line in open(BASE).read().splitlines():
        if re.match(r"^\s+\w+: \S", line):  # a key with a value
            assert "#" in line, f"{BASE}: an override without its reason: {line.strip()!r}"


def _set_keys(path: Path) -> list[tuple[str, object]]:
    data = yaml.safe_load(path.read_text())
    data.pop("defaults", None)
    return flat_items(data)


@pytest.mark.parametrize("path", sorted(Path("configs").glob("*.yaml")), ids=str)
def test_no_config_restates_what_it_inherits(path):
    """Every value a file sets differs from what it would inherit (its defaults files, then the schema,
    with keys that default to another key's value resolved): a restated value is drift waiting to happen."""
    parents = [path.parent / p for p in (yaml.safe_load(path.read_text()).get("defaults") or [])]
    inherited = load_experiment(parents) if parents else ExperimentConfig()
    inherited.resolve_defaults()
    values = dict(flat_items(config_to_dict(inherited)))
    restated = [k for k, v in _set_keys(path) if k in values and values[k] == v]
    assert not restated, f"{path} restates what it inherits: {restated}"


def test_show_names_default_file_and_override(capsys):
    text = show(["configs/quickstart_grpo_cpu.yaml"], ["actor.optim.lr=3e-4"])
    lines = {line.split(" = ")[0]: line for line in text.splitlines()}
    assert lines["trainer.seed"].endswith("# default")  # set by no file
    assert lines["data.batch_size"].split("# ")[1] == "configs/quickstart_grpo_cpu.yaml"
    assert lines["data.max_response_length"].split("# ")[1] == "configs/quickstart_cpu.yaml"
    assert lines["resources.gpus_per_worker"].split("# ")[1] == "configs/quickstart_cpu.yaml"
    assert lines["actor.megatron.dtype"].split("# ")[1] == "configs/quickstart_cpu.yaml"
    assert lines["data.max_prompt_length"].startswith("data.max_prompt_length = 16 ")
    assert lines["actor.optim.lr"].split("# ")[1] == "override 'actor.optim.lr=3e-4'"
    assert len(lines) == len(flat_items(config_to_dict(ExperimentConfig())))
    assert main(["show", "--config", BASE, "actor.optim.lrr=1"]) == 2
    assert "did you mean 'actor.optim.lr'" in capsys.readouterr().err


def test_dump_is_the_schema_defaults(tmp_path, capsys):
    assert main(["dump"]) == 0
    path = tmp_path / "defaults.yaml"
    path.write_text(capsys.readouterr().out)
    defaults = ExperimentConfig()
    defaults.resolve_defaults()  # loading fills the keys that default to another key's value
    assert config_to_dict(load_experiment([str(path)])) == config_to_dict(defaults)
