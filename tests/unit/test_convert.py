"""HF <-> megatron weight layout: fused QKV per query group, TP sharding, round trips."""

import pytest
import torch
from transformers import Qwen2Config

from hybridflow.megatron.convert import Shard, fuse_qkv, hf_to_megatron, megatron_to_hf, split_qkv, tp_split_dim


def _cfg(**kw):
    base = dict(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, tie_word_embeddings=False)
    return Qwen2Config(**{**base, **kw})


def test_fused_qkv_is_ordered_per_query_group():
    cfg = _cfg()  # 4 heads, 2 groups, head dim 4
    q = torch.arange(16.0)[:, None].repeat(1, 3)  # rows 0..15 = q heads 0..3
    k = 100 + torch.arange(8.0)[:, None].repeat(1, 3)
    v = 200 + torch.arange(8.0)[:, None].repeat(1, 3)
    fused = fuse_qkv(q, k, v, cfg)[:, 0].tolist()
    # group 0: q heads 0,1 (rows 0..7), k_0 (100..103), v_0 (200..203); then group 1
    assert fused == [*range(0, 8), *range(100, 104), *range(200, 204), *range(8, 16), *range(104, 108), *range(204, 208)]
    back = split_qkv(fuse_qkv(q, k, v, cfg), cfg)
    assert all(torch.equal(a, b) for a, b in zip(back, (q, k, v)))


def _hf_state(cfg):
    torch.manual_seed(0)
    from transformers import Qwen2ForCausalLM

    return {k: v.clone() for k, v in Qwen2ForCausalLM(cfg).state_dict().items()}


def _gather_tp(shards: list[dict]) -> dict:
    """One stage's full tensors from its TP shards (what the export's TP gather produces)."""
    return {k: torch.cat([s[k] for s in shards], dim=tp_split_dim(k)) if tp_split_dim(k) is not None
            else shards[0][k] for k in shards[0]}


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_shard_then_gather_round_trips_bit_identically(tp, pp):
    cfg = _cfg()
    hf = _hf_state(cfg)
    merged = {}
    for p in range(pp):
        shards = [hf_to_megatron(hf, cfg, Shard(t, tp, p, pp)) for t in range(tp)]
        merged.update(megatron_to_hf(_gather_tp(shards), cfg, Shard(0, tp, p, pp)))
    assert set(merged) == set(hf)
    for k in hf:
        assert torch.equal(merged[k], hf[k]), k


def test_tp_shards_split_groups_and_gate_up():
    cfg = _cfg()
    hf = _hf_state(cfg)
    s0 = hf_to_megatron(hf, cfg, Shard(0, 2, 0, 1))
    gate, up = hf["model.layers.0.mlp.gate_proj.weight"], hf["model.layers.0.mlp.up_proj.weight"]
    assert torch.equal(s0["decoder.layers.0.mlp.linear_fc1.weight"], torch.cat([gate[:12], up[:12]]))
    assert s0["decoder.layers.0.self_attention.linear_qkv.weight"].shape == ((2 + 2) * 4, 16)  # 1 group per rank
    assert s0["decoder.layers.0.self_attention.linear_proj.weight"].shape == (16, 8)


def test_pipeline_stage_numbers_layers_locally():
    cfg = _cfg()
    stage1 = hf_to_megatron(_hf_state(cfg), cfg, Shard(0, 1, 1, 2))
    assert "decoder.layers.0.input_layernorm.weight" in stage1 and "decoder.layers.2.input_layernorm.weight" not in stage1
    assert "embedding.word_embeddings.weight" not in stage1 and "output_layer.weight" in stage1


# Transformer Engine's spec: the norms are fused into the next linear layer; TE adds _extra_state entries.
TE_KEYS = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
           "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}


def _te_named(local: dict) -> dict:
    """What a TE-spec GPTModel's state_dict() looks like, written out by hand (independent of convert)."""
    out = {}
    for k, v in local.items():
        for old, new in TE_KEYS.items():
            if k.startswith("decoder.layers.") and k.endswith(old):
                k = k[: -len(old)] + new
        out[k] = v
        if k.endswith("linear_qkv.weight"):
            out[k.replace("weight", "_extra_state")] = None  # TE's fp8 metadata, not a weight
    return out


