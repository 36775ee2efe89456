"""The colocated actor + rollout + reference worker: one process per device.

The actor (megatron-core, trained), the reference (megatron-core, frozen) and the vLLM rollout engine
share the process and its device in phases, as the paper's hybrid engine intends: vLLM sleeps outside
generation (GPU), the actor and reference go to host memory while idle when the offload keys say so, and
the driver pushes the actor's weights into vLLM in place (``sync_weights``) after every update.
"""

from __future__ import annotations

import time

import torch

from hybridflow import device
from hybridflow.controller import Dispatch, Worker, register
from hybridflow.megatron import parallel
from hybridflow.megatron.role import MegatronRole
from hybridflow.protocol import Batch
from hybridflow.resharding.plan import HybridPlan, Layout
from hybridflow.resharding.transition import Resharder, TransitionStats
from hybridflow.resharding.vllm_layout import to_checkpoint_names
from hybridflow.rollout.vllm_rollout import VLLMRollout
from hybridflow.workers import role_ops
from hybridflow.workers.common import (init_megatron_worker, load_role_checkpoint, offload_settings, optim_settings,
                                       ref_offload_settings, save_role_checkpoint)
from hybridflow.workers.export import save_hf_folder
from hybridflow.workers.generation import build_agent_loop, generate_batch


