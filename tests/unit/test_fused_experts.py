"""MoE experts into vLLM's fused expert weights (rollout/fused_experts.py), with a stand-in for vLLM's FusedMoE
layers: the first sync passes every expert to the loaders, the next one writes them in place when the engine held
the probed expert as given, and keeps the loaders when its backend transformed it (as vLLM-CPU's prepack does:
tests/integration and tests/distributed run that path)."""

from __future__ import annotations

import torch

from hybridflow.rollout.fused_experts import FusedExperts

E, H, I = 4, 8, 6


class _Experts(torch.nn.Module):  # vLLM 0.32: the weights one module below mlp.experts
    def __init__(self):
        super().__init__()
        self.w13_weight = torch.nn.Parameter(torch.zeros(E, 2 * I, H), requires_grad=False)
        self.w2_weight = torch.nn.Parameter(torch.zeros(E, H, I), requires_grad=False)


def _engine(layers=2):
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList()
    for _ in range(layers):
        layer = torch.nn.Module()
        layer.mlp = torch.nn.Module()
        layer.mlp.experts = torch.nn.Module()
        layer.mlp.experts.routed_experts = _Experts()
        model.model.layers.append(layer)
    return model


def _shard(seed):
    g = torch.Generator().manual_seed(seed)
    items = [("model.layers.0.self_attn.qkv_proj.weight", torch.randn(3, H, generator=g))]
    for layer in range(2):
        for e in range(E):
            p = f"model.layers.{layer}.mlp.experts.{e}."
            items += [(p + "gate_up_proj.weight", torch.randn(2 * I, H, generator=g)),
                      (p + "down_proj.weight", torch.randn(H, I, generator=g))]
    return items


def _load(model, items, transform=lambda t: t):
    """vLLM's loaders: each expert into its slot of the fused weights, through the backend's ``transform``."""
    for name, t in items:
        parts = name.split(".")
        if "experts" in parts:
            fused = model.model.layers[int(parts[2])].mlp.experts.routed_experts
            target = fused.w13_weight if parts[6] == "gate_up_proj" else fused.w2_weight
            target.data[int(parts[5])] = transform(t)


def _same(a, b):
    return [n for n, _ in a] == [n for n, _ in b] and all(torch.equal(x, y) for (_, x), (_, y) in zip(a, b))


def test_experts_go_in_place_once_the_engine_is_seen_holding_them_as_given():
    model = _engine()
    experts = FusedExperts(model)
    assert list(experts.layers) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    first = _shard(1)
    passed = list(experts.take(iter(first)))
    assert _same(passed, first) and experts.in_place is None  # all to the loaders, one expert kept to check
    _load(model, passed)
    second = _shard(2)
    passed = list(experts.take(iter(second)))
    assert experts.in_place and [n for n, _ in passed] == ["model.layers.0.self_attn.qkv_proj.weight"]
    fused = model.model.layers[1].mlp.experts.routed_experts
    assert torch.equal(fused.w13_weight[3], dict(second)["model.layers.1.mlp.experts.3.gate_up_proj.weight"])
    assert torch.equal(fused.w2_weight[0], dict(second)["model.layers.1.mlp.experts.0.down_proj.weight"])
    assert experts.bytes_in_place == 2 * E * 3 * I * H * 4


def test_a_backend_that_transforms_its_experts_keeps_the_loaders():
    model = _engine()
    experts = FusedExperts(model)
    _load(model, list(experts.take(iter(_shard(1)))), transform=lambda t: t * 2)  # e.g. a prepacked layout
    passed = list(experts.take(iter(_shard(2))))
    assert experts.in_place is False and _same(passed, _shard(2))
    assert _same(list(experts.take(iter(_shard(3)))), _shard(3))  # decided once


def test_a_dense_engine_passes_everything():
    model = torch.nn.Linear(2, 2)
    experts = FusedExperts(model)
    items = [("model.layers.0.mlp.experts.0.gate_up_proj.weight", torch.ones(1))]
    assert list(experts.take(iter(items))) == items
