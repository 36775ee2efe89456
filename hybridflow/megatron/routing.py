"""MoE routing replay (verl 0.9.1's ``router_replay.mode``: R2 and R3) on megatron-core 0.16's ``RouterReplay``.

A model built with ``moe_enable_routing_replay`` gives each ``TopKRouter`` a ``RouterReplay``
(transformer/moe/router.py), which megatron's ``topk_routing_with_score_function`` asks for the top-k: its own
(``RECORD`` keeps them), or target indices (``REPLAY_FORWARD``), the gate's probabilities then gathered at those
experts so its gradient flows as with its own choice (moe_utils.py). megatron keeps every instance in one
process-wide list (``RouterReplay.global_router_replay_instances``), but the actor and the reference live in one
process here: each model's routers are addressed through its own modules instead (``ModelRouting``), and
megatron's list is left without them.

Routes travel per token as [tokens, layers, top-k] expert ids (int16, verl's dtype). Inside the model a token's
place is megatron's: hidden states are [s, b, h], the router sees them flattened s-major, and under sequence
parallelism each TP rank holds one contiguous s-chunk (``model_order`` / ``layout_order``).

Deliberate differences from verl: a rank replays the routes of its own micro-batch layout (row_layout's
``token_position``), so the replay is exact under shared prompts and token-budget packing alike; the fused TE
router (``moe_router_fusion``) never asks ``RouterReplay`` and is refused with replay (plan/rules.py), as is
replay under activation recompute with pipeline stages (a recomputed layer would see a later micro-batch's
targets: megatron-core 0.16 leaves ``REPLAY_BACKWARD`` to its caller).
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist

from hybridflow import device

@functools.cache
def _counting_replay():
    """megatron's ``RouterReplay`` for one router, which while replaying also computes its own top-k and counts
    the real tokens whose expert set differs from the replayed one (the routing-difference metric)."""
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    class CountingReplay(RouterReplay):
        def __init__(self):
            super().__init__()
            RouterReplay.global_router_replay_instances.remove(self)  # addressed through its model (module doc)
            self.differ: torch.Tensor | None = None  # [tokens]: the last replayed forward's own top-k differed

        def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
            if self.router_replay_action == RouterReplayAction.REPLAY_FORWARD:
                with torch.no_grad():
                    own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)[1]
                    target = self.target_topk_idx.to(own.device)
                    self.differ = (own.sort(-1).values != target.sort(-1).values).any(-1)
            return super().get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)

    return CountingReplay


class ModelRouting:
    """Records and replays the top-k of one megatron model's MoE routers (this pipeline stage's)."""

    def __init__(self, module: torch.nn.Module, sequence_parallel: bool):
        from megatron.core.transformer.moe.router import TopKRouter
        from megatron.core.transformer.moe.router_replay import RouterReplay

        found = [m for m in module.modules() if isinstance(m, TopKRouter) and m.router_replay is not None]
        self.routers = sorted(found, key=lambda r: r.layer_number)
        for r in self.routers:
            RouterReplay.global_router_replay_instances.remove(r.router_replay)
            r.router_replay = _counting_replay()()
        # layer_number is 1-based and global (megatron offsets it by the pipeline stage)
        self.layers = [r.layer_number - 1 for r in self.routers]
        self.sequence_parallel = sequence_parallel

    def replay(self, routes: torch.Tensor) -> None:
        """The next forward uses ``routes`` [rows, s, layers (all of the model's), k] (the micro-batch's layout)
        instead of the routers' own top-k."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        local = self.model_order(routes)
        for i, router in zip(self.layers, self.routers):
            router.router_replay.clear_indices()
            router.router_replay.set_target_indices(local[:, i].long())
            router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def record(self) -> None:
        """The next forward keeps the routers' own top-k (``recorded``)."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        for router in self.routers:
            router.router_replay.clear_indices()
            router.router_replay.set_router_replay_action(RouterReplayAction.RECORD)

    def recorded(self, rows: int, num_layers: int) -> torch.Tensor:
        """The top-k the last forward chose, as [rows, s, num_layers, k] int16 in the micro-batch's layout
        (layers of other pipeline stages -1); every TP rank of the stage must call it (sequence parallel
        gathers)."""
        picks = torch.stack([r.router_replay.get_recorded_indices() for r in self.routers], 1)  # [t, L_local, k]
        ordered = self.layout_order(picks.to(torch.int32), rows).to(torch.int16)  # gloo gathers no int16
        out = torch.full((*ordered.shape[:2], num_layers, ordered.shape[-1]), NO_ROUTE, dtype=torch.int16,
                         device=ordered.device)
        out[:, :, self.layers] = ordered
        return out

    def differing(self, rows: int) -> torch.Tensor:
        """[rows, s]: of this stage's layers, how many chose (by their own top-k) other experts than the last
        forward replayed, per token of the layout; every TP rank of the stage must call it."""
        differ = torch.stack([r.router_replay.differ for r in self.routers], 1).sum(1)
        return self.layout_order(differ.to(torch.int32), rows)

    def clear(self) -> None:
        """Back to the routers' own top-k, nothing kept."""
        for router in self.routers:
            router.router_replay.clear_indices()
            router.router_replay.clear_router_replay_action()
            router.router_replay.differ = None

    # --- token order ------------------------------------------------------------------------------

    def _tp(self):
        from megatron.core import parallel_state as ps

        return ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()

    def model_order(self, per_token: torch.Tensor) -> torch.Tensor:
        """[rows, s, ...] in the layout -> [s_local * rows, ...] as this rank's routers see the tokens: s-major
        ([s, b, h] hidden states flattened), this TP rank's s-chunk under sequence parallelism."""
        x = per_token.transpose(0, 1)
        if self.sequence_parallel:
            size, rank = self._tp()
            chunk = x.shape[0] // size
            x = x[rank * chunk:(rank + 1) * chunk]
        return x.reshape(-1, *x.shape[2:])

    def layout_order(self, picks: torch.Tensor, rows: int) -> torch.Tensor:
        """The inverse of ``model_order`` (sequence-parallel chunks gathered over the TP group)."""
        x = picks.reshape(-1, rows, *picks.shape[1:])
        if self.sequence_parallel:
            from megatron.core import parallel_state as ps

            size, _ = self._tp()
            parts = [torch.empty_like(x) for _ in range(size)]
            dist.all_gather(parts, x.contiguous(), group=ps.get_tensor_model_parallel_group())
            x = torch.cat(parts)
        return x.transpose(0, 1)


class RoleRouting(ModelRouting):
    """A role's routing state around megatron's schedule: which micro-batch replays, which records, and the
    per-row outputs of each forward (``forward_pass``), for this pipeline stage's layers."""

    def __init__(self, module: torch.nn.Module, tf_config, pp_size: int):
        super().__init__(module, tf_config.sequence_parallel)
        self.num_layers, self.top_k, self.pp_size = tf_config.num_layers, tf_config.moe_router_topk, pp_size
        self._recording, self._routed = False, None

    @contextlib.contextmanager
    def forward_pass(self, record: bool):
        """A forward-only pass over micro-batches: yields the list each micro-batch's ``outputs`` are appended to
        (``record``: the routes the routers chose, else replay counts where a micro-batch replays)."""
        self._recording, self._routed = record, []
        try:
            yield self._routed
        finally:
            self._recording, self._routed = False, None
            self.clear()

    def before_forward(self, mb: dict) -> None:
        """Set the routers up for this micro-batch's forward: replay its ``routed_experts``, record, or neither."""
        if "routed_experts" in mb:
            self.replay(to_layout(mb["routed_experts"], mb["token_position"], *mb["input_ids"].shape))
        elif self._recording:
            self.record()
        else:
            self.clear()

    def after_forward(self, mb: dict) -> None:
        """Keep this stage's routing of the micro-batch inside a ``forward_pass``, before the next one's."""
        if self._routed is not None:
            self._routed.append(device.to_host(self.outputs(mb)))

    def outputs(self, mb: dict) -> dict:
        """Per input row of the micro-batch this stage just forwarded, for its own layers: how many of the routes
        replayed differed from the routers' own choice, or the routes recorded (``forward_pass``); every TP rank of
        the stage calls it."""
        rows, pos = mb["input_ids"].shape[0], mb["token_position"]
        if "routed_experts" in mb:
            cells = routed_cells(mb["routed_experts"], pos)
            if not self.routers:  # a stage of dense layers only
                return {"routing_differing": torch.zeros(len(pos), dtype=torch.float64),
                        "routing_counted": torch.zeros(len(pos), dtype=torch.float64)}
            differ = from_layout(self.differing(rows), pos, 0)
            return {"routing_differing": (differ * cells).sum(1).double(),
                    "routing_counted": cells.sum(1).double() * len(self.layers)}
        if self._recording:
            if not self.routers:  # a stage of dense layers only: the other stages' routes
                shape = (*pos.shape, self.num_layers, self.top_k)
                return {"routed_experts": torch.full(shape, NO_ROUTE, dtype=torch.int16)}
            return {"routed_experts": from_layout(self.recorded(rows, self.num_layers), pos, NO_ROUTE)}
        return {}

    def of_all_stages(self, routed: list[dict]) -> list[dict]:
        """Each micro-batch's ``outputs`` of every pipeline stage merged: the recorded routes by maximum (a stage
        leaves other stages' layers ``NO_ROUTE``), the counts summed."""
        if not routed or self.pp_size == 1:
            return routed
        from megatron.core import parallel_state as ps

        for r in routed:
            for key, value in r.items():
                merged = device.to_device(value.to(torch.int32 if key == "routed_experts" else torch.float64))
                dist.all_reduce(merged, op=dist.ReduceOp.MAX if key == "routed_experts" else dist.ReduceOp.SUM,
                                group=ps.get_pipeline_model_parallel_group())
                r[key] = device.to_host(merged).to(value.dtype)
        return routed


NO_ROUTE = -1  # a batch cell whose token nobody routed: padding, or a response's last token (never fed to vLLM)


def filler(shape: tuple, top_k: int) -> torch.Tensor:
    """Routes for tokens with none (``NO_ROUTE`` cells, layout padding): experts 0..k-1, distinct as a real
    top-k is; their outputs are never read."""
    return torch.arange(top_k, dtype=torch.int16).expand(*shape, top_k).clone()


def routed_cells(routes: torch.Tensor, token_position: torch.Tensor) -> torch.Tensor:
    """[n, T] bool: the batch cells that are tokens of the layout and carry routes (in any layer: a model's dense
    layers, GLM-4.5's first or Qwen-MoE's mlp_only_layers, have none)."""
    return (token_position >= 0) & (routes[..., 0] != NO_ROUTE).any(-1)


def to_layout(routes: torch.Tensor, token_position: torch.Tensor, rows: int, length: int) -> torch.Tensor:
    """Batch routes [n, T, L, k] (cells of the rows' [n, T] token grid) -> the micro-batch layout's [rows, length, L,
    k], by ``token_position`` [n, T] (row_layout: each cell's flat place in the layout, -1 for padding). A shared
    prompt's token takes the routes of one of its rows (identical: the same tokens routed by the same weights)."""
    L, k = routes.shape[-2:]
    out = filler((rows * length, L), k).to(routes.device)
    cells = routed_cells(routes, token_position)
    out[token_position[cells]] = routes[cells].to(torch.int16)
    return out.view(rows, length, L, k)


def from_layout(layout_values: torch.Tensor, token_position: torch.Tensor, fill) -> torch.Tensor:
    """Per-token values of the layout [rows, length, ...] -> the batch's cells [n, T, ...] (the inverse of
    ``to_layout``); cells that are no token of the layout get ``fill``."""
    flat = layout_values.reshape(-1, *layout_values.shape[2:])
    out = torch.full((*token_position.shape, *flat.shape[1:]), fill, dtype=flat.dtype, device=flat.device)
    cells = token_position >= 0
    out[cells] = flat[token_position[cells]]
    return out
