"""A local GSM8K copy (jsonl or parquet with ``question``/``answer``) -> the suite's prompt parquet.

Prompts are built as verl's ``examples/data_preprocess/gsm8k.py`` builds them (same instruction, one
user turn) and rendered with the tokenizer's chat template, since the suite feeds ``prompt`` verbatim.

    python -m hybridflow.data.gsm8k --input train.jsonl --output-dir data/gsm8k \\
        --tokenizer path/to/tokenizer --max-prompt-length 512 --split train
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import NamedTuple

import pyarrow as pa
import pyarrow.parquet as pq

from hybridflow.rewards.gsm8k import extract_ground_truth
from hybridflow.util import atomic_path

logger = logging.getLogger(__name__)

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


class PreprocessResult(NamedTuple):
    path: Path  # the written parquet
    kept: int
    dropped: int  # prompts over max_prompt_length tokens


def read_rows(path: str | Path) -> list[dict]:
    """Rows of a .jsonl (one JSON object a line) or .parquet file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GSM8K input not found: {path}")
    if path.suffix == ".parquet":
        return pq.read_table(path).to_pylist()
    rows = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} line {line_no}: not valid JSON ({e})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path} line {line_no}: expected a JSON object, got {type(row).__name__}")
            rows.append(row)
    return rows


def build_prompt(question: str, tokenizer) -> str:
    messages = [{"role": "user", "content": question + " " + INSTRUCTION}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def _load_tokenizer(tokenizer):
    if isinstance(tokenizer, (str, Path)):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer))
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template; "
                         "GSM8K prompts are chat-formatted (set tokenizer.chat_template)")
    return tokenizer


def preprocess_gsm8k(input_path: str | Path, output_dir: str | Path, tokenizer, max_prompt_length: int,
                     split: str = "train") -> PreprocessResult:
    """Write ``output_dir/<split>.parquet`` (prompt, answer, data_source, index).

    ``tokenizer`` is a tokenizer or its folder. ``index`` is the row number in the input, so rows
    keep verl's ids even after over-long prompts are dropped.
    """
    if max_prompt_length < 1:
        raise ValueError(f"max_prompt_length must be >= 1, got {max_prompt_length}")
    tokenizer = _load_tokenizer(tokenizer)
    rows = read_rows(input_path)
    if not rows:
        raise ValueError(f"{input_path}: no rows")

    prompts, answers, indices = [], [], []
    for i, row in enumerate(rows):
        for key in ("question", "answer"):
            if not isinstance(row.get(key), str):
                raise ValueError(f"{input_path} row {i}: {key!r} missing or not a string "
                                 f"(keys: {sorted(row)})")
        try:
            answers.append(extract_ground_truth(row["answer"]))
        except ValueError as e:
            raise ValueError(f"{input_path} row {i}: {e}") from None
        prompts.append(build_prompt(row["question"], tokenizer))
        indices.append(i)

    # Counted exactly as PromptDataset counts them, so every kept prompt loads there.
    lengths = [len(ids) for ids in tokenizer(prompts).input_ids]
    keep = [j for j, n in enumerate(lengths) if n <= max_prompt_length]
    dropped = len(rows) - len(keep)
    logger.info("%s: dropped %d of %d prompts longer than max_prompt_length=%d tokens",
                input_path, dropped, len(rows), max_prompt_length)
    if not keep:
        raise ValueError(f"{input_path}: every prompt is longer than max_prompt_length={max_prompt_length} "
                         f"tokens (shortest: {min(lengths)})")

    table = pa.table({
        "prompt": [prompts[j] for j in keep],
        "answer": [answers[j] for j in keep],
        "data_source": [DATA_SOURCE] * len(keep),
        "index": pa.array([indices[j] for j in keep], pa.int64()),
    })
    path = Path(output_dir) / f"{split}.parquet"
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)
    return PreprocessResult(path, len(keep), dropped)


def main(argv: list[str] | None = None) -> PreprocessResult:
    parser = argparse.ArgumentParser(prog="python -m hybridflow.data.gsm8k", description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", required=True, help="GSM8K .jsonl or .parquet with question/answer")
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--tokenizer", required=True, help="tokenizer folder (must have a chat template)")
    parser.add_argument("--max-prompt-length", type=int, required=True)
    parser.add_argument("--split", default="train", help="output file name: <split>.parquet")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    result = preprocess_gsm8k(args.input, args.output_dir, args.tokenizer, args.max_prompt_length, args.split)
    print(f"wrote {result.path}: {result.kept} prompts ({result.dropped} over-long dropped)")
    return result


if __name__ == "__main__":
    main()
