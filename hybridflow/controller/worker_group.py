"""`RayWorkerGroup`: one Ray actor per pool bundle, driven as a single object.

Every `@register`-ed method of the worker class becomes a method of the group
that dispatches its arguments per the method's mode, runs on the ranks in
parallel and collects the results (see decorator.DISPATCH_TABLE).
"""

from __future__ import annotations

import contextlib
import functools
import math
import re
import threading
import time
import uuid
from collections import Counter
from typing import Any, Callable

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from hybridflow.device import local_ranks

from .decorator import (DISPATCH_TABLE, Call, CollectFn, Dispatch, Plan, RegisterSpec,
                        get_register_spec)
from .resource_pool import ResourcePool
from .worker import Worker

# Arguments this cheap are sent inline; anything else that several ranks share
# is put into the object store once instead of serialised once per rank.
_INLINE_TYPES = (type(None), bool, int, float, str, Dispatch, ray.ObjectRef)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # Ray colours its tracebacks; logs want plain text
# A blocking call waits in slices this long, asking ``_give_up`` between them: a driver asked to stop
# (SIGTERM) does not stay in a call that may never end (an endless generation, a wedged rank).
_WAIT_SLICE_S = 0.5
_give_up: Callable[[], str | None] | None = None


class WaitAbandoned(RuntimeError):
    """A blocking call the driver stopped waiting for (``give_up_waiting_when``); its ranks may still run."""


def give_up_reason() -> str | None:
    """Why the driver stops waiting now (the installed check's answer), or None: for the driver's other
    waits that may never end (a user reward function's call)."""
    return _give_up() if _give_up is not None else None


@contextlib.contextmanager
def give_up_waiting_when(check: Callable[[], str | None]):
    """While inside, every blocking worker-group call asks ``check()`` at least every 0.5 s and raises
    ``WaitAbandoned`` with its answer once it is not None (e.g. "SIGTERM 10 s ago"). A signal handler
    cannot do this itself: Ray turns an exception raised inside its blocking calls into its own exit."""
    global _give_up
    previous, _give_up = _give_up, check
    try:
        yield
    finally:
        _give_up = previous


class WorkerGroupError(RuntimeError):
    """A remote call failed; names the rank and method, keeps the remote traceback."""

    def __init__(self, message: str, rank: int, method: str, cause: BaseException | None, summary: str = "",
                 died: bool = False):
        super().__init__(message)
        self.rank, self.method, self.cause, self.died = rank, method, cause, died
        self.summary = summary or message.splitlines()[0]  # one line: group, method, rank, node, what


class DispatchFuture:
    """Result of a `blocking=False` call; `.get()` waits and collects."""

    def __init__(self, wg: RayWorkerGroup, method: str, plan: Plan, refs: list, collect: CollectFn):
        self._wg, self._method, self._plan = wg, method, plan
        self._refs, self._collect = refs, collect

    @property
    def refs(self) -> list:
        return list(self._refs)

    def done(self) -> bool:
        ready, _ = ray.wait(self._refs, num_returns=len(self._refs), timeout=0)
        return len(ready) == len(self._refs)

    def get(self, timeout: float | None = None) -> Any:
        """Wait for every rank (at most ``timeout`` s, by default the group's ``call_timeout_s``; a rank
        still running then is named in a WorkerGroupError) and collect."""
        timeout = self._wg.call_timeout_s if timeout is None else timeout
        rank_of = {ref: call.rank for ref, call in zip(self._refs, self._plan.calls)}
        results, pending = {}, list(self._refs)
        deadline = None if timeout is None else time.monotonic() + timeout
        while pending:
            # before every wait too: a step of quick calls (DAPO generating batch after batch) gives up at its next
            self._check_give_up()
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            # Wait for one at a time so the first failure surfaces at once,
            # even while other ranks block in a collective waiting for it.
            wait_s = _WAIT_SLICE_S if left is None else min(_WAIT_SLICE_S, left)
            ready, pending = ray.wait(pending, num_returns=1, timeout=wait_s)
            if not ready:
                if deadline is not None and time.monotonic() >= deadline:
                    raise self._wg._stuck(self._method, sorted(rank_of[r] for r in pending), timeout)
                continue
            more = []
            if pending:  # drain whatever else is already finished
                more, pending = ray.wait(pending, num_returns=len(pending), timeout=0)
            for ref in ready + more:
                try:
                    results[ref] = ray.get(ref)
                except ray.exceptions.RayError as e:
                    raise self._wg._error(self._method, rank_of[ref], e) from e
        return self._collect(self._plan, [results[r] for r in self._refs])

    def _check_give_up(self) -> None:
        reason = give_up_reason()
        if reason is not None:
            raise WaitAbandoned(f"stopped waiting for worker group {self._wg.name!r} "
                                f"({self._wg.worker_cls.__name__}.{self._method}): {reason}")


