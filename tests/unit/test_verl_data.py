"""verl's parquet format in PromptDataset: chat prompts rendered with the tokenizer's template, the ground
truth from reward_model.ground_truth, over-long prompts filtered (and counted) or truncated as verl does."""

import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hybridflow.data.dataset import PromptDataset, truncate
from hybridflow.models.char_tokenizer import build_char_tokenizer
from hybridflow.models.tiny_qwen2 import build_chat_tokenizer

QUESTIONS = ["1+1=", "What is 12+30?", "2*3=", "Is 7 odd? Say yes or no."]
TRUTHS = ["2", "42", "6", "yes"]


def verl_rows(questions=QUESTIONS, truths=TRUTHS, source="openai/gsm8k"):
    """Rows as verl's examples/data_preprocess scripts write them."""
    return [{"data_source": source, "prompt": [{"role": "user", "content": q}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": t},
             "extra_info": {"split": "train", "index": i}} for i, (q, t) in enumerate(zip(questions, truths))]


def write(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_chat_tokenizer(tmp_path_factory.mktemp("chat_tok"))


def load(files, tokenizer, max_prompt_length=64, **kw):
    return PromptDataset(files, tokenizer, prompt_key="prompt", max_prompt_length=max_prompt_length, **kw)


def test_chat_prompts_render_with_the_template(tokenizer, tmp_path):
    ds = load([write(tmp_path / "t.parquet", verl_rows())], tokenizer)
    assert len(ds) == 4
    for row, q in enumerate(QUESTIONS):
        messages = [{"role": "user", "content": q}]
        # transformers' own tokenize=True path, as verl's RLHFDataset counts prompt tokens
        expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
        assert ds.prompt_ids[row] == expected
    batch = ds.batch([1])
    ids = batch.tensors["input_ids"][0][batch.tensors["attention_mask"][0].bool()]
    assert tokenizer.decode(ids.tolist()) == "<|im_start|>user\nWhat is 12+30?<|im_end|>\n<|im_start|>assistant\n"
    # non-tensor columns are one object per row (a chat prompt is not spread into a 2-D array)
    assert batch.non_tensors["prompt"].shape == (1,) and batch.non_tensors["prompt"][0] == [
        {"role": "user", "content": "What is 12+30?"}]
    assert list(ds.columns["answer"]) == TRUTHS
    assert list(ds.columns["data_source"]) == ["openai/gsm8k"] * 4
    assert ds.columns["extra_info"][3] == {"split": "train", "index": 3}
    assert ds.columns["reward_model"][0] == {"style": "rule", "ground_truth": "2"}
    assert ds.unrepresentable == {} and ds.filtered == {str(tmp_path / "t.parquet"): 0}


def test_plain_prompts_and_files_of_both_formats(tokenizer, tmp_path):
    verl = write(tmp_path / "verl.parquet", verl_rows())
    plain = write(tmp_path / "plain.parquet", [{"prompt": "Q: 1+1= A:", "answer": "2"}])
    ds = load([verl, plain], tokenizer)
    assert ds.prompt_ids[4] == tokenizer("Q: 1+1= A:").input_ids  # plain text is tokenized as it is
    assert list(ds.columns["answer"]) == TRUTHS + ["2"]
    assert list(ds.columns["data_source"]) == ["openai/gsm8k"] * 4 + [None]  # scored by reward.name
    assert ds.where(4) == f"{plain} row 0"


def test_ground_truth_column(tokenizer, tmp_path):
    rows = verl_rows()
    for row in rows:
        row["extra_info"]["answer"] = "#### " + row["reward_model"]["ground_truth"]
        row["answer"] = "from the answer column"
    f = write(tmp_path / "both.parquet", rows)
    assert list(load([f], tokenizer).columns["answer"]) == TRUTHS  # reward_model.ground_truth first
    assert list(load([f], tokenizer, answer_key="answer").columns["answer"]) == ["from the answer column"] * 4
    assert load([f], tokenizer, answer_key="extra_info.answer").columns["answer"][1] == "#### 42"
    with pytest.raises(ValueError, match=rf"^{f}: column 'solution' missing \(columns: \["):
        load([f], tokenizer, answer_key="solution")
    with pytest.raises(ValueError, match=rf"^{f}: column 'extra_info' has no field 'solution' \(it holds struct"):
        load([f], tokenizer, answer_key="extra_info.solution")


def test_ground_truth_missing_or_null(tokenizer, tmp_path):
    rows = [{k: v for k, v in r.items() if k != "reward_model"} for r in verl_rows()]
    f = write(tmp_path / "none.parquet", rows)
    with pytest.raises(ValueError) as e:
        load([f], tokenizer)
    assert str(e.value) == (f"{f}: no ground truth: neither reward_model.ground_truth nor a column 'answer' (set "
                            "data.answer_key; columns: ['data_source', 'prompt', 'ability', 'extra_info'])")
    rows = verl_rows()
    rows[2]["reward_model"] = None
    f = write(tmp_path / "null.parquet", rows)
    with pytest.raises(ValueError, match=rf"^{f} row 2: 'reward_model.ground_truth' is empty \(null\)$"):
        load([f], tokenizer)


def test_chat_prompt_needs_a_chat_template(tmp_path):
    plain_tokenizer = build_char_tokenizer(tmp_path / "tok")
    f = write(tmp_path / "t.parquet", verl_rows())
    with pytest.raises(ValueError) as e:
        load([f], plain_tokenizer)
    assert str(e.value).startswith(f"{f}: column 'prompt' holds chat messages but the tokenizer ")
    assert str(e.value).endswith("has no chat template to render them") and "\n" not in str(e.value)


def test_empty_chat_is_named(tokenizer, tmp_path):
    rows = verl_rows()
    rows[1]["prompt"] = []
    f = write(tmp_path / "t.parquet", rows)
    with pytest.raises(ValueError, match=rf"^{f} row 1: 'prompt' is empty \(no messages\)$"):
        load([f], tokenizer)


def lengths(tokenizer, questions=QUESTIONS):
    return [len(tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                              tokenize=True)["input_ids"]) for q in questions]


def test_filter_overlong_prompts_counts_per_file(tokenizer, tmp_path, caplog):
    n = lengths(tokenizer)
    limit = sorted(n)[1]  # keeps the two shortest; rows 1 and 3 are longer
    assert [x > limit for x in n] == [False, True, False, True]
    a, b = write(tmp_path / "a.parquet", verl_rows()), write(tmp_path / "b.parquet", verl_rows()[:1])
    with caplog.at_level(logging.WARNING, logger="hybridflow.data.dataset"):
        ds = load([a, b], tokenizer, max_prompt_length=limit, filter_overlong_prompts=True)
    assert ds.filtered == {a: 2, b: 0}
    assert [r.getMessage() for r in caplog.records] == [
        f"{a}: dropped 2 of 4 prompts longer than data.max_prompt_length={limit} tokens (data.filter_overlong_prompts)"]
    assert len(ds) == 3 and list(ds.columns["answer"]) == ["2", "6", "2"]  # the columns follow the kept rows
    assert [ds.where(r) for r in range(3)] == [f"{a} row 0", f"{a} row 2", f"{b} row 0"]
    assert all(len(p) <= limit for p in ds.prompt_ids)
    # the boundary is inclusive: a prompt of exactly max_prompt_length tokens stays
    assert load([a], tokenizer, max_prompt_length=max(n), filter_overlong_prompts=True).filtered == {a: 0}


def test_nothing_left_after_filtering_is_one_line(tokenizer, tmp_path):
    a = write(tmp_path / "a.parquet", verl_rows())
    with pytest.raises(ValueError) as e:
        load([a], tokenizer, max_prompt_length=3, filter_overlong_prompts=True)
    assert str(e.value) == (f"{a}: no prompts left: all 4 are longer than data.max_prompt_length=3 tokens "
                            "(data.filter_overlong_prompts)")


@pytest.mark.parametrize("side", ["left", "right", "middle"])
@pytest.mark.parametrize("limit", [7, 8])
def test_truncation_keeps_what_verl_keeps(tokenizer, tmp_path, side, limit):
    f = write(tmp_path / "t.parquet", verl_rows())
    full = load([f], tokenizer).prompt_ids
    cut = load([f], tokenizer, max_prompt_length=limit, truncation=side).prompt_ids
    for whole, kept in zip(full, cut):
        # verl's postprocess_data on the token row: [:, -max:], [:, :max], or the first max // 2 and the
        # last max - max // 2
        expected = {"left": whole[-limit:], "right": whole[:limit],
                    "middle": whole[:limit // 2] + whole[-(limit - limit // 2):]}[side]
        assert kept == (whole if len(whole) <= limit else expected)
        assert len(kept) == min(len(whole), limit)
    assert load([f], tokenizer, max_prompt_length=limit, truncation=side).batch([0, 1, 2, 3]).tensors[
        "attention_mask"].sum(-1).tolist() == [min(len(w), limit) for w in full]


def test_truncate_by_hand():
    ids = list(range(10))
    assert truncate(ids, 4, "left") == [6, 7, 8, 9]
    assert truncate(ids, 4, "right") == [0, 1, 2, 3]
    assert truncate(ids, 4, "middle") == [0, 1, 8, 9]
    assert truncate(ids, 5, "middle") == [0, 1, 7, 8, 9]  # verl: left half max // 2, right half the rest
    assert truncate(ids, 1, "middle") == [9]
    assert truncate(ids, 10, "left") == ids


def test_truncation_error_names_the_row(tokenizer, tmp_path):
    f = write(tmp_path / "t.parquet", verl_rows())
    n = lengths(tokenizer)
    with pytest.raises(ValueError) as e:
        load([f], tokenizer, max_prompt_length=n[0])
    assert str(e.value) == (f"{f} row 1: prompt has {n[1]} tokens, more than data.max_prompt_length={n[0]} (set "
                            "data.filter_overlong_prompts or data.truncation: left | right | middle)")


def test_from_config_reads_the_data_section(tokenizer, tmp_path):
    from hybridflow.config.schema import Data

    f = write(tmp_path / "t.parquet", verl_rows())
    d = Data(max_prompt_length=sorted(lengths(tokenizer))[1], filter_overlong_prompts=True)
    assert PromptDataset.from_config([f], tokenizer, d).filtered == {f: 2}


def test_chat_template_kwargs_reach_the_template(tokenizer, tmp_path):
    """verl's data.apply_chat_template_kwargs (e.g. gpt-oss's reasoning_effort, Qwen3's enable_thinking)."""
    import copy

    templated = copy.deepcopy(tokenizer)
    templated.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                               "{% if effort is defined %}={{ effort }}{% endif %}")
    f = write(tmp_path / "t.parquet", verl_rows())
    plain = load([f], templated)
    high = load([f], templated, chat_template_kwargs={"effort": "high"})
    assert templated.decode(high.prompt_ids[0]) == QUESTIONS[0] + "=high"
    assert templated.decode(plain.prompt_ids[0]) == QUESTIONS[0]
