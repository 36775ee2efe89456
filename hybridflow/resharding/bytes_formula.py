"""The planner's bytes for a given model: a HF state dict's tensors counted by the training stage that holds them
(TP-split dense, expert, replicated, and experts' whole pieces), then HybridPlan.stage_bytes_received. What check-model and the transition
tests hold the measured bytes to."""

from __future__ import annotations

from hybridflow.families.weights import EMBEDDING, Split, hf_weight, is_expert, layer_index
from hybridflow.plan.stages import StageSplit
from hybridflow.resharding.plan import HybridPlan, Layout


def stage_bytes(state: dict, cfg, stages: StageSplit, ep: int, element_size: int | None = None) -> tuple:
    """(split, experts, replicated, whole experts) bytes per training stage (of ``stages``) of ``state`` (HF names).
    ``element_size``: the megatron model's (None: each tensor's own); a weight declared float32 (the expert bias)
    counts 4 either way. Experts are their own category only where expert parallelism exchanges them (at EP 1
    they are TP-split); an expert's replicated piece (gpt-oss's down_proj_bias) goes whole to every generation rank."""
    pp = stages.pp
    split, experts, replicated, whole = ([0] * pp for _ in range(4))
    stage_of = {layer: s for s in range(pp) for layer in stages.layers(cfg.num_hidden_layers, s)}
    for name, t in state.items():
        weight = hf_weight(name)
        n = t.numel() * (4 if weight.float32 else element_size or t.element_size())
        layer = layer_index(name)
        s = stage_of[layer] if layer is not None else (0 if weight == EMBEDDING else pp - 1)
        if is_expert(name) and ep > 1:
            (whole if weight.split is Split.REPLICATED else experts)[s] += n
        elif weight.split is Split.REPLICATED:
            replicated[s] += n
        else:
            split[s] += n
    return split, experts, replicated, whole


def expected_bytes_received(state: dict, cfg, train: Layout, ep: int, t_g: int, element_size: int | None = None,
                            stage: int | None = None, stages: StageSplit | None = None) -> float:
    """The bytes a rank of training stage ``stage`` (None: the stage whose ranks receive the most) receives in the
    hybrid transition of ``state``'s model from ``train`` (EP ``ep``, expert TP 1 where ep > 1; its layers split
    by ``stages``, None: evenly) to generation TP ``t_g``."""
    stages = stages or StageSplit(train.p)
    plan, parts = HybridPlan(train, 1, t_g), stage_bytes(state, cfg, stages, ep, element_size)
    stages = range(train.p) if stage is None else [stage]
    return float(max(plan.stage_bytes_received(s, *parts, ep) for s in stages))
