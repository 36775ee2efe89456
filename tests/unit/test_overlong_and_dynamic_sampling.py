"""DAPO's overlong reward shaping at the buffer's edges, and dynamic sampling: groups whose rewards are all equal
are dropped and further generation batches fill the step (trainer/dynamic_sampling.py, driven here with a
scoring function in place of vLLM: the filter and the refill are the driver's own code)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridflow.protocol import Batch
from hybridflow.rewards.overlong import overlong_penalty
from hybridflow.trainer.dynamic_sampling import DynamicSamplingError, fill_batch, informative_groups
from hybridflow.trainer.experience import as_group_ids


@pytest.mark.parametrize("factor", [1.0, 0.5])
def test_overlong_penalty_at_the_buffer_edges(factor):
    # max 20 tokens, buffer 4: no penalty up to 16 tokens, then -factor/4 per token, -factor at 20
    lengths = torch.tensor([0, 15, 16, 17, 18, 20])
    got = overlong_penalty(lengths, max_resp_len=20, buffer_len=4, penalty_factor=factor)
    expected = torch.tensor([0.0, 0.0, 0.0, -0.25, -0.5, -1.0]) * factor
    assert got.dtype == torch.float32 and got.tolist() == pytest.approx(expected.tolist(), rel=1e-6, abs=0)
    whole = overlong_penalty(torch.tensor([0, 1, 20]), max_resp_len=20, buffer_len=20, penalty_factor=factor)
    assert whole.tolist() == pytest.approx([0.0, -factor / 20, -factor], rel=1e-6)  # buffer = whole length


def test_overlong_buffer_bounds():
    for bad in (0, 21):
        with pytest.raises(ValueError, match="overlong_buffer.len"):
            overlong_penalty(torch.tensor([3]), max_resp_len=20, buffer_len=bad, penalty_factor=1.0)


N, BATCH = 4, 6  # rollout.n, data.batch_size (prompt groups per step)


def scored(prompts: Batch, gen: int) -> Batch:
    """What the driver's generate+score gives: n rows per prompt with their uid; prompt p scores its responses
    0, 1, 0, 1 when p is even (an informative group) and 1, 1, 1, 1 when odd (all alike)."""
    prompts.non_tensors["uid"] = as_group_ids(len(prompts), 1, f"1.{gen}")
    rows = prompts.repeat(N, interleave=True)
    p = rows.tensors["prompt"]
    k = torch.arange(len(rows)) % N
    scores = torch.where(p % 2 == 0, (k % 2).float(), torch.ones(len(rows)))
    token = torch.zeros(len(rows), 3)
    token[:, -1] = scores
    return Batch(tensors={**rows.tensors, "scores": scores, "token_level_scores": token},
                 non_tensors=rows.non_tensors)


def prompt_batches():
    start = 0
    while True:
        yield Batch.from_dict(tensors={"prompt": torch.arange(start, start + BATCH)})
        start += BATCH


def test_equal_reward_groups_are_dropped_and_the_batch_fills():
    stream = prompt_batches()
    out, metrics = fill_batch(next(stream), stream, scored, n=N, batch_size=BATCH, metric="reward",
                              max_num_gen_batches=0)
    # each generation batch has 3 informative groups of 6: two batches fill the step
    assert len(out) == BATCH * N and metrics["train/num_gen_batches"] == 2
    assert metrics["dynamic_sampling/kept_group_fraction"] == 0.5 and metrics["dynamic_sampling/dropped_groups"] == 6
    kept_prompts = out.tensors["prompt"].view(BATCH, N)
    assert (kept_prompts % 2 == 0).all() and (kept_prompts == kept_prompts[:, :1]).all()  # whole, even groups
    assert kept_prompts[:, 0].tolist() == [0, 2, 4, 6, 8, 10]
    assert len(set(out.non_tensors["uid"])) == BATCH  # uids stay unique across generation batches
    for g in range(BATCH):  # every kept group has a non-zero reward std
        assert out.tensors["scores"][g * N:(g + 1) * N].std() > 0


def test_surplus_groups_are_cut_and_max_num_gen_batches_is_an_error():
    stream = prompt_batches()
    out, metrics = fill_batch(next(stream), stream, scored, n=N, batch_size=2, metric="acc", max_num_gen_batches=1)
    assert len(out) == 2 * N and metrics["train/num_gen_batches"] == 1  # 3 kept, 2 used
    with pytest.raises(DynamicSamplingError) as e:  # the Trainer's one-line error (session._failures_named)
        stream = prompt_batches()
        fill_batch(next(stream), stream, scored, n=N, batch_size=BATCH, metric="reward", max_num_gen_batches=1)
    assert str(e.value).startswith("dynamic sampling: 3 of data.batch_size=6 prompt groups have a non-constant "
                                   "'reward' after 1 generation batches (algorithm.filter_groups.max_num_gen_batches=1)")
    assert "raise algorithm.filter_groups.max_num_gen_batches, set it to 0 (no limit)" in str(e.value)


def always_alike(prompts: Batch, gen: int) -> Batch:
    """Every response of every prompt scores 0 (a reward that never pays): no group is ever kept."""
    prompts.non_tensors["uid"] = as_group_ids(len(prompts), 1, f"1.{gen}")
    rows = prompts.repeat(N, interleave=True)
    return Batch(tensors={**rows.tensors, "scores": torch.zeros(len(rows)),
                          "token_level_scores": torch.zeros(len(rows), 3)}, non_tensors=rows.non_tensors)


@pytest.mark.parametrize("limit", [0, 5])
def test_each_further_generation_batch_says_how_far_the_step_is(limit, caplog):
    """A reward that never varies regenerates batch after batch (for ever with max_num_gen_batches=0): each
    further batch is one line saying how many groups are kept of how many needed."""
    stream, calls = prompt_batches(), []

    def counted(prompts, gen):
        calls.append(gen)
        if len(calls) > 3:
            raise KeyboardInterrupt  # stands in for the user stopping an endless step
        return always_alike(prompts, gen)

    with caplog.at_level("WARNING", logger="hybridflow.trainer.dynamic_sampling"), pytest.raises(KeyboardInterrupt):
        fill_batch(next(stream), stream, counted, n=N, batch_size=BATCH, metric="reward", max_num_gen_batches=limit)
    lines = [r.getMessage() for r in caplog.records]
    bound = "of at most 5 " if limit else ""
    unbounded = "" if limit else " (algorithm.filter_groups.max_num_gen_batches=0: no limit)"
    assert lines == [f"dynamic sampling: 0 of 6 prompt groups kept after {k} {bound}generation batches{unbounded}; "
                     "generating another" for k in (1, 2, 3)], lines


def test_metric_column_and_single_response_groups():
    b = Batch.from_dict(tensors={"scores": torch.tensor([1.0, 1.0, 0.0]),
                                 "token_level_scores": torch.tensor([[1.0], [1.0], [0.0]])},
                        non_tensors={"uid": np.array(["a", "a", "b"], dtype=object),
                                     "format_ok": np.array([0.0, 1.0, 1.0])})
    rows, kept, groups = informative_groups(b, "reward")
    assert rows.tolist() == [2] and (kept, groups) == (1, 2)  # a single-response group is kept (verl's rule)
    rows, _, _ = informative_groups(b, "format_ok")  # a reward function's returned entry
    assert rows.tolist() == [0, 1, 2]
    with pytest.raises(DynamicSamplingError, match="algorithm.filter_groups.metric 'bogus': the reward function "
                                                   "returned no such entry"):
        informative_groups(b, "bogus")


def test_reward_function_entries_become_columns_for_filtering(tmp_path):
    """A reward function's returned dict entries besides ``score`` are batch columns (verl's reward_extra_info),
    which gdpo and a filter_groups metric read."""
    from hybridflow.models.char_tokenizer import build_char_tokenizer
    from hybridflow.rewards.custom import adapt_to_scorer
    from hybridflow.trainer.experience import score_responses
    from tests.unit.test_custom_reward import _rollout_batch

    tokenizer = build_char_tokenizer(tmp_path / "tok")

    def fn(data_source, solution_str, ground_truth, extra_info=None):
        return {"score": float(solution_str == ground_truth), "format_ok": 1.0, "acc": solution_str == ground_truth}

    batch = _rollout_batch(tokenizer, ["Q: 1+2= A:", "Q: 1+2= A:"], ["3", "4"], ["3", "3"])
    scored = score_responses(batch, tokenizer, adapt_to_scorer(fn))
    assert scored.non_tensors["format_ok"].tolist() == [1.0, 1.0] and scored.non_tensors["acc"].tolist() == [True, False]
    scored.non_tensors["uid"] = np.array(["g", "g"], dtype=object)
    assert informative_groups(scored, "format_ok")[1:] == (0, 1)  # alike: dropped
    assert informative_groups(scored, "acc")[1:] == (1, 1)


@pytest.mark.parametrize("overrides, message", [
    (["reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=300", "data.max_response_length=256"],
     r"reward.overlong_buffer.len \(300\) must be <= data.max_response_length \(256\)"),
    (["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=seq_final_reward",
      "algorithm.use_kl_in_reward=true"], "algorithm.filter_groups.metric 'seq_final_reward'"),
    (["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acuracy"],
     r"algorithm.filter_groups.metric 'acuracy' is not a reward column: use one of reward, seq_reward, "
     r"seq_final_reward, score, acc, scores, rule_scores, overlong_reward \(a key a custom_reward_function returns"),
])
def test_config_errors_come_from_loading_the_config(overrides, message):
    """Raised by the run plan's rules as the config loads, before any worker starts, on one line."""
    from hybridflow.config import ConfigError
    from hybridflow.plan import load_experiment

    with pytest.raises(ConfigError, match=message) as e:
        load_experiment([{}], ["data.batch_size=16", "actor.ppo_mini_batch_size=16", *overrides])
    assert "\n" not in str(e.value)


