"""On-policy distillation's megatron side (workers/teachers.py, role_ops.update_policy with a distillation loss):
two teachers at the actor's layout, each row scored by the teacher its data_source names, equal Hugging Face's
forward of that teacher at TP 2, PP 2 and DP 2 (where one data-parallel rank holds no row of one teacher); a few
supervised k3 updates (distillation only) bring the student closer to its teachers, the same at every layout."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.distributed.batched import batched_worlds, one_case
from tests.numerics import assert_close

pytestmark = pytest.mark.distributed

P, R, B = 8, 5, 8
K = 4  # forward_kl_topk's k
KEYS = np.array(["a", "b", "a", "b", "b", "b", "b", "b"], dtype=object)  # DP 2: the second rank has no "a" row
CASES = {"tp2": (2, 1), "pp2": (1, 2), "dp2": (1, 1)}
UPDATES = 3


def batch():
    from hybridflow.protocol import Batch

    g = torch.Generator().manual_seed(0)
    mask = torch.ones(B, P + R, dtype=torch.long)
    for i in range(B):
        mask[i, : i % 3] = 0
        mask[i, P + R - i % 2:] = 0
    ids = torch.randint(3, 40, (B, P + R), generator=g) * mask
    return Batch.from_dict(tensors={
        "input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
        "responses": ids[:, P:], "response_mask": mask[:, P:],
        "old_log_probs": -torch.rand(B, R, generator=g), "advantages": torch.zeros(B, R),
    }, non_tensors={"data_source": KEYS.copy()})


def _rank_fn(rank, world, root, tp, pp):
    from megatron.core import parallel_state as ps

    from hybridflow.config.schema import Actor, DistillationLoss, Megatron, Optim
    from hybridflow.megatron import parallel
    from hybridflow.megatron.role import MegatronRole, ModelBuild, OptimSettings
    from hybridflow.protocol import Batch
    from hybridflow.workers import role_ops
    from hybridflow.workers.common import load_hf_folder
    from hybridflow.workers.teachers import Teachers

    parallel.init_model_parallel(tp, pp, seed=1)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    actor_cfg = Actor(optim=Optim(lr=1e-2), ppo_mini_batch_size=B, ppo_micro_batch_size_per_gpu=2,
                      megatron=Megatron(dtype="float32", sequence_parallel=tp > 1))
    spec = SimpleNamespace(process=SimpleNamespace(trust_remote_code=False), actor=actor_cfg,
                           teachers={"a": f"{root}/teacher_a", "b": f"{root}/teacher_b"}, teacher_key="data_source")
    teachers = Teachers(spec)
    cfg, state = load_hf_folder(f"{root}/student")
    student = MegatronRole(cfg, state, ModelBuild(sequence_parallel=tp > 1),
                           optim=OptimSettings(lr=1e-2, eps=1e-3, use_distributed_optimizer=dp > 1))
    shard = batch().chunk(dp)[dp_rank]
    scores = teachers.scores(shard, 2)  # None off the last pipeline stage, whose loss alone reads it
    lp = None if scores is None else scores["teacher_log_probs"]
    out = {"dp_rank": dp_rank, "collect": parallel.dispatch_info()["collect"], "teacher": lp,
           "before": role_ops.log_probs(student, shard, 2)["log_probs"]}
    shard = shard.union(Batch.from_dict(tensors={"teacher_log_probs": torch.zeros(len(shard), R) if lp is None else lp}))
    distill = DistillationLoss(loss_mode="k3", use_policy_gradient=False, use_task_rewards=False)
    out["metrics"] = [role_ops.update_policy(student, shard, actor_cfg, dp, distillation=distill) for _ in range(UPDATES)]
    out["after"] = role_ops.log_probs(student, shard, 2)["log_probs"]
    out.update(_topk_side(teachers, cfg, state, shard, actor_cfg, dp, tp > 1))
    return out


def _topk_side(teachers, cfg, state, shard, actor_cfg, dp: int, sequence_parallel: bool) -> dict:
    """forward_kl_topk: the teachers' top-k, a fresh student's forward KL to it before any update (workers/topk_ops.py),
    and supervised updates on it."""
    from hybridflow.config.schema import DistillationLoss
    from hybridflow.megatron.role import MegatronRole, ModelBuild, OptimSettings
    from hybridflow.protocol import Batch
    from hybridflow.workers import role_ops
    from hybridflow.workers.topk_ops import student_topk_kl

    scores = teachers.scores(shard, 2, topk=K)
    zeros = {"teacher_topk_log_probs": torch.zeros(len(shard), R, K), "teacher_topk_ids": torch.zeros(len(shard), R, K,
                                                                                                        dtype=torch.int64)}
    shard = shard.union(Batch.from_dict(tensors=zeros if scores is None else scores))
    student = MegatronRole(cfg, state, ModelBuild(sequence_parallel=sequence_parallel),
                           optim=OptimSettings(lr=3e-3, eps=1e-3, use_distributed_optimizer=dp > 1))
    keys = ("teacher_topk_log_probs", "teacher_topk_ids")
    mbs, order = role_ops.micro_batches_of(student, shard, 2, keys)
    def kl(mb, logits):
        return {"kl": role_ops.zero_past_end(student_topk_kl(role_ops.picked(logits, mb), mb, None)["losses"], mb)}

    outs = student.forward(mbs, kl)
    distill = DistillationLoss(loss_mode="forward_kl_topk", topk=K, use_policy_gradient=False, use_task_rewards=False)
    return {"topk": scores, "topk_kl": role_ops.gathered(outs, "kl", order),
            "topk_metrics": [role_ops.update_policy(student, shard, actor_cfg, dp, distillation=distill) for _ in range(UPDATES)]}


def _merged(results, key):
    collected = sorted((r for r in results if r["collect"]), key=lambda r: r["dp_rank"])
    return torch.cat([r[key] for r in collected])


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    from hybridflow.models.char_tokenizer import build_char_tokenizer
    from hybridflow.models.tiny_qwen2 import build_tiny_qwen2

    root = tmp_path_factory.mktemp("distill")
    for name, seed in (("student", 5), ("teacher_a", 6), ("teacher_b", 7)):
        build_tiny_qwen2(root / name, build_char_tokenizer(root / name), hidden_size=64, num_layers=2, seed=seed)
    return str(root)


@pytest.fixture(scope="module")
def results(root):
    return batched_worlds(one_case, {case: (2, (_rank_fn, root, tp, pp)) for case, (tp, pp) in CASES.items()})


def _hf_log_probs(path: str) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    t = batch().tensors
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=t["input_ids"], attention_mask=t["attention_mask"],
                       position_ids=t["position_ids"]).logits[:, P - 1:P - 1 + R]
    return torch.log_softmax(logits, -1).gather(-1, t["input_ids"][:, P:, None])[..., 0]


@pytest.fixture(scope="module")
def hf_teachers(root):
    """Each row's own teacher's log-probs by Hugging Face transformers."""
    a, b = _hf_log_probs(f"{root}/teacher_a"), _hf_log_probs(f"{root}/teacher_b")
    return torch.where(torch.as_tensor(KEYS == "a")[:, None], a, b)


@pytest.mark.parametrize("case", list(CASES))
def test_each_row_is_scored_by_its_teacher(results, hf_teachers, case):
    got = _merged(results(case), "teacher")
    valid = batch().tensors["response_mask"].bool()
    assert_close(got[valid], hf_teachers[valid], slack=10, what=f"teacher log-probs at {case} vs HF")


def test_distillation_updates_move_the_student_to_its_teachers_alike_at_every_layout(results, hf_teachers):
    from hybridflow.algorithms.kl import kl_penalty

    valid = batch().tensors["response_mask"].bool()
    after = {}
    for case in CASES:
        r = results(case)
        before, after[case] = _merged(r, "before"), _merged(r, "after")
        k3 = {name: kl_penalty(x, hf_teachers, "k3")[valid].mean().item() for name, x in
              (("before", before), ("after", after[case]))}
        assert k3["after"] < 0.8 * k3["before"], (case, k3)
        losses = [m["actor/distillation/loss"] for rank in r for m in rank["metrics"] if "actor/distillation/loss" in m]
        assert len(losses) >= UPDATES and all(x > 0 for x in losses), (case, losses)  # the last stage's
    for case in list(CASES)[1:]:
        assert_close(after[case][valid], after["tp2"][valid], slack=100, what=f"student after updates, {case} vs tp2")


def _hf_logits(path: str) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    t = batch().tensors
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=t["input_ids"], attention_mask=t["attention_mask"],
                     position_ids=t["position_ids"]).logits[:, P - 1:P - 1 + R]


@pytest.mark.parametrize("case", list(CASES))
def test_forward_kl_topk_at_every_layout_equals_the_full_vocabulary_function(results, root, case):
    """The teachers' top-k over the vocabulary split by TP equal HF's; the student's forward KL to them from its own
    vocabulary shard equals algorithms/distillation.forward_kl_topk on HF's whole logits; supervised updates on it
    lower it."""
    from hybridflow.algorithms.distillation import forward_kl_topk

    r = results(case)
    collected = sorted((x for x in r if x["collect"]), key=lambda x: x["dp_rank"])
    lp = torch.cat([x["topk"]["teacher_topk_log_probs"] for x in collected])
    ids = torch.cat([x["topk"]["teacher_topk_ids"] for x in collected])
    valid = batch().tensors["response_mask"].bool()
    teacher = torch.where(torch.as_tensor(KEYS == "a")[:, None, None], _hf_logits(f"{root}/teacher_a"),
                          _hf_logits(f"{root}/teacher_b"))
    want_lp, want_ids = torch.topk(torch.log_softmax(teacher, -1), K, dim=-1)
    assert_close(lp[valid], want_lp[valid], slack=10, what=f"teacher top-k log-probs at {case} vs HF")
    assert (ids[valid] == want_ids[valid]).float().mean() > 0.95, "teacher top-k ids differ from HF's"
    want_kl = forward_kl_topk(_hf_logits(f"{root}/student"), lp, ids, None)["losses"]
    assert_close(torch.cat([x["topk_kl"] for x in collected])[valid], want_kl[valid], slack=10,
                 what=f"student forward KL at {case} vs the full-vocabulary function")
    losses = [[m["actor/distillation/loss"] for m in x["topk_metrics"]] for x in r if "actor/distillation/loss" in x["topk_metrics"][0]]
    assert losses and all(run[-1] < run[0] for run in losses), losses
