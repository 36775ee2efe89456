"""GSM8K preprocessing on the hand-written fixture (tests/fixtures/gsm8k/train.jsonl)."""

import json
import logging
import string
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hybridflow.data.dataset import PromptDataset
from hybridflow.data.gsm8k import INSTRUCTION, main, preprocess_gsm8k, read_rows
from hybridflow.models.char_tokenizer import build_char_tokenizer

FIXTURE = Path(__file__).parents[1] / "fixtures" / "gsm8k" / "train.jsonl"
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
ANSWERS = ["6", "350", "2000", "600", "-7"]  # fixture rows, by hand: "#### 2,000" loses its comma
LONG_ROW = 3  # the only fixture question over 300 characters


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    # every printable char gets its own id, so a prompt's token count is its length
    d = tmp_path_factory.mktemp("tok")
    tok = build_char_tokenizer(d, alphabet=string.printable)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(d))  # the CLI loads the template from the folder
    return d


@pytest.fixture(scope="module")
def tokenizer(tok_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tok_dir))


def expected_prompt(question):
    return f"<|user|>\n{question} {INSTRUCTION}\n<|assistant|>\n"


def test_instruction_is_verls():
    assert INSTRUCTION == 'Let\'s think step by step and output the final answer after "####".'


def test_jsonl_to_prompt_parquet(tmp_path, tokenizer, caplog):
    questions = [r["question"] for r in read_rows(FIXTURE)]
    with caplog.at_level(logging.INFO, logger="hybridflow.data.gsm8k"):
        result = preprocess_gsm8k(FIXTURE, tmp_path, tokenizer, max_prompt_length=300)
    assert (result.path, result.kept, result.dropped) == (tmp_path / "train.parquet", 4, 1)
    assert "dropped 1 of 5 prompts longer than max_prompt_length=300 tokens" in caplog.text

    table = pq.read_table(result.path)
    assert table.column_names == ["prompt", "answer", "data_source", "index"]
    keep = [i for i in range(5) if i != LONG_ROW]
    assert table["prompt"].to_pylist() == [expected_prompt(questions[i]) for i in keep]
    assert table["answer"].to_pylist() == [ANSWERS[i] for i in keep]
    assert table["data_source"].to_pylist() == ["openai/gsm8k"] * 4
    assert table["index"].to_pylist() == keep  # original row ids survive the filter
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.parquet"]  # no temp file left

    # the suite's loader accepts every kept prompt at the same limit
    ds = PromptDataset([str(result.path)], tokenizer, prompt_key="prompt", answer_key="answer",
                       max_prompt_length=300)
    assert len(ds) == 4


def test_filter_boundary_is_inclusive(tmp_path, tokenizer):
    first = expected_prompt(read_rows(FIXTURE)[0]["question"])
    longest_kept = max(len(expected_prompt(r["question"])) for i, r in enumerate(read_rows(FIXTURE)) if i != LONG_ROW)
    assert preprocess_gsm8k(FIXTURE, tmp_path, tokenizer, longest_kept).dropped == 1
    assert preprocess_gsm8k(FIXTURE, tmp_path, tokenizer, longest_kept - 1).dropped == 2
    assert len(first) < longest_kept
    with pytest.raises(ValueError, match="every prompt is longer than max_prompt_length=10 tokens"):
        preprocess_gsm8k(FIXTURE, tmp_path, tokenizer, 10)


def test_parquet_input_and_split_name(tmp_path, tokenizer):
    rows = read_rows(FIXTURE)
    src = tmp_path / "test-00000.parquet"
    pq.write_table(pa.table({"question": [r["question"] for r in rows],
                             "answer": [r["answer"] for r in rows]}), src)
    result = preprocess_gsm8k(src, tmp_path / "out", tokenizer, max_prompt_length=1000, split="test")
    assert result.path == tmp_path / "out" / "test.parquet" and (result.kept, result.dropped) == (5, 0)
    assert pq.read_table(result.path)["answer"].to_pylist() == ANSWERS


@pytest.mark.parametrize("bad_row, message", [
    ({"answer": "#### 1"}, "row 1: 'question' missing or not a string (keys: ['answer'])"),
    ({"question": "Q?", "answer": None}, "row 1: 'answer' missing or not a string (keys: ['answer', 'question'])"),
    ({"question": "Q?", "answer": "just 4"}, "row 1: GSM8K answer has no '#### <number>' line"),
])
def test_bad_row_names_file_and_row(tmp_path, tokenizer, bad_row, message):
    src = tmp_path / "bad.jsonl"
    good = {"question": "What is 2+2?", "answer": "2+2=4\n#### 4"}
    src.write_text("\n".join(json.dumps(r) for r in (good, bad_row, good)) + "\n")
    with pytest.raises(ValueError) as e:
        preprocess_gsm8k(src, tmp_path / "out", tokenizer, 300)
    assert str(e.value).startswith(f"{src} {message}")
    assert not (tmp_path / "out").exists()  # nothing written on failure