def test_a_custom_reward_functions_keys_are_accepted_as_the_metric(tmp_path):
    """With a custom reward function any key it may return is a metric (checked when a batch is scored)."""
    from hybridflow.plan import load_experiment

    fn = tmp_path / "my_reward.py"
    fn.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                  "    return {'score': 1.0, 'format_ok': 1.0}\n")
    cfg = load_experiment([{}], ["data.batch_size=16", "actor.ppo_mini_batch_size=16",
                                               "algorithm.filter_groups.enable=true",
                                               "algorithm.filter_groups.metric=format_ok",
                                               f"custom_reward_function.path={fn}"])
    assert cfg.algorithm.filter_groups.metric == "format_ok"


def test_resume_skips_the_batches_dynamic_sampling_consumed(tmp_path):
    """The Trainer's data stream counts every batch taken (a step's first and dynamic sampling's further ones);
    a checkpoint records the count and the resumed stream continues with the batch the uninterrupted run draws
    next, across an epoch boundary (90 prompts, 3 batches an epoch). A checkpoint without the count took one
    batch per step."""
    from types import SimpleNamespace

    from hybridflow.data.arithmetic import write_arithmetic_parquet
    from hybridflow.data.dataset import PromptDataset
    from hybridflow.models.char_tokenizer import build_char_tokenizer
    from hybridflow.trainer import checkpoint
    from hybridflow.trainer.session import data_stream

    train, _ = write_arithmetic_parquet(tmp_path, max_operand=9, n_val=10, seed=0)
    ds = PromptDataset([str(train)], build_char_tokenizer(tmp_path / "tok"), prompt_key="prompt", answer_key="answer",
                       max_prompt_length=16)
    cfg = SimpleNamespace(data=SimpleNamespace(batch_size=30, shuffle=True), trainer=SimpleNamespace(seed=3))
    run = data_stream(ds, cfg, None)
    for taken in (1, 3):  # step 1: one batch; step 2: its own and two more drawn by dynamic sampling
        for _ in range(taken):
            next(run)
    state = {"step": 2, checkpoint.DATA_BATCHES: run.consumed}
    assert checkpoint.data_batches(state) == 4
    resumed = data_stream(ds, cfg, state)
    for _ in range(3):
        assert next(resumed).non_tensors["prompt"].tolist() == next(run).non_tensors["prompt"].tolist()
    assert resumed.consumed == run.consumed == 7
    assert checkpoint.data_batches({"step": 2}) == 2
