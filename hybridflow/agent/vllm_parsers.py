"""verl 0.9.1's tool-call formats beyond Hermes (``rollout.multi_turn.format``: verl's names), read by vLLM's own
parsers (``vllm.tool_parsers``), and gpt-oss's harmony messages.

verl 0.9.1 writes its nine parsers by hand (experimental/agent_loop/tool_parser.py). vLLM ships one per family,
registered by its own name (``ToolParserManager``); each reads a whole assistant turn's text
(``extract_tool_calls``, non-streaming) and converts parameter values by the tools' schemas where the format
writes them as text (Qwen3-Coder, GLM, Seed-OSS, MiniMax, DeepSeek-V4). gpt-oss is the exception: vLLM parses its
harmony messages from token ids with the ``openai_harmony`` encoding, whose vocabulary it downloads; the few
lines of ``HarmonyCalls`` read the decoded text instead, as verl's parser does.

Deliberate difference from verl and vLLM, as for Hermes (agent/parsers.py): a turn that opens a call its
parser cannot read is returned as one malformed call, which the agent loop answers with an error message,
instead of being dropped (the model learns from it).
"""

from __future__ import annotations

import json
import re

from hybridflow.agent.tool_call import ToolCall, register_parser

# verl's name -> (vLLM's parser, the text that opens a turn's calls and the one that closes each call, in the
# family's chat template)
VLLM_FORMATS = {
    "qwen3_coder": ("qwen3_coder", "<tool_call>", "</tool_call>"),
    "glm": ("glm45", "<tool_call>", "</tool_call>"),
    "seed": ("seed_oss", "<seed:tool_call>", "</seed:tool_call>"),
    "minimax": ("minimax_m2", "<minimax:tool_call>", "</invoke>"),
    "kimi": ("kimi_k2", "<|tool_calls_section_begin|>", "<|tool_call_end|>"),
    "deepseek_v4": ("deepseek_v4", "<｜DSML｜function_calls>", "</｜DSML｜invoke>"),
    "gemma4": ("gemma4", "<|tool_call>", "<tool_call|>"),
}


def decoded_call(name: str | None, arguments) -> ToolCall:
    """A call whose arguments arrive JSON-encoded (or as a dict): malformed unless they are a JSON object."""
    if not name:
        return ToolCall(None, {}, "malformed tool call: no function name")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as e:
            return ToolCall(name, {}, f"malformed tool call: invalid JSON arguments ({e.msg} at char {e.pos})")
    if not isinstance(arguments, dict):
        return ToolCall(name, {}, "malformed tool call: arguments are not a JSON object")
    return ToolCall(name, arguments)


class VLLMCalls:
    """One of ``VLLM_FORMATS`` through vLLM's parser of that family; ``tools``: the tools' OpenAI schemas, from
    which the parser converts the values a format writes as text."""

    def __init__(self, verl_name: str, tokenizer, tools: list[dict] | None = None):
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.tool_parsers import ToolParserManager

        vllm_name, self.start, self.end = VLLM_FORMATS[verl_name]
        self._request = ChatCompletionRequest(model="policy", messages=[], tools=tools or None)
        self._parser = ToolParserManager.get_tool_parser(vllm_name)(tokenizer, self._request.tools)

    def parse(self, text: str) -> list[ToolCall]:
        if self.start not in text:
            return []
        info = self._parser.extract_tool_calls(text, self._request)
        parsed = info.tool_calls if info.tools_called else []
        # vLLM's parsers also return a call the length budget cut (its name cut short): only closed calls count
        calls = [decoded_call(c.function.name, c.function.arguments) for c in parsed[:text.count(self.end)]]
        if len(calls) < len(parsed) or not calls:  # a call opened that the format does not close
            calls.append(ToolCall(None, {}, f"malformed tool call: {self.start} with a call not closed by {self.end}"))
        return calls


def _register_vllm_formats() -> None:
    for verl_name in VLLM_FORMATS:
        register_parser(verl_name)(lambda tokenizer=None, tools=None, _n=verl_name: VLLMCalls(_n, tokenizer, tools))


_register_vllm_formats()


@register_parser("gpt-oss")
class HarmonyCalls:
    """gpt-oss's harmony format: each message is ``[<|start|>assistant]<|channel|>CHANNEL[ to=RECIPIENT][
    <|constrain|>json]<|message|>BODY`` ending in ``<|end|>``, ``<|call|>`` or ``<|return|>``; a call is a message
    addressed ``to=functions.NAME`` (the recipient may stand before the channel), its body the JSON arguments
    (https://cookbook.openai.com/articles/openai-harmony). Analysis (reasoning) messages call nothing."""

    start = "to=functions."
    _message = re.compile(r"(?:<\|start\|>assistant)?(?P<header>(?:(?!<\|message\|>|<\|start\|>).)*)<\|message\|>"
                          r"(?P<body>.*?)(?P<end><\|call\|>|<\|end\|>|<\|return\|>|$)", re.DOTALL)
    _recipient = re.compile(r"to=functions\.([^\s<]+)")

    def __init__(self, tokenizer=None, tools=None):
        pass  # the format is read from the decoded text alone

    def parse(self, text: str) -> list[ToolCall]:
        calls = []
        for m in self._message.finditer(text):
            recipient = self._recipient.search(m.group("header"))
            if recipient is None or "<|channel|>analysis" in m.group("header"):
                continue
            if m.group("end") != "<|call|>":  # cut by the length budget, or ended as an answer
                calls.append(ToolCall(recipient.group(1), {}, "malformed tool call: the call is not ended by <|call|>"))
                continue
            calls.append(decoded_call(recipient.group(1), m.group("body")))
        return calls


HARMONY_CHANNEL = "<|channel|>"  # a special token of gpt-oss's tokenizer (o200k_harmony) and of no other here


def harmony_final(text: str) -> str | None:
    """The answer of a turn in the harmony format (decoded with its special tokens): the bodies of its messages on
    the final channel, joined by newlines, analysis and commentary left out ("" where the turn was cut before its
    answer); None for text that is not in the format."""
    if HARMONY_CHANNEL not in text:
        return None
    return "\n".join(m.group("body") for m in HarmonyCalls._message.finditer(text)
                     if f"{HARMONY_CHANNEL}final" in m.group("header"))
