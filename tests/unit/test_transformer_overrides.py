"""megatron/overrides.py: a role's override_transformer_config refused in one line where megatron-core 0.16.1 would
fail later (as a layer is built or at the first forward), and accepted where it runs. The kernels' checks follow
what megatron's own imports found on this machine (a GPU machine with the extensions accepts them)."""

from __future__ import annotations

import pytest

from hybridflow.megatron.overrides import check_transformer_overrides

KEY = "actor.megatron.override_transformer_config"


def test_fused_gradient_accumulation_needs_its_extension():
    from megatron.core.tensor_parallel import layers

    if layers._grad_accum_fusion_available:
        pytest.skip("fused_weight_gradient_mlp_cuda is installed: megatron builds the fused linears")
    with pytest.raises(ValueError, match=rf"^{KEY}\.gradient_accumulation_fusion: needs the "
                                         "fused_weight_gradient_mlp_cuda extension"):
        check_transformer_overrides({"gradient_accumulation_fusion": True}, KEY)
    assert check_transformer_overrides({"gradient_accumulation_fusion": False}, KEY)


def test_the_token_dispatcher_is_alltoall_or_flex_with_deepep():
    from megatron.core.transformer.moe import fused_a2a

    assert check_transformer_overrides({"moe_token_dispatcher_type": "alltoall"}, KEY)
    with pytest.raises(ValueError, match=rf"^{KEY}\.moe_token_dispatcher_type: 'allgather' is not built here"):
        check_transformer_overrides({"moe_token_dispatcher_type": "allgather"}, KEY)
    if fused_a2a.HAVE_DEEP_EP:
        pytest.skip("DeepEP is installed: the flex dispatcher runs")
    # verl's DeepSeek-V3 671B script
    with pytest.raises(ValueError, match=rf"^{KEY}\.moe_token_dispatcher_type: flex needs DeepEP"):
        check_transformer_overrides({"moe_token_dispatcher_type": "flex", "moe_enable_deepep": True}, KEY)


@pytest.mark.parametrize("overrides,message", [
    ({"account_for_embedding_in_pipeline_split": True}, "account_for_embedding_in_pipeline_split: this pipeline "
                                                        "split is not built here"),
    ({"pipeline_model_parallel_layout": "Et|tL"}, "pipeline_model_parallel_layout: this pipeline split"),
    ({"num_layers_in_last_pipeline_stage": 0}, r"num_layers_in_last_pipeline_stage: a number of layers \(1 or more\)"),
    ({"num_layers_in_first_pipeline_stage": True}, "num_layers_in_first_pipeline_stage: a number of layers"),
])
def test_pipeline_splits_other_than_first_and_last_layer_counts_are_refused(overrides, message):
    with pytest.raises(ValueError, match=rf"^{KEY}\.{message}"):
        check_transformer_overrides(overrides, KEY)


def test_uneven_stages_and_megatrons_defaults_pass():
    # the split itself is checked against the model (plan/stages.py); verl's scripts set the defaults explicitly
    overrides = {"num_layers_in_last_pipeline_stage": 13, "account_for_embedding_in_pipeline_split": False,
                 "account_for_loss_in_pipeline_split": False}
    assert check_transformer_overrides(overrides, KEY) == overrides