def _consume_later(refs: list) -> None:
    """Fetch ``refs`` on a daemon thread, dropping what they raise: the other side of a failed collective usually
    fails too (a rollout worker's death breaks the actor's send), and an error object dropped unfetched makes Ray
    print an unhandled-error stack although the caller has already reported the failure in one line."""
    def fetch() -> None:
        for ref in refs:
            with contextlib.suppress(Exception):
                ray.get(ref)

    if refs:
        threading.Thread(target=fetch, name="hybridflow-consume-failed-calls", daemon=True).start()


def get_together(*futures: DispatchFuture) -> list:
    """Results of calls on several groups that wait on each other (the two sides of one collective, as the
    checkpoint engine's sender and receivers): the first rank to fail on either side is raised at once, not
    after the other side's collective times out; a rank still running after its group's ``call_timeout_s`` is
    named as ``DispatchFuture.get`` names it."""
    owner = {ref: f for f in futures for ref in f.refs}
    rank_of = {ref: call.rank for f in futures for ref, call in zip(f.refs, f._plan.calls)}
    timeouts = [f._wg.call_timeout_s for f in futures if f._wg.call_timeout_s is not None]
    deadline = time.monotonic() + max(timeouts) if timeouts else None
    pending = list(owner)
    while pending:
        futures[0]._check_give_up()
        ready, pending = ray.wait(pending, num_returns=1, timeout=_WAIT_SLICE_S)
        for ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayError as e:
                _consume_later(pending)
                raise owner[ref]._wg._error(owner[ref]._method, rank_of[ref], e) from e
        if not ready and deadline is not None and time.monotonic() >= deadline:
            # every side still waiting is named (and marked failed): which one holds the others up is not known
            errors = [f._wg._stuck(f._method, sorted(rank_of[r] for r in pending if owner[r] is f), f._wg.call_timeout_s)
                      for f in futures if any(owner[r] is f for r in pending)]
            if len(errors) == 1:
                raise errors[0]
            summary = "; and ".join(e.summary for e in errors)
            raise WorkerGroupError(summary, errors[0].rank, errors[0].method, None, summary)
    return [f.get() for f in futures]


