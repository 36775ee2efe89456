"""Agent programs' episodes, run in Ray worker processes: ``agent.entrypoint`` (``path/to/file.py:function`` or
``package.module:function``) called as ``function(task, base_url, api_key, session_id)``, many episodes at once
on threads of a few processes (an episode mostly waits: on the policy, on its tools).

The processes run on the driver's node (the endpoint listens on its loopback by default). An episode that raises
is dropped and counted with its error's first line; one still running at its deadline is dropped and counted as
timed out, and the process running it is replaced (a Python thread cannot be stopped), so a hung program never
holds the run.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import logging
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

KEY = "agent.entrypoint"


def load_entrypoint(entrypoint: str):
    """The agent program's function; a one-line ValueError naming ``agent.entrypoint`` when it cannot be loaded or
    does not take (task, base_url, api_key, session_id)."""
    target, name = entrypoint.rsplit(":", 1)
    try:
        if target.endswith(".py") or "/" in target:
            path = Path(target).expanduser().resolve()
            if not path.is_file():
                raise ValueError(f"{KEY}={entrypoint!r}: no file {path}")
            module_name = f"hybridflow_agent_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:12]}"
            module = sys.modules.get(module_name)
            if module is None:
                spec = importlib.util.spec_from_file_location(module_name, path)
                module = importlib.util.module_from_spec(spec)
                sys.modules[module_name] = module
                spec.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
    except ValueError:
        raise
    except Exception as e:  # the user's module failed to import: its error, in one line
        raise ValueError(f"{KEY}={entrypoint!r}: importing {target} failed ({type(e).__name__}: {e})") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"{KEY}={entrypoint!r}: {target} has no function {name!r}")
    try:
        inspect.signature(fn).bind("task", "base_url", "api_key", "session_id")
    except TypeError as e:
        raise ValueError(f"{KEY}={entrypoint!r}: {name} must take (task, base_url, api_key, session_id): {e}") from None
    return fn


@dataclass
class Outcome:
    """How an episode ended: ``reward`` returned (None: none), or ``error`` ("timeout" or the failure's line)."""

    reward: float | None = None
    error: str | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None


def _one_line(error: BaseException) -> str:
    """``Type: first line``, and the root cause's where it wraps one (a client's "Connection error." says little)."""
    def line(e: BaseException) -> str:
        return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}"

    root = error
    for _ in range(16):  # a chain can loop
        root = root.__cause__ or root.__context__ or root
    return line(error) if root is error else f"{line(error)} ({line(root)})"


class EpisodeWorker:
    """One process's episodes, each on a thread of its own (a Ray actor with ``max_concurrency``)."""

    def __init__(self, entrypoint: str):
        import torch

        torch.set_num_threads(1)  # an agent's process shares the machine with the engines and the trainer
        self.fn = load_entrypoint(entrypoint)

    def run(self, task: dict, base_url: str, api_key: str, session_id: str) -> Outcome:
        start = time.monotonic()
        try:
            reward = self.fn(task, base_url, api_key, session_id)
        except Exception as e:  # noqa: BLE001 - the program's failure drops its episode, not the run
            return Outcome(error=_one_line(e), seconds=time.monotonic() - start)
        if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float))):
            return Outcome(error=f"returned {type(reward).__name__}, not a number or None",
                           seconds=time.monotonic() - start)
        return Outcome(None if reward is None else float(reward), seconds=time.monotonic() - start)

    def ready(self) -> bool:
        return True


class EpisodeRunner:
    """``processes`` EpisodeWorker actors on this (the driver's) node, each running up to ``per_process`` episodes
    at once. Runs may overlap (threads of a pool source): the processes are shared, and a hung one is replaced once,
    by the first run whose episode outlived its deadline there (its other runs' episodes on it fail and are
    dropped)."""

    def __init__(self, entrypoint: str, processes: int, per_process: int, timeout_s: float):
        self.entrypoint, self.processes, self.per_process, self.timeout_s = entrypoint, processes, per_process, timeout_s
        self._lock = threading.Lock()  # who submits to and who replaces self.workers
        self.workers = [self._start() for _ in range(processes)]
        self._wait_ready(self.workers)

    def _start(self):
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        return ray.remote(EpisodeWorker).options(num_cpus=0, max_concurrency=self.per_process, max_restarts=0,
                                                 scheduling_strategy=here).remote(self.entrypoint)

    @staticmethod
    def _wait_ready(workers: list) -> None:
        import ray

        try:
            ray.get([w.ready.remote() for w in workers])
        except ray.exceptions.RayActorError as e:  # the entrypoint failed to load in the worker
            cause = getattr(e, "cause", None) or e
            raise ValueError((str(cause).strip().splitlines() or [str(e)])[-1]) from None

    def run(self, tasks: list[dict], base_url: str, api_key: str, session_ids: list[str], on_done=None
            ) -> list[Outcome]:
        """Every task's episode, spread over the processes; ``on_done(running)`` after each one ends."""
        import ray

        with self._lock:
            on = [self.workers[i % len(self.workers)] for i in range(len(tasks))]
            refs = [w.run.remote(task, base_url, api_key, sid) for w, task, sid in zip(on, tasks, session_ids)]
        index = {ref: i for i, ref in enumerate(refs)}
        outcomes: list[Outcome | None] = [None] * len(refs)
        pending, deadline = list(refs), time.monotonic() + self.timeout_s
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not done:
                break
            outcomes[index[done[0]]] = self._result(done[0])
            if on_done is not None:
                on_done(len(pending))
        if pending:
            self._replace_hung([on[index[r]] for r in pending])
        return [o or Outcome(error="timeout", seconds=self.timeout_s) for o in outcomes]

    @staticmethod
    def _result(ref) -> Outcome:
        import ray

        try:
            return ray.get(ref)
        except ray.exceptions.RayError as e:  # the worker process died under the episode
            return Outcome(error=f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}")

    def _replace_hung(self, hung: list) -> None:
        """Replace the processes in ``hung`` still serving (another run may have replaced them already)."""
        import ray

        with self._lock:  # handles compare by actor id
            slots = [i for i, w in enumerate(self.workers) if w in hung]
            if not slots:
                return
            log.warning("%d agent process(es) held episodes past agent.episode_timeout_s=%s: replaced", len(slots),
                        self.timeout_s)
            for i in slots:
                ray.kill(self.workers[i], no_restart=True)
                self.workers[i] = self._start()
            self._wait_ready([self.workers[i] for i in slots])

    def close(self) -> None:
        import ray

        with self._lock:
            for w in self.workers:
                ray.kill(w, no_restart=True)
            self.workers = []
