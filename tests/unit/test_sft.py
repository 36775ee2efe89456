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


def test_length_grouped_loss_has_the_gradient_of_the_whole_padded_batch(tmp_path):
    """sft_loss pads each length group to its own longest (the tools warm start mixes ~30- and ~110-token
    demonstrations) and weighs every answer token as one padded batch does: same loss, same gradient."""
    from transformers import AutoModelForCausalLM

    from hybridflow.models.char_tokenizer import build_char_tokenizer
    from hybridflow.models.tiny_qwen2 import build_tiny_qwen2
    from hybridflow.trainer.sft import _sft_batch, length_groups, sft_loss
    from tests.numerics import assert_close

    build_tiny_qwen2(tmp_path, build_char_tokenizer(tmp_path), hidden_size=64, num_layers=2, seed=1)
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    sequences = []
    for n, answer in [(30, 4), (110, 60), (28, 3), (112, 70), (29, 5), (9, 2)]:
        ids = torch.randint(3, 40, (n,), generator=g).tolist()
        sequences.append((ids, [0] * (n - answer) + [1] * answer))
    assert [len(grp) for grp in length_groups(sequences)] == [1, 3, 2]  # 9 | 28-30 | 110-112

    ids, mask, labels = _sft_batch(0, sequences)
    want = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                 labels=labels).loss
    want.backward()
    want_grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    got = sft_loss(model, 0, sequences)
    # the same sums in another order (per group), and a padded row's attention over fewer pads
    assert_close(got, want.detach(), slack=10, what="length-grouped loss vs one padded batch")
    assert_close({k: p.grad for k, p in model.named_parameters()}, want_grads, slack=100,
                 what="length-grouped gradient vs one padded batch")


def test_the_stopping_rule_is_checked_five_times_as_often_once_half_way():
    """The tiny models' greedy accuracy jumps near the target (0.31 -> 0.49 between two checks 10 steps apart on the
    quickstart), so checks every eval_every steps stopped the warm start anywhere up to 0.15 past it."""
    from hybridflow.trainer.sft import _every

    assert _every(10, None, 0.4) == 10 and _every(10, 0.19, 0.4) == 10
    assert _every(10, 0.2, 0.4) == 2 and _every(10, 0.39, 0.4) == 2 and _every(3, 0.3, 0.4) == 1
