"""`@register` and the dispatch/collect table used by `RayWorkerGroup`.

A dispatch function turns one driver call into per-rank calls; a collect
function turns the per-rank results back into one value. Both are plain
functions in `DISPATCH_TABLE`, so a new mode is one enum member + one entry.
The worker group is duck-typed here (`world_size`, `dispatch_infos()`) to keep
this module free of Ray.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable

from hybridflow.protocol import Batch

# Attribute name stored on registered functions; the group looks for it.
REGISTER_ATTR = "__hybridflow_register__"


class Dispatch(Enum):
    ONE_TO_ALL = "one_to_all"  # same args everywhere -> list of per-rank results
    RANK_ZERO = "rank_zero"  # rank 0 only -> its result
    DP_COMPUTE = "dp_compute"  # Batch args split evenly -> concat results
    DP_COMPUTE_3D = "dp_compute_3d"  # split by dp_rank, collect flagged


@dataclass(frozen=True)
class RegisterSpec:
    dispatch_mode: Dispatch
    blocking: bool
    mesh: str = "train"


def register(dispatch_mode: Dispatch = Dispatch.ONE_TO_ALL, blocking: bool = True, mesh: str = "train"):
    """Mark a worker method to be bound onto its worker group.

    ``mesh`` names the layout DP_COMPUTE_3D splits over: the worker's ``dispatch_info(mesh)``
    (e.g. the training mesh for updates, the generation mesh for rollouts, which may group ranks
    differently). The function itself is returned unchanged (only an attribute is added); ``Worker``
    subclasses time it (``Worker.compute_seconds``).
    """
    if not isinstance(dispatch_mode, Dispatch):
        raise TypeError(f"dispatch_mode must be a Dispatch, got {dispatch_mode!r}")

    def deco(fn):
        setattr(fn, REGISTER_ATTR, RegisterSpec(dispatch_mode, blocking, mesh))
        return fn

    return deco


def get_register_spec(fn) -> RegisterSpec | None:
    return getattr(fn, REGISTER_ATTR, None)


@dataclass
class Call:
    """One remote invocation: which rank, with which arguments."""
    rank: int
    args: tuple
    kwargs: dict


@dataclass
class Plan:
    """Per-rank calls plus whatever the collect step needs to know."""
    calls: list[Call]
    ctx: dict = field(default_factory=dict)


# ------------------------------------------------------------------ dispatch
def _one_to_all(wg, method, args, kwargs) -> Plan:
    return Plan([Call(r, args, kwargs) for r in range(wg.world_size)])


def _rank_zero(wg, method, args, kwargs) -> Plan:
    return Plan([Call(0, args, kwargs)])


def _split_batches(method, args, kwargs, n, mode) -> tuple[list[tuple], list[dict]]:
    """Chunk every Batch argument into n parts; other arguments are broadcast."""
    def parts(a, where):
        if not isinstance(a, Batch):
            return [a] * n
        if len(a) % n:
            raise ValueError(f"{method}: {mode} cannot split Batch argument {where} of size "
                             f"{len(a)} into {n} equal chunks ({len(a)} % {n} = {len(a) % n}); "
                             f"pad it first (Batch.pad_to_divisor)")
        return a.chunk(n)

    a_parts = [parts(a, i) for i, a in enumerate(args)]
    k_parts = {k: parts(v, repr(k)) for k, v in kwargs.items()}
    return ([tuple(p[i] for p in a_parts) for i in range(n)],
            [{k: p[i] for k, p in k_parts.items()} for i in range(n)])


def _dp_compute(wg, method, args, kwargs) -> Plan:
    n = wg.world_size
    a, k = _split_batches(method, args, kwargs, n, "DP_COMPUTE")
    return Plan([Call(r, a[r], k[r]) for r in range(n)])


def _dp_compute_3d(wg, method, args, kwargs) -> Plan:
    infos = wg.dispatch_infos(wg.mesh_of(method))
    dp_size = infos[0]["dp_size"]
    if any(i["dp_size"] != dp_size for i in infos):
        raise ValueError(f"{method}: ranks disagree on dp_size: {[i['dp_size'] for i in infos]}")
    collectors = sorted((i["dp_rank"], r) for r, i in enumerate(infos) if i["collect"])
    if [d for d, _ in collectors] != list(range(dp_size)):
        raise ValueError(f"{method}: DP_COMPUTE_3D needs exactly one collecting rank "
                         f"per dp_rank 0..{dp_size - 1}; got (dp_rank, rank) {collectors}")
    a, k = _split_batches(method, args, kwargs, dp_size, "DP_COMPUTE_3D")
    calls = [Call(r, a[i["dp_rank"]], k[i["dp_rank"]]) for r, i in enumerate(infos)]
    return Plan(calls, {"collect_ranks": [r for _, r in collectors]})


# ------------------------------------------------------------------- collect
def _as_list(plan: Plan, outputs: list) -> list:
    return outputs


def _first(plan: Plan, outputs: list) -> Any:
    return outputs[0]


def _concat(outputs: list) -> Any:
    # Batches are merged; anything else (None, metrics dicts) stays a list.
    if outputs and all(isinstance(o, Batch) for o in outputs):
        return Batch.concat(outputs)
    return outputs


def _concat_all(plan: Plan, outputs: list) -> Any:
    return _concat(outputs)


def _concat_collectors(plan: Plan, outputs: list) -> Any:
    by_rank = {c.rank: o for c, o in zip(plan.calls, outputs)}
    return _concat([by_rank[r] for r in plan.ctx["collect_ranks"]])


DispatchFn = Callable[[Any, str, tuple, dict], Plan]
CollectFn = Callable[[Plan, list], Any]

DISPATCH_TABLE: dict[Dispatch, tuple[DispatchFn, CollectFn]] = {
    Dispatch.ONE_TO_ALL: (_one_to_all, _as_list),
    Dispatch.RANK_ZERO: (_rank_zero, _first),
    Dispatch.DP_COMPUTE: (_dp_compute, _concat_all),
    Dispatch.DP_COMPUTE_3D: (_dp_compute_3d, _concat_collectors),
}
