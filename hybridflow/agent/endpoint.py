"""The policy behind an OpenAI-compatible HTTP endpoint, for agent programs that talk to a model through the
OpenAI API: ``/v1/models``, ``/v1/chat/completions`` and ``/v1/completions`` (non-streaming), and ``/rl/reward``.

Requests and responses are vLLM's own OpenAI protocol models (``vllm.entrypoints.openai...protocol``); the chat
template is the tokenizer's; tool calls are read by the run's tool-call format (agent/parsers.py) and returned as
OpenAI ``tool_calls``. Every request names its episode, ``session_id`` in the body (the openai client's
``extra_body``) or the ``X-Session-Id`` header, and what it samples is recorded token by token in that session
(agent/sessions.py). The sampling itself is a ``Backend``'s: the rollout engine of the process serving.

Safety: the server binds to 127.0.0.1 unless told otherwise, every request needs the run's API key (``Bearer``),
bodies are bounded, a session takes one request at a time, and malformed JSON, a wrong key, an unknown session,
an oversize body, ``n`` > 1, streaming and ``max_tokens`` beyond the context are answered 4xx with one line,
before the engine is touched.
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Protocol

from starlette.requests import Request  # module level: FastAPI reads the routes' annotations here

from hybridflow.agent.sessions import SessionStore
from hybridflow.rollout.engine_requests import SamplingSettings

log = logging.getLogger(__name__)


class Backend(Protocol):
    def generate(self, context: list[int], sampling: SamplingSettings, stop_token_ids: list[int], key: str
                 ) -> tuple[list[int], list[float], int]:
        """The sampled ids, their log-probs and the policy version of the weights that sampled them; ``key``
        (the session id and the request's number in it) names the request's own sampling seed where the backend
        seeds requests."""


class RolloutBackend:
    """A VLLMRollout of this process, one request at a time (its ``LLM`` is not re-entrant), from the server's
    threads: each runs with the engine's own thread count (OpenMP's is per thread; vLLM-CPU's attention checks that
    the thread running it has the count its metadata was planned for)."""

    def __init__(self, rollout, version: int = 0):
        import torch

        self.rollout, self.version, self._lock = rollout, version, threading.Lock()
        self._threads = torch.get_num_threads()

    def generate(self, context, sampling, stop_token_ids, key):  # the engine's seeded stream: no seed per request
        import torch

        if torch.get_num_threads() != self._threads:
            torch.set_num_threads(self._threads)
        with self._lock:
            ((ids, log_probs),) = self.rollout.generate_with_log_probs([context], sampling, log_probs=True,
                                                                      stop_token_ids=stop_token_ids)
        return list(ids), list(log_probs), self.version


def _seed_key(session_id: str, turn) -> str:
    """A request's seed key: its session and its number there, so that an episode samples alike however the
    episodes running beside it interleave their requests."""
    return f"{session_id}/{turn.session.requests}"


@dataclass
class EndpointSettings:
    model_name: str  # what /v1/models lists and responses name
    max_model_len: int  # prompt + new tokens of one request
    api_key: str = ""  # "": one is generated (``Endpoint.api_key``)
    max_request_bytes: int = 4 * 2**20
    max_new_tokens: int | None = None  # one request's new tokens at most (a request asking more gets this many)


class RequestError(Exception):
    """A request answered 4xx (``status``), with one line."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.kind = status, kind


