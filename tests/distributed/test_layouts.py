"""Every megatron layout (TP x PP x DP, sequence parallel when TP > 1) reproduces the single-rank run.

On a fixed rollout-like batch: actor log-probs (vs single rank within fp32 rounding, vs HF transformers within
10x that: other kernels), critic values, one PPO policy update and one value update (gathered weights), and export to
a HF folder then re-import into the same layout is bit-identical.

All layouts of one world size run in one spawned world (starting processes dominates these tests), one after
another (tests/distributed/batched.py), each case torn down by ``one_case`` below, which test_model_archs.py,
test_dynamic_bsz.py and test_shared_prompt_rows.py use too.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.batched import batched_worlds, one_case
from tests.numerics import assert_close

pytestmark = pytest.mark.distributed

# (t, p, d, c, v): context parallel (c) with TP, the mask of its CPU attention built from the causal one; virtual
# pipeline stages (v: megatron's interleaved schedule, 4 layers as chunks of one on 2 stages)
LAYOUTS = [(1, 1, 1, 1, 1), (2, 1, 1, 1, 1), (1, 2, 1, 1, 1), (1, 1, 2, 1, 1), (2, 2, 1, 1, 1), (2, 1, 2, 1, 1),
           (1, 2, 2, 1, 1), (1, 1, 1, 2, 1), (2, 1, 1, 2, 1), (1, 2, 1, 1, 2), (1, 2, 2, 1, 2)]
IDS = [f"tp{t}_pp{p}_dp{d}" + (f"_cp{c}" if c > 1 else "") + (f"_vpp{v}" if v > 1 else "") for t, p, d, c, v in LAYOUTS]
# id -> (layout, num_layers_in_last_pipeline_stage): uneven stages (plan/stages.py), the 4 layers as 3 + 1
CASES = {**{i: (layout, None) for i, layout in zip(IDS, LAYOUTS)}, "tp1_pp2_dp2_last1": ((1, 2, 2, 1, 1), 1)}
P, R, B = 10, 5, 8  # prompt width, response width, rows


def rollout_batch():
    """A fixed batch shaped like a rollout: left-padded prompts, right-padded responses, PPO inputs."""
    from hybridflow.protocol import Batch

    g = torch.Generator().manual_seed(0)
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    for i in range(B):
        prompt_mask[i, : i % 4] = 0
    resp_mask = torch.ones(B, R, dtype=torch.long)
    for i in range(B):
        resp_mask[i, R - i % 3:] = 0
    mask = torch.cat([prompt_mask, resp_mask], 1)
    return Batch.from_dict(tensors={
        "input_ids": torch.randint(3, 50, (B, P + R), generator=g) * mask,
        "attention_mask": mask,
        "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
        "responses": torch.zeros(B, R, dtype=torch.long),
        "response_mask": resp_mask,
        "old_log_probs": -torch.rand(B, R, generator=g) * 4,
        "advantages": torch.randn(B, R, generator=g),
        "values": torch.randn(B, R, generator=g) * 0.1,
        "returns": torch.randn(B, R, generator=g),
    })


def _settings():
    from hybridflow.config.schema import Actor, Critic, Optim

    actor = Actor(optim=Optim(lr=1e-3), ppo_mini_batch_size=B, ppo_micro_batch_size_per_gpu=2, clip_ratio_low=0.2)
    critic = Critic(optim=Optim(lr=1e-3), ppo_mini_batch_size=B, ppo_micro_batch_size_per_gpu=2, ppo_epochs=1,
                    use_dynamic_bsz=False)
    return actor, critic


def _rank_fn(rank, world, hf_dir, tp, pp, cp=1, vpp=1, last=None):
    from megatron.core import parallel_state as ps

    from hybridflow.megatron import convert, parallel
    from hybridflow.megatron.role import MegatronRole, ModelBuild, OptimSettings
    from hybridflow.workers import role_ops
    from hybridflow.workers.common import load_hf_folder
    from hybridflow.workers.export import save_hf_folder

    parallel.init_model_parallel(tp, pp, seed=1, cp=cp, vpp=vpp)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    cfg, state = load_hf_folder(f"{hf_dir}/policy")
    _, critic_state = load_hf_folder(f"{hf_dir}/critic")
    actor_cfg, critic_cfg = _settings()
    # Adam's first step is ~lr*sign(g): a large eps keeps it smooth in g, so summation-order noise
    # between layouts stays noise instead of flipping the sign of near-zero gradients.
    optim = OptimSettings(lr=1e-3, eps=1e-3, use_distributed_optimizer=dp > 1)
    seq_parallel, stages = tp > 1, {"num_layers_in_last_pipeline_stage": last} if last else None
    actor = MegatronRole(cfg, state, ModelBuild(sequence_parallel=seq_parallel, transformer_overrides=stages),
                         optim=optim)
    critic = MegatronRole(cfg, critic_state, ModelBuild(value_head=True, sequence_parallel=seq_parallel,
                                                        transformer_overrides=stages), optim=optim)
    assert last is None or actor.shard.layers(4) == ([0, 1, 2] if actor.shard.pp_rank == 0 else [3])
    shard = rollout_batch().chunk(dp)[dp_rank]

    out = {"dp_rank": dp_rank, "collect": parallel.dispatch_info()["collect"]}
    lp = role_ops.log_probs(actor, shard, 2, with_entropy=True)
    out.update(log_probs=lp["log_probs"], entropy=lp["entropy"], values=role_ops.values(critic, shard, 2))
    out["actor_metrics"] = role_ops.update_policy(actor, shard, actor_cfg, dp)
    out["critic_metrics"] = role_ops.update_value(critic, shard, critic_cfg, dp)
    actor_hf = {k: v.clone() for k, v in actor.hf_state_dict().items()}
    critic_hf = {k: v.clone() for k, v in critic.hf_state_dict().items()}

    # Export to a HF folder and convert back into this rank's shard: must be bit-identical.
    export_dir = f"{hf_dir}/export_{tp}{pp}{dp}{cp}{vpp}{last}"
    if rank == 0:
        save_hf_folder(export_dir, cfg, actor_hf)
    torch.distributed.barrier()
    _, reloaded = load_hf_folder(export_dir)
    local = {k: v for k, v in actor.module.state_dict().items() if not k.endswith("_extra_state")}
    again = convert.hf_to_megatron(reloaded, cfg, actor.shard)
    out["reimport_identical"] = set(again) <= set(local) and all(torch.equal(again[k], local[k]) for k in again)
    if rank == 0:
        out.update(actor_hf=actor_hf, critic_hf=critic_hf)
    return out


def _merged(results, d):
    collected = sorted((r for r in results if r["collect"]), key=lambda r: r["dp_rank"])
    assert [r["dp_rank"] for r in collected] == list(range(d))
    merged = {k: torch.cat([r[k] for r in collected]) for k in ("log_probs", "entropy", "values")}
    merged.update(actor_hf=results[0]["actor_hf"], critic_hf=results[0]["critic_hf"],
                  reimport=[r["reimport_identical"] for r in results],
                  actor_loss=sum(r["actor_metrics"]["actor/pg_loss"] for r in collected) / d)
    return merged


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from hybridflow.models.tiny_qwen2 import build_tiny_qwen2
    from hybridflow.models.char_tokenizer import build_char_tokenizer
    from hybridflow.workers.common import load_hf_folder
    from hybridflow.workers.export import save_hf_folder

    root = tmp_path_factory.mktemp("layouts")
    tok = build_char_tokenizer(root / "policy")
    build_tiny_qwen2(root / "policy", tok, hidden_size=64, num_layers=4, seed=5)
    cfg, state = load_hf_folder(str(root / "policy"))
    state["score.weight"] = torch.randn(1, cfg.hidden_size, generator=torch.Generator().manual_seed(1)) * 0.5
    save_hf_folder(str(root / "critic"), cfg, state)
    return str(root)


@pytest.fixture(scope="module")
def layout_results(hf_dir):
    return batched_worlds(one_case, {i: (t * p * d * c, (_rank_fn, hf_dir, t, p, c, v, last))
                                     for i, ((t, p, d, c, v), last) in CASES.items()})


@pytest.fixture(scope="module")
def single_rank(layout_results):
    return _merged(layout_results(IDS[0]), 1)


@pytest.fixture(scope="module")
def hf_log_probs(hf_dir):
    """Response-token log-probs from Hugging Face transformers on the full batch."""
    from transformers import AutoModelForCausalLM

    t = rollout_batch().tensors
    model = AutoModelForCausalLM.from_pretrained(f"{hf_dir}/policy", dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=t["input_ids"], attention_mask=t["attention_mask"],
                       position_ids=t["position_ids"]).logits[:, P - 1:P - 1 + R]
    return torch.log_softmax(logits, -1).gather(-1, t["input_ids"][:, P:, None])[..., 0]


def test_single_rank_matches_hf(hf_dir, single_rank, hf_log_probs):
    valid = rollout_batch().tensors["response_mask"].bool()
    # HF's unfused q/k/v and its own attention kernels: 10x the same-kernel tolerance.
    assert_close(single_rank["log_probs"][valid], hf_log_probs[valid], slack=10, what="log-probs vs HF")
    assert all(single_rank["reimport"])
    from hybridflow.workers.common import load_hf_folder

    _, initial = load_hf_folder(f"{hf_dir}/policy")
    moved = max((single_rank["actor_hf"][k] - initial[k]).abs().max().item() for k in initial)
    assert moved > 1e-4, "the PPO update did not change the actor"


@pytest.mark.parametrize("case", list(CASES)[1:])
def test_layout_reproduces_single_rank(layout_results, single_rank, hf_log_probs, case):
    got = _merged(layout_results(case), CASES[case][0][2])
    valid = rollout_batch().tensors["response_mask"].bool()
    assert_close(got["log_probs"][valid], hf_log_probs[valid], slack=10, what="log-probs vs HF")
    for key in ("log_probs", "entropy", "values"):
        assert_close(got[key][valid], single_rank[key][valid], what=key)
    for role in ("actor_hf", "critic_hf"):
        assert_close(got[role], single_rank[role], what=f"{role} weights after one update")
    assert all(got["reimport"]), "export -> re-import is not bit-identical on some rank"
    assert_close(got["actor_loss"], single_rank["actor_loss"], what="actor loss")
