"""Qwen3, Qwen3-MoE, Qwen2-MoE, GLM-4.5 and gpt-oss as megatron-core models at every (TP, PP, EP) layout that 4 gloo
processes allow, and Mistral with a sliding window shorter than the rows at every dense one: log-probs equal HF
transformers', one PPO update equals the single-rank one (gathered weights, experts included), and export ->
re-import is bit-identical on every rank.

All layouts of one world size run in one spawned world, one after another (tests/distributed/batched.py),
each torn down by test_layouts.one_case."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.batched import batched_worlds, one_case
from tests.distributed.moe_archs import runs_at
from tests.distributed.test_layouts import P, R, _settings, rollout_batch
from tests.numerics import assert_close

pytestmark = pytest.mark.distributed

# Mistral converts as Llama does (Llama at TP 1 and 2: test_rope_scaling.py); its own check: test_check_model.py
ARCHS = ("qwen3", "qwen3_moe", "qwen2_moe", "glm4_moe", "gpt_oss", "deepseek_v3")
WINDOWED = "mistral_window"  # every layer within 4 positions (rows of up to 15 tokens)
# (t, p, e); data parallel = e. TP 2 with EP 2 keeps the experts whole (expert TP 1): with both above 1,
# megatron's dispatcher all-gathers uneven token counts, which gloo cannot (plan.layout.ParallelLayout.check_experts).
LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 1, 2)]
IDS = [f"tp{t}_pp{p}_ep{e}" for t, p, e in LAYOUTS]


def archs_of(tp: int, ep: int) -> tuple[str, ...]:
    archs = tuple(a for a in ARCHS if runs_at(a, tp, ep))
    return archs + ((WINDOWED,) if ep == 1 else ())  # a dense model: expert parallelism changes nothing


def _rank_fn(rank, world, root, tp, pp, ep):
    from megatron.core import parallel_state as ps

    from hybridflow.megatron import convert, parallel
    from hybridflow.megatron.role import MegatronRole, ModelBuild, OptimSettings
    from hybridflow.workers import role_ops
    from hybridflow.workers.common import open_hf_folder
    from hybridflow.workers.export import save_hf_folder

    parallel.init_model_parallel(tp, pp, seed=1, ep=ep, etp=1 if ep > 1 else None)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    actor_cfg, _ = _settings()
    shard = rollout_batch().chunk(dp)[dp_rank]
    out = {"dp_rank": dp_rank, "collect": parallel.dispatch_info()["collect"]}
    for arch in archs_of(tp, ep):
        cfg, weights = open_hf_folder(f"{root}/{arch}")
        # Adam's first step is ~lr*sign(g): a large eps keeps it smooth in g (test_layouts.py).
        actor = MegatronRole(cfg, weights, ModelBuild(sequence_parallel=tp > 1),
                             optim=OptimSettings(lr=1e-3, eps=1e-3, use_distributed_optimizer=dp > 1))
        res = {"log_probs": role_ops.log_probs(actor, shard, 2)["log_probs"]}
        metrics = role_ops.update_policy(actor, shard, actor_cfg, dp)
        res["loss"] = metrics.get("actor/pg_loss", metrics)
        hf = {k: v.clone() for k, v in actor.hf_state_dict().items()}
        export_dir = f"{root}/export_{arch}_{tp}{pp}{ep}"
        if rank == 0:
            save_hf_folder(export_dir, cfg, hf)
            res["hf"] = hf
        torch.distributed.barrier()
        _, reloaded = open_hf_folder(export_dir)
        local = {k: v for k, v in actor.module.state_dict().items() if not k.endswith("_extra_state")}
        again = convert.hf_to_megatron(reloaded, cfg, actor.shard)
        res["reimport"] = set(again) == set(local) and all(torch.equal(again[k], local[k]) for k in again)
        out[arch] = res
    return out


def _merged(results):
    collected = sorted((r for r in results if r["collect"]), key=lambda r: r["dp_rank"])
    out = {}
    for arch in (a for a in (*ARCHS, WINDOWED) if a in results[0]):
        out[arch] = dict(log_probs=torch.cat([r[arch]["log_probs"] for r in collected]),
                         loss=sum(r[arch]["loss"] for r in collected) / len(collected),
                         hf=results[0][arch]["hf"], reimport=[r[arch]["reimport"] for r in results])
    return out


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    from hybridflow.models.char_tokenizer import build_char_tokenizer
    from hybridflow.models.tiny_arch import build_tiny, build_tiny_folders

    root = build_tiny_folders(tmp_path_factory.mktemp("archs"), ARCHS, seed=10)
    build_tiny(f"{root}/{WINDOWED}", build_char_tokenizer(f"{root}/{WINDOWED}"), "mistral", sliding_window=4, seed=20)
    return root


@pytest.fixture(scope="module")
def hf_log_probs(root):
    from transformers import AutoModelForCausalLM

    t = rollout_batch().tensors
    out = {}
    for arch in (*ARCHS, WINDOWED):
        model = AutoModelForCausalLM.from_pretrained(f"{root}/{arch}", dtype=torch.float32).eval()
        with torch.no_grad():
            logits = model(input_ids=t["input_ids"], attention_mask=t["attention_mask"],
                           position_ids=t["position_ids"]).logits[:, P - 1:P - 1 + R]
        out[arch] = torch.log_softmax(logits, -1).gather(-1, t["input_ids"][:, P:, None])[..., 0]
    return out


@pytest.fixture(scope="module")
def layout_results(root):
    return batched_worlds(one_case, {i: (t * p * e, (_rank_fn, root, t, p, e)) for i, (t, p, e) in zip(IDS, LAYOUTS)})


@pytest.fixture(scope="module")
def single_rank(layout_results):
    return _merged(layout_results(IDS[0]))


@pytest.mark.parametrize("t,p,e", LAYOUTS, ids=IDS)
def test_layout_matches_hf_and_the_single_rank_update(root, layout_results, hf_log_probs, single_rank, t, p, e):
    from hybridflow.workers.common import load_hf_folder

    got = single_rank if (t, p, e) == (1, 1, 1) else _merged(layout_results(IDS[LAYOUTS.index((t, p, e))]))
    valid = rollout_batch().tensors["response_mask"].bool()
    for arch in archs_of(t, e):
        mine = got[arch]
        # HF's unfused q/k/v, its own attention and expert kernels: 10x the same-kernel tolerance.
        assert_close(mine["log_probs"][valid], hf_log_probs[arch][valid], slack=10, what=f"{arch} log-probs vs HF")
        assert all(mine["reimport"]), f"{arch}: export -> re-import is not bit-identical on some rank"
        _, initial = load_hf_folder(f"{root}/{arch}")
        assert set(mine["hf"]) == set(initial), f"{arch}: exported names differ from the HF checkpoint's"
        if (t, p, e) == (1, 1, 1):
            moved = max((mine["hf"][k] - initial[k]).abs().max().item() for k in initial)
            assert moved > 1e-4, f"{arch}: the PPO update did not change the weights"
            continue
        ref = single_rank[arch]
        assert_close(mine["log_probs"][valid], ref["log_probs"][valid], what=f"{arch} log-probs vs single rank")
        assert_close(mine["loss"], ref["loss"], what=f"{arch} policy loss")
        assert_close(mine["hf"], ref["hf"], what=f"{arch} weights after one update")
