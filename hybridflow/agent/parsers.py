"""Tool-call parsers: an assistant turn's decoded text -> the calls it makes, by ``rollout.multi_turn.format``.

Decoding here only finds the calls; the trajectory keeps the sampled token ids as they are. Unlike verl
0.9.1's parsers (``experimental/agent_loop/tool_parser.py``), which log and drop a call they cannot decode, a
malformed call is returned as such: the agent loop answers it with an error message, so the model learns
from it instead of seeing its call silently ignored.
"""

from __future__ import annotations

import json
import re

from hybridflow.agent import vllm_parsers  # noqa: F401 (registers verl's other formats)
from hybridflow.agent.tool_call import PARSERS, ToolCall, register_parser

__all__ = ["PARSERS", "ToolCall", "get_parser", "register_parser"]


def get_parser(name: str, tokenizer=None, tools: list[dict] | None = None):
    """The parser of format ``name`` for the policy's ``tokenizer`` and the tools' OpenAI schemas ``tools``."""
    check_format(name)
    return PARSERS.get(name)(tokenizer, tools)


def check_format(name: str) -> None:
    """ValueError naming ``rollout.multi_turn.format`` unless a parser has that name (nothing is built)."""
    try:
        PARSERS.get(name)
    except KeyError as e:
        raise ValueError(f"rollout.multi_turn.format: {e}") from None


@register_parser("hermes")
class HermesParser:
    """Hermes / Qwen: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number per turn (the
    format of Qwen2.5/Qwen3's chat templates and vLLM's hermes_tool_parser)."""

    start, end = "<tool_call>", "</tool_call>"
    _call = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def __init__(self, tokenizer=None, tools=None):
        pass  # the format is read from the decoded text alone

    def parse(self, text: str) -> list[ToolCall]:
        calls = [self._decode(body) for body in self._call.findall(text)]
        tail = self._call.sub("", text)
        if self.start in tail:  # an opened call the turn never closed (cut by the length budget, or garbled)
            calls.append(ToolCall(None, {}, f"malformed tool call: {self.start} without {self.end}"))
        return calls

    @staticmethod
    def _decode(body: str) -> ToolCall:
        try:
            call = json.loads(body)
        except json.JSONDecodeError as e:
            return ToolCall(None, {}, f"malformed tool call: invalid JSON ({e.msg} at char {e.pos})")
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return ToolCall(None, {}, 'malformed tool call: expected {"name": <string>, "arguments": {...}}')
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):  # some models emit the arguments JSON-encoded as a string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return ToolCall(call["name"], {}, "malformed tool call: arguments are not a JSON object")
        if not isinstance(arguments, dict):
            return ToolCall(call["name"], {}, "malformed tool call: arguments are not a JSON object")
        return ToolCall(call["name"], arguments)
