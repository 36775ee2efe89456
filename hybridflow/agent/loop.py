"""The multi-turn agent loop: turns of batched generation and concurrent tool calls, token-in, token-out.

Per turn every active trajectory generates in one batched engine call that stops at the end of the
assistant turn; the tool calls in each turn are parsed and run (all trajectories' calls at once, each bounded
by its tool's timeout), and their responses are appended as tool messages rendered by the chat template. A
trajectory ends with an answer that calls no tool, at ``max_assistant_turns`` / ``max_user_turns``, or at the
response budget. Its tokens are exactly the ids the engine sampled plus the tool messages' tokens: decoded
text is only read (to find calls), never tokenized again. ``response_mask`` is 1 on sampled tokens and 0 on
tool-message tokens; the engine's log-prob comes back for each sampled token.

The termination rules are verl 0.9.1's (``experimental/agent_loop/tool_agent_loop.py``): the turn limits
are checked after generation, and tool messages that would reach the response budget end the trajectory
without being appended. verl runs one asyncio task per trajectory against an async server; here one
batched call per turn serves all trajectories of a rollout worker (vLLM batches them either way).
"""

from __future__ import annotations

import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from hybridflow.agent.chat import ChatFormat, truncate_tool_response
from hybridflow.agent.parsers import ToolCall


@dataclass
class Trajectory:
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)  # 1: sampled by the model, 0: tool-message tokens
    log_probs: list[float] = field(default_factory=list)  # the engine's, per response token (0.0 on tool tokens)
    assistant_turns: int = 0
    user_turns: int = 0  # tool-response turns
    tool_calls: int = 0
    tool_errors: Counter = field(default_factory=Counter)  # by kind (agent/tools.py ToolResult.error)
    tool_seconds: float = 0.0
    truncated_tool_responses: int = 0
    done: bool = False
    # MoE routing replay (R3): the experts of every token but the last, from the latest turn's request, which routed
    # the whole context again (an engine with ``routed_experts``)
    routes: object = None
    turn_start: int = 0  # where the assistant turn in progress begins in response_ids

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def append(self, ids: list[int], sampled: bool, log_probs: list[float] | None = None) -> None:
        self.response_ids += ids
        self.response_mask += [int(sampled)] * len(ids)
        self.log_probs += log_probs if log_probs is not None else [0.0] * len(ids)


@dataclass
class AgentSettings:
    """rollout.multi_turn's limits (config/schema.py MultiTurn holds their defaults)."""
    max_response_length: int
    max_assistant_turns: int | None
    max_user_turns: int | None
    max_parallel_calls: int
    max_tool_response_length: int
    tool_response_truncate_side: str

    @classmethod
    def from_config(cls, multi_turn, max_response_length: int) -> AgentSettings:
        m = multi_turn
        return cls(max_response_length, m.max_assistant_turns, m.max_user_turns, m.max_parallel_calls,
                   m.max_tool_response_length, m.tool_response_truncate_side)


@dataclass
class ToolJobs:
    """Tool calls running for some trajectories' ended turns (``AgentLoop.start_tools``)."""

    calling: list  # (trajectory, its calls)
    jobs: list  # (trajectory, future of one call)
    deadline: float  # time.monotonic() past which a call still running is answered as timed out
    limit: float  # seconds from start to deadline

    def ready(self) -> bool:
        return time.monotonic() >= self.deadline or all(f.done() for _, f in self.jobs)