class Endpoint:
    """The request handling, free of HTTP (``app`` wraps it in FastAPI): tokens in, tokens out, recorded."""

    def __init__(self, backend: Backend, sessions: SessionStore, parser, settings: EndpointSettings):
        self.backend, self.sessions, self.parser, self.settings = backend, sessions, parser, settings
        self.chat = sessions.chat
        # session id -> the run's sampling (temperature, top_p, top_k) of its episodes, set by a run that trains on
        # what is sampled: the trainer's log-probs assume it, so a request's own values are then ignored; a session
        # not listed samples with its request's
        self.run_sampling: dict[str, SamplingSettings] = {}
        self.api_key = settings.api_key or f"hf-{secrets.token_urlsafe(24)}"
        self._busy: set[str] = set()
        self._lock = threading.Lock()

    def check_key(self, authorization: str | None) -> None:
        if authorization != f"Bearer {self.api_key}":
            raise RequestError(401, "a wrong or missing API key (Authorization: Bearer <the run's key>)",
                               "authentication_error")

    def parse_body(self, raw: bytes) -> dict:
        if len(raw) > self.settings.max_request_bytes:
            raise RequestError(413, f"the request body is {len(raw)} bytes; at most {self.settings.max_request_bytes}")
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RequestError(400, f"malformed JSON: {e}") from None
        if not isinstance(body, dict):
            raise RequestError(400, "the request body must be a JSON object")
        return body

    def chat_completion(self, body: dict, session_header: str | None) -> dict:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        request = self._validated(ChatCompletionRequest, body)
        session_id = self._session_id(body, session_header)
        tools = [t.model_dump(exclude_none=True) for t in request.tools] if request.tools else None
        with self._session(session_id):
            turn = self._begin(self.sessions.begin, session_id, request.messages, tools)
            context = turn.context
            sampling = self._sampling(request, len(context), session_id)
            ids, log_probs, version = self.backend.generate(context, sampling, self.chat.stop_token_ids,
                                                            _seed_key(session_id, turn))
            message, finish = self._reply(ids, sampling.max_new_tokens)
            self.sessions.record(turn, ids, log_probs, version, message)
        return self._chat_response(message, finish, len(context), len(ids))

    def completion(self, body: dict, session_header: str | None) -> dict:
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest

        request = self._validated(CompletionRequest, body)
        session_id = self._session_id(body, session_header)
        prompt = request.prompt
        if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
            prompt = prompt[0]
        if not isinstance(prompt, str) and not (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)):
            raise RequestError(400, "prompt: one string or one list of token ids")
        with self._session(session_id):
            ids = prompt if isinstance(prompt, list) else self.chat.tokenizer(prompt, add_special_tokens=False).input_ids
            turn = self._begin(self.sessions.begin_tokens, session_id, ids)
            context = turn.context
            sampling = self._sampling(request, len(context), session_id)
            ids, log_probs, version = self.backend.generate(context, sampling, [], _seed_key(session_id, turn))
            self.sessions.record(turn, ids, log_probs, version)
        text = self.chat.tokenizer.decode(ids, skip_special_tokens=True)
        finish = "length" if len(ids) >= sampling.max_new_tokens else "stop"
        return {"id": f"cmpl-{secrets.token_hex(12)}", "object": "text_completion", "model": self.settings.model_name,
                "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}],
                "usage": _usage(len(context), len(ids))}

    def models(self) -> dict:
        from vllm.entrypoints.serve.engine.protocol import ModelCard, ModelList

        card = ModelCard(id=self.settings.model_name, owned_by="hybridflow", max_model_len=self.settings.max_model_len)
        return ModelList(data=[card]).model_dump()

    def reward(self, body: dict) -> dict:
        session_id, reward = body.get("session_id"), body.get("reward")
        if not isinstance(session_id, str) or isinstance(reward, bool) or not isinstance(reward, (int, float)):
            raise RequestError(400, 'expected {"session_id": <string>, "reward": <number>}')
        try:
            self.sessions.set_reward(session_id, reward)
        except KeyError as e:
            raise RequestError(404, str(e).strip("'\"")) from None
        return {"session_id": session_id, "reward": float(reward)}

    # --- the parts of a request ----------------------------------------------------------------------

    @staticmethod
    def _validated(model, body: dict):
        from pydantic import ValidationError

        if body.get("stream"):
            raise RequestError(400, "stream: streaming is not served; send stream=false")
        if body.get("n", 1) != 1:
            raise RequestError(400, f"n: one choice per request (got {body.get('n')}); an episode is one sample")
        try:
            return model.model_validate(body)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first.get("loc", ())) or "body"
            raise RequestError(400, f"{where}: {first.get('msg')}") from None

    @staticmethod
    def _session_id(body: dict, header: str | None) -> str:
        session_id = body.get("session_id") or header
        if not isinstance(session_id, str) or not session_id:
            raise RequestError(400, "session_id: every request names its episode (body session_id, the openai "
                                    "client's extra_body, or the X-Session-Id header)")
        return session_id

    @contextlib.contextmanager
    def _session(self, session_id: str):
        """``session_id`` held for one request: a second one while it generates is refused."""
        with self._lock:
            if session_id in self._busy:
                raise RequestError(409, f"session {session_id!r} has a request generating: one at a time")
            self._busy.add(session_id)
        try:
            yield
        finally:
            with self._lock:
                self._busy.discard(session_id)

    @staticmethod
    def _begin(begin, *args):
        try:
            return begin(*args)
        except OverflowError as e:
            raise RequestError(429, str(e), "rate_limit_error") from None

    def _sampling(self, request, prompt_tokens: int, session_id: str) -> SamplingSettings:
        room = self.settings.max_model_len - prompt_tokens
        wanted = getattr(request, "max_completion_tokens", None) or request.max_tokens
        if room <= 0 or (wanted is not None and wanted > room):
            raise RequestError(400, f"max_tokens {wanted}: the prompt's {prompt_tokens} tokens leave {max(room, 0)} "
                                    f"of the model's {self.settings.max_model_len}")
        budget = min(wanted or room, self.settings.max_new_tokens or room)
        s = self.run_sampling.get(session_id)
        if s is not None:
            return SamplingSettings(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_new_tokens=budget)
        temperature = 1.0 if request.temperature is None else request.temperature
        return SamplingSettings(temperature=temperature, top_p=1.0 if request.top_p is None else request.top_p,
                                top_k=request.top_k if request.top_k is not None else -1, max_new_tokens=budget)

    def _reply(self, ids: list[int], budget: int) -> tuple[dict, str]:
        """The assistant message of the sampled ``ids`` (its text, its tool calls in OpenAI's form) and why it
        ended."""
        text = self.chat.tokenizer.decode(ids, skip_special_tokens=False)
        calls = [c for c in self.parser.parse(text) if c.name is not None and c.error is None]
        shown = self.chat.tokenizer.decode(ids, skip_special_tokens=True)
        message: dict = {"role": "assistant", "content": shown.split(self.parser.start)[0].strip() if calls else shown}
        if calls:
            message["tool_calls"] = [{"id": f"call_{i}", "type": "function", "function": {
                "name": c.name, "arguments": json.dumps(c.arguments)}} for i, c in enumerate(calls)]
            return message, "tool_calls"
        return message, "stop" if ids and ids[-1] in self.chat.stop_token_ids or len(ids) < budget else "length"

    def _chat_response(self, message: dict, finish: str, prompt_tokens: int, completion_tokens: int) -> dict:
        from vllm.entrypoints.openai.chat_completion.protocol import (ChatCompletionResponse,
                                                                      ChatCompletionResponseChoice, ChatMessage)

        choice = ChatCompletionResponseChoice(index=0, message=ChatMessage(**message), finish_reason=finish)
        return ChatCompletionResponse(model=self.settings.model_name, choices=[choice],
                                      usage=_usage(prompt_tokens, completion_tokens)).model_dump(exclude_none=True)


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def http_app(endpoint: Endpoint):
    """``endpoint`` as a FastAPI app; the engine work runs on threads, one per open session at most (starlette's
    run_in_threadpool shares anyio's default 40: no engine batch would hold more than 40 requests)."""
    import anyio
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    api = FastAPI(title="hybridflow policy", docs_url=None, redoc_url=None, openapi_url=None)
    threads = anyio.CapacityLimiter(endpoint.sessions.max_sessions + 8)  # + /v1/models, /rl/reward

    async def answer(request: Request, handle) -> JSONResponse:
        try:
            endpoint.check_key(request.headers.get("authorization"))
            size = int(request.headers.get("content-length") or 0)
            if size > endpoint.settings.max_request_bytes:
                raise RequestError(413, f"the request body is {size} bytes; at most "
                                        f"{endpoint.settings.max_request_bytes}")
            raw = await request.body()
            return JSONResponse(await anyio.to_thread.run_sync(handle, raw, request.headers.get("x-session-id"),
                                                               limiter=threads))
        except RequestError as e:
            return JSONResponse({"error": {"message": str(e), "type": e.kind, "code": e.status}}, status_code=e.status)
        except Exception as e:  # noqa: BLE001 - the engine's failure, answered in one line; the server goes on
            log.exception("endpoint request failed")
            return JSONResponse({"error": {"message": f"{type(e).__name__}: {e}", "type": "internal_error",
                                           "code": 500}}, status_code=500)

    @api.get("/v1/models")
    async def models(request: Request):
        return await answer(request, lambda raw, session: endpoint.models())

    @api.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await answer(request, lambda raw, session: endpoint.chat_completion(endpoint.parse_body(raw), session))

    @api.post("/v1/completions")
    async def completions(request: Request):
        return await answer(request, lambda raw, session: endpoint.completion(endpoint.parse_body(raw), session))

    @api.post("/rl/reward")
    async def reward(request: Request):
        return await answer(request, lambda raw, session: endpoint.reward(endpoint.parse_body(raw)))

    return api


class Server:
    """The endpoint served by uvicorn on a thread of this process, at ``base_url`` once ``start`` returns."""

    def __init__(self, endpoint: Endpoint, host: str = "127.0.0.1", port: int = 0):
        import uvicorn

        self.host, self.base_url = host, None
        self._server = uvicorn.Server(uvicorn.Config(http_app(endpoint), host=host, port=port, log_level="warning",
                                                     access_log=False, lifespan="off"))
        self._thread = threading.Thread(target=self._server.run, name="hybridflow-endpoint", daemon=True)

    def start(self, timeout_s: float = 30) -> str:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the endpoint did not start on {self.host}")
            time.sleep(0.05)
        port = self._server.servers[0].sockets[0].getsockname()[1]
        self.base_url = f"http://{self.host}:{port}/v1"
        return self.base_url

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
