"""With Apex importable and Transformer Engine absent, the model still builds RMSNorm norms and equals HF.

megatron-core picks its default norm at import (``try: import apex``): Apex's FusedLayerNorm, which
accepts only LayerNorm. The rank sets those module attributes to what they are on such a machine.
"""

from __future__ import annotations

import pytest
import torch

from hybridflow.spawn import run_ranks
from tests.numerics import assert_close

pytestmark = pytest.mark.distributed


def _input_ids():
    return torch.randint(3, 40, (2, 12), generator=torch.Generator().manual_seed(0))


def _as_if_apex_present():
    from megatron.core.fusions.fused_layer_norm import FusedLayerNorm
    from megatron.core.models import backends
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer import transformer_block

    # The assignments of each module's `try: import apex` branch.
    backends.HAVE_APEX = gpt_layer_specs.HAVE_APEX = transformer_block.HAVE_APEX = True
    backends.LNImpl = gpt_layer_specs.LNImpl = transformer_block.LayerNormImpl = FusedLayerNorm


def _rank_fn(rank, world, hf_dir):
    from hybridflow.megatron import parallel
    from hybridflow.megatron.role import MegatronRole
    from hybridflow.workers.common import load_hf_folder

    _as_if_apex_present()
    parallel.init_model_parallel(1, 1, seed=1)
    role = MegatronRole(*load_hf_folder(hf_dir))
    norms = {name: type(m) for name, m in role.module.named_modules()
             if name.endswith(("input_layernorm", "pre_mlp_layernorm", "final_layernorm"))}
    ids = _input_ids()
    mb = dict(input_ids=ids, position_ids=torch.arange(ids.shape[1]).expand_as(ids))
    return norms, role.forward([mb], lambda mb, o: {"logits": o})[0]["logits"]


def test_apex_without_te_builds_rmsnorm_and_matches_hf(tmp_path):
    from transformers import AutoModelForCausalLM

    from hybridflow.models.char_tokenizer import build_char_tokenizer
    from hybridflow.models.tiny_qwen2 import build_tiny_qwen2

    build_tiny_qwen2(tmp_path, build_char_tokenizer(tmp_path), hidden_size=64, num_layers=2, seed=3)
    norms, logits = run_ranks(_rank_fn, 1, str(tmp_path))[0]
    # 2 layers x (input, pre-MLP) + the final norm, all torch's RMSNorm (megatron's WrappedTorchNorm).
    assert len(norms) == 5 and set(norms.values()) == {torch.nn.RMSNorm}, norms
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(input_ids=_input_ids()).logits
    assert_close(logits, ref, slack=10, what="logits vs HF")  # other kernels
