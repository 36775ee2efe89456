"""Requests on a VLLMRollout's engine that the caller steps (continuous serving, carried generation), and the
sampling settings every generation takes; a module of its own beside rollout/vllm_rollout.py, which builds the
engine and generates whole batches."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SamplingSettings:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 8


class EngineRequests:
    """Requests on a VLLMRollout's engine that the caller steps: vLLM's ``LLMEngine.add_request``, ``step`` and
    ``abort_request`` (v1/engine/llm_engine.py), as ``LLM.generate`` runs them, but open to new requests while
    others run and able to stop them keeping what they sampled. Every rank of a TP group must make the same calls
    on the same outputs, so they stay in step."""

    def __init__(self, rollout, stop_token_ids: list[int] | None = None):
        """``rollout``: the VLLMRollout whose engine runs them; ``stop_token_ids``: tokens that end a request besides
        EOS (an agent's turn end, kept in the output)."""
        self.rollout, self.engine = rollout, rollout.llm.llm_engine
        self.stop_token_ids = list(stop_token_ids or [])
        self._prompt_len: dict[str, int] = {}
        self._latest: dict = {}  # request id -> its latest output
        self._finished: dict[str, object] = {}  # request id -> its routes (None without routed_experts)
        self._live: set[str] = set()

    def add(self, rid: str, prompt: list[int], budget: int, seed: int | None, sampling: SamplingSettings) -> None:
        """Start request ``rid`` (unique in the engine's life): ``budget`` tokens at most after ``prompt``, seeded."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self.engine.add_request(rid, TokensPrompt(prompt_token_ids=list(prompt)), SamplingParams(
            temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k, max_tokens=budget,
            seed=seed, skip_special_tokens=False, logprobs=0, detokenize=False,
            stop_token_ids=self.stop_token_ids), lora_request=self.rollout.lora_request)
        self._prompt_len[rid] = len(prompt)
        self._live.add(rid)

    @property
    def running(self) -> bool:
        return bool(self._live)

    def step(self) -> list[str]:
        """One engine step; returns the ids of the requests it finished."""
        done = []
        for out in self.engine.step():
            self._latest[out.request_id] = out
            if out.finished:
                done.append(out.request_id)
                self._live.discard(out.request_id)
                self._finished[out.request_id] = (
                    self.rollout._routes(out, self._prompt_len[out.request_id] + len(out.outputs[0].token_ids) - 1)
                    if self.rollout.routed_experts else None)
        return done

    def token_ids(self, rid: str) -> list[int]:
        out = self._latest.get(rid)
        return list(out.outputs[0].token_ids) if out is not None else []

    def stop_all(self) -> list[str]:
        """Abort every running request (each keeps what it sampled: ``result``); returns their ids."""
        stopped = sorted(self._live)
        if stopped:
            self.engine.abort_request(stopped)
        self._live.clear()
        if self.rollout._capture is not None:
            self.rollout._capture.forget()  # an aborted request's routes: it goes on as a new one, routed anew
        return stopped

    def result(self, rid: str) -> tuple:
        """(token ids, vLLM's log-prob of each, finished) of a finished or stopped request, forgotten afterwards;
        with ``routed_experts`` a fourth, a finished request's routes (None for a stopped one)."""
        out = self._latest.pop(rid, None)
        ids = list(out.outputs[0].token_ids) if out is not None else []
        lps = [out.outputs[0].logprobs[i][tok].logprob for i, tok in enumerate(ids)] if ids else []
        finished = rid in self._finished
        routes = self._finished.pop(rid, None)
        self._prompt_len.pop(rid, None)
        return (ids, lps, finished, routes) if self.rollout.routed_experts else (ids, lps, finished)
