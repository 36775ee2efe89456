"""colocate_async's partial rollouts (workers/carry.py) on a real vLLM-CPU engine: a step returns its quota of
complete groups as soon as they are there, the unfinished responses are carried, go on after a weight update
(resumed from prompt + their tokens) and record the version of every token; a carried response that would lag
by the staleness bound is restarted and counted."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridflow.spawn import run_ranks

pytestmark = pytest.mark.distributed
MAX_LEN = 48


def _prompts(start: int, groups: int, n: int):
    from hybridflow.protocol import Batch
    from hybridflow.trainer.experience import sample_seeds

    ids = torch.tensor([[5 + (start + g) % 7, 9, 11 + g % 3, 6] for g in range(groups) for _ in range(n)])
    uids = [f"{start}-{g}" for g in range(groups)]
    return Batch.from_dict(tensors={"input_ids": ids, "attention_mask": torch.ones_like(ids),
                                    "sample_seed": sample_seeds(1, uids, n)},
                           non_tensors={"uid": np.array([u for u in uids for _ in range(n)], dtype=object)})


def _rank_fn(rank, world, hf_dir, eos_id):
    from hybridflow.rollout.vllm_rollout import SamplingSettings, VLLMRollout
    from hybridflow.workers.carry import CarriedGeneration
    from hybridflow.workers.common import load_hf_folder

    _, hf = load_hf_folder(hf_dir)
    rollout = VLLMRollout(hf_dir, max_model_len=64, seed=0)
    rollout.update_weights(hf)
    sampling = SamplingSettings(temperature=1.0, max_new_tokens=MAX_LEN)
    runs = {}
    for threshold in (None, 1):  # no bound; then every trained token from the current version
        carry, steps = CarriedGeneration(MAX_LEN, threshold=threshold), []
        for version in range(4):
            out = carry.generate(rollout, _prompts(10 * version, 6, 2), sampling, version, groups=2, pad_id=0,
                                 eos_id=eos_id)
            steps.append({"uids": list(out.non_tensors["uid"]), "versions": out.tensors["token_policy_versions"].clone(),
                          "mask": out.tensors["response_mask"].clone(), "restarts": out.tensors["stale_restarts"].clone(),
                          "log_probs": out.tensors["rollout_log_probs"].clone(), "carried": len(carry.samples),
                          "carried_tokens": sum(len(s.tokens) for s in carry.samples)})
            # an update: the weights change in place (versions count them)
            rollout.update_weights({k: v * (1.02 if v.dim() > 1 else 1.0) for k, v in hf.items()})
        runs[threshold] = steps
    rollout.close()
    return runs


def _ending_often(model_dir, eos_id: int, logit: float = 1.5) -> None:
    """Give the random model an EOS logit of about ``logit`` (its others are about 0): responses end after a
    geometric number of tokens, so groups finish at different times."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        ids = torch.randint(3, 30, (8, 16), generator=torch.Generator().manual_seed(0))
        mean = model.model(ids).last_hidden_state.mean((0, 1))
        model.lm_head.weight[eos_id] = mean * (logit / mean.dot(mean))
    model.save_pretrained(model_dir)


def test_partial_rollouts_carry_resume_and_bound_staleness(tmp_path):
    from hybridflow.models.char_tokenizer import build_char_tokenizer
    from hybridflow.models.tiny_qwen2 import build_tiny_qwen2

    tok = build_char_tokenizer(tmp_path)
    build_tiny_qwen2(tmp_path, tok, hidden_size=128, num_layers=2, seed=5, max_position_embeddings=64)
    _ending_often(tmp_path, tok.eos_token_id)
    (runs,) = run_ranks(_rank_fn, 1, str(tmp_path), tok.eos_token_id, timeout=300)
    steps = runs[None]
    for k, s in enumerate(steps + runs[1]):
        k %= len(steps)
        assert len(s["uids"]) == 4, "two complete groups of two per step"
        assert s["carried"] > 0, f"step {k}: nothing carried"
        sampled = s["mask"].bool()
        assert ((s["versions"] >= 0) == sampled).all() and (s["versions"] <= k).all()
        assert (s["log_probs"][sampled] < 0).all() and (s["log_probs"][~sampled] == 0).all()
    assert any(s["carried_tokens"] for s in steps), "no unfinished response was carried: no partial rollout"
    spans = [(v[v >= 0].min(), v[v >= 0].max()) for s in steps[1:] for v in s["versions"] if (v >= 0).any()]
    assert any(lo < hi for lo, hi in spans), "no trained response went on across an update"
    # bound 1: a carried response is restarted at every update, so every trained token is of the current version
    for k, s in enumerate(runs[1]):
        assert all((v[v >= 0] == k).all() for v in s["versions"]), f"step {k}: a stale token was trained on"
    assert sum(int(s["restarts"].sum()) for s in runs[1]) > 0, "nothing was restarted: the bound was not exercised"
