"""The experiment config's data section: prompt files, lengths, batch size and shuffling."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from hybridflow.config.checks import check_sizes


@dataclass
class Data:
    """Parquet prompt data: plain-text prompts, or verl's format (``prompt`` a list of chat messages rendered
    with the tokenizer's chat template, ``data_source``, ``reward_model: {style, ground_truth}``, ``extra_info``)."""

    train_files: list[str] = field(default_factory=list)
    val_files: list[str] = field(default_factory=list)
    prompt_key: str = "prompt"
    # The column holding each row's ground truth; None: verl's reward_model.ground_truth when the data has
    # it, else a column named "answer".
    answer_key: str | None = None
    reward_fn_key: str = "data_source"  # the column that picks each row's scorer (verl's default scorer routing)
    batch_size: int = 1024  # prompts per PPO step (verl's data.train_batch_size)
    val_batch_size: int = 256  # prompts per validation generate call
    max_prompt_length: int = 512  # tokens, after the chat template
    max_response_length: int = 512
    # Prompts longer than max_prompt_length: dropped (and counted) when filter_overlong_prompts, else cut
    # as truncation says: left | right | middle keep that many tokens, error names the row.
    filter_overlong_prompts: bool = False
    truncation: Literal["error", "left", "right", "middle"] = "error"
    apply_chat_template_kwargs: dict = field(default_factory=dict)  # extra arguments of apply_chat_template
    shuffle: bool = True

    def validate(self):
        check_sizes(self, "batch_size", "val_batch_size", "max_prompt_length", "max_response_length")