class ActorRolloutRefWorker(Worker):
    def __init__(self, spec):
        """``spec``: the run plan's ``ActorSpec`` (the actor's and the rollout's sections, what the run needs:
        a reference model, the actor's sum_pi_squared)."""
        super().__init__()
        self.spec, self.needs, p = spec, spec.needs, spec.process
        mp = spec.actor.megatron
        hf_config, state = init_megatron_worker(self, mp, p.seed, p.model_path, p.dist_timeout_s)
        dtype = device.torch_dtype(mp.dtype)
        self.actor = MegatronRole(hf_config, state, optim=optim_settings(spec.actor.optim, mp, p.total_steps,
                                                                         "actor.optim"),
                                  dtype=dtype, sequence_parallel=mp.sequence_parallel, offload=offload_settings(mp),
                                  transformer_overrides=mp.override_transformer_config)
        # The reference lives in the actor's processes, with the actor's layout and its own param offload.
        self.ref = MegatronRole(hf_config, state, dtype=dtype, sequence_parallel=mp.sequence_parallel,
                                offload=ref_offload_settings(spec.actor),
                                transformer_overrides=mp.override_transformer_config) if self.needs.reference else None
        del state
        from transformers import AutoTokenizer

        shard = self.actor.shard
        train = Layout(shard.pp_size, shard.tp_size, parallel.dispatch_info()["dp_size"])
        self.hybrid_plan = HybridPlan(train, p_g=1, t_g=spec.rollout.tensor_model_parallel_size)
        self.resharder = Resharder(self.actor.module, hf_config, self.hybrid_plan, spec.rollout.resharding)

        self.tokenizer = AutoTokenizer.from_pretrained(p.model_path)
        r = spec.rollout
        self.rollout = VLLMRollout(
            p.model_path, max_model_len=spec.max_prompt_length + spec.max_response_length,
            tensor_parallel_size=r.tensor_model_parallel_size, kv_cache_gib=r.kv_cache_gib, dtype=r.dtype,
            gpu_memory_utilization=r.gpu_memory_utilization, enforce_eager=r.enforce_eager,
            free_cache_engine=r.free_cache_engine, max_num_batched_tokens=r.max_num_batched_tokens,
            max_num_seqs=r.max_num_seqs, enable_chunked_prefill=r.enable_chunked_prefill,
            engine_kwargs=r.engine_kwargs,
            # ranks of one generation TP group must sample identically: seed per replica
            seed=p.seed + self.hybrid_plan.ranks[self.rank].replica,
            generation_groups=self.hybrid_plan.replicas)
        self.agent = (build_agent_loop(r.multi_turn, spec.max_response_length, spec.chat_template_kwargs, self.tokenizer)
                      if r.multi_turn.enable else None)

    def dispatch_info(self, mesh: str = "train") -> dict:
        """'train': megatron's DP shards; 'rollout': one shard per generation replica."""
        if mesh == "rollout":
            return self.hybrid_plan.dispatch_info(self.rank)
        return parallel.dispatch_info()

    # --- rollout ----------------------------------------------------------------------------------

    @register(Dispatch.ONE_TO_ALL)
    def sync_weights(self) -> dict:
        """Push the actor's current weights into this rank's vLLM engine through the configured
        transition (streamed, one layer at a time for ``hybrid``); returns its accounting as metrics."""
        stats = TransitionStats(self.resharder.scheme)
        start = time.perf_counter()
        self.rollout.wake_up(["weights"])
        with torch.no_grad(), self.actor.resident():
            shard = self.resharder.stream(stats)
            if self.rollout.takes_shards:  # GPU: vLLM's parameters are the shard's layout; no staging
                self.rollout.update_weights(shard, shards=True)
            else:
                me = self.hybrid_plan.ranks[self.rank]
                self.rollout.update_weights(to_checkpoint_names(shard, self.actor.hf_config, k=me.gen_tp_rank,
                                                                t_g=self.hybrid_plan.t_g, stats=stats))
        stats.seconds = time.perf_counter() - start
        return {**stats.as_metrics(), **device.memory_stats("memory/reshard")}

    @register(Dispatch.DP_COMPUTE_3D, mesh="rollout")
    def generate(self, prompts: Batch) -> Batch:
        """Sample one response per row (repeat rows beforehand for n > 1); each generation replica
        gets its own prompts (workers/generation.py). The weights are the last ``sync_weights``'."""
        return generate_batch(self.rollout, self.agent, prompts, self.spec, self.tokenizer)

    # --- log-probs and update -------------------------------------------------------------------

    @register(Dispatch.DP_COMPUTE_3D)
    def compute_log_prob(self, batch: Batch) -> Batch:
        # the optimal token baselines also need sum_vocab p^2 per position (verl's actor.calculate_sum_pi_squared)
        otb = self.needs.sum_pi_squared
        out = role_ops.log_probs(self.actor, batch, role_ops.log_prob_batching(self.spec.actor), with_entropy=True,
                                 with_sum_pi_squared=otb, temperature=self.spec.logit_temperature)
        extra = {"sum_pi_squared": out["sum_pi_squared"]} if otb else {}
        return role_ops.last_stage_batch(old_log_probs=out["log_probs"], entropy=out["entropy"], **extra)

    @register(Dispatch.DP_COMPUTE_3D)
    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        out = role_ops.log_probs(self.ref, batch, role_ops.log_prob_batching(self.spec.actor, ref=True),
                                 temperature=self.spec.logit_temperature)
        return role_ops.last_stage_batch(ref_log_prob=out["log_probs"])

    @register(Dispatch.DP_COMPUTE_3D)
    def update_actor(self, batch: Batch) -> dict:
        s = self.spec
        metrics = role_ops.update_policy(self.actor, batch, s.actor, parallel.dispatch_info()["dp_size"], s.rollout.n,
                                         rollout_correction=s.rollout_correction, temperature=s.logit_temperature)
        return {**metrics, **device.memory_stats("memory/update_actor")}

    @register(Dispatch.ONE_TO_ALL)
    def close(self) -> None:
        """Release the rollout engine's shared resources before the process is killed."""
        if self.agent is not None:
            self.agent.close()
        self.rollout.close()

    # --- checkpoints ------------------------------------------------------------------------------

    @register(Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        """The actor (weights, optimizer) and this rank's random streams, vLLM's sampling included. The
        reference is not saved: it is the frozen starting model, rebuilt from ``model.path``."""
        save_role_checkpoint(self, self.actor, "actor", path)

    @register(Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str, restore_rng: bool) -> None:
        """Load the actor; vLLM gets the loaded weights at the driver's next ``sync_weights``."""
        load_role_checkpoint(self, self.actor, "actor", path, restore_rng)

    # --- export -----------------------------------------------------------------------------------

    @register(Dispatch.ONE_TO_ALL)
    def export_hf_state_dict(self) -> dict:
        """The actor's full weights with HF names as host tensors, on rank 0 ({} on the others)."""
        return self.actor.hf_state_dict()

    @register(Dispatch.ONE_TO_ALL)
    def save_hf(self, out_dir: str) -> None:
        """Write the actor as a HF folder (config, sharded safetensors, tokenizer) from rank 0, atomically,
        streamed one layer at a time (no rank holds the whole model)."""
        weights = self.actor.iter_hf_weights()
        if self.rank == 0:
            save_hf_folder(out_dir, self.actor.hf_config, weights, self.tokenizer)
        else:
            for _ in weights:  # every rank drives the gathers
                pass
