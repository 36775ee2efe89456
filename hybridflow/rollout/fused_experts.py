"""MoE experts written straight into vLLM's fused expert weights, where vLLM keeps them per expert as loaded.

vLLM stacks a MoE layer's experts into two parameters of its ``FusedMoE`` (fused_moe/layer.py): ``w13_weight``
[E, 2 I/t_g, H] (expert e's [gate rows; up rows] of its TP shard) and ``w2_weight`` [E, H, I/t_g], which is exactly
the generation shard the transition produces per expert (resharding/vllm_layout.py ``expert_generation_shard``).
Through vLLM's checkpoint loaders each piece would first be staged into a checkpoint-shaped tensor, t_g times its
size (vllm_layout.to_checkpoint_names); written in place it costs nothing extra. Whether a backend keeps that
layout after loading is not assumed: the first sync goes through the loaders, and the next one checks that the
engine holds one of the experts it was given, value for value, and at the shapes of the shard. Where a backend
transforms its experts (padding on vLLM-CPU at widths off its alignment, a shuffled or interleaved layout for
another kernel) the check fails and the loaders stay.

During vLLM's layerwise reload each layer's parameters are swapped for meta tensors until its weights arrive
(model_loader/reload/layerwise.py); a FusedMoE layer given none gets its own tensors back at the end ("Failed to
load weights", reported once). The parameters are held from before the reload, so the copies land in the tensors
vLLM puts back. vLLM-CPU's expert prepack runs after every sync (patches/vllm_engine.py CPU_EXPERTS_REPACK).
"""

from __future__ import annotations

import re

import torch

_EXPERT_ITEM = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_up_proj|down_proj)\.weight$")


class FusedExperts:
    """The FusedMoE layers of one vLLM model, and whether their experts are written in place."""

    def __init__(self, model: torch.nn.Module):
        # by the experts' name in the shard (vLLM 0.32 keeps the weights one module below: mlp.experts.routed_experts)
        self.layers = {re.match(r"^(.*\bmlp\.experts)\b", name)[1]: m for name, m in model.named_modules()
                       if hasattr(m, "w13_weight") and hasattr(m, "w2_weight")}
        self.in_place: bool | None = None  # None: not yet known (a probe is checked at the next sync)
        self._probe: tuple[str, int, str, torch.Tensor] | None = None
        self._params: dict[str, dict[str, torch.Tensor]] = {}
        self.bytes_in_place = 0

    def take(self, items):
        """Pass (vLLM name, tensor) items of a generation shard on, each expert's either copied into the engine's
        fused weights (``in_place``) or passed on to the loaders (the first one kept to check the layout). Call it
        before the engine's reload starts: the check reads the engine's weights, which the reload swaps for meta
        tensors while it runs."""
        if self.in_place is None and self._probe is not None:
            self._decide()
        self.bytes_in_place = 0
        return self._pass(items)

    def _pass(self, items):
        for name, t in items:
            m = _EXPERT_ITEM.match(name)
            if m is None or not self.layers:
                yield name, t
            elif self.in_place:
                target = self._params[m[1]][m[3]][int(m[2])]
                target.copy_(t.to(device=target.device, dtype=target.dtype))
                self.bytes_in_place += t.numel() * t.element_size()
            else:
                if self.in_place is None and self._probe is None:
                    self._probe = (m[1], int(m[2]), m[3], t.detach().to("cpu", copy=True))
                yield name, t

    def _decide(self) -> None:
        """In place from now on if the engine holds the probed expert as it was given, in every layer's layout."""
        prefix, e, kind, probe = self._probe
        params = {name: {"gate_up_proj": m.w13_weight, "down_proj": m.w2_weight} for name, m in self.layers.items()}
        held = params[prefix][kind]
        same_shapes = all(p["gate_up_proj"].shape[1:] == params[prefix]["gate_up_proj"].shape[1:]
                          and p["down_proj"].shape[1:] == params[prefix]["down_proj"].shape[1:] for p in params.values())
        self.in_place = bool(same_shapes and held.shape[1:] == probe.shape
                             and torch.equal(held[e].detach().cpu(), probe.to(held.dtype)))
        self._params = params if self.in_place else {}
        self._probe = None
