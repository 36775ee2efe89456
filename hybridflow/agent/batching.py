"""The endpoint's requests as engine batches on a worker group: the ``Backend`` of agent/endpoint.py when the
policy serves from a run's rollout engines (the hybrid engine's, or the rollout pool's).

Every rank of a generation replica must make the same engine calls, and each call of a worker group's
``generate`` splits its rows over the replicas, so requests are not sent one by one: the requests that arrive
together (all the episodes waiting, or those within ``window_s`` of the first) go as one batch, each row with its
own token budget and stop tokens, and each request gets its row back. One batch runs at a time; the next
gathers while it runs. Each request is sampled with a seed of its own (the run's seed, its session and its number
there): the ranks of a vLLM TP group sample alike whatever else drew from their generators, and an episode samples
alike whatever ran beside it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from hybridflow import rng
from hybridflow.protocol import Batch
from hybridflow.rollout.engine_requests import SamplingSettings

log = logging.getLogger(__name__)


@dataclass
class _Request:
    context: list[int]
    sampling: SamplingSettings
    stop_token_ids: tuple[int, ...]
    seed: int
    done: Future = field(default_factory=Future)

    @property
    def key(self) -> tuple:  # requests sampled alike share an engine call
        s = self.sampling
        return s.temperature, s.top_p, s.top_k, self.stop_token_ids


def request_rows(requests: list[_Request], pad_id: int) -> Batch:
    """The requests' contexts as left-padded prompt rows, each with its token budget (``max_new_tokens``) and
    sampling seed (``sample_seed``)."""
    width = max(len(r.context) for r in requests)
    ids = torch.full((len(requests), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(requests):
        ids[i, width - len(r.context):] = torch.tensor(r.context, dtype=torch.long)
        mask[i, width - len(r.context):] = 1
    budgets = torch.tensor([r.sampling.max_new_tokens for r in requests], dtype=torch.long)
    seeds = torch.tensor([r.seed for r in requests], dtype=torch.long)
    s = requests[0].sampling
    return Batch.from_dict(
        tensors={"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
                 "max_new_tokens": budgets, "sample_seed": seeds},
        meta={"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k,
              "max_new_tokens": int(budgets.max()), "stop_token_ids": list(requests[0].stop_token_ids)})


def sampled(out: Batch, row: int, version: int) -> tuple[list[int], list[float], int]:
    """Row ``row``'s sampled ids, their log-probs (zeros where the engine returned none: greedy) and the policy
    version that sampled them: the one a rollout pool's worker stamped (``token_policy_versions``), else
    ``version``."""
    mask = out.tensors["response_mask"][row].bool()
    ids = out.tensors["responses"][row][mask].tolist()
    log_probs = out.tensors.get("rollout_log_probs")
    stamped = out.tensors.get("token_policy_versions")
    if stamped is not None and mask.any():
        version = int(stamped[row][mask][0])
    return ids, (log_probs[row][mask].tolist() if log_probs is not None else [0.0] * len(ids)), version


class GroupBackend:
    """Requests batched onto ``group()``'s ``generate`` (a callable: a rebuilt rollout pool is a new group), whose
    rows split over ``replicas`` generation replicas. A batch goes as soon as every episode running (``started`` /
    ``ended``, told by their runners) has a request waiting, or ``window_s`` after its first."""

    def __init__(self, group: Callable[[], object], replicas: int, pad_id: int, window_s: float, seed: int = 0):
        self.group, self.replicas, self.pad_id, self.window_s, self.seed = group, replicas, pad_id, window_s, seed
        self.version = 0  # the policy version of the engines' weights where the engines do not stamp it (hybrid engine)
        self._live = 0
        self.batches = self.requests = 0  # engine calls made and requests served (metrics: requests per call)
        self.error: BaseException | None = None  # the first engine failure (its requests got it too; kept)
        self._pending: list[_Request] = []
        self._ready = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="hybridflow-endpoint-batches", daemon=True)
        self._thread.start()

    def generate(self, context, sampling, stop_token_ids, key):
        seed = rng.seed_of(self.seed, "endpoint", key)
        with self._ready:
            if self._closed:
                raise RuntimeError("the rollout engines stopped serving")
            self.requests += 1
            request = _Request(list(context), sampling, tuple(stop_token_ids), seed)
            self._pending.append(request)
            self._ready.notify_all()
        return request.done.result()

    def started(self, episodes: int) -> None:
        with self._ready:
            self._live += episodes

    def ended(self, episodes: int = 1) -> None:
        with self._ready:
            self._live -= episodes
            self._ready.notify_all()  # the requests waiting may be all there is now

    def close(self) -> None:
        with self._ready:
            self._closed = True
            self._ready.notify_all()
        self._thread.join(timeout=30)

    def _serve(self) -> None:
        while True:
            requests = self._gather()
            if requests is None:
                return
            by_key: dict[tuple, list[_Request]] = {}
            for r in requests:
                by_key.setdefault(r.key, []).append(r)
            for group in by_key.values():
                self._run(group)

    def _gather(self) -> list[_Request] | None:
        """The next batch's requests (None once closed): all that wait once every running episode does, or
        ``window_s`` passed."""
        with self._ready:
            while not self._pending and not self._closed:
                self._ready.wait()
            if self._closed:
                for r in self._pending:
                    r.done.set_exception(RuntimeError("the rollout engines stopped serving"))
                return None
            deadline = time.monotonic() + self.window_s
            while len(self._pending) < self._live and (left := deadline - time.monotonic()) > 0:
                self._ready.wait(left)
            requests, self._pending = self._pending, []
            return requests

    def _run(self, requests: list[_Request]) -> None:
        try:
            rows, _ = request_rows(requests, self.pad_id).pad_to_divisor(self.replicas)
            out = self.group().generate(rows)
            self.batches += 1
            for i, r in enumerate(requests):
                r.done.set_result(sampled(out, i, self.version))
        except BaseException as e:  # noqa: BLE001 - every waiting request gets the engine's error
            log.warning("an endpoint batch of %d request(s) failed: %s", len(requests), e)
            self.error = self.error or e
            for r in requests:
                if not r.done.done():
                    r.done.set_exception(e)
