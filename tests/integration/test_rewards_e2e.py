"""2 steps with the reward-model worker (PPO: actor, critic and reward model share each bundle; also with a
separate rollout pool generating ahead) and with a user's custom reward function (GRPO: the scores are grouped)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.integration.conftest import make_cfg, run_steps

pytestmark = pytest.mark.integration

ALGOS = {"ppo": [], "grpo": ["algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=false",
                             "actor.use_kl_loss=true", "rollout.n=2", "data.batch_size=8",
                             "actor.ppo_mini_batch_size=8"]}


@pytest.fixture(scope="module")
def reward_model_dir(assets, tmp_path_factory):
    """A tiny Qwen2 sequence classifier (one logit) with the policy's tokenizer, built locally."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForSequenceClassification

    out = tmp_path_factory.mktemp("rm")
    tok = AutoTokenizer.from_pretrained(f"{assets}/sft")
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(tok) + (-len(tok) % 16), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, num_labels=1, pad_token_id=tok.pad_token_id)
    Qwen2ForSequenceClassification(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def custom_reward_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("custom") / "my_reward.py"
    path.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    # a dict result with a 'score' key, as verl allows\n"
        "    return {'score': 1.0 if solution_str.strip() == ground_truth else 0.1 * len(solution_str.strip())}\n")
    return path


SEPARATE = ["schedule.mode=separate_async", "resources.rollout_n_workers=1", "resources.cpus_per_worker=0.5",
            "schedule.parameter_sync_step=1"]


@pytest.mark.parametrize("algo,mode", [("ppo", []), ("ppo", SEPARATE)], ids=["sync", "separate_async"])
def test_reward_model_worker(algo, mode, assets, reward_model_dir, tmp_path, ray_cluster):
    cfg = make_cfg(assets, tmp_path, *ALGOS[algo], "reward_model.enable=true", f"reward_model.path={reward_model_dir}",
                   *mode)
    history = run_steps(cfg, 2)
    for m in history:
        assert math.isfinite(m["reward/score_mean"]) and math.isfinite(m["actor/pg_loss"])
        assert "reward/rule_score_mean" in m  # the rule accuracy is still reported
    # A randomly initialised reward model gives non-binary scores: the RM, not the rule, was used.
    assert any(0 < abs(m["reward/score_mean"]) and m["reward/score_mean"] not in (0.0, 1.0) for m in history)


@pytest.mark.parametrize("algo", ["grpo"])
def test_custom_reward_function(algo, assets, custom_reward_file, tmp_path, ray_cluster):
    cfg = make_cfg(assets, tmp_path, *ALGOS[algo], f"custom_reward_function.path={custom_reward_file}")
    history = run_steps(cfg, 2)
    for m in history:
        assert math.isfinite(m["actor/pg_loss"])
        assert m["reward/score_mean"] > 0  # partial credit from the user's function (0.1 per character)


def test_custom_reward_errors_are_config_errors(assets, tmp_path, custom_reward_file):
    from hybridflow.config import ConfigError

    with pytest.raises(ConfigError, match="custom_reward_function.path.*not found"):
        make_cfg(assets, tmp_path, f"custom_reward_function.path={tmp_path}/missing.py")
    with pytest.raises(ConfigError, match="custom_reward_function.name.*'nope'"):
        make_cfg(assets, tmp_path, f"custom_reward_function.path={custom_reward_file}",
                 "custom_reward_function.name=nope")
    with pytest.raises(ConfigError, match="reward_model: path is required"):
        make_cfg(assets, tmp_path, "reward_model.enable=true")
