"""megatron-core policy and value models on one gloo rank vs Hugging Face transformers."""

from __future__ import annotations

import pytest
import torch

from hybridflow.spawn import run_ranks
from tests.numerics import assert_close

pytestmark = pytest.mark.distributed


def _tiny_hf(tmp):
    from hybridflow.models.tiny_qwen2 import build_tiny_qwen2
    from hybridflow.models.char_tokenizer import build_char_tokenizer

    build_tiny_qwen2(tmp, build_char_tokenizer(tmp), hidden_size=64, num_layers=2, seed=3)
    return str(tmp)


def _fixed_batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 40, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    # The engine runs causal-only attention (no padding mask, as TE does on GPU): its rows carry their
    # padding after the real tokens (row_layout.micro_batches lays batches out so).
    mask[0, -4:] = 0
    mask[1, -1:] = 0
    return dict(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                labels=torch.roll(ids, -1, 1))


def _rank_fn(rank, world, hf_dir):
    from hybridflow.megatron import parallel
    from hybridflow.megatron.role import MegatronRole, ModelBuild, OptimSettings, token_log_probs
    from hybridflow.workers.common import load_hf_folder

    parallel.init_model_parallel(1, 1, seed=1)
    cfg, state = load_hf_folder(hf_dir)
    policy = MegatronRole(cfg, state, optim=OptimSettings(lr=1e-3))
    mb = _fixed_batch()
    lp = policy.forward([mb], lambda mb, o: {"lp": token_log_probs(o, mb["labels"])})[0]["lp"]
    exported = {k: v.clone() for k, v in policy.hf_state_dict().items()}  # views of live params

    def loss_fn(mb, o):
        loss = -(token_log_probs(o, mb["labels"]) * mb["attention_mask"]).sum() / mb["attention_mask"].sum()
        return loss, {"loss": loss.detach()}

    losses = [m["loss"] for m in policy.train([([mb], loss_fn)] * 3)]
    value = MegatronRole(cfg, state, ModelBuild(value_head=True))
    v = value.forward([mb], lambda mb, o: {"v": o[..., 0]})[0]["v"]
    return dict(lp=lp, exported=exported, losses=losses, values=v)


def test_megatron_matches_hf_and_trains(tmp_path):
    from transformers import AutoModelForCausalLM

    from hybridflow.workers.common import load_hf_folder

    hf_dir = _tiny_hf(tmp_path)
    out = run_ranks(_rank_fn, 1, hf_dir)[0]
    mb = _fixed_batch()
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"], position_ids=mb["position_ids"]).logits
    ref = torch.log_softmax(logits, -1).gather(-1, mb["labels"][..., None])[..., 0]
    valid = mb["attention_mask"].bool()
    assert_close(out["lp"][valid], ref[valid], slack=10, what="log-probs vs HF")  # other kernels
    _, state = load_hf_folder(hf_dir)
    assert set(out["exported"]) == set(state)
    assert all(torch.equal(out["exported"][k], state[k]) for k in state)  # export before training is exact
    assert out["losses"][2] < out["losses"][0]  # the optimizer really steps
    assert out["values"].shape == mb["input_ids"].shape and torch.all(out["values"] == 0)  # zero-init head
