"""What the agent loop takes from the tokenizer's chat template: the token that ends an assistant turn, and
the tokens of tool messages appended after one.

Tool messages are rendered by the template itself in a stand-in conversation, and only the text the template
puts after the assistant's end-of-turn token is tokenized: the model's sampled tokens are never decoded and
tokenized again (verl 0.9.1's continuous-token builder does the same by rendering deltas,
``utils/tokenizer/continuous_token.py``; where Qwen's template writes ``<|im_end|>\\n`` and generation stops at
``<|im_end|>``, verl inserts the missing newline, which here is simply part of the rendered delta).
"""

from __future__ import annotations

_MARK = "\u2063HFMARK\u2063"  # content no template alters, to find where an assistant message's text ends
_STAND_IN = [{"role": "user", "content": "u"},
             {"role": "assistant", "content": "",
              "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {}}}]}]


def truncate_tool_response(text: str, limit: int, side: str) -> tuple[str, bool]:
    """verl's truncation of a tool's response to ``limit`` characters (tool_agent_loop.py ``_call_tool``), and
    whether it was cut."""
    if len(text) <= limit:
        return text, False
    if side == "left":
        return "(truncated)..." + text[-limit:], True
    if side == "right":
        return text[:limit] + "...(truncated)", True
    half = limit // 2
    return text[:half] + "...(truncated)..." + text[len(text) - half:], True


class ChatFormat:
    """The chat template's turn structure for one tokenizer (and ``chat_template_kwargs``, verl's
    data.apply_chat_template_kwargs, e.g. Qwen3's enable_thinking)."""

    def __init__(self, tokenizer, chat_template_kwargs: dict | None = None):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"rollout.multi_turn needs a chat template: the tokenizer "
                             f"{getattr(tokenizer, 'name_or_path', '')!r} has none")
        self.tokenizer, self.kwargs = tokenizer, {k: v for k, v in (chat_template_kwargs or {}).items() if k != "tools"}
        self.end_of_turn_id = self._end_of_turn_id()
        self.end_of_turn = tokenizer.convert_ids_to_tokens(self.end_of_turn_id)
        # generation stops at the end of the assistant turn (and at EOS, for models whose EOS differs)
        self.stop_token_ids = sorted({self.end_of_turn_id} | ({tokenizer.eos_token_id} - {None}))

    def render(self, messages: list[dict], *, add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                  tokenize=False, **self.kwargs)

    def _end_of_turn_id(self) -> int:
        """The first special token the template writes after an assistant message's text (``<|im_end|>`` for
        ChatML, ``<|eot_id|>`` for Llama 3); the EOS token when there is none."""
        text = self.render([{"role": "user", "content": "u"}, {"role": "assistant", "content": _MARK}],
                           add_generation_prompt=False)
        after = text[text.rindex(_MARK) + len(_MARK):]
        special = set(self.tokenizer.all_special_ids) | set(self.tokenizer.added_tokens_decoder)
        for token in self.tokenizer(after, add_special_tokens=False).input_ids:
            if token in special:
                return token
        if self.tokenizer.eos_token_id is None:
            raise ValueError("the chat template ends assistant turns with no special token and the tokenizer has "
                             "no EOS: rollout.multi_turn cannot tell where a turn ends")
        return self.tokenizer.eos_token_id

    def tool_message_ids(self, contents: list[str]) -> list[int]:
        """Token ids of tool messages with ``contents`` and the next assistant turn's generation prompt, as they
        follow an assistant turn that ended with its end-of-turn token."""
        return self.message_ids([{"role": "tool", "content": c} for c in contents])

    def message_ids(self, messages: list[dict]) -> list[int]:
        """Token ids of ``messages`` (tool or user turns) and the next assistant turn's generation prompt, as they
        follow an assistant turn that ended with its end-of-turn token."""
        before = self.render(_STAND_IN, add_generation_prompt=False)
        after = self.render(_STAND_IN + list(messages), add_generation_prompt=True)
        cut = before.rfind(self.end_of_turn)
        if cut < 0 or not after.startswith(before[:cut + len(self.end_of_turn)]):
            raise ValueError("the chat template renders an assistant turn differently once tool messages follow it: "
                             "tool messages cannot be appended token by token")
        return self.tokenizer(after[cut + len(self.end_of_turn):], add_special_tokens=False).input_ids
