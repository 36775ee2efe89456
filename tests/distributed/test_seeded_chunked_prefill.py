"""A seeded request's response does not depend on how vLLM chunked its prompt (patches/vllm_engine.py
``SEEDED_PARTIAL_PREFILL``): on vLLM-CPU the seeded requests of a prefill cut over several engine steps failed the
engine ('CPU Generator does not use offset'), as every training row and agent request is seeded. An engine whose
token budget (32) cuts each prompt samples exactly what an engine that prefills them whole does."""

from __future__ import annotations

import pytest
import torch

from hybridflow.spawn import run_ranks

pytestmark = pytest.mark.distributed
PROMPTS = [[5 + (7 * i + j) % 23 for j in range(40 + 3 * i)] for i in range(4)]  # 40-49 tokens each
PROMPTS += [PROMPTS[0], PROMPTS[0]]
SEEDS = [11, 12, 13, 977, 40213, 11]  # the last row is the first again


def _rank_fn(rank, world, hf_dir):
    from hybridflow.rollout.vllm_rollout import EngineSettings, SamplingSettings, VLLMRollout
    from hybridflow.workers.common import load_hf_folder

    _, hf = load_hf_folder(hf_dir)
    out = {}
    for name, settings in (("whole", EngineSettings()), ("chunked", EngineSettings(max_num_batched_tokens=32,
                                                                                    max_num_seqs=8))):
        rollout = VLLMRollout(hf_dir, settings, max_model_len=96, seed=0)
        rollout.wake_up(["weights", "kv_cache"])
        rollout.update_weights(hf)
        sched = rollout.llm.llm_engine.vllm_config.scheduler_config
        out[name] = {"budget": sched.max_num_batched_tokens, "samples": rollout.generate_with_log_probs(
            PROMPTS, SamplingSettings(temperature=1.0, max_new_tokens=8), seeds=SEEDS)}
        rollout.close()
    return out


def test_a_seeded_response_does_not_depend_on_prompt_chunking(tmp_path):
    from hybridflow.models.char_tokenizer import build_char_tokenizer
    from hybridflow.models.tiny_qwen2 import build_tiny_qwen2
    from tests.numerics import assert_close

    tok = build_char_tokenizer(tmp_path)
    build_tiny_qwen2(tmp_path, tok, hidden_size=128, num_layers=2, seed=5, max_position_embeddings=128)
    (out,) = run_ranks(_rank_fn, 1, str(tmp_path), timeout=300)
    assert out["chunked"]["budget"] == 32 < min(map(len, PROMPTS)) and out["whole"]["budget"] > sum(map(len, PROMPTS))
    whole, chunked = out["whole"]["samples"], out["chunked"]["samples"]
    assert [ids for ids, _ in chunked] == [ids for ids, _ in whole]
    assert whole[5][0] == whole[0][0] != whole[4][0]  # the seed picks the sample
    for (_, a), (_, b) in zip(chunked, whole):
        assert_close(torch.tensor(a), torch.tensor(b), dtype=torch.float32, slack=4, what="log-probs")
