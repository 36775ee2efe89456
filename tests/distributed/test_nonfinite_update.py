"""A non-finite loss never reaches the weights: the role skips the optimizer step (megatron-core applies
it in bf16/fp32), reports it, and the next finite update proceeds as a first update would."""

from __future__ import annotations

import pytest
import torch

from hybridflow.spawn import run_ranks
from tests.distributed.test_padding_free_and_offload import _settings, uneven_batch

pytestmark = pytest.mark.distributed


def _rank_fn(rank, world, hf_dir):
    from hybridflow.megatron import parallel
    from hybridflow.megatron.role import MegatronRole, ModelBuild, OptimSettings
    from hybridflow.workers import role_ops
    from hybridflow.workers.common import load_hf_folder

    parallel.init_model_parallel(1, 1, seed=1)
    cfg, state = load_hf_folder(hf_dir)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        actor = MegatronRole(cfg, state, ModelBuild(dtype=dtype), optim=OptimSettings(lr=1e-3))
        before = actor.hf_state_dict()
        nan = uneven_batch()
        nan.tensors["advantages"][:] = float("nan")  # every mini-batch
        skipped = role_ops.update_policy(actor, nan, _settings()[0], dp_size=1)
        after_nan = actor.hf_state_dict()
        fine = role_ops.update_policy(actor, uneven_batch(), _settings()[0], dp_size=1)
        fresh = MegatronRole(cfg, state, ModelBuild(dtype=dtype), optim=OptimSettings(lr=1e-3))
        role_ops.update_policy(fresh, uneven_batch(), _settings()[0], dp_size=1)
        out[str(dtype)] = dict(before=before, after_nan=after_nan, skipped=skipped, fine=fine,
                               after=actor.hf_state_dict(), fresh=fresh.hf_state_dict())
    return out


def test_nonfinite_update_is_skipped(tmp_path):
    from hybridflow.models.char_tokenizer import build_char_tokenizer
    from hybridflow.models.tiny_qwen2 import build_tiny_qwen2

    build_tiny_qwen2(tmp_path / "m", build_char_tokenizer(tmp_path / "m"), hidden_size=64, num_layers=2, seed=5)
    for dtype, r in run_ranks(_rank_fn, 1, str(tmp_path / "m"))[0].items():
        assert r["skipped"]["actor/update_skipped"] == 1 and not torch.isfinite(torch.tensor(r["skipped"]["actor/grad_norm"]))
        for k, v in r["before"].items():
            assert torch.equal(v, r["after_nan"][k]), f"{dtype}: {k} changed by a NaN update"
        assert r["fine"]["actor/update_skipped"] == 0
        # Skipped steps left Adam untouched: the next update equals a fresh role's first one.
        for k, v in r["fresh"].items():
            assert torch.equal(v, r["after"][k]), f"{dtype}: {k}"
