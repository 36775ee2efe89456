"""Agents as a service during a run: the rollout engines behind the OpenAI-compatible endpoint (agent/endpoint.py,
requests batched onto the engines by agent/batching.py) and the agent program's episodes (agent/episodes.py), one
per prompt row, whose recorded tokens become the rows trained (agent/episode_rows.py).

The endpoint serves for the whole run on the driver; it samples with the run's settings (rollout.temperature,
top_p, top_k; validation: rollout.val_kwargs), whatever a request asks, because the trainer's log-probs assume
them. Its base URL and key are logged once; an episode gets them as arguments.
"""

from __future__ import annotations

import logging
import time

from hybridflow.agent.batching import GroupBackend
from hybridflow.agent.chat import ChatFormat
from hybridflow.agent.endpoint import Endpoint, EndpointSettings, Server
from hybridflow.agent.episode_rows import episode_batch
from hybridflow.agent.episodes import EpisodeRunner
from hybridflow.agent.parsers import get_parser
from hybridflow.agent.sessions import SessionStore
from hybridflow.protocol import Batch
from hybridflow.rollout.engine_requests import SamplingSettings

log = logging.getLogger(__name__)

EPISODE_PROCESSES = 2  # agent processes; each runs its episodes on threads


def task_of(rows: Batch, i: int) -> dict:
    """Row ``i``'s task for the agent program: its dataset columns (``prompt``, ``answer``, ``data_source``,
    ``extra_info``, ...) and ``question``, the last user message's text (or the prompt's text)."""
    task = {k: (v[i].tolist() if hasattr(v[i], "tolist") else v[i]) for k, v in rows.non_tensors.items()}
    prompt = task.get("prompt")
    if isinstance(prompt, list):
        users = [m.get("content") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        task["question"] = users[-1] if users else ""
    else:
        task["question"] = prompt
    return task


class AgentService:
    """The endpoint on ``generator()``'s engines (``replicas`` generation replicas) and the episodes' runner."""

    def __init__(self, cfg, tokenizer, generator, replicas: int):
        a, d = cfg.agent, cfg.data
        self.cfg, self.tokenizer = cfg, tokenizer
        self.backend = GroupBackend(generator, replicas, tokenizer.pad_token_id, a.batch_window_s, cfg.trainer.seed)
        self.sessions = SessionStore(ChatFormat(tokenizer, d.apply_chat_template_kwargs), a.max_sessions)
        settings = EndpointSettings(model_name=a.model_name, max_model_len=d.max_prompt_length + d.max_response_length,
                                    api_key=a.api_key, max_new_tokens=d.max_response_length)
        self.endpoint = Endpoint(self.backend, self.sessions, get_parser(cfg.rollout.multi_turn.format, tokenizer),
                                 settings)
        self.server = Server(self.endpoint, host=a.host, port=a.port)
        self.base_url = self.server.start()
        log.warning("agent endpoint: %s (model %r; the API key is passed to each episode)", self.base_url,
                    a.model_name)
        try:
            self.runner = EpisodeRunner(a.entrypoint, EPISODE_PROCESSES, -(-a.max_sessions // EPISODE_PROCESSES),
                                        a.episode_timeout_s)
        except BaseException:
            self.server.stop()
            self.backend.close()
            raise

    def run(self, rows: Batch, sampling: SamplingSettings, label) -> tuple[Batch, dict]:
        """One episode per row of ``rows`` (``label``: their session ids' prefix, unique among the runs going on),
        sampled with ``sampling``; the rows trained on and the episodes' metrics. Runs may overlap (threads of a
        pool source): their requests share the engines' batches."""
        ids = [f"{label}/{i}" for i in range(len(rows))]
        self.endpoint.run_sampling.update(dict.fromkeys(ids, sampling))
        self.backend.started(len(rows))
        calls, requests, start = self.backend.batches, self.backend.requests, time.monotonic()
        ended = 0

        def one_ended(_running: int) -> None:
            nonlocal ended
            ended += 1
            self.backend.ended()

        try:
            outcomes = self.runner.run([task_of(rows, i) for i in range(len(rows))], self.base_url,
                                       self.endpoint.api_key, ids, on_done=one_ended)
        finally:
            self.backend.ended(len(ids) - ended)  # timed out, or the runner failed
            for i in ids:
                self.endpoint.run_sampling.pop(i, None)
        seconds = time.monotonic() - start
        if self.backend.error is not None:  # the engines failed under the episodes: the run's error, not theirs
            raise self.backend.error  # every run going on ends with it (kept: the engines are gone)
        failed = [o.error for o in outcomes if not o.ok]
        if failed:  # one line per batch: how many, and the most common error
            kinds = sorted(set(failed), key=failed.count, reverse=True)
            log.warning("agent: %d of %d episodes dropped (%s)", len(failed), len(outcomes),
                        "; ".join(f"{failed.count(k)}x {k}" for k in kinds[:2]))
        sessions = [self.sessions.pop(s) for s in ids]
        d = self.cfg.data
        batch, metrics = episode_batch(rows, sessions, outcomes, d.max_prompt_length, d.max_response_length,
                                       self.tokenizer.pad_token_id)
        requests = self.backend.requests - requests
        metrics.update({"agent/episodes_per_s": len(rows) / max(seconds, 1e-9),
                        "agent/episode_s_mean": sum(o.seconds for o in outcomes) / max(len(outcomes), 1),
                        "agent/requests_per_episode": requests / max(len(rows), 1),
                        "agent/requests_per_engine_call": requests / max(self.backend.batches - calls, 1)})
        return batch, metrics

    def close(self) -> None:
        self.runner.close()
        self.server.stop()
        self.backend.close()
