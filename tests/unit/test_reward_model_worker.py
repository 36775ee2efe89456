"""The reward-model worker scores on its own device (its GPU share; the CPU here) in reward_model.dtype."""

import pytest
import torch

from hybridflow import device
from hybridflow.config.schema import RewardModel
from hybridflow.protocol import Batch
from tests.numerics import assert_close


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory):
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    from hybridflow.models.char_tokenizer import build_char_tokenizer

    out = tmp_path_factory.mktemp("rm")
    tok = build_char_tokenizer(out)
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(tok) + (-len(tok) % 16), hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, num_labels=1,
                      pad_token_id=tok.pad_token_id)
    Qwen2ForSequenceClassification(cfg).save_pretrained(out)
    return out, tok


def _batch(tok):
    prompts = torch.tensor([tok.encode("1+2=")], dtype=torch.long).repeat(2, 1)
    responses = torch.tensor([tok.encode("3"), tok.encode("4")], dtype=torch.long)
    mask = torch.ones(2, prompts.shape[1] + 1, dtype=torch.long)
    return Batch.from_dict(tensors={"prompts": prompts, "responses": responses, "attention_mask": mask,
                                    "response_mask": torch.ones(2, 1, dtype=torch.long)})


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_scores_on_its_device_in_the_configured_dtype(reward_model_dir, dtype):
    from transformers import AutoModelForSequenceClassification

    from hybridflow.plan.specs import RewardModelSpec
    from hybridflow.workers.reward_model import RewardModelWorker

    path, tok = reward_model_dir
    rm = RewardModel(enable=True, path=str(path), micro_batch_size=1, dtype=dtype)
    worker = RewardModelWorker(RewardModelSpec(rm, str(path)))
    params = list(worker.model.parameters())
    assert {p.dtype for p in params} == {getattr(torch, dtype)}
    assert {p.device for p in params} == {device.current()}
    scores = worker.compute_rm_score(_batch(tok)).tensors["rm_scores"]
    assert scores.device == device.CPU and scores.dtype == torch.float32  # back on the host for the driver
    reference = AutoModelForSequenceClassification.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        expected = torch.cat([reference(**tok(text, return_tensors="pt")).logits[:, 0]
                              for text in ("1+2=3", "1+2=4")])
    assert_close(scores, expected, dtype=getattr(torch, dtype), slack=2, what="reward scores")
