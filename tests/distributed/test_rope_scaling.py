"""Scaled RoPE (Llama 3.1's ``llama3``, ``linear``): megatron logits equal HF transformers' at TP1 and TP2.

The tiny Llamas share their weights (one seed) and differ only in ``rope_parameters``; the sequence runs
past ``original_max_position_embeddings``, where the scaled frequencies change every logit. The unscaled
twin is what megatron computed for a Llama 3.1 config before the scaling was mapped.
"""

from __future__ import annotations

import pytest
import torch

from hybridflow.spawn import run_ranks
from tests.numerics import assert_close, used_fraction

pytestmark = pytest.mark.distributed

ROPES = {
    "llama3": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "unscaled": None,
}
SEQ = 16  # twice original_max_position_embeddings
SLACK = 10  # other kernels (megatron's vs transformers'): rtol 1e-4 in fp32


def _input_ids():
    return torch.randint(3, 40, (2, SEQ), generator=torch.Generator().manual_seed(0))


def _rank_fn(rank, world, root):
    from megatron.core import tensor_parallel

    from hybridflow.megatron import parallel
    from hybridflow.megatron.role import MegatronRole
    from hybridflow.workers.common import load_hf_folder

    parallel.init_model_parallel(world, 1, seed=1)
    ids = _input_ids()
    mb = dict(input_ids=ids, position_ids=torch.arange(SEQ).expand_as(ids))
    logits = {}
    for name in ROPES:
        role = MegatronRole(*load_hf_folder(f"{root}/{name}"))
        out = role.forward([mb], lambda mb, o: {"logits": tensor_parallel.gather_from_tensor_model_parallel_region(o)})
        logits[name] = out[0]["logits"]
    return logits


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from hybridflow.models.char_tokenizer import build_char_tokenizer
    from hybridflow.models.tiny_llama import build_tiny_llama

    root = tmp_path_factory.mktemp("rope")
    tokenizer = build_char_tokenizer(root / "tokenizer")
    hf_logits = {}
    for name, rope in ROPES.items():
        build_tiny_llama(root / name, tokenizer, rope_parameters=rope, max_position_embeddings=32, seed=5)
        hf = AutoModelForCausalLM.from_pretrained(str(root / name), dtype=torch.float32).eval()
        with torch.no_grad():
            hf_logits[name] = hf(input_ids=_input_ids()).logits
    return str(root), hf_logits


@pytest.mark.parametrize("tp", [1, 2])
def test_scaled_rope_logits_match_hf(models, tp):
    root, hf = models
    megatron = run_ranks(_rank_fn, tp, root)[0]
    for name in ROPES:
        assert_close(megatron[name], hf[name], slack=SLACK, what=f"{name} logits at TP{tp}")
    # Without the mapping (megatron's plain RoPE) the llama3 logits are off by far more than the tolerance
    # (7.6e-3 of the largest logit here: random-init attention is nearly uniform, so positions move the
    # logits only a little).
    assert used_fraction(megatron["unscaled"], hf["llama3"], slack=SLACK) > 10