class RayWorkerGroup:
    def __init__(self, pool: ResourcePool, worker_cls: type, *args,
                 name_prefix: str | None = None, share: float = 1.0,
                 env: dict[str, str] | None = None, call_timeout_s: float | None = None,
                 build_timeout_s: float | None = None, **kwargs):
        """``call_timeout_s``: a blocking call whose ranks have not all finished after this many seconds
        raises a WorkerGroupError naming them (a stopped process or a wedged collective); None waits.
        ``build_timeout_s``: the same for the workers' construction (imports, the distributed world, the model, an
        engine), which the first call waits for apart from its own ``call_timeout_s``; None waits."""
        if not isinstance(worker_cls, type):
            raise TypeError("RayWorkerGroup wants the plain worker class, not a Ray actor class "
                            f"(got {worker_cls!r}); it applies ray.remote itself")
        self.pool = pool
        self.worker_cls = worker_cls
        self.name = name_prefix or f"{worker_cls.__name__}_{uuid.uuid4().hex[:6]}"
        self.share = share
        self.call_timeout_s = call_timeout_s if call_timeout_s and call_timeout_s > 0 else None
        self.build_timeout_s = build_timeout_s if build_timeout_s and build_timeout_s > 0 else None
        self._built = False
        # a call reaches every rank in the same order whichever driver thread makes it (an agent endpoint's engine
        # batches beside the trainer's weight pushes): ranks run their collectives in call order
        self._order = threading.Lock()
        self._dispatch_infos: dict[str, list[dict]] = {}
        self._meshes: dict[str, str] = {}
        self._workers: list = []
        self.node_names: list[str] = []
        self._reserved = 0.0
        # A rank died, failed or did not finish a call: the group is not asked to clean up (a stopped worker
        # would hold the caller a second call timeout), only killed.
        self.failed = False
        self._bind_registered_methods()  # first: a name clash should cost no actors
        pool.reserve(share, f"worker group {self.name!r}")
        self._reserved = share
        try:
            self._create_workers(args, kwargs, env or {})
        except BaseException:
            self.shutdown()
            raise

    # ---------------------------------------------------------------- setup
    def _create_workers(self, args, kwargs, extra_env: dict) -> None:
        pool, pg = self.pool, self.pool.placement_group
        bundles = pool.rank_bundles()
        node_ids = [pool.bundle_node_ids()[b] for b in bundles]  # per rank
        # Node names (`ray start --node-name`; the node's IP by default) of each rank: named in errors and
        # recorded by the trainer.
        names = {n["NodeID"]: n.get("NodeName") or n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")}
        self.node_names = [names.get(n, n) for n in node_ids]
        master_addr, master_port = self._master_addr_port(pg, node_ids, bundles[0])
        # Fractional resources: Ray keeps 4 decimals; round down so a 1/3
        # share times 3 groups still fits in the bundle.
        frac = lambda x: math.floor(x * self.share * 1e4) / 1e4  # noqa: E731
        remote_cls = ray.remote(self.worker_cls)
        local = local_ranks(node_ids)
        # torch threads: the bundle's whole CPUs (at least one). Groups sharing a bundle take turns (the
        # driver runs one stage at a time), so each may use all of it.
        threads = max(1, int(pool.cpus_per_bundle))
        for rank, node in enumerate(node_ids):
            env = {
                "RANK": str(rank), "WORLD_SIZE": str(pool.world_size),
                "LOCAL_RANK": str(local[rank]),
                "LOCAL_WORLD_SIZE": str(node_ids.count(node)),
                "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port),
                "OMP_NUM_THREADS": str(threads),
                **{k: str(v) for k, v in extra_env.items()},
            }
            actor = remote_cls.options(
                name=f"{self.name}_{rank}",
                num_cpus=frac(pool.cpus_per_bundle),
                num_gpus=frac(pool.gpus_per_bundle),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=bundles[rank]),
                runtime_env={"env_vars": env},
            ).remote(*args, **kwargs)
            self._workers.append(actor)

    @staticmethod
    def _master_addr_port(pg, node_ids: list[str], rank0_bundle: int) -> tuple[str, int]:
        """Rank 0's address and a port free on its node."""
        ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")}
        rank0_ip = ips[node_ids[0]]
        # All ranks on one node: loopback avoids picking a wrong interface.
        addr = "127.0.0.1" if len(set(node_ids)) == 1 else rank0_ip
        if rank0_ip == ray.util.get_node_ip_address():
            return addr, Worker.find_free_port()
        probe = ray.remote(num_cpus=0)(Worker.find_free_port).options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=rank0_bundle))
        return addr, ray.get(probe.remote())

    def _bind_registered_methods(self) -> None:
        for attr in dir(self.worker_cls):
            spec = get_register_spec(getattr(self.worker_cls, attr, None))
            if spec is None:
                continue
            if hasattr(self, attr):
                raise AttributeError(f"{self.worker_cls.__name__}.{attr} is @register-ed but "
                                     f"clashes with RayWorkerGroup.{attr}; rename it")
            setattr(self, attr, self._make_method(attr, spec))
            self._meshes[attr] = spec.mesh

    def _make_method(self, method: str, spec: RegisterSpec):
        @functools.wraps(getattr(self.worker_cls, method))
        def call(*args, **kwargs):
            return self._run(method, spec.dispatch_mode, spec.blocking, args, kwargs)
        return call

    # ------------------------------------------------------------- dispatch
    @property
    def world_size(self) -> int:
        return self.pool.world_size

    @property
    def workers(self) -> list:
        return list(self._workers)

    def mesh_of(self, method: str) -> str:
        return self._meshes.get(method, "train")

    def dispatch_infos(self, mesh: str = "train") -> list[dict]:
        """Per-rank `dispatch_info(mesh)`, fetched once per mesh (layouts are fixed per group)."""
        if mesh not in self._dispatch_infos:
            infos = self.execute_all("dispatch_info", mesh)
            for rank, info in enumerate(infos):
                if not isinstance(info, dict) or not {"dp_rank", "dp_size", "collect"} <= set(info):
                    raise ValueError(f"{self.name}: rank {rank} dispatch_info() returned {info!r}; "
                                     "expected dict(dp_rank=int, dp_size=int, collect=bool)")
            self._dispatch_infos[mesh] = infos
        return self._dispatch_infos[mesh]

    def dead_ranks(self, wait_s: float = 2.0) -> list[int]:
        """The ranks whose process is gone: a call on a dead actor fails at once, one on a live (even busy) actor
        does not within ``wait_s``."""
        refs = {w.alive.remote(): rank for rank, w in enumerate(self._workers)}
        done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=wait_s)
        dead = []
        for ref in done:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError:
                dead.append(refs[ref])
        return sorted(dead)

    def submit(self, method: str, *args, **kwargs) -> DispatchFuture:
        """A registered method dispatched as registered, without waiting: its future (``get`` collects)."""
        spec = get_register_spec(getattr(self.worker_cls, method))
        return self._run(method, spec.dispatch_mode, False, args, kwargs)

    def execute_all(self, method: str, *args, **kwargs) -> list:
        """Call any worker method (registered or not) on every rank."""
        return self._run(method, Dispatch.ONE_TO_ALL, True, args, kwargs)

    def _run(self, method: str, mode: Dispatch, blocking: bool, args: tuple, kwargs: dict):
        if not self._workers:
            raise RuntimeError(f"worker group {self.name!r} is shut down")
        self._wait_built(method)
        dispatch_fn, collect_fn = DISPATCH_TABLE[mode]
        plan = dispatch_fn(self, method, args, kwargs)
        with self._order:
            refs = self._submit(method, plan.calls)
        future = DispatchFuture(self, method, plan, refs, collect_fn)
        return future.get() if blocking else future

    def _wait_built(self, method: str) -> None:
        """Before the group's first call (``method``, named in errors): every actor built (its ``__init__``
        returned), within ``build_timeout_s``, so that the call's own ``call_timeout_s`` counts the call alone."""
        if self._built:
            return
        calls = [Call(rank, (), {}) for rank in range(len(self._workers))]
        refs = [w.alive.remote() for w in self._workers]
        built = DispatchFuture(self, method, Plan(calls), refs, lambda plan, results: None)
        built.get(self.build_timeout_s or math.inf)
        self._built = True

    def _submit(self, method: str, calls: list[Call]) -> list:
        shared = Counter(id(a) for c in calls for a in (*c.args, *c.kwargs.values())
                         if not isinstance(a, _INLINE_TYPES))
        refs_by_id: dict[int, Any] = {}

        def prep(a):
            if shared.get(id(a), 0) < 2:
                return a
            if id(a) not in refs_by_id:
                refs_by_id[id(a)] = ray.put(a)
            return refs_by_id[id(a)]

        return [getattr(self._workers[c.rank], method).remote(
                    *map(prep, c.args), **{k: prep(v) for k, v in c.kwargs.items()})
                for c in calls]

    def _error(self, method: str, rank: int, e: BaseException) -> WorkerGroupError:
        self.failed = True
        where = f"rank {rank} of {self.world_size} on node {self.node_names[rank]}"
        lines = [line for line in _ANSI.sub("", str(e)).splitlines() if line.strip()]
        last = lines[-1].strip() if lines else type(e).__name__
        died = False
        if isinstance(e, ray.exceptions.RayActorError) and getattr(e, "actor_init_failed", False):
            what = f"failed while being built: {last}"  # its __init__ raised: that error, not "died"
        elif isinstance(e, ray.exceptions.RayActorError):  # the process is gone (killed, OOM, crashed)
            what, died = "its worker process died", True
        else:
            what = f"failed: {last}"
        summary = f"worker group {self.name!r} ({self.worker_cls.__name__}.{method}), {where}: {what}"
        return WorkerGroupError(f"{summary}\n{_ANSI.sub('', str(e))}", rank, method, getattr(e, "cause", None) or e,
                                summary, died)

    def died(self, method: str, ranks: list[int]) -> WorkerGroupError:
        """The error of ``ranks`` found dead (``dead_ranks``) after another group's call failed with them: a
        receiver's death breaks the sender's collective, and the sender often reports first."""
        self.failed = True
        nodes = sorted({self.node_names[r] for r in ranks})
        summary = (f"worker group {self.name!r} ({self.worker_cls.__name__}.{method}), rank(s) "
                   f"{', '.join(map(str, ranks))} of {self.world_size} on node(s) {', '.join(nodes)}: "
                   "its worker process died")
        return WorkerGroupError(summary, ranks[0], method, None, summary, died=True)

    def _stuck(self, method: str, ranks: list[int], timeout: float) -> WorkerGroupError:
        self.failed = True
        nodes = sorted({self.node_names[r] for r in ranks})
        summary = (f"worker group {self.name!r} ({self.worker_cls.__name__}.{method}): rank(s) "
                   f"{', '.join(map(str, ranks))} of {self.world_size} on node(s) {', '.join(nodes)} did not finish "
                   f"within {timeout:g} s (a stopped worker or a wedged collective)")
        return WorkerGroupError(summary, ranks[0], method, None, summary)

    # ------------------------------------------------------------- teardown
    def shutdown(self) -> None:
        """Kill this group's actors and give its share back to the pool."""
        for actor in self._workers:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already dead: nothing to do
                pass
        self.pool.release(self._reserved)
        self._workers, self._reserved = [], 0.0

    def __repr__(self) -> str:
        return (f"RayWorkerGroup({self.name!r}, {self.worker_cls.__name__}, "
                f"world_size={self.world_size})")
