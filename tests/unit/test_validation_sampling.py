"""Validation samples as rollout.val_kwargs says (verl 0.9.1's ``_validate``): each held-out prompt answered n
times with the validation temperature/top_p/top_k, and val/accuracy the mean score of every answer (mean@n).
The driver's side is checked here, with a stand-in for the actor/rollout worker group that answers through
the real response layout; the engine's use of the settings is vLLM's SamplingParams (rollout/vllm_rollout.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hybridflow.trainer.main import load

QUICKSTART = "configs/quickstart_cpu.yaml"


class _Rollout:
    """The worker group's generate: records each call's sampling settings and answers every third row right."""

    def __init__(self, tokenizer, max_len):
        self.tokenizer, self.max_len, self.calls = tokenizer, max_len, []

    def dispatch_infos(self, mesh):
        return [{"dp_size": 2}]

    def generate(self, prompts):
        from hybridflow.workers.generation import responses_to_batch

        meta = prompts.meta
        self.calls.append((len(prompts), meta.get("temperature"), meta.get("top_p"), meta.get("top_k")))
        answers = [str(a) if i % 3 == 0 else "x" for i, a in enumerate(prompts.non_tensors["answer"])]
        tok = self.tokenizer
        ids = [tok(a, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for a in answers]
        out = responses_to_batch(prompts, ids, self.max_len, tok.pad_token_id, tok.eos_token_id)
        return _merge(prompts, out)


def _merge(prompts, out):
    from hybridflow.protocol import Batch

    kept = {k: v for k, v in prompts.tensors.items() if k not in out.tensors}
    return Batch(tensors={**kept, "prompts": prompts.tensors["input_ids"], **out.tensors},
                 non_tensors=dict(prompts.non_tensors), meta=dict(prompts.meta))


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from hybridflow.data.arithmetic import write_arithmetic_parquet
    from hybridflow.models.char_tokenizer import build_char_tokenizer

    root = tmp_path_factory.mktemp("valsampling")
    write_arithmetic_parquet(root / "data", max_operand=20, n_val=8, seed=1)
    return root, build_char_tokenizer(root / "tok")


def _driver(assets, *overrides):
    from hybridflow.data.dataset import PromptDataset
    from hybridflow.trainer.ppo import PPODriver, training_scorer

    root, tokenizer = assets
    cfg = load(["--config", QUICKSTART, f"data.val_files=[{root}/data/val.parquet]", "data.val_batch_size=4",
                *overrides])
    driver = PPODriver.__new__(PPODriver)  # the driver's validation alone: no worker groups started
    driver.cfg, driver.tokenizer, driver.train_scorer = cfg, tokenizer, training_scorer(cfg)
    driver.val_data = PromptDataset.from_config(cfg.data.val_files, tokenizer, cfg.data)
    rollout = _Rollout(tokenizer, cfg.data.max_response_length)
    driver.source = SimpleNamespace(generator=rollout, validation=rollout.generate)  # as the hybrid engine's
    driver.generation_dp = 2  # the run plan's generation replicas
    return driver


def test_validation_samples_n_answers_with_the_validation_settings(assets):
    driver = _driver(assets, "rollout.val_kwargs.n=3", "rollout.val_kwargs.temperature=0.7",
                     "rollout.val_kwargs.top_p=0.9", "rollout.val_kwargs.top_k=5")
    metrics, samples = driver.validate(n_samples=5)
    assert driver.generator.calls == [(12, 0.7, 0.9, 5)] * 2  # 4 prompts x 3 answers per call, 8 prompts
    assert metrics["val/accuracy"] == pytest.approx(1 / 3, rel=1e-6)  # every third answer is right: mean@3
    assert len(samples) == 5 and samples[0]["prompt"] == samples[1]["prompt"] == samples[2]["prompt"]


def test_validation_is_greedy_and_once_by_default(assets):
    driver = _driver(assets)
    metrics, _ = driver.validate()
    assert driver.generator.calls == [(4, 0.0, 1.0, -1)] * 2
    assert metrics["val/accuracy"] == pytest.approx(1 / 2, rel=1e-6)  # rows 0 and 3 of each call of 4