class AgentLoop:
    """Runs conversations to their end with a generation engine (``generate_with_log_probs(prompts, sampling,
    log_probs=, max_new_tokens=[...], stop_token_ids=[...])``: the vLLM rollout, or ``hf_engine.HFEngine``)."""

    def __init__(self, tokenizer, tools: dict, parser, settings: AgentSettings, chat: ChatFormat):
        self.tokenizer, self.tools, self.parser, self.settings, self.chat = tokenizer, tools, parser, settings, chat
        self._pool = ThreadPoolExecutor(max_workers=32, thread_name_prefix="tool")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def run(self, engine, prompts: list[list[int]], sampling, *, log_probs: bool) -> list[Trajectory]:
        s = self.settings
        trajectories = [Trajectory(list(p)) for p in prompts]
        routes = {"with_routes": True} if getattr(engine, "routed_experts", False) else {}
        while active := [t for t in trajectories if not t.done]:
            outs = engine.generate_with_log_probs(
                [t.context for t in active], sampling, log_probs=log_probs, stop_token_ids=self.chat.stop_token_ids,
                max_new_tokens=[s.max_response_length - len(t.response_ids) for t in active], **routes)
            calling = []
            for t, (ids, lps, *turn_routes) in zip(active, outs):
                if turn_routes:
                    t.routes = turn_routes[0]
                t.append(list(ids), True, list(lps) if lps is not None else None)
                if calls := self.end_turn(t, ids):
                    calling.append((t, calls))
            self.run_tools(calling)
        return trajectories

    def end_turn(self, t: Trajectory, turn: list[int]) -> list[ToolCall]:
        """Count ``t``'s finished assistant turn ``turn`` (appended already) and return the tool calls to run
        after it; none when the turn ends the trajectory (marked done): an answer that calls no tool, or a limit
        reached."""
        t.assistant_turns += 1
        calls = []
        if not self._limit_reached(len(t.response_ids), t.assistant_turns, t.user_turns, turn):
            text = self.tokenizer.decode(turn, skip_special_tokens=False)
            calls = self.parser.parse(text)[: self.settings.max_parallel_calls]
        t.done = not calls
        return calls

    def turn_would_end(self, t: Trajectory, turn: list[int]) -> bool:
        """Whether ``t`` would end with the assistant turn ``turn`` (not yet appended): for a caller that stops
        generating once enough trajectories have ended (workers/carried_generation.py)."""
        new = len(turn) - (len(t.response_ids) - t.turn_start)  # a resumed turn: its earlier part is appended
        return (self._limit_reached(len(t.response_ids) + new, t.assistant_turns + 1, t.user_turns, turn)
                or not self.parser.parse(self.tokenizer.decode(turn, skip_special_tokens=False)))

    def _limit_reached(self, length: int, assistant_turns: int, user_turns: int, turn: list[int]) -> bool:
        s = self.settings
        return (length >= s.max_response_length
                or (s.max_assistant_turns is not None and assistant_turns >= s.max_assistant_turns)
                or (s.max_user_turns is not None and user_turns >= s.max_user_turns)
                or not turn or turn[-1] not in self.chat.stop_token_ids)  # cut by the budget mid-turn

    def run_tools(self, calling: list[tuple[Trajectory, list[ToolCall]]]) -> None:
        """Every call of this turn at once; each response is the tool's text or an error message."""
        self.finish_tools(self.start_tools(calling))

    def start_tools(self, calling: list[tuple[Trajectory, list[ToolCall]]]) -> ToolJobs:
        """Start the calls of ``calling`` on the tool threads; ``finish_tools`` appends their messages."""
        jobs = [(t, self._pool.submit(self._call, call)) for t, calls in calling for call in calls]
        # a tool over its own timeout (a hung user tool: threads cannot be killed) is left behind, answered as such
        limit = max((self._timeout(call) for _, calls in calling for call in calls), default=0.0) + 5.0
        return ToolJobs(calling, jobs, time.monotonic() + limit, limit)

    def finish_tools(self, job: ToolJobs) -> None:
        """Wait for ``job``'s calls (until its deadline) and append each trajectory's tool message. Tokenizes on the
        caller's thread: a fast tokenizer must not be used by two threads at once."""
        wait([f for _, f in job.jobs], timeout=max(0.0, job.deadline - time.monotonic()))
        responses: dict[int, list[str]] = {}
        for t, future in job.jobs:
            if future.done():
                text, error, seconds = future.result()
            else:
                text, error, seconds = "Error: the tool did not return within its timeout", "timeout", job.limit
            t.tool_calls += 1
            t.tool_seconds += seconds
            if error:
                t.tool_errors[error] += 1
            text, cut = truncate_tool_response(text, self.settings.max_tool_response_length,
                                               self.settings.tool_response_truncate_side)
            t.truncated_tool_responses += cut
            responses.setdefault(id(t), []).append(text)
        for t, _ in job.calling:
            ids = self.chat.tool_message_ids(responses[id(t)])
            if len(t.response_ids) + len(ids) >= self.settings.max_response_length:
                t.done = True  # verl: tool messages that reach the budget end the trajectory unappended
                continue
            t.append(ids, False)
            t.user_turns += 1
            t.turn_start = len(t.response_ids)

    def _timeout(self, call: ToolCall) -> float:
        tool = self.tools.get(call.name)
        return float(getattr(tool, "timeout_s", 0.0) or 0.0)

    def _call(self, call: ToolCall) -> tuple[str, str | None, float]:
        """(response text, error kind or None, seconds); never raises."""
        if call.error:
            return f"Error: {call.error}", "malformed_call", 0.0
        tool = self.tools.get(call.name)
        if tool is None:
            return (f"Error: unknown tool {call.name!r} (available: {', '.join(sorted(self.tools))})",
                    "unknown_tool", 0.0)
        start = time.perf_counter()
        try:
            result = tool.call(call.arguments)
        except Exception as e:  # Tool.call does not raise; a user's tool class might
            return f"Error: {type(e).__name__}: {e}", "exception", time.perf_counter() - start
        return result.text, result.error, result.seconds or (time.perf_counter() - start)