def test_bad_parquet_row(tmp_path, tokenizer):
    src = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"question": ["A?", None], "answer": ["#### 1", "#### 2"]}), src)
    with pytest.raises(ValueError, match=r"bad.parquet row 1: 'question' missing or not a string"):
        preprocess_gsm8k(src, tmp_path / "out", tokenizer, 300)


def test_input_errors(tmp_path, tokenizer):
    with pytest.raises(FileNotFoundError, match="GSM8K input not found: .*missing.jsonl"):
        preprocess_gsm8k(tmp_path / "missing.jsonl", tmp_path, tokenizer, 300)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"question": "a", "answer": "#### 1"}\n\n{oops\n')
    with pytest.raises(ValueError, match=r"broken.jsonl line 3: not valid JSON"):
        preprocess_gsm8k(broken, tmp_path, tokenizer, 300)


def test_tokenizer_without_chat_template(tmp_path):
    plain = build_char_tokenizer(tmp_path / "tok")
    with pytest.raises(ValueError, match="has no chat template"):
        preprocess_gsm8k(FIXTURE, tmp_path, plain, 300)


def test_cli(tmp_path, tok_dir, capsys):
    result = main(["--input", str(FIXTURE), "--output-dir", str(tmp_path), "--tokenizer", str(tok_dir),
                   "--max-prompt-length", "300", "--split", "train"])
    assert (result.kept, result.dropped) == (4, 1)
    assert f"wrote {tmp_path / 'train.parquet'}: 4 prompts (1 over-long dropped)" in capsys.readouterr().out


# --- verl's format: the rows verl's examples/data_preprocess/gsm8k.py writes ----------------------------

def verl_process_fn(example, idx, split):
    """verl's make_map_fn(split)'s process_fn, as written there."""
    question_raw = example.pop("question")
    question = question_raw + " " + 'Let\'s think step by step and output the final answer after "####".'
    answer_raw = example.pop("answer")
    solution = answer_raw.split("#### ")[1].split("\n")[0].replace(",", "")  # its regex match, here simpler
    return {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": question}], "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": solution},
            "extra_info": {"split": split, "index": idx, "answer": answer_raw, "question": question_raw}}


def test_verl_format_is_verls(tmp_path, tokenizer):
    rows = read_rows(FIXTURE)
    result = preprocess_gsm8k(FIXTURE, tmp_path, fmt="verl", split="test")  # no tokenizer needed
    assert (result.path, result.kept, result.dropped) == (tmp_path / "test.parquet", 5, 0)
    table = pq.read_table(result.path)
    assert table.column_names == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    assert table.to_pylist() == [verl_process_fn(dict(r), i, "test") for i, r in enumerate(rows)]

    # rendered when loaded: the same tokens as the hybridflow format's pre-rendered prompt
    ds = PromptDataset([str(result.path)], tokenizer, prompt_key="prompt", max_prompt_length=1000)
    assert list(ds.columns["answer"]) == ANSWERS
    rendered = [expected_prompt(r["question"]) for r in rows]
    assert ds.prompt_ids == tokenizer(rendered, add_special_tokens=False).input_ids
    filtered = PromptDataset([str(result.path)], tokenizer, prompt_key="prompt", max_prompt_length=300,
                             filter_overlong_prompts=True)
    assert filtered.filtered == {str(result.path): 1}  # as preprocessing's own filter drops LONG_ROW


def test_verl_format_with_the_filter_keeps_verls_ids(tmp_path, tokenizer):
    result = preprocess_gsm8k(FIXTURE, tmp_path, tokenizer, 300, fmt="verl")
    assert (result.kept, result.dropped) == (4, 1)
    kept = pq.read_table(result.path).to_pylist()
    assert [r["extra_info"]["index"] for r in kept] == [i for i in range(5) if i != LONG_ROW]
    with pytest.raises(ValueError, match="needs both a tokenizer and max_prompt_length"):
        preprocess_gsm8k(FIXTURE, tmp_path, tokenizer, fmt="verl")
    with pytest.raises(ValueError, match="the hybridflow format needs a tokenizer and max_prompt_length"):
        preprocess_gsm8k(FIXTURE, tmp_path)


def test_cli_verl_format(tmp_path, capsys):
    result = main(["--input", str(FIXTURE), "--output-dir", str(tmp_path), "--format", "verl"])
    assert (result.kept, result.dropped) == (5, 0)
    assert f"wrote {tmp_path / 'train.parquet'}: 5 prompts (0 over-long dropped)" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--input", str(FIXTURE), "--output-dir", str(tmp_path)])  # the hybridflow format renders: a tokenizer
    assert "--format hybridflow needs --tokenizer and --max-prompt-length" in capsys.readouterr().err
