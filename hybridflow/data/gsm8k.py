"""A local GSM8K copy (jsonl or parquet with ``question``/``answer``) -> a prompt parquet, in one of two
formats:

- ``hybridflow`` (default): ``prompt`` already rendered with the tokenizer's chat template (plain text),
  ``answer``, ``data_source``, ``index``; prompts over --max-prompt-length tokens are dropped here.
- ``verl``: exactly what verl's ``examples/data_preprocess/gsm8k.py`` writes: ``data_source``, ``prompt``
  (one user message), ``ability``, ``reward_model: {style, ground_truth}``, ``extra_info: {split, index,
  answer, question}``. The template is applied when the data is loaded (as verl does), so no tokenizer is
  needed; given --tokenizer and --max-prompt-length, over-long prompts are dropped here too.

Both build the prompt as verl does (the question, then the same instruction, as one user turn).

    python -m hybridflow.data.gsm8k --input train.jsonl --output-dir data/gsm8k \\
        --tokenizer path/to/tokenizer --max-prompt-length 512 --split train [--format verl]
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


FORMATS = ("hybridflow", "verl")


def chat_messages(question: str) -> list[dict]:
    return [{"role": "user", "content": question + " " + INSTRUCTION}]


def build_prompt(question: str, tokenizer) -> str:
    return tokenizer.apply_chat_template(chat_messages(question), add_generation_prompt=True, tokenize=False)


def verl_row(question: str, answer_field: str, ground_truth: str, split: str, index: int) -> dict:
    """One row as verl's ``examples/data_preprocess/gsm8k.py`` ``process_fn`` makes it."""
    return {"data_source": DATA_SOURCE, "prompt": chat_messages(question), "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": ground_truth},
            "extra_info": {"split": split, "index": index, "answer": answer_field, "question": question}}


def _load_tokenizer(tokenizer):
    if isinstance(tokenizer, (str, Path)):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer))
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template; "
                         "GSM8K prompts are chat-formatted (set tokenizer.chat_template)")
    return tokenizer


def _check_options(fmt: str, tokenizer, max_prompt_length: int | None) -> bool:
    """Refuse a format or a tokenizer/max_prompt_length combination that cannot work; True when over-long
    prompts are to be dropped (both given)."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    filtering = tokenizer is not None or max_prompt_length is not None
    if fmt == "hybridflow" and not (tokenizer is not None and max_prompt_length is not None):
        raise ValueError("the hybridflow format needs a tokenizer and max_prompt_length (it renders prompts)")
    if filtering and (tokenizer is None or max_prompt_length is None):
        raise ValueError("dropping over-long prompts needs both a tokenizer and max_prompt_length")
    if filtering and max_prompt_length < 1:
        raise ValueError(f"max_prompt_length must be >= 1, got {max_prompt_length}")
    return filtering


def _ground_truths(rows: list[dict], input_path: str | Path) -> list[str]:
    """Each row's final answer (after ``####``); ValueError naming the row when it has none."""
    answers = []
    for i, row in enumerate(rows):
        for key in ("question", "answer"):
            if not isinstance(row.get(key), str):
                raise ValueError(f"{input_path} row {i}: {key!r} missing or not a string "
                                 f"(keys: {sorted(row)})")
        try:
            answers.append(extract_ground_truth(row["answer"]))
        except ValueError as e:
            raise ValueError(f"{input_path} row {i}: {e}") from None
    return answers


def _short_prompts(rows: list[dict], tokenizer, max_prompt_length: int, fmt: str,
                   input_path: str | Path) -> tuple[list[str], list[int]]:
    """Every row's rendered prompt and the row numbers of those within ``max_prompt_length`` tokens."""
    prompts = [build_prompt(row["question"], tokenizer) for row in rows]
    # Counted exactly as PromptDataset counts them, so every kept prompt loads there.
    lengths = [len(ids) for ids in tokenizer(prompts, add_special_tokens=fmt == "hybridflow").input_ids]
    keep = [j for j, n in enumerate(lengths) if n <= max_prompt_length]
    logger.info("%s: dropped %d of %d prompts longer than max_prompt_length=%d tokens",
                input_path, len(rows) - len(keep), len(rows), max_prompt_length)
    if not keep:
        raise ValueError(f"{input_path}: every prompt is longer than max_prompt_length={max_prompt_length} "
                         f"tokens (shortest: {min(lengths)})")
    return prompts, keep


def _output_table(fmt: str, rows: list[dict], answers: list[str], prompts: list[str] | None, keep: list[int],
                  split: str) -> pa.Table:
    """The kept rows in format ``fmt`` (``prompts``: the rendered ones, which the hybridflow format needs)."""
    if fmt == "verl":
        return pa.Table.from_pylist([verl_row(rows[j]["question"], rows[j]["answer"], answers[j], split, j)
                                     for j in keep])
    return pa.table({
        "prompt": [prompts[j] for j in keep],
        "answer": [answers[j] for j in keep],
        "data_source": [DATA_SOURCE] * len(keep),
        "index": pa.array(keep, pa.int64()),
    })


def preprocess_gsm8k(input_path: str | Path, output_dir: str | Path, tokenizer=None,
                     max_prompt_length: int | None = None, split: str = "train",
                     fmt: str = "hybridflow") -> PreprocessResult:
    """Write ``output_dir/<split>.parquet`` in format ``fmt`` (see the module docstring).

    ``tokenizer`` is a tokenizer or its folder (needed by the hybridflow format, and by the verl format
    only to drop over-long prompts). The row number in the input is kept (``index``, or
    ``extra_info.index`` in verl's format), so rows keep verl's ids even after over-long prompts are dropped.
    """
    filtering = _check_options(fmt, tokenizer, max_prompt_length)
    if filtering:
        tokenizer = _load_tokenizer(tokenizer)
    rows = read_rows(input_path)
    if not rows:
        raise ValueError(f"{input_path}: no rows")
    answers = _ground_truths(rows, input_path)
    prompts, keep = None, list(range(len(rows)))
    if filtering:
        prompts, keep = _short_prompts(rows, tokenizer, max_prompt_length, fmt, input_path)
    table = _output_table(fmt, rows, answers, prompts, keep, split)
    path = Path(output_dir) / f"{split}.parquet"
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)
    return PreprocessResult(path, len(keep), len(rows) - len(keep))


def main(argv: list[str] | None = None) -> PreprocessResult:
    parser = argparse.ArgumentParser(prog="python -m hybridflow.data.gsm8k", description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", required=True, help="GSM8K .jsonl or .parquet with question/answer")
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--format", choices=FORMATS, default="hybridflow",
                        help="hybridflow: prompts rendered here (needs --tokenizer, --max-prompt-length); "
                             "verl: verl's chat-message parquet, rendered when loaded")
    parser.add_argument("--tokenizer", help="tokenizer folder (must have a chat template)")
    parser.add_argument("--max-prompt-length", type=int, help="drop prompts longer than this many tokens")
    parser.add_argument("--split", default="train", help="output file name: <split>.parquet")
    args = parser.parse_args(argv)
    if args.format == "hybridflow" and (args.tokenizer is None or args.max_prompt_length is None):
        parser.error("--format hybridflow needs --tokenizer and --max-prompt-length")
    if (args.tokenizer is None) != (args.max_prompt_length is None):
        parser.error("--tokenizer and --max-prompt-length go together")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    result = preprocess_gsm8k(args.input, args.output_dir, args.tokenizer, args.max_prompt_length, args.split,
                              fmt=args.format)
    print(f"wrote {result.path}: {result.kept} prompts ({result.dropped} over-long dropped)")
    return result


if __name__ == "__main__":
    main()
