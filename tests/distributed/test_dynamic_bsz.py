"""Dynamic batch size on real megatron ranks: micro-batches formed by a token budget, each one packed row
(block-diagonal mask and explicit positions on CPU, with or without a GRPO group's prompt shared), give the
log-probs, entropy, values, losses and gradients of the fixed micro-batch run, at DP 1/2 x TP 1/2 (sequence
parallel) and PP 2, with data-parallel ranks whose rows alone need different numbers of micro-batches
running the largest (agreed by an all-reduce, as verl's same_micro_num_in_dp): so does a Qwen3-MoE at expert
parallelism 2, whose token all-to-all needs both ranks in every micro-batch. And the entropy bonus: its
gradient through the whole model equals Hugging Face's in float64, also computed 3 response tokens at a time
(actor.entropy_from_logits_with_chunking, at TP 2). Context parallel 2 gives all of it too, in
the GPU's packed-sequence layout as well. A model with a sliding window (3 positions) shorter than the rows packs
exactly too (its window measured in each packed row's positions), and so does GLM-4.5.

All cases of one world size (layouts and entropy checks) run in one spawned world, one after another
(tests/distributed/batched.py), each torn down by test_layouts.one_case."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.batched import batched_worlds, one_case
from tests.numerics import assert_close

pytestmark = pytest.mark.distributed

P, R = 9, 6
GROUP = 2
PROMPT_LENS = [4, 9, 2, 6, 3, 8, 1, 5]  # one per group of GROUP rows
RESPONSE_LENS = [6, 1, 3, 0, 2, 6, 5, 5, 1, 4, 6, 2, 6, 6, 3, 1]
BUDGET = 24  # tokens per micro-batch: rows are 1 to 15 tokens, a rank's 8 rows ~70
# (micro, shared prompts, packed sequences): "dynamic_thd" is the GPU's token-budget layout (THD rows, each sequence
# padded to 2 x CP), which megatron's local attention takes under CP only (as a mask: context parallel cases)
MODES = {"fixed": (2, False, False), "dynamic": (BUDGET, False, False), "dynamic_shared": (BUDGET, True, False),
         "dynamic_thd": (BUDGET, False, True)}


def grouped_batch():
    from hybridflow.protocol import Batch

    g = torch.Generator().manual_seed(7)
    rows = len(RESPONSE_LENS)
    ids = torch.randint(3, 40, (rows, P + R), generator=g)
    mask = torch.zeros_like(ids)
    for i in range(rows):
        ids[i, :P] = ids[i // GROUP * GROUP, :P]  # the group's prompt
        mask[i, P - PROMPT_LENS[i // GROUP]:P] = 1
        mask[i, P:P + RESPONSE_LENS[i]] = 1
    ids = ids * mask
    rm = mask[:, P:]
    adv = torch.randn(rows, R, generator=g) * rm
    return Batch.from_dict(tensors=dict(
        input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0), responses=ids[:, P:],
        response_mask=rm, advantages=adv, ref_log_prob=(-3 + torch.randn(rows, R, generator=g)) * rm,
        values=torch.randn(rows, R, generator=g) * 0.1 * rm, returns=torch.randn(rows, R, generator=g) * rm))


def _critic_state(state, cfg):
    return {**state, "score.weight": torch.randn(1, cfg.hidden_size, generator=torch.Generator().manual_seed(2)) * 0.5}


def _rank_fn(rank, world, hf_dir, tp, pp, cp=1):
    from megatron.core import parallel_state as ps

    from hybridflow.config.schema import Actor, Critic
    from hybridflow.megatron import parallel
    from hybridflow.megatron.role import MegatronRole, ModelBuild, OptimSettings
    from hybridflow.protocol import Batch
    from hybridflow.workers import role_ops, row_layout
    from hybridflow.workers.common import load_hf_folder

    parallel.init_model_parallel(tp, pp, seed=1, cp=cp)
    cfg, state = load_hf_folder(hf_dir)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    shard = grouped_batch().chunk(dp)[dp_rank]
    rows = len(shard) * dp
    out = {"dp_rank": dp_rank, "last": ps.is_pipeline_last_stage(), "tp_rank": ps.get_tensor_model_parallel_rank(),
           "cp_rank": ps.get_context_parallel_rank()}
    for mode, (micro, shared, thd) in MODES.items():
        if thd and cp == 1:
            continue
        dynamic = micro == BUDGET
        budget = row_layout.TokenBudget(BUDGET, "test") if dynamic else micro
        optim = OptimSettings(lr=1e-2, eps=1e-3, clip_grad=1e9)  # the gradient itself is compared
        policy = MegatronRole(cfg, state, ModelBuild(sequence_parallel=tp > 1), optim=optim)
        critic = MegatronRole(cfg, _critic_state(state, cfg), ModelBuild(value_head=True, sequence_parallel=tp > 1),
                              optim=optim)
        policy.shares_prompts = critic.shares_prompts = shared
        policy.packs_sequences = critic.packs_sequences = thd
        lp = role_ops.log_probs(policy, shard, budget, with_entropy=True)
        values = role_ops.values(critic, shard, budget)
        # the fixed run's log-probs off by +-0.3 are every mode's old ones: ratios on both sides of the clip
        # range (stages before the last compute no loss: zeros there)
        old = out["fixed"]["lp"]["log_probs"] if dynamic else lp["log_probs"]
        adv = shard.tensors["advantages"]
        old = (torch.zeros_like(adv) if old is None else old) - 0.3 * adv.sign()
        batch = Batch(tensors={**shard.tensors, "old_log_probs": old})
        common = dict(ppo_mini_batch_size=rows, ppo_epochs=1, use_dynamic_bsz=dynamic, ppo_max_token_len_per_gpu=BUDGET,
                      ppo_micro_batch_size_per_gpu=micro if not dynamic else 1)
        actor_cfg = Actor(**common, use_kl_loss=True, kl_loss_coef=0.1, entropy_coeff=0.05)
        critic_cfg = Critic(**common)
        am = role_ops.update_policy(policy, batch, actor_cfg, dp)
        cm = role_ops.update_value(critic, batch, critic_cfg, dp)
        n_mbs = len(role_ops.micro_batches_of(policy, shard, budget)[0])
        own = row_layout.micro_batch_count(shard, budget, shared) if dynamic else n_mbs
        out[mode] = dict(
            lp=lp, values=values, n_mbs=n_mbs, own=own, metrics={**am, **cm},
            actor_grads={n: p.main_grad.detach().clone() for n, p in policy.module.named_parameters()},
            critic_grads={n: p.main_grad.detach().clone() for n, p in critic.module.named_parameters()})
    return out


def _moe_rank_fn(rank, world, moe_dir):
    """EP 2 (= DP 2): rank 0 holds the 8 longest rows, needing more micro-batches than rank 1's 8 shortest;
    fixed micro-batches of 1 row are the reference."""
    from megatron.core import parallel_state as ps

    from hybridflow.config.schema import Actor
    from hybridflow.megatron import parallel
    from hybridflow.megatron.role import MegatronRole, OptimSettings
    from hybridflow.protocol import Batch
    from hybridflow.workers import role_ops, row_layout
    from hybridflow.workers.common import load_hf_folder

    parallel.init_model_parallel(1, 1, seed=1, ep=2, etp=1)
    cfg, state = load_hf_folder(moe_dir)
    full, dp_rank = grouped_batch(), ps.get_data_parallel_rank()
    lengths = full.tensors["attention_mask"].sum(1)
    by_length = torch.argsort(lengths, descending=True, stable=True)
    shard = full[(by_length[:8] if dp_rank == 0 else by_length[8:]).sort().values.numpy()]
    old = -1.0 - 0.3 * shard.tensors["advantages"].sign()
    batch = Batch(tensors={**shard.tensors, "old_log_probs": old * shard.tensors["response_mask"]})
    out = {"dp_rank": dp_rank}
    for mode in ("fixed", "dynamic"):
        dynamic = mode == "dynamic"
        budget = row_layout.TokenBudget(BUDGET, "test") if dynamic else 1
        policy = MegatronRole(cfg, state, optim=OptimSettings(lr=1e-2, eps=1e-3, clip_grad=1e9))
        policy.shares_prompts = True  # GRPO groups as units, cut into rows where the count needs it
        lp = role_ops.log_probs(policy, shard, budget)["log_probs"]
        actor = Actor(ppo_mini_batch_size=len(shard), ppo_epochs=1, use_dynamic_bsz=dynamic,
                      ppo_max_token_len_per_gpu=BUDGET, ppo_micro_batch_size_per_gpu=1)
        metrics = role_ops.update_policy(policy, batch, actor, 1)  # one mini-batch: the shard
        out[mode] = dict(lp=lp, loss=metrics["actor/pg_loss"], n_mbs=len(role_ops.micro_batches_of(policy, shard, budget)[0]),
                         own=row_layout.micro_batch_count(shard, budget, True) if dynamic else len(shard),
                         grads={n: p.main_grad.detach().clone() for n, p in policy.module.named_parameters()})
    return out


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from hybridflow.models.char_tokenizer import build_char_tokenizer
    from hybridflow.models.tiny_arch import build_tiny

    root = tmp_path_factory.mktemp("dynbsz_moe")
    build_tiny(root, build_char_tokenizer(root), "qwen3_moe", seed=12)
    return str(root)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """{case: folder} of the models packed on one rank besides the Qwen2: Mistral with a 3-position window, GLM-4.5
    (half-rotary heads at each packed row's positions, routed and shared experts), gpt-oss (sinks with a window on
    every other layer, YaRN at each packed row's positions), DeepSeek-V3 (each MLA layer's own YaRN table at each
    packed row's positions)."""
    from hybridflow.models.char_tokenizer import build_char_tokenizer
    from hybridflow.models.tiny_arch import build_tiny

    root = tmp_path_factory.mktemp("dynbsz_models")
    build_tiny(root / "window", build_char_tokenizer(root / "window"), "mistral", sliding_window=3, seed=13)
    build_tiny(root / "glm4_moe", build_char_tokenizer(root / "glm4_moe"), "glm4_moe", seed=13)
    build_tiny(root / "gpt_oss", build_char_tokenizer(root / "gpt_oss"), "gpt_oss", seed=13)
    build_tiny(root / "deepseek_v3", build_char_tokenizer(root / "deepseek_v3"), "deepseek_v3", seed=13)
    return {case: str(root / case) for case in PACKED_MODELS}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from hybridflow.models.char_tokenizer import build_char_tokenizer
    from hybridflow.models.tiny_qwen2 import build_tiny_qwen2

    root = tmp_path_factory.mktemp("dynbsz")
    build_tiny_qwen2(root, build_char_tokenizer(root), hidden_size=64, num_layers=2, seed=11)
    return str(root)


# (tp, pp, dp, cp): context parallel 2 also against the single rank (packed rows split over the CP ranks)
LAYOUTS = [(1, 1, 1, 1), (1, 1, 2, 1), (2, 1, 1, 1), (2, 1, 2, 1), (1, 2, 1, 1), (1, 1, 1, 2)]
IDS = [f"tp{t}_pp{p}_dp{d}" + (f"_cp{c}" if c > 1 else "") for t, p, d, c in LAYOUTS]
ENTROPY_TP = [1, 2]
PACKED_MODELS = ("window", "glm4_moe", "gpt_oss", "deepseek_v3")


@pytest.fixture(scope="module")
def case_results(hf_dir, moe_dir, model_dirs):
    cases = {i: (t * p * d * c, (_rank_fn, hf_dir, t, p, c)) for i, (t, p, d, c) in zip(IDS, LAYOUTS)}
    cases["moe_ep2"] = (2, (_moe_rank_fn, moe_dir))
    cases.update({case: (1, (_rank_fn, model_dirs[case], 1, 1)) for case in PACKED_MODELS})
    cases.update({f"entropy_tp{tp}": (tp, (_entropy_rank_fn, hf_dir, tp)) for tp in ENTROPY_TP})
    return batched_worlds(one_case, cases)


@pytest.mark.parametrize("tp,pp,dp,cp", LAYOUTS, ids=IDS)
def test_dynamic_bsz_equals_fixed_micro_batches(case_results, tp, pp, dp, cp):
    results = case_results(IDS[LAYOUTS.index((tp, pp, dp, cp))])
    counts, own = {}, {}
    for r in results:
        fixed = r["fixed"]
        for mode in ("dynamic", "dynamic_shared", "dynamic_thd")[:3 if cp > 1 else 2]:
            got, where = r[mode], f"{mode} dp_rank {r['dp_rank']} tp_rank {r['tp_rank']} cp_rank {r['cp_rank']}"
            # another attention layout (packed rows) and summation order, within fp32 rounding: measured at
            # under 0.04 of this tolerance
            _assert_same_run(got, fixed, where, outputs=r["last"])
            counts.setdefault(mode, set()).add(got["n_mbs"])
            own.setdefault(mode, set()).add(got["own"])
            m = got["metrics"]
            assert m["perf/actor_update/computed_tokens"] <= m["perf/actor_update/real_tokens"] + 2 * got["n_mbs"]
            if mode == "dynamic_shared":  # a group's prompt computed once
                assert m["perf/actor_update/computed_tokens"] < m["perf/actor_update/real_tokens"]
        if cp == 1:  # under CP a rank computes its part of each row
            m = fixed["metrics"]
            assert m["perf/actor_update/computed_tokens"] > m["perf/actor_update/real_tokens"]
    assert max(max(c) for c in counts.values()) > 1  # the budget did split the rows
    for mode, c in counts.items():  # every rank ran the count of the rank that needed the most
        assert c == {max(own[mode])}, (mode, c, own[mode])
    if dp > 1:  # data-parallel ranks alone would have run different numbers of micro-batches
        assert any(len(c) > 1 for c in own.values())
    g = results[0]["fixed"]["actor_grads"]
    assert max(v.abs().max().item() for v in g.values()) > 1e-4  # a real gradient was compared


@pytest.mark.parametrize("case", PACKED_MODELS)
def test_a_windowed_model_glm_and_gpt_oss_pack_exactly(case_results, case):
    """Token-budget micro-batches of a sliding-window model, of GLM-4.5 and of gpt-oss, with and without shared
    prompts, equal their fixed run."""
    (r,) = case_results(case)
    for mode in ("dynamic", "dynamic_shared"):
        assert r[mode]["n_mbs"] > 1
        _assert_same_run(r[mode], r["fixed"], f"{case} {mode}")


def test_context_parallel_equals_the_single_rank_in_every_batching(case_results):
    """CP 2 (each rank two of four chunks of every (packed) row, attention over the gathered K/V) against CP 1:
    the same log-probs, entropy, values, losses and (all-reduced) gradients, with fixed micro-batches and with
    token-budget packing, prompts shared or not, and in the GPU's packed-sequence (THD) layout: each sequence
    split into its own chunks, as Transformer Engine partitions it."""
    one = case_results("tp1_pp1_dp1")[0]
    for r in case_results("tp1_pp1_dp1_cp2"):
        for mode in MODES:  # the THD layout too
            _assert_same_run(r[mode], one.get(mode, one["fixed"]), f"{mode} cp_rank {r['cp_rank']}")


def _assert_same_run(got: dict, ref: dict, where: str, outputs: bool = True) -> None:
    """Log-probs, entropy, values and losses (where the rank has ``outputs``) and both gradients equal ``ref``'s."""
    if outputs:
        for key in ("log_probs", "entropy"):
            assert_close(got["lp"][key], ref["lp"][key], what=f"{where}: {key}")
        assert_close(got["values"], ref["values"], what=f"{where}: values")
        for key in ("actor/pg_loss", "actor/entropy_loss", "actor/kl_loss", "critic/vf_loss"):
            assert_close(got["metrics"][key], ref["metrics"][key], what=f"{where}: {key}")
    assert_close(got["actor_grads"], ref["actor_grads"], what=f"{where}: actor gradient")
    assert_close(got["critic_grads"], ref["critic_grads"], what=f"{where}: critic gradient")


def test_expert_parallel_ranks_agree_on_the_micro_batch_count(case_results):
    """Without the agreed count the ranks' all-to-alls go out of step and the world hangs (until the test's
    timeout); with it every rank runs the largest count and the results equal the fixed micro-batch run's."""
    results = case_results("moe_ep2")
    own = {r["dp_rank"]: r["dynamic"]["own"] for r in results}
    assert own[0] > own[1], own  # the ranks alone would run different counts
    for r in results:
        got, ref, where = r["dynamic"], r["fixed"], f"dp_rank {r['dp_rank']}"
        assert got["n_mbs"] == max(own.values()), (where, got["n_mbs"], own)
        assert_close(got["lp"], ref["lp"], what=f"{where}: log-probs")
        assert_close(got["loss"], ref["loss"], what=f"{where}: pg_loss")
        assert_close(got["grads"], ref["grads"], what=f"{where}: gradient")
    assert max(v.abs().max().item() for v in results[0]["fixed"]["grads"].values()) > 1e-4


def _entropy_rank_fn(rank, world, hf_dir, tp):
    from hybridflow.config.schema import Actor
    from hybridflow.megatron import convert, parallel
    from hybridflow.megatron.role import MegatronRole, ModelBuild, OptimSettings
    from hybridflow.protocol import Batch
    from hybridflow.workers import role_ops
    from hybridflow.workers.common import load_hf_folder

    parallel.init_model_parallel(tp, 1, seed=1)
    cfg, state = load_hf_folder(hf_dir)
    shard = grouped_batch()
    policy = MegatronRole(cfg, state, ModelBuild(sequence_parallel=tp > 1), optim=OptimSettings(lr=1e-2, clip_grad=1e9))
    # zero advantages and no KL: the policy loss has no gradient, the step's is the entropy bonus's alone
    batch = Batch(tensors={**shard.tensors, "advantages": torch.zeros_like(shard.tensors["advantages"])})
    # at TP 2 the entropy is computed 3 response tokens at a time (actor.entropy_from_logits_with_chunking)
    chunking = dict(entropy_from_logits_with_chunking=True, entropy_from_logits_chunk_size=3) if tp > 1 else {}
    actor = Actor(ppo_mini_batch_size=len(batch), ppo_micro_batch_size_per_gpu=5, ppo_epochs=1, entropy_coeff=1.0,
                  **chunking)
    whole, chunked = (role_ops.log_probs(policy, batch, 5, with_entropy=True, entropy_chunk=c)["entropy"]
                      for c in (None, 3))
    metrics = role_ops.update_policy(policy, batch, actor, 1)
    grads = {n: p.main_grad.detach().clone() for n, p in policy.module.named_parameters()}

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float64)
    t = shard.tensors
    logits = hf(input_ids=t["input_ids"], attention_mask=t["attention_mask"],
                position_ids=t["position_ids"]).logits[:, P - 1:P - 1 + R]
    entropy = torch.logsumexp(logits, -1) - (logits.softmax(-1) * logits).sum(-1)
    mask = t["response_mask"].double()
    mean_entropy = (entropy * mask).sum() / mask.sum()  # token-mean
    (-mean_entropy).backward()
    hf_grads = convert.hf_to_megatron({n: p.grad for n, p in hf.named_parameters()}, cfg, policy.shard)
    return dict(grads=grads, hf_grads={n: hf_grads[n] for n in grads}, entropy=metrics["actor/entropy_loss"],
                hf_entropy=mean_entropy.item(), whole=whole, chunked=chunked)


@pytest.mark.parametrize("tp", ENTROPY_TP)
def test_entropy_bonus_gradient_equals_hf_float64(case_results, tp):
    for r in case_results(f"entropy_tp{tp}"):
        # HF's unfused kernels in float64 against megatron's fp32: 10x the same-kernel tolerance
        assert_close(r["entropy"], r["hf_entropy"], slack=10, what=f"tp{tp}: entropy (token-mean)")
        assert_close(r["grads"], r["hf_grads"], slack=10, what=f"tp{tp}: gradient of -entropy")
        assert max(v.abs().max().item() for v in r["hf_grads"].values()) > 1e-4
        if r["whole"] is not None:  # the last stage: entropy 3 tokens at a time is the same entropy
            assert_close(r["chunked"], r["whole"], what=f"tp{tp}: entropy 3 tokens at a time")
