"""A parsed tool call and the registry of tool-call formats (``rollout.multi_turn.format``)."""

from __future__ import annotations

from dataclasses import dataclass

from hybridflow.registry import Registry


@dataclass
class ToolCall:
    name: str | None  # None when the call could not be decoded
    arguments: dict
    error: str | None = None  # why the call is malformed (the model reads it as the tool's response)


# name -> factory(tokenizer, tools) of an object whose parse(text) returns the turn's ToolCalls
PARSERS = Registry("tool-call format")
register_parser = PARSERS.register
