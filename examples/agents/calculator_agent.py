"""A tool agent written against the plain OpenAI API, as a harness user writes one: it sends the task, runs
every calculator call the model makes, sends the results back, and scores the final answer.

    run_episode(task, base_url, api_key, session_id) -> reward

``task``: {"question": ..., "answer": ...}. It knows nothing of hybridflow's internals: any endpoint speaking the
chat completions API with tool calls serves it, and hybridflow's (hybridflow/agent/endpoint.py) records what the
policy sampled in the episode named ``session_id`` (sent as ``extra_body``), whatever this program does with the
text. The calculator is the quickstart's (arithmetic parsed with ``ast``, never ``eval``).
"""

from __future__ import annotations

import functools
import json

from hybridflow.agent.calculator import CalculatorError, evaluate

CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


def calculator(arguments: str) -> str:
    try:
        return evaluate(json.loads(arguments)["expression"])
    except (CalculatorError, KeyError, TypeError, json.JSONDecodeError) as e:
        return f"error: {e}"


@functools.cache
def client_for(base_url: str, api_key: str):
    """One client per endpoint for every episode of this process (clients are thread-safe and pool their
    connections; making one costs ~20 ms of CPU, most of it its TLS context)."""
    import openai

    return openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)


def run_episode(task: dict, base_url: str, api_key: str, session_id: str, *, model: str = "policy",
                max_turns: int = 4, max_tokens: int | None = None, tool=calculator) -> float:
    """One episode: 1.0 when the model's last answer is the task's answer, else 0.0 (also when the conversation
    outgrew the model's context: the server refuses the request). ``max_tokens``: None lets the server give what
    the context has left; ``tool(arguments) -> text`` answers the calculator calls."""
    import openai

    client = client_for(base_url, api_key)
    messages = [{"role": "user", "content": task["question"]}]
    for _ in range(max_turns):
        try:
            reply = client.chat.completions.create(model=model, messages=messages, tools=[CALCULATOR],
                                                   max_tokens=max_tokens, extra_body={"session_id": session_id})
        except openai.BadRequestError as e:
            if "leave" in str(e):  # no room left in the context: the episode ends unanswered
                return 0.0
            raise
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return float((message.content or "").strip() == str(task["answer"]))
        for call in message.tool_calls:
            result = tool(call.function.arguments) if call.function.name == "calculator" else "unknown tool"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return 0.0
