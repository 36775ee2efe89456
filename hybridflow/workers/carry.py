"""Partial rollouts: a generation call stops as soon as its quota of complete GRPO groups is there, and the
responses (or multi-turn trajectories) still unfinished are carried into the next call, where they go on (as
prompt + what they have so far, recomputed under the updated weights: verl's abort-and-resume) instead of holding
the batch back for its longest one. colocate_async carries them on the hybrid engine from step to step,
separate_async's rollout pool across weight pushes.

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
import zlib
from dataclasses import dataclass, field

import torch

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
        return self.seed if self.seed is None or not n else zlib.crc32(f"{self.seed}/{n}".encode()) & 0x7FFFFFFF


class CarriedGeneration:
    """The samples a generation replica carries from call to call; ``agent``: the multi-turn loop, or None."""

    def __init__(self, max_response_length: int, threshold: int | None, agent=None):
        self.max_len, self.threshold, self.agent = max_response_length, threshold, agent
        self.samples: list[Sample] = []  # oldest first
        self._engine_ids = uuid.uuid4().hex[:8]
        self._calls = 0

    def generate(self, rollout, prompts: Batch, sampling: SamplingSettings, version: int, groups: int,
                 pad_id: int, eos_id: int) -> Batch:
        """Add ``prompts``' rows (rollout.n consecutive rows per group, ``uid`` and ``sample_seed`` columns), go on
        with the carried samples, and return the ``groups`` oldest complete groups as rows in verl's layout with
        ``rollout_log_probs``, ``token_policy_versions`` (-1 on padding and tool messages) and ``stale_restarts``."""
        ids, mask = prompts.tensors["input_ids"], prompts.tensors["attention_mask"].bool()
        seeds = prompts.tensors.get("sample_seed")
        clash = {str(u) for u in prompts.non_tensors["uid"]} & {s.group for s in self.samples}
        if clash:  # a carried group would take the new rows in: responses of two prompts trained as one group
            raise ValueError(f"partial rollouts: group ids {sorted(clash)[:3]} are still carried; each generation "
                             "batch needs group ids of its own")
        for i in range(len(prompts)):
            self.samples.append(Sample(prompts[i:i + 1], str(prompts.non_tensors["uid"][i]),
                                       None if seeds is None else int(seeds[i]), Trajectory(ids[i][mask[i]].tolist())))
        for s in self.samples:  # the staleness bound: nothing trained on lags by threshold versions or more
            sampled = [v for v in s.versions if v >= 0]
            if sampled and self.threshold is not None and version - min(sampled) >= self.threshold:
                s.restart()
        while len(self._complete_groups()) < groups and any(not s.trajectory.done for s in self.samples):
            self._sample(rollout, sampling, version, groups)
        complete = self._complete_groups()[:groups]
        if len(complete) < groups:
            raise RuntimeError(f"partial rollouts: {len(complete)} complete groups after generation, {groups} needed")
        out = [s for s in self.samples if s.group in complete]
        self.samples = [s for s in self.samples if s.group not in complete]
        return self._rows(out, pad_id, eos_id)

    def _complete_groups(self, ending: set[int] = frozenset()) -> list[str]:
        """The groups all of whose samples are done (or in ``ending``: the ids of samples about to end), oldest
        first."""
        order, done = [], {}
        for s in self.samples:
            if s.group not in done:
                order.append(s.group)
            done[s.group] = done.get(s.group, True) and (s.trajectory.done or id(s) in ending)
        return [g for g in order if done[g]]

    def _sample(self, rollout, sampling: SamplingSettings, version: int, groups: int) -> None:
        """One engine call over every unfinished sample (a multi-turn trajectory: its next turn, or the rest of
        the turn it was cut in), stopped once ``groups`` groups have ended; then the ended turns' tool calls."""
        self._calls += 1
        todo = {f"{self._engine_ids}-{self._calls}-{i}": s for i, s in enumerate(self.samples) if not s.trajectory.done}
        requests = {}
        for rid, s in todo.items():
            t = s.trajectory
            requests[rid] = (t.context, self.max_len - len(t.response_ids), s.request_seed())
        ends: dict[str, bool] = {}

        def enough(finished: dict[str, list[int]]) -> bool:
            for rid in finished.keys() - ends.keys():
                ends[rid] = self._turn_would_end(todo[rid], finished[rid])
            return len(self._complete_groups({id(todo[r]) for r, e in ends.items() if e})) >= groups

        stop = self.agent.chat.stop_token_ids if self.agent is not None else None
        results = rollout.generate_until(requests, sampling, enough, stop_token_ids=stop)
        calling = []
        for rid, (new, lps, finished, *routes) in results.items():
            s = todo[rid]
            t = s.trajectory
            t.append(new, True, lps)
            s.versions += [version] * len(new)
            if routes and routes[0] is not None:  # the finishing request routed the carried tokens again
                t.routes = routes[0]
            if not finished and len(t.response_ids) < self.max_len:
                continue  # cut by the stop: goes on in the next call
            if self.agent is None:
                t.done = True
            elif calls := self.agent.end_turn(t, t.response_ids[t.turn_start:]):
                calling.append((t, calls))
        if calling:
            self.agent.run_tools(calling)
            for s in todo.values():
                s.versions += [-1] * (len(s.trajectory.response_ids) - len(s.versions))  # tool messages

    def _turn_would_end(self, s: Sample, new: list[int]) -> bool:
        t = s.trajectory
        if self.agent is None:
            return True
        return self.agent.turn_would_end(t, t.response_ids[t.turn_start:] + new)

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
