"""Token-exact agent sessions behind the OpenAI-compatible endpoint (agent/endpoint.py): what the policy really
sampled in each episode, whatever its harness does with the text.

A session (an episode, named by the harness) holds one or more segments. A segment is a token sequence: the
prompt its first request rendered, then every sampled token (with its log-prob and the policy version that
sampled it) and every token the conversation added between turns (tool or user messages, rendered by the chat
template after the assistant's end-of-turn token: agent/chat.py), the latter masked out of training. A request
whose messages extend the session's (the same messages, the assistant turns as the endpoint returned them, then
new tool or user messages) continues the segment from its tokens: only the new messages are tokenized, the
sampled ids are never decoded and tokenized again. A request that does not (the harness rewrote or trimmed the
history) starts a new segment and is counted as a rewrite, never merged.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field


@dataclass
class Segment:
    """One token sequence of a session: ``ids`` with, per token, whether it was sampled, its log-prob (0 where not
    sampled) and the policy version that sampled it (-1 where not sampled)."""

    ids: list[int] = field(default_factory=list)
    sampled: list[bool] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    prompt_length: int = 0  # the first request's rendered prompt
    messages: list = field(default_factory=list)  # the conversation so far, normalized (``_normal``)

    def extend(self, ids: list[int], log_probs: list[float] | None = None, version: int | None = None) -> None:
        """Append ``ids``: sampled by policy ``version`` with ``log_probs``, or (None) added between turns."""
        self.ids += ids
        self.sampled += [log_probs is not None] * len(ids)
        self.log_probs += list(log_probs) if log_probs is not None else [0.0] * len(ids)
        self.versions += [version] * len(ids) if log_probs is not None else [-1] * len(ids)


@dataclass
class Session:
    segments: list[Segment] = field(default_factory=list)
    rewrites: int = 0  # requests that did not extend the conversation: each began a segment of its own
    requests: int = 0  # requests served (the next one's number: its sampling seed's key)
    reward: float | None = None


@dataclass
class Turn:
    """A request's place in its session, nothing changed yet (``SessionStore.record`` commits it): the segment it
    continues with ``added`` (the tokens the new messages add), or a ``new`` segment beginning with them."""

    session: Session
    segment: Segment
    added: list[int]
    new: bool
    messages: list  # the request's messages, normalized

    @property
    def context(self) -> list[int]:
        """The tokens to generate from."""
        return self.segment.ids + self.added


def _plain(messages: list) -> list[dict]:
    """Chat messages as dicts (the request's, or pydantic models of them)."""
    return [m if isinstance(m, dict) else m.model_dump(exclude_none=True) for m in messages]


def _normal(message) -> tuple:
    """What of a chat message must match for a conversation to extend another: its role, text and tool calls (name
    and decoded arguments); ids, names of tool results and fields a client adds do not count."""
    (m,) = _plain([message])
    content = m.get("content")
    if isinstance(content, list):  # content parts: their text
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    calls = []
    for call in m.get("tool_calls") or []:
        fn = call.get("function", {})
        args = fn.get("arguments")
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except json.JSONDecodeError:
            pass
        calls.append((fn.get("name"), json.dumps(args, sort_keys=True)))
    return m.get("role"), content or "", tuple(calls)


class SessionStore:
    """Sessions by id, safe for the endpoint's concurrent requests (one request of a session at a time: a second
    one while the first generates is refused by the endpoint). ``chat``: the policy's ChatFormat."""

    def __init__(self, chat, max_sessions: int = 1024):
        self.chat, self.max_sessions = chat, max_sessions
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()

    def get(self, session_id: str) -> Session | None:
        return self._sessions.get(session_id)

    def begin(self, session_id: str, messages: list, tools: list[dict] | None = None) -> Turn:
        """The tokens a chat request of ``session_id`` generates from: its segment's tokens and the new messages'
        where ``messages`` extend the conversation, else a new segment of the whole conversation rendered."""
        normal = [_normal(m) for m in messages]
        session = self._open(session_id)
        last = session.segments[-1] if session.segments else None
        if last is not None and self._extends(last, normal):
            return Turn(session, last, self._added(last, messages[len(last.messages):]), False, normal)
        text = self.chat.tokenizer.apply_chat_template(_plain(messages), tools=tools or None, add_generation_prompt=True,
                                                       tokenize=False, **self.chat.kwargs)
        return Turn(session, Segment(), self.chat.tokenizer(text, add_special_tokens=False).input_ids, True, normal)

    def begin_tokens(self, session_id: str, prompt_ids: list[int]) -> Turn:
        """A completion request: it continues the segment whose tokens ``prompt_ids`` start with (the rest added
        between turns), else begins a new segment."""
        session = self._open(session_id)
        last = session.segments[-1] if session.segments else None
        if last is not None and prompt_ids[:len(last.ids)] == last.ids:
            return Turn(session, last, list(prompt_ids[len(last.ids):]), False, [])
        return Turn(session, Segment(), list(prompt_ids), True, [])

    def _open(self, session_id: str) -> Session:
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None:
                if len(self._sessions) >= self.max_sessions:
                    raise OverflowError(f"{self.max_sessions} sessions are open: end one (POST /rl/reward) first")
                session = self._sessions[session_id] = Session()
            return session

    @staticmethod
    def _extends(segment: Segment, normal: list) -> bool:
        seen = segment.messages
        return (bool(seen) and len(normal) > len(seen) and normal[:len(seen)] == seen
                and all(role in ("tool", "user") for role, _, _ in normal[len(seen):]))

    def _added(self, segment: Segment, new_messages: list) -> list[int]:
        """``new_messages`` (tool or user turns) rendered after the segment's last assistant turn, which gets its
        end-of-turn token where the length budget cut it."""
        end = [] if segment.ids[-1] == self.chat.end_of_turn_id else [self.chat.end_of_turn_id]
        return end + self.chat.message_ids(_plain(new_messages))

    @staticmethod
    def record(turn: Turn, ids: list[int], log_probs: list[float], version: int, reply: dict | None = None) -> None:
        """Commit ``turn`` with its sampled ``ids`` (their ``log_probs``, by policy ``version``) and, for a chat
        request, the assistant message the endpoint returned for them (``reply``): the conversation a next request
        must extend. A new segment after another is a rewrite of the history."""
        if turn.new:
            turn.session.rewrites += bool(turn.session.segments)
            turn.segment.prompt_length = len(turn.added)
            turn.session.segments.append(turn.segment)
        turn.segment.extend(turn.added)
        turn.segment.extend(list(ids), list(log_probs), version)
        turn.segment.messages = turn.messages + [_normal(reply)] if reply is not None else []
        turn.session.requests += 1

    def pop(self, session_id: str) -> Session | None:
        """The session, closed (None: it made no request)."""
        with self._lock:
            return self._sessions.pop(session_id, None)

    def set_reward(self, session_id: str, reward: float) -> None:
        session = self._sessions.get(session_id)
        if session is None:
            raise KeyError(f"unknown session {session_id!r}")
        session.reward = float(reward)
