"""Continuous serving on separate_async's rollout pool (with partial rollouts): the engine runs in a thread of its
own and serves every admitted sample request by request (a multi-turn trajectory turn by turn; its tool calls run
on the agent's tool threads while the engine steps on, and its next turn starts when they return), whether or not
the driver is waiting, so neither a long response nor a slow tool holds the others back, and the engine does not
stop between the driver's calls. The driver's calls are commands to that thread:

- ``admit(rows)``: new prompt rows, served at once;
- ``take(groups)``: the oldest ``groups`` complete groups, as soon as they are there;
- ``exclusive(fn, version)``: a weight push (or a batch generation: validation, ReMax's greedy baseline) with the
  engine to itself: every running request is stopped keeping what it sampled (verl's abort), ``fn`` runs, the
  samples too stale for the new ``version`` are restarted, and the rest resume from where they were cut.

Each token records the version of the weights that sampled it (a request's tokens are all sampled under one: a
push stops every request first). The ranks of one vLLM TP group must make the same engine calls: the group's
first rank decides after each step how many of the queued commands to apply, and which trajectories' tool calls
have returned, and tells the others (``Agreement``); commands reach every rank of a group in the same order (the
driver sends each to all of them), so a count names the same commands everywhere.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from concurrent.futures import Future

import torch.distributed as dist

from hybridflow import device
from hybridflow.protocol import Batch
from hybridflow.rollout.engine_requests import EngineRequests
from hybridflow.rollout.vllm_rollout import SamplingSettings
from hybridflow.workers.carried_generation import SampleSet

log = logging.getLogger(__name__)


class Agreement:
    """The commands the ranks of one TP group apply before their next engine step: as many as are queued on the
    group's first rank, counted there and broadcast (``group``: a gloo group of the TP group's ranks, ``leader``
    its first; None alone)."""

    def __init__(self, group=None, leader: int = 0):
        self.group, self.leader = group, leader
        self._pending: deque = deque()
        self._arrived = threading.Condition()

    def put(self, command) -> None:
        with self._arrived:
            self._pending.append(command)
            self._arrived.notify()

    def wake(self) -> None:
        """A tool call has returned: an idle rank looks again (``next``)."""
        with self._arrived:
            self._arrived.notify_all()

    def next(self, wait: bool, tools: dict) -> tuple[list, list]:
        """The commands to apply now and the ids of the tool jobs (``tools``: id -> ``ToolJobs``) whose messages
        to append, in id order; with ``wait`` (nothing to step) at least one of either, blocking until it comes.
        Every rank waits for one of its own before it joins the broadcast, so none sits in a collective while the
        engine is idle; a follower finishing a job the leader named waits for its own calls (``finish_tools``)."""
        with self._arrived:
            while wait and not self._pending and not any(j.ready() for j in tools.values()):
                soonest = min((j.deadline for j in tools.values()), default=None)  # a hung tool wakes no one
                self._arrived.wait(None if soonest is None else max(0.0, soonest - time.monotonic()) + 0.01)
            message = [len(self._pending), sorted(k for k, j in tools.items() if j.ready())]
        if self.group is not None:
            dist.broadcast_object_list(message, src=self.leader, group=self.group)
        count, ready = message
        with self._arrived:
            self._arrived.wait_for(lambda: len(self._pending) >= count)
            return [self._pending.popleft() for _ in range(count)], ready

    def drain(self) -> list:
        with self._arrived:
            out, self._pending = list(self._pending), deque()
            return out


class ContinuousServing:
    """The serving thread of one rollout rank and the driver's commands to it (see the module's docstring)."""

    def __init__(self, rollout, samples: SampleSet, sampling: SamplingSettings, stop_token_ids: list[int] | None,
                 pad_id: int, eos_id: int, agreement: Agreement, version: int):
        self.rollout, self.samples, self.sampling = rollout, samples, sampling
        self.pad_id, self.eos_id, self.agreement, self.version = pad_id, eos_id, agreement, version
        self.engine = EngineRequests(rollout, stop_token_ids)
        self.running: dict = {}  # request id -> its sample
        self.takes: list[tuple[int, Future]] = []  # waiting, oldest first
        self.tools: dict = {}  # tool job id -> (sample, its ToolJobs): trajectories whose tools are running
        self.steps = 0  # engine steps so far
        self._tool_jobs = itertools.count()
        self.busy_s = 0.0  # seconds spent stepping the engine
        self.error: BaseException | None = None
        self._closed = False
        self.thread = threading.Thread(target=self._serve, name="rollout-serving", daemon=True)
        self.thread.start()

    # --- the driver's commands (from the worker's call thread) ---------------------------------------

    def admit(self, rows: Batch) -> None:
        self._command("admit", rows)

    def take(self, groups: int) -> Batch:
        return self._command("take", groups)

    def exclusive(self, fn, version: int | None = None):
        """``fn()`` in the serving thread with the engine stopped; then ``version`` (when given) is the engine's."""
        return self._command("exclusive", fn, version)

    def close(self) -> None:
        if self.thread.is_alive():
            self._command("close")
        self.thread.join(timeout=60)

    def _command(self, kind: str, *args):
        if self.error is not None:
            raise RuntimeError(f"the rollout engine's serving thread failed earlier: {self.error!r}") from self.error
        done: Future = Future()
        self.agreement.put((kind, args, done))
        while True:
            try:
                return done.result(timeout=1.0)
            except TimeoutError:
                if not self.thread.is_alive() and not done.done():  # it ended before taking this command
                    raise RuntimeError(f"the rollout engine's serving thread has ended: {self.error!r}") from None

    # --- the serving thread ---------------------------------------------------------------------------

    def _serve(self) -> None:
        device.bind_thread()
        try:
            while not self._closed:
                commands, ready = self.agreement.next(not self.engine.running, {k: j for k, (_, j) in self.tools.items()})
                for kind, args, done in commands:
                    self._apply(kind, args, done)
                for key in ready:
                    self._tools_returned(*self.tools.pop(key))
                self._answer_takes()  # before the next step: a take waits for no step it does not need
                if self.engine.running:
                    start = time.perf_counter()
                    self._step()
                    self.busy_s += time.perf_counter() - start
                self._answer_takes()
        except BaseException as error:  # every waiting call gets it; later calls are refused with it
            log.exception("the rollout engine's serving thread failed")
            self.error = error
            for _, done in self.takes:
                done.set_exception(error)
            for _, _, done in self.agreement.drain():
                done.set_exception(error)

    def _apply(self, kind: str, args: tuple, done: Future) -> None:
        if kind == "take":
            self.takes.append((args[0], done))
            return
        try:
            if kind == "admit":
                for s in self.samples.add(args[0]):
                    self._start(s)
                done.set_result(None)
            elif kind == "exclusive":
                self._exclusive(*args, done)
            else:  # close
                self._stop_all()
                self._closed = True
                done.set_result(None)
        except Exception as error:  # the caller's error (a clash of group ids, a failed push): raised there
            done.set_exception(error)

    def _exclusive(self, fn, version: int | None, done: Future) -> None:
        self._stop_all()
        try:
            done.set_result(fn())
            if version is not None:
                self.version = version
                self.samples.restart_stale(version, self._idle_samples())  # (those in a tool call: when it returns)
        finally:
            for s in self._idle_samples():
                if not s.trajectory.done:
                    self._start(s)

    def _idle_samples(self) -> list:
        """The samples no tool call is running for (their trajectories are the tool threads' until it returns)."""
        calling = {id(s) for s, _ in self.tools.values()}
        return [s for s in self.samples.samples if id(s) not in calling]

    def _start(self, s) -> None:
        rid, context, budget, seed = self.samples.request(s)
        self.engine.add(rid, context, budget, seed, self.sampling)
        self.running[rid] = s

    def _stop_all(self) -> None:
        """Stop every running request, recording what it sampled (it resumes from there)."""
        for rid in self.engine.stop_all():
            ids, lps, finished, *routes = self.engine.result(rid)
            self.samples.record(self.running.pop(rid), ids, lps, finished, self.version)

    def _step(self) -> None:
        """One engine step; each request it finished is recorded, and its sample's next request starts, or, for a
        turn that calls tools, its tool calls (on the agent's tool threads, while the engine steps on)."""
        self.steps += 1
        for rid in self.engine.step():
            s = self.running.pop(rid)
            ids, lps, finished, *routes = self.engine.result(rid)
            calls = self.samples.record(s, ids, lps, finished, self.version, routes[0] if routes else None)
            if calls:
                job = self.samples.start_tools([(s, calls)])
                self.tools[f"{next(self._tool_jobs):012d}"] = (s, job)  # the same ids on every rank of a TP group
                for _, future in job.jobs:
                    future.add_done_callback(lambda _: self.agreement.wake())
            elif not s.trajectory.done:
                self._start(s)

    def _tools_returned(self, s, job) -> None:
        """A trajectory's tool calls have returned (or timed out): their messages appended, it goes on, restarted
        first when a push made it stale meanwhile."""
        self.samples.finish_tools([s], job)
        self.samples.restart_stale(self.version, [s])
        if not s.trajectory.done:
            self._start(s)

    def _answer_takes(self) -> None:
        while self.takes:
            groups, done = self.takes[0]
            rows = self.samples.take(groups, self.pad_id, self.eos_id)
            if rows is None and (self.engine.running or self.tools):
                return
            self.takes.pop(0)
            if rows is None:
                done.set_exception(RuntimeError(f"partial rollouts: {len(self.samples.complete_groups())} complete "
                                                f"groups with nothing left to generate, {groups} needed"))
            else:
                rows.meta["rollout/busy_s"] = self.busy_s
                done.set_result(rows)
