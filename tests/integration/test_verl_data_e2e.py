"""verl's data format end to end: a parquet as verl's preprocessing writes it (chat prompts,
reward_model.ground_truth, data_source openai/gsm8k) and a tiny Qwen2 whose tokenizer has a ChatML chat
template train 2 PPO steps through Ray, vLLM and megatron-core; validation scores by the same routing."""

from __future__ import annotations

import math
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hybridflow.rewards import gsm8k
from tests.integration.conftest import SMALL, run_steps

pytestmark = pytest.mark.integration


def verl_rows(pairs, split):
    return [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"{a}+{b}="}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": str(a + b)},
             "extra_info": {"split": split, "index": i}} for i, (a, b) in enumerate(pairs)]


@pytest.fixture(scope="module")
def verl_assets(tmp_path_factory):
    from hybridflow.models.tiny_qwen2 import build_tiny_qwen2_chat

    out = tmp_path_factory.mktemp("verl_data")
    build_tiny_qwen2_chat(out / "model", num_layers=2, max_position_embeddings=64)
    train = verl_rows([(a, 2 * a + 1) for a in range(16)], "train")
    train[5]["prompt"][0]["content"] = "What is the sum of " + "1+" * 10 + "1?"  # over max_prompt_length
    pq.write_table(pa.Table.from_pylist(train), out / "train.parquet")
    pq.write_table(pa.Table.from_pylist(verl_rows([(a, 3) for a in range(20, 24)], "test")), out / "test.parquet")
    return out


def test_two_ppo_steps_on_verl_format(verl_assets, tmp_path, ray_cluster):
    from hybridflow.plan import load_experiment

    d = verl_assets
    cfg = load_experiment(["configs/quickstart_cpu.yaml"], [
        f"model.path={d}/model", f"data.train_files=[{d}/train.parquet]", f"data.val_files=[{d}/test.parquet]",
        f"trainer.output_dir={tmp_path}/run", "prepare.enable=false", *SMALL, "data.batch_size=15",
        "actor.ppo_mini_batch_size=15", "actor.ppo_micro_batch_size_per_gpu=5", "critic.ppo_mini_batch_size=15",
        "critic.ppo_micro_batch_size_per_gpu=5", "data.max_prompt_length=32", "data.max_response_length=8",
        "data.filter_overlong_prompts=true"])

    def check(trainer, step, metrics):
        for key in ("actor/pg_loss", "actor/grad_norm", "critic/vf_loss", "reward/score_mean"):
            assert math.isfinite(metrics[key]), (step, key, metrics[key])
        if step == 1:
            data = trainer.train_data
            assert data.filtered == {f"{d}/train.parquet": 1} and len(data) == 15
            first = data.batch([0])
            ids = first.tensors["input_ids"][0][first.tensors["attention_mask"][0].bool()].tolist()
            tok = trainer.tokenizer  # the folder's, as the driver loads it
            assert ids == tok.apply_chat_template([{"role": "user", "content": "0+1="}], add_generation_prompt=True,
                                                  tokenize=True)["input_ids"]
            assert tok.convert_ids_to_tokens(ids).count("<|im_start|>") == 2 and tok.decode(ids).endswith("assistant")
        if step == 2:  # validation: greedy answers scored by data_source openai/gsm8k's scorer
            val, samples = trainer.validate(n_samples=4)
            assert len(samples) == 4 and math.isfinite(val["val/accuracy"])
            for sample in samples:
                a, b = map(int, re.search(r"(\d+)\+(\d+)=", sample["prompt"]).groups())
                assert sample["score"] == gsm8k.compute_score(sample["response"], str(a + b))

    history = run_steps(cfg, 2, check)
    assert len(history) == 2
