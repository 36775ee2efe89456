"""colocate_async's partial rollouts on the hybrid engine: a step's generation stops as soon as its batch of
complete GRPO groups is there, and the responses still unfinished are carried into the next step, where they go
on (as prompt + what they sampled, recomputed under the updated weights: verl's abort-and-resume) instead of
holding the batch back for its longest response.

Every sampled token records the policy version that sampled it; a carried response whose oldest token would lag
the trainer by ``max_off_policy_threshold`` versions or more is dropped (restarted from its prompt under the
current weights) and counted on its row (``stale_restarts``). With routing replay (R3) a response's routes are
those of the request that finished it, which routed its carried tokens again under its own weights.
"""

from __future__ import annotations

import uuid
import zlib
from dataclasses import dataclass, field

import torch

from hybridflow.protocol import Batch
from hybridflow.rollout.vllm_rollout import SamplingSettings
from hybridflow.workers.generation import responses_to_batch, routes_grid


@dataclass
class Sample:
    """One response in progress: its prompt row (a 1-row Batch), what it sampled so far and under which versions."""

    row: Batch
    prompt: list[int]
    group: str
    seed: int | None
    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    done: bool = False
    routes: object = None  # R3: the experts of its prompt and response, from the request that finished it
    resumed: int = 0  # times it went on after an update
    stale_restarts: int = 0

    def restart(self) -> None:
        self.tokens, self.log_probs, self.versions, self.stale_restarts = [], [], [], self.stale_restarts + 1


class CarriedGeneration:
    """The samples a hybrid-engine worker carries from step to step (per generation replica)."""

    def __init__(self, max_response_length: int, threshold: int | None):
        self.max_len, self.threshold = max_response_length, threshold
        self.samples: list[Sample] = []  # oldest first
        self._engine_ids = uuid.uuid4().hex[:8]
        self._calls = 0

    def generate(self, rollout, prompts: Batch, sampling: SamplingSettings, version: int, groups: int,
                 pad_id: int, eos_id: int) -> Batch:
        """Add ``prompts``' rows (rollout.n consecutive rows per group, ``uid`` and ``sample_seed`` columns), go on
        with the carried samples, and return the ``groups`` oldest complete groups as rows in verl's layout with
        ``rollout_log_probs``, ``token_policy_versions`` (-1 on padding) and ``stale_restarts``."""
        ids, mask = prompts.tensors["input_ids"], prompts.tensors["attention_mask"].bool()
        seeds = prompts.tensors.get("sample_seed")
        clash = {str(u) for u in prompts.non_tensors["uid"]} & {s.group for s in self.samples}
        if clash:  # a carried group would take the new rows in: responses of two prompts trained as one group
            raise ValueError(f"colocate_async: group ids {sorted(clash)[:3]} are still carried; each generation "
                             "batch needs group ids of its own")
        for i in range(len(prompts)):
            self.samples.append(Sample(prompts[i:i + 1], ids[i][mask[i]].tolist(), str(prompts.non_tensors["uid"][i]),
                                       None if seeds is None else int(seeds[i])))
        for s in self.samples:  # the staleness bound: nothing trained on lags by threshold versions or more
            if s.versions and self.threshold is not None and version - min(s.versions) >= self.threshold:
                s.done = False
                s.restart()
        self._sample(rollout, sampling, version, groups)
        complete = self._complete_groups()[:groups]
        if len(complete) < groups:
            raise RuntimeError(f"colocate_async: {len(complete)} complete groups after generation, {groups} needed")
        out = [s for s in self.samples if s.group in complete]
        self.samples = [s for s in self.samples if s.group not in complete]
        return self._rows(out, pad_id, eos_id)

    def _complete_groups(self) -> list[str]:
        order, done = [], {}
        for s in self.samples:
            if s.group not in done:
                order.append(s.group)
            done[s.group] = done.get(s.group, True) and s.done
        return [g for g in order if done[g]]

    def _sample(self, rollout, sampling: SamplingSettings, version: int, groups: int) -> None:
        self._calls += 1
        todo = {f"{self._engine_ids}-{self._calls}-{i}": s for i, s in enumerate(self.samples) if not s.done}
        requests = {}
        for rid, s in todo.items():
            seed = s.seed if s.seed is None or not s.tokens else zlib.crc32(f"{s.seed}/{len(s.tokens)}".encode()) & 0x7FFFFFFF
            requests[rid] = (s.prompt + s.tokens, self.max_len - len(s.tokens), seed)
            s.resumed += bool(s.tokens)
        waiting: dict[str, set[str]] = {s.group: set() for s in self.samples}  # group -> its requests not done
        for rid, s in todo.items():
            waiting[s.group].add(rid)

        def enough(finished: set[str]) -> bool:
            return sum(not (w - finished) for w in waiting.values()) >= groups

        if enough(set()):  # enough groups completed last time already: nothing to sample now
            return
        results = rollout.generate_until(requests, sampling, enough)
        for rid, (new, lps, finished, *routes) in results.items():
            s = todo[rid]
            s.tokens += new
            s.log_probs += lps
            s.versions += [version] * len(new)
            s.done = finished or len(s.tokens) >= self.max_len
            if routes:  # the finishing request routed the carried tokens again, under its weights
                s.routes = routes[0]

    def _rows(self, samples: list[Sample], pad_id: int, eos_id: int) -> Batch:
        rows = Batch.concat([s.row for s in samples])
        prompts = Batch(rows.tensors, rows.non_tensors, {})  # the request's meta (sampling, quota) stays behind
        new = responses_to_batch(prompts, [s.tokens for s in samples], self.max_len, pad_id, eos_id)
        mask = new.tensors["response_mask"]
        log_probs = torch.zeros(mask.shape, dtype=torch.float32)
        versions = torch.full(mask.shape, -1, dtype=torch.int64)
        for i, s in enumerate(samples):
            n = int(mask[i].sum())
            log_probs[i, :n] = torch.tensor(s.log_probs[:n], dtype=torch.float32)
            versions[i, :n] = torch.tensor(s.versions[:n], dtype=torch.int64)
        new.tensors.update(rollout_log_probs=log_probs, token_policy_versions=versions,
                           stale_restarts=torch.tensor([s.stale_restarts for s in samples], dtype=torch.int64))
        if samples and samples[0].routes is not None:  # R3
            new.tensors["routed_experts"] = routes_grid(prompts, mask, [s.routes for s in samples])
        return prompts.replace(tensors={"prompts": prompts.tensors["input_ids"], **new.tensors})
