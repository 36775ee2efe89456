"""Partial rollouts: a generation call stops as soon as its quota of complete GRPO groups is there, and the
responses (or multi-turn trajectories) still unfinished are carried into the next call, where they go on (as
prompt + what they have so far, recomputed under the updated weights: verl's abort-and-resume) instead of holding
the batch back for its longest one. colocate_async carries them on the hybrid engine from step to step
(``CarriedGeneration``); separate_async's rollout pool serves them continuously across weight pushes
(workers/serving.py), on the same ``SampleSet``.

A multi-turn trajectory is carried whole: the turns and tool messages it has so far, and the assistant turn in
progress, cut where the call stopped and resumed from there. It ends as the agent loop ends one (agent/loop.py);
the call stops once enough groups have ended, deciding from each finished turn whether it ends its trajectory.

Every sampled token records the policy version that sampled it (tool-message tokens: -1); a carried response
whose oldest token would lag the trainer by ``max_off_policy_threshold`` versions or more is dropped (restarted
from its prompt under the current weights) and counted on its row (``stale_restarts``). With routing replay (R3)
a response's routes are those of the request that finished it (a trajectory's: its last turn's), which routed
its carried tokens again under its own weights.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

import torch

from hybridflow import rng
from hybridflow.agent.loop import Trajectory
from hybridflow.protocol import Batch
from hybridflow.rollout.vllm_rollout import SamplingSettings
from hybridflow.workers.generation import responses_to_batch, rollout_log_probs, routes_grid, trajectories_to_batch


@dataclass
class Sample:
    """One response in progress: its prompt row (a 1-row Batch), what it has so far (a single-turn response is a
    trajectory of one assistant turn) and the policy version of each of its tokens (-1: a tool message's)."""

    row: Batch
    group: str
    seed: int | None
    trajectory: Trajectory
    versions: list[int] = field(default_factory=list)
    stale_restarts: int = 0

    def restart(self) -> None:
        self.trajectory = Trajectory(self.trajectory.prompt_ids)
        self.versions, self.stale_restarts = [], self.stale_restarts + 1

    def request_seed(self) -> int | None:
        """The first request's seed is the row's; a request going on from ``n`` tokens has one derived from both,
        so what it samples does not depend on the engine or the call that runs it."""
        n = len(self.trajectory.response_ids)
        return self.seed if self.seed is None or not n else rng.seed_of(self.seed, n)


class SampleSet:
    """The samples a generation replica carries: added by prompt rows, recorded request by request under the
    version that sampled them, restarted when stale, and taken out by complete groups. ``agent``: the
    multi-turn loop, or None. Stepped by ``CarriedGeneration`` (a call at a time) or by the rollout pool's
    continuous serving (workers/serving.py)."""

    def __init__(self, max_response_length: int, threshold: int | None, agent=None):
        self.max_len, self.threshold, self.agent = max_response_length, threshold, agent
        self.samples: list[Sample] = []  # oldest first
        self._engine_ids = uuid.uuid4().hex[:8]
        self._requests = 0

    def add(self, prompts: Batch) -> list[Sample]:
        """``prompts``' rows (rollout.n consecutive rows per group, ``uid`` and ``sample_seed`` columns) as new
        samples, returned."""
        ids, mask = prompts.tensors["input_ids"], prompts.tensors["attention_mask"].bool()
        seeds = prompts.tensors.get("sample_seed")
        clash = {str(u) for u in prompts.non_tensors["uid"]} & {s.group for s in self.samples}
        if clash:  # a carried group would take the new rows in: responses of two prompts trained as one group
            raise ValueError(f"partial rollouts: group ids {sorted(clash)[:3]} are still carried; each generation "
                             "batch needs group ids of its own")
        new = [Sample(prompts[i:i + 1], str(prompts.non_tensors["uid"][i]), None if seeds is None else int(seeds[i]),
                      Trajectory(ids[i][mask[i]].tolist())) for i in range(len(prompts))]
        self.samples += new
        return new

    def restart_stale(self, version: int, samples: list[Sample] | None = None) -> None:
        """The staleness bound: nothing trained on lags ``version`` by ``threshold`` versions or more (of
        ``samples``, by default all)."""
        for s in self.samples if samples is None else samples:
            sampled = [v for v in s.versions if v >= 0]
            if sampled and self.threshold is not None and version - min(sampled) >= self.threshold:
                s.restart()

    def unfinished(self) -> list[Sample]:
        return [s for s in self.samples if not s.trajectory.done]

    def complete_groups(self, ending: set[int] = frozenset()) -> list[str]:
        """The groups all of whose samples are done (or in ``ending``: the ids of samples about to end), oldest
        first."""
        order, done = [], {}
        for s in self.samples:
            if s.group not in done:
                order.append(s.group)
            done[s.group] = done.get(s.group, True) and (s.trajectory.done or id(s) in ending)
        return [g for g in order if done[g]]

    def request(self, s: Sample) -> tuple[str, list[int], int, int | None]:
        """The next engine request of unfinished sample ``s``: (id, context, token budget, seed)."""
        self._requests += 1
        t = s.trajectory
        return f"{self._engine_ids}-{self._requests}", t.context, self.max_len - len(t.response_ids), s.request_seed()

    def record(self, s: Sample, new: list[int], log_probs: list[float], finished: bool, version: int,
               routes=None) -> list | None:
        """What a request of ``s`` sampled under ``version``; when it ended a multi-turn trajectory's turn that
        calls tools, the calls (run them with ``run_tools``), else None."""
        t = s.trajectory
        t.append(new, True, log_probs)
        s.versions += [version] * len(new)
        if routes is not None:  # the finishing request routed the carried tokens again
            t.routes = routes
        if not finished and len(t.response_ids) < self.max_len:
            return None  # cut by a stop: goes on in the next request
        if self.agent is None:
            t.done = True
            return None
        return self.agent.end_turn(t, t.response_ids[t.turn_start:]) or None

    def run_tools(self, calling: list[tuple[Sample, list]]) -> None:
        """The tool calls of the turns just ended, their messages appended (policy version -1)."""
        self.finish_tools([s for s, _ in calling], self.start_tools(calling))

    def start_tools(self, calling: list[tuple[Sample, list]]):
        return self.agent.start_tools([(s.trajectory, calls) for s, calls in calling])

    def finish_tools(self, samples: list[Sample], job) -> None:
        self.agent.finish_tools(job)
        for s in samples:
            s.versions += [-1] * (len(s.trajectory.response_ids) - len(s.versions))

    def turn_would_end(self, s: Sample, new: list[int]) -> bool:
        t = s.trajectory
        if self.agent is None:
            return True
        return self.agent.turn_would_end(t, t.response_ids[t.turn_start:] + new)

    def take(self, groups: int, pad_id: int, eos_id: int) -> Batch | None:
        """The ``groups`` oldest complete groups, taken out as rows in verl's layout with ``rollout_log_probs``,
        ``token_policy_versions`` (-1 on padding and tool messages) and ``stale_restarts``; None while fewer are
        complete."""
        complete = self.complete_groups()[:groups]
        if len(complete) < groups:
            return None
        out = [s for s in self.samples if s.group in complete]
        self.samples = [s for s in self.samples if s.group not in complete]
        return self._rows(out, pad_id, eos_id)

    def _rows(self, samples: list[Sample], pad_id: int, eos_id: int) -> Batch:
        rows = Batch.concat([s.row for s in samples])
        prompts = Batch(rows.tensors, rows.non_tensors, {})  # the request's meta (sampling, quota) stays behind
        trajectories = [s.trajectory for s in samples]
        if self.agent is not None:
            new = trajectories_to_batch(prompts, trajectories, self.max_len, pad_id)
            kept = new.tensors["attention_mask"][:, -self.max_len:]
        else:
            new = responses_to_batch(prompts, [t.response_ids for t in trajectories], self.max_len, pad_id, eos_id)
            kept = new.tensors["response_mask"]
            new.tensors["rollout_log_probs"] = rollout_log_probs([t.log_probs for t in trajectories], kept)
            if trajectories and trajectories[0].routes is not None:  # R3
                new.tensors["routed_experts"] = routes_grid(prompts, kept, [t.routes for t in trajectories])
        versions = torch.full(kept.shape, -1, dtype=torch.int64)
        for i, s in enumerate(samples):
            n = int(kept[i].sum())
            versions[i, :n] = torch.tensor(s.versions[:n], dtype=torch.int64)
        new.tensors.update(token_policy_versions=versions,
                           stale_restarts=torch.tensor([s.stale_restarts for s in samples], dtype=torch.int64))
        return prompts.replace(tensors={"prompts": prompts.tensors["input_ids"], **new.tensors},
                               non_tensors={**prompts.non_tensors, **new.non_tensors})


class CarriedGeneration(SampleSet):
    """Partial rollouts a call at a time (colocate_async's hybrid engine): each call adds a batch of prompts and
    samples until its quota of complete groups is there."""

    def generate(self, rollout, prompts: Batch, sampling: SamplingSettings, version: int, groups: int,
                 pad_id: int, eos_id: int) -> Batch:
        """Add ``prompts``' rows, go on with the carried samples, and return the ``groups`` oldest complete groups
        (``SampleSet.take``)."""
        self.add(prompts)
        self.restart_stale(version)
        while len(self.complete_groups()) < groups and self.unfinished():
            self._sample(rollout, sampling, version, groups)
        out = self.take(groups, pad_id, eos_id)
        if out is None:
            raise RuntimeError(f"partial rollouts: {len(self.complete_groups())} complete groups after generation, "
                               f"{groups} needed")
        return out

    def _sample(self, rollout, sampling: SamplingSettings, version: int, groups: int) -> None:
        """One engine call over every unfinished sample (a multi-turn trajectory: its next turn, or the rest of
        the turn it was cut in), stopped once ``groups`` groups have ended; then the ended turns' tool calls."""
        todo, requests = {}, {}
        for s in self.unfinished():
            rid, *request = self.request(s)
            todo[rid], requests[rid] = s, tuple(request)
        ends: dict[str, bool] = {}

        def enough(finished: dict[str, list[int]]) -> bool:
            for rid in finished.keys() - ends.keys():
                ends[rid] = self.turn_would_end(todo[rid], finished[rid])
            return len(self.complete_groups({id(todo[r]) for r, e in ends.items() if e})) >= groups

        stop = self.agent.chat.stop_token_ids if self.agent is not None else None
        results = rollout.generate_until(requests, sampling, enough, stop_token_ids=stop)
        calling = []
        for rid, (new, lps, finished, *routes) in results.items():
            calls = self.record(todo[rid], new, lps, finished, version, routes[0] if routes else None)
            if calls:
                calling.append((todo[rid], calls))
        if calling:
            self.run_tools(calling)
