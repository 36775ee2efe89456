"""A Ray placement group of equal bundles that worker groups share.

Colocation: several worker groups (e.g. actor and critic) each place one actor
per bundle and take a `share` of it, so their ranks land on the same devices.
The pool tracks the shares handed out, so over-subscription fails at once
instead of leaving actors pending forever.
"""

from __future__ import annotations

import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

_EPS = 1e-6


class ResourcePoolError(RuntimeError):
    pass


class ResourcePool:
    def __init__(self, name: str, world_size: int, cpus_per_bundle: float = 1.0,
                 gpus_per_bundle: float = 0, strategy: str = "PACK",
                 ready_timeout_s: float = 120.0):
        if world_size < 1:
            raise ValueError(f"ResourcePool {name!r}: world_size must be >= 1, got {world_size}")
        if cpus_per_bundle <= 0 and gpus_per_bundle <= 0:
            raise ValueError(f"ResourcePool {name!r}: a bundle needs some CPU or GPU")
        self.name = name
        self.world_size = world_size
        self.cpus_per_bundle = float(cpus_per_bundle)
        self.gpus_per_bundle = float(gpus_per_bundle)
        self.strategy = strategy
        self.ready_timeout_s = ready_timeout_s
        self._pg = None
        self._used_share = 0.0

    @property
    def bundle(self) -> dict[str, float]:
        b = {"CPU": self.cpus_per_bundle} if self.cpus_per_bundle > 0 else {}
        if self.gpus_per_bundle > 0:
            b["GPU"] = self.gpus_per_bundle
        return b

    @property
    def placement_group(self):
        """Created on first use (not at construction) so a pool can be declared
        in config code before Ray is up; blocks until every bundle is placed."""
        if self._pg is None:
            pg = placement_group([dict(self.bundle) for _ in range(self.world_size)],
                                 strategy=self.strategy, name=f"hybridflow_pool_{self.name}")
            try:
                ray.get(pg.ready(), timeout=self.ready_timeout_s)
            except ray.exceptions.GetTimeoutError:
                remove_placement_group(pg)  # don't leave a pending request behind
                raise ResourcePoolError(self._shortage_message()) from None
            self._pg = pg
        return self._pg

    def _shortage_message(self) -> str:
        total, avail = ray.cluster_resources(), ray.available_resources()
        ask_cpu = self.cpus_per_bundle * self.world_size
        ask_gpu = self.gpus_per_bundle * self.world_size
        return (f"ResourcePool {self.name!r}: {self.world_size} bundles of {self.bundle} "
                f"({self.strategy}) not placed within {self.ready_timeout_s}s; asked "
                f"{ask_cpu:g} CPUs / {ask_gpu:g} GPUs, cluster has "
                f"{avail.get('CPU', 0):g}/{total.get('CPU', 0):g} CPUs and "
                f"{avail.get('GPU', 0):g}/{total.get('GPU', 0):g} GPUs available/total")

    def bundle_node_ids(self) -> list[str]:
        """Node id of each bundle (bundle index order)."""
        table = placement_group_table(self.placement_group)
        return [table["bundles_to_node_id"][i] for i in range(self.world_size)]

    def rank_bundles(self) -> list[int]:
        """The bundle of each rank: a node's bundles get consecutive ranks (nodes in order of their first
        bundle), so megatron's consecutive TP groups and vLLM's generation groups stay inside a node
        whatever order the placement listed the bundles in. Deterministic: colocated groups agree."""
        nodes = self.bundle_node_ids()
        first = {n: nodes.index(n) for n in nodes}
        return sorted(range(self.world_size), key=lambda i: (first[nodes[i]], i))

    def reserve(self, share: float, who: str) -> None:
        if not 0 < share <= 1:
            raise ValueError(f"{who}: share must be in (0, 1], got {share}")
        if self._used_share + share > 1 + _EPS:
            raise ResourcePoolError(
                f"{who}: share {share:g} does not fit in pool {self.name!r}, "
                f"{self._used_share:g} of each bundle is already taken")
        self._used_share += share

    def release(self, share: float) -> None:
        self._used_share = max(0.0, self._used_share - share)

    @property
    def free_share(self) -> float:
        return 1.0 - self._used_share

    def remove(self) -> None:
        """Free the placement group; actors still in it are killed by Ray."""
        if self._pg is not None:
            remove_placement_group(self._pg)
            self._pg = None
        self._used_share = 0.0

    def __repr__(self) -> str:
        return (f"ResourcePool({self.name!r}, world_size={self.world_size}, "
                f"bundle={self.bundle}, used_share={self._used_share:g})")
