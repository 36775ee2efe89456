"""The shared-prompt layout (row_layout.shared_prompt_rows, the CPU path for GRPO groups): one packed row per
group of rows with the same prompt gives the same log-probs, entropy, values and gradient as the rotated
one-row-per-sample layout, for prompts of different lengths, responses of 0 to R tokens, and groups cut by
a micro-batch boundary; at TP=2 with sequence parallel too; for a model with a sliding window (3 positions)
shorter than the rows, whose responses sit apart from their prompt in the packed row (the window is measured in
positions, within the packed mask: patches/megatron_layers.py WINDOW_WITHIN_ROWS); and for GLM-4.5 (half-rotary
heads at the packed positions, its routed and shared experts), and for gpt-oss (sinks, a window on every other layer,
YaRN at the packed positions, biased experts).

The cases of one world size run in one spawned world, one after another (tests/distributed/batched.py),
each torn down by test_layouts.one_case."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.batched import batched_worlds, one_case
from tests.numerics import assert_close

pytestmark = pytest.mark.distributed

P, R = 9, 6
PROMPT_LENS = [4, 9, 6, 2]  # one per group of GROUP rows
GROUP = 3
RESPONSE_LENS = [6, 1, 3, 0, 2, 6, 5, 5, 1, 4, 6, 2]
# (tp, micro-batch rows, model: the tiny Qwen2, Mistral with a window, GLM-4.5, gpt-oss, DeepSeek-V3's MLA)
CASES = [(1, 12, "qwen2"), (1, 5, "qwen2"), (2, 12, "qwen2"), (1, 12, "mistral_window"), (1, 12, "glm4_moe"),
         (1, 12, "gpt_oss"), (1, 12, "deepseek_v3")]
IDS = [f"{tp}-{micro}" + ("" if model == "qwen2" else f"-{model}") for tp, micro, model in CASES]


def grouped_batch():
    from hybridflow.protocol import Batch

    g = torch.Generator().manual_seed(5)
    rows = len(RESPONSE_LENS)
    ids = torch.randint(3, 40, (rows, P + R), generator=g)
    mask = torch.zeros_like(ids)
    for i in range(rows):
        n_prompt = PROMPT_LENS[i // GROUP]
        ids[i, :P] = ids[i // GROUP * GROUP, :P]  # the group's prompt
        mask[i, P - n_prompt:P] = 1
        mask[i, P:P + RESPONSE_LENS[i]] = 1
    ids = ids * mask
    rm = mask[:, P:]
    return Batch.from_dict(tensors=dict(
        input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0), responses=ids[:, P:],
        response_mask=rm, advantages=torch.randn(rows, R, generator=g) * rm,
        ref_log_prob=(-3 + torch.randn(rows, R, generator=g)) * rm))


def _rank_fn(rank, world, hf_dir, tp, micro, model):
    from hybridflow.config.schema import Actor
    from hybridflow.megatron import parallel
    from hybridflow.megatron.role import MegatronRole, ModelBuild, OptimSettings
    from hybridflow.workers import role_ops
    from hybridflow.workers.common import load_hf_folder

    parallel.init_model_parallel(tp, 1, seed=1)
    cfg, state = load_hf_folder(f"{hf_dir}/{model}")
    batch = grouped_batch()
    actor = Actor(ppo_mini_batch_size=len(batch), ppo_micro_batch_size_per_gpu=micro, use_kl_loss=True)
    out = {}
    for shared in (False, True):
        policy = MegatronRole(cfg, state, ModelBuild(sequence_parallel=tp > 1),
                              optim=OptimSettings(lr=1e-2, eps=1e-3, clip_grad=1e9))
        critic = MegatronRole(cfg, state, ModelBuild(value_head=True, sequence_parallel=tp > 1))
        policy.shares_prompts = critic.shares_prompts = shared
        lp = role_ops.log_probs(policy, batch, micro, with_entropy=True)
        values = role_ops.values(critic, batch, micro)
        role_ops.update_policy(policy, batch, actor, 1)
        out[shared] = dict(lp=lp, values=values,
                           grads={n: p.main_grad.detach().clone() for n, p in policy.module.named_parameters()})
    return out


@pytest.fixture(scope="module")
def case_results(tmp_path_factory):
    from hybridflow.models.char_tokenizer import build_char_tokenizer
    from hybridflow.models.tiny_arch import build_tiny
    from hybridflow.models.tiny_qwen2 import build_tiny_qwen2

    root = tmp_path_factory.mktemp("shared_prompt")
    build_tiny_qwen2(root / "qwen2", build_char_tokenizer(root / "qwen2"), hidden_size=64, num_layers=2, seed=11)
    build_tiny(root / "mistral_window", build_char_tokenizer(root / "mistral_window"), "mistral", sliding_window=3,
               seed=11)
    build_tiny(root / "glm4_moe", build_char_tokenizer(root / "glm4_moe"), "glm4_moe", seed=11)
    build_tiny(root / "gpt_oss", build_char_tokenizer(root / "gpt_oss"), "gpt_oss", seed=11)
    build_tiny(root / "deepseek_v3", build_char_tokenizer(root / "deepseek_v3"), "deepseek_v3", seed=11)
    return batched_worlds(one_case, {i: (case[0], (_rank_fn, str(root), *case)) for i, case in zip(IDS, CASES)})


@pytest.mark.parametrize("tp,micro,model", CASES, ids=IDS)
def test_shared_prompt_rows_equal_rotated_rows(case_results, tp, micro, model):
    from hybridflow.workers import row_layout

    packed = row_layout.shared_prompt_rows(grouped_batch(), P)
    assert packed["input_ids"].shape[0] == len(PROMPT_LENS)  # one row per group
    assert packed["input_ids"].shape[1] == max(PROMPT_LENS[g] + sum(RESPONSE_LENS[g * GROUP:(g + 1) * GROUP])
                                              for g in range(len(PROMPT_LENS)))

    rank0 = case_results(IDS[CASES.index((tp, micro, model))])[0]
    rotated, shared = rank0[False], rank0[True]
    for key in ("log_probs", "entropy"):
        assert_close(shared["lp"][key], rotated["lp"][key], what=key)
    assert_close(shared["values"], rotated["values"], what="values")
    assert (rotated["lp"]["log_probs"] != 0).sum() == sum(RESPONSE_LENS)  # every response token was scored
    # Another attention layout (one packed row per group): summed over more terms in another order.
    assert_close(shared["grads"], rotated["grads"], slack=10, what="gradient")
