"""The adapter's forward hook (megatron/lora.py ``_hook``) on the three output forms of megatron's linears: the local
linears' (out, bias), TE's LayerNorm-linear with return_layernorm_output ((out, ln_out), bias) and, where TE returns
its bias too, (out, bias, ln_out). The adapter takes the linear's input or the norm's output, and the caller always
gets (out, bias), with the adapters on or off (the reference forward)."""

import pytest
import torch

from hybridflow.megatron.lora import _hook


class _Adapter:
    def __init__(self):
        self.enabled, self.seen = True, None

    def __call__(self, x):
        self.seen = x
        return torch.full_like(x, 10.0)


def _linear():
    m = torch.nn.Module()
    m.adapter = _Adapter()
    return m


X, LN, OUT, BIAS = torch.ones(2, 3), torch.full((2, 3), 2.0), torch.zeros(2, 3), torch.ones(3)


@pytest.mark.parametrize("output,adapter_input", [((OUT, BIAS), X), (((OUT, LN), BIAS), LN), ((OUT, BIAS, LN), LN)],
                         ids=["local", "te_layernorm", "te_layernorm_bias"])
@pytest.mark.parametrize("enabled", [True, False])
def test_hook_unpacks_every_form_and_returns_out_and_bias(output, adapter_input, enabled):
    linear = _linear()
    linear.adapter.enabled = enabled
    out, bias = _hook(linear, (X,), output)
    assert bias is BIAS
    assert torch.equal(out, OUT + (10.0 if enabled else 0.0))
    if enabled:
        assert linear.adapter.seen is adapter_input


class _TEExpertLinear(torch.nn.Module):
    """What megatron-core hands TE for a routed expert's linear under EP or expert TP > 1 (extensions/transformer_engine.py
    TELinear with explicit_expert_comm): TE's own split off, so neither its parallel mode nor its group tells the kind."""

    parallel_mode, tp_group, explicit_expert_comm = None, None, True


@pytest.mark.parametrize("name,kind", [("decoder.layers.0.mlp.experts.3.linear_fc1", "column"),
                                       ("decoder.layers.0.mlp.experts.3.linear_fc2", "row")])
def test_te_expert_linears_split_by_name_and_megatrons_expert_tp(monkeypatch, name, kind):
    from megatron.core import parallel_state as ps

    from hybridflow.megatron.lora import COLUMN, ROW, _split

    monkeypatch.setattr(ps, "get_expert_tensor_parallel_world_size", lambda: 1)
    assert _split(name, _TEExpertLinear(), expert=True) == ({"column": COLUMN, "row": ROW}[kind], 1, 0)
    monkeypatch.setattr(ps, "get_expert_tensor_parallel_world_size", lambda: 2)
    with pytest.raises(ValueError, match=r"split over expert tensor parallelism \(2\); adapters on routed experts need"):
        _split(name, _TEExpertLinear(), expert=True)
    with pytest.raises(ValueError, match="explicit_expert_comm"):  # the same linear as a shared expert's: refused
        _split(name.replace("experts.3", "shared_experts"), _TEExpertLinear(), expert=False)