def trajectory_columns(trajectories: list[Trajectory]) -> tuple[dict, dict]:
    """Per-row agent statistics as batch columns (tensors, non-tensors), for ``agent_metrics`` on the driver."""
    import numpy as np
    import torch

    tensors = {
        "agent_assistant_turns": torch.tensor([t.assistant_turns for t in trajectories], dtype=torch.long),
        "agent_tool_calls": torch.tensor([t.tool_calls for t in trajectories], dtype=torch.long),
        "agent_tool_seconds": torch.tensor([t.tool_seconds for t in trajectories], dtype=torch.float64),
        "agent_tool_truncated": torch.tensor([t.truncated_tool_responses for t in trajectories], dtype=torch.long),
    }
    errors = np.empty(len(trajectories), dtype=object)
    errors[:] = [dict(t.tool_errors) for t in trajectories]
    return tensors, {"agent_tool_errors": errors}


def agent_metrics(tensors: dict, non_tensors: dict) -> dict:
    """Per step: turns per trajectory, tool calls, tool errors by kind, tool seconds, share of the response
    tokens that are tool tokens (``attention`` over the response minus ``response_mask``)."""
    turns, calls = tensors["agent_assistant_turns"].float(), tensors["agent_tool_calls"].float()
    errors = sum((Counter(e) for e in non_tensors["agent_tool_errors"]), Counter())
    tokens = tensors["attention_mask"][:, -tensors["responses"].shape[1]:].sum().item()
    sampled = tensors["response_mask"].sum().item()
    return {
        "agent/assistant_turns_mean": turns.mean().item(),
        "agent/multi_turn_fraction": (turns > 1).float().mean().item(),
        "agent/tool_calls": calls.sum().item(),
        "agent/tool_calls_per_trajectory": calls.mean().item(),
        "agent/tool_errors": float(sum(errors.values())),
        **{f"agent/tool_errors/{kind}": float(count) for kind, count in sorted(errors.items())},
        "agent/tool_seconds": tensors["agent_tool_seconds"].sum().item(),
        "agent/tool_responses_truncated": tensors["agent_tool_truncated"].sum().item(),
        "agent/tool_token_fraction": (tokens - sampled) / tokens if tokens else 0.0,
    }
