import pyarrow.parquet as pq
import pytest
import torch

from hybridflow.data.arithmetic import make_split_pairs, write_arithmetic_parquet
from hybridflow.data.dataset import PromptDataset
from hybridflow.models.char_tokenizer import build_char_tokenizer


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tok")


@pytest.fixture(scope="module")
def tokenizer(tok_dir):
    return build_char_tokenizer(tok_dir)


def test_tokenizer_round_trip_and_reload(tokenizer, tok_dir):
    from transformers import AutoTokenizer

    text = "Q: 37+48= A:85"
    ids = tokenizer(text).input_ids
    assert len(ids) == len(text)  # one token per character
    assert tokenizer.decode(ids) == text
    again = AutoTokenizer.from_pretrained(str(tok_dir))
    assert again(text).input_ids == ids and again.pad_token_id == tokenizer.pad_token_id


def test_split_is_disjoint_and_complete():
    train, val = make_split_pairs(9, 20, seed=3)
    assert len(val) == 20 and len(train) == 80 and not set(train) & set(val)


def test_parquet_and_left_padded_batches(tokenizer, tmp_path):
    train, val = write_arithmetic_parquet(tmp_path, max_operand=9, n_val=10, seed=0)
    assert pq.read_table(val).num_rows == 10
    ds = PromptDataset([str(train)], tokenizer, prompt_key="prompt", answer_key="answer", max_prompt_length=16)
    b = ds.batch([0, 1, 2])
    assert b.tensors["input_ids"].shape == (3, 16)
    for row, mask, prompt in zip(b.tensors["input_ids"], b.tensors["attention_mask"], b.non_tensors["prompt"]):
        assert tokenizer.decode(row[mask.bool()].tolist()) == prompt
        assert mask[-1] == 1  # left padding: every prompt ends at the last column
    first = b.tensors["attention_mask"][0].argmax()
    assert b.tensors["position_ids"][0, first] == 0
    epoch = [x for _, x in zip(range(90 // 30), ds.iterate(30, shuffle=True, seed=0))]
    seen = sorted(p for x in epoch for p in x.non_tensors["prompt"])
    assert seen == sorted(ds.columns["prompt"])  # one epoch sees every row once


def test_overlong_prompt_names_file_and_row(tokenizer, tmp_path):
    train, _ = write_arithmetic_parquet(tmp_path, max_operand=99, n_val=10, seed=0)
    with pytest.raises(ValueError, match=rf"{train} row \d+: prompt has \d+ tokens, more than data.max_prompt_length=8"):
        PromptDataset([str(train)], tokenizer, prompt_key="prompt", answer_key="answer", max_prompt_length=8)


def test_missing_column_is_named(tokenizer, tmp_path):
    train, _ = write_arithmetic_parquet(tmp_path, max_operand=9, n_val=10, seed=0)
    with pytest.raises(ValueError, match="column 'question' missing"):
        PromptDataset([str(train)], tokenizer, prompt_key="question", answer_key="answer", max_prompt_length=16)


def test_responses_to_batch_layout():
    from hybridflow.protocol import Batch
    from hybridflow.workers.generation import responses_to_batch

    prompts = Batch.from_dict(tensors={"input_ids": torch.tensor([[0, 5, 6], [7, 8, 9]]),
                                       "attention_mask": torch.tensor([[0, 1, 1], [1, 1, 1]])})
    out = responses_to_batch(prompts, [[3, 1, 4], [2, 2, 2, 2, 2]], max_len=4, pad_id=0, eos_id=1)
    assert out.tensors["responses"].tolist() == [[3, 1, 0, 0], [2, 2, 2, 2]]  # cut after EOS / at max_len
    assert out.tensors["response_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    assert out.tensors["input_ids"].tolist() == [[0, 5, 6, 3, 1, 0, 0], [7, 8, 9, 2, 2, 2, 2]]
    assert out.tensors["position_ids"][0].tolist() == [0, 0, 1, 2, 3, 3, 3]


def test_answer_column_is_the_default_ground_truth(tokenizer, tmp_path):
    train, _ = write_arithmetic_parquet(tmp_path, max_operand=9, n_val=10, seed=0)
    ds = PromptDataset([str(train)], tokenizer, prompt_key="prompt", max_prompt_length=16)  # answer_key None
    assert list(ds.columns["answer"]) == pq.read_table(train)["answer"].to_pylist()
    assert ds.filtered == {str(train): 0} and ds.where(3) == f"{train} row 3"
