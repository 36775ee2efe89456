"""The warm start stops at its target held-out accuracy, measured by greedy decoding and the task scorer."""

from __future__ import annotations

import torch


def test_warm_start_stops_at_the_target_accuracy(tmp_path):
    from hybridflow.data.arithmetic import write_arithmetic_parquet
    from hybridflow.models.char_tokenizer import build_char_tokenizer
    from hybridflow.models.tiny_qwen2 import build_tiny_qwen2
    from hybridflow.trainer.sft import greedy_accuracy, warm_start

    write_arithmetic_parquet(tmp_path / "data", max_operand=20, n_val=16, seed=1)
    build_tiny_qwen2(tmp_path / "base", build_char_tokenizer(tmp_path / "base"), hidden_size=64, num_layers=1, seed=1)
    exact = lambda response, answer: float(response.strip() == answer)  # noqa: E731
    train = str(tmp_path / "data" / "train.parquet")
    # target 0: reached at the first evaluation
    first = warm_start(str(tmp_path / "base"), str(tmp_path / "a"), train, steps=50, lr=1e-3, batch_size=8, seed=1,
                       target_accuracy=0.0, scorer=exact, dev_size=32, eval_every=3, max_new_tokens=4)
    assert first["steps"] == 3 and first["dev_accuracy"] is not None
    # unreachable target: runs every step, with the accuracy of the last evaluation
    full = warm_start(str(tmp_path / "base"), str(tmp_path / "b"), train, steps=6, lr=1e-3, batch_size=8, seed=1,
                      target_accuracy=1.1, scorer=exact, dev_size=32, eval_every=3, max_new_tokens=4)
    assert full["steps"] == 6 and 0.0 <= full["dev_accuracy"] <= 1.0

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tmp_path / "a"))
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "a"), dtype=torch.float32)
    pairs = [("Q: 1+1= A:", "2"), ("Q: 2+3= A:", "5")]
    always = greedy_accuracy(model, tok, pairs, lambda r, a: 1.0, max_new_tokens=3)
    assert always == 1.0 and greedy_accuracy(model, tok, pairs, lambda r, a: 0.0, max_new_tokens=3) == 0.0