class _TEModel:
    """Stands in for a TE-spec model: load_into reads state_dict() and copies into its tensors."""

    def __init__(self, template: dict):
        self.tensors = {k: (torch.empty_like(v) if v is not None else None) for k, v in template.items()}

    def state_dict(self):
        return dict(self.tensors)

    def named_modules(self):  # no megatron GroupedMLP inside
        return iter(())


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 2)])
def test_te_names_round_trip_bit_identically(tp, pp):
    from hybridflow.megatron.convert import canonical_names, load_into, uses_te_names

    cfg = _cfg()
    hf = _hf_state(cfg)
    merged = {}
    for p in range(pp):
        shards = []
        for t in range(tp):
            local = hf_to_megatron(hf, cfg, Shard(t, tp, p, pp))
            te_model = _TEModel(_te_named(local))
            assert uses_te_names(te_model.tensors)
            load_into(te_model, local)  # local-spec names in, TE names in the model
            for k, v in _te_named(local).items():
                if v is not None:
                    assert torch.equal(te_model.tensors[k], v), k
            back = canonical_names(te_model.state_dict())
            assert set(back) == set(local)  # _extra_state dropped, norms renamed back
            shards.append(back)
        merged.update(megatron_to_hf(_gather_tp(shards), cfg, Shard(0, tp, p, pp)))
    assert set(merged) == set(hf)
    for k in hf:
        assert torch.equal(merged[k], hf[k]), k


def test_te_grouped_expert_names_are_sequential_ones_per_expert():
    """TE's grouped experts (TEGroupedMLP, moe_grouped_gemm on GPU) keep expert i's weight as
    ``experts.linear_fc1.weight{i}`` (TE GroupedLinear, one parameter per GEMM) with ``_extra_state{i}``:
    conversion, resharding and export see SequentialMLP's ``experts.local_experts.{i}.linear_fc1.weight``."""
    from hybridflow.megatron.convert import canonical_names, load_into

    layer = "decoder.layers.0."
    local = {f"{layer}mlp.experts.local_experts.{i}.linear_fc{j}.weight": torch.randn(4, 3) for i in range(2)
             for j in (1, 2)}
    local[f"{layer}input_layernorm.weight"] = torch.randn(3)
    expert = f"{layer}mlp.experts.local_experts.{{}}.linear_fc{{}}.weight"
    te = {f"{layer}mlp.experts.linear_fc{j}.weight{i}": local[expert.format(i, j)] for i in range(2) for j in (1, 2)}
    te[f"{layer}self_attention.linear_qkv.layer_norm_weight"] = local[f"{layer}input_layernorm.weight"]
    te_model = _TEModel({**te, f"{layer}mlp.experts.linear_fc1._extra_state1": None})
    load_into(te_model, local)
    assert all(torch.equal(te_model.tensors[k], v) for k, v in te.items())
    assert set(canonical_names(te_model.state_dict())) == set(local)


def test_te_norm_names_come_from_megatron_and_are_replicated():
    from hybridflow.megatron.convert import _te_norm_renames, canonical_names

    assert dict(_te_norm_renames()) == {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                                        "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
                                        # MLA's latent norms, fused into its up-projections by TE's spec
                                        "self_attention.q_layernorm.": "self_attention.linear_q_up_proj.layer_norm_",
                                        "self_attention.kv_layernorm.": "self_attention.linear_kv_up_proj.layer_norm_"}
    te_mla = {"decoder.layers.0.self_attention.linear_kv_up_proj.layer_norm_weight": torch.ones(2)}
    assert set(canonical_names(te_mla)) == {"decoder.layers.0.self_attention.kv_layernorm.weight"}
    assert tp_split_dim("decoder.layers.3.self_attention.linear_qkv.layer_norm_weight") is None
    assert tp_split_dim("decoder.layers.3.mlp.linear_fc1.layer_norm_weight") is None
    assert tp_split_dim("decoder.layers.3.mlp.linear_fc1.weight") == 0
