"""The colocated actor + rollout + reference worker: one process per device.

The actor (megatron-core, trained), the reference (megatron-core, frozen) and the vLLM rollout engine
share the process and its device in phases, as the paper's hybrid engine intends: vLLM sleeps outside
generation (GPU), the actor and reference go to host memory while idle when the offload keys say so, and
the driver pushes the actor's weights into vLLM in place (``sync_weights``) after every update.
"""

from __future__ import annotations

import contextlib
import time

import torch

from hybridflow import device
from hybridflow.controller import Dispatch, Worker, register
from hybridflow.megatron import lora, parallel
from hybridflow.megatron.role import MegatronRole
from hybridflow.protocol import Batch
from hybridflow.resharding.plan import HybridPlan, Layout
from hybridflow.resharding.transition import Resharder, TransitionStats
from hybridflow.resharding import checkpoint_engine
from hybridflow.resharding.separate import SeparatePlan
from hybridflow.workers import role_ops
from hybridflow.workers.common import (init_megatron_worker, load_role_checkpoint, lora_settings, model_build,
                                       offload_settings, optim_settings, ref_offload_settings, save_role_checkpoint,
                                       start_weights)
from hybridflow.workers.export import save_hf_folder
from hybridflow.workers.teachers import Teachers
from hybridflow.workers.carried_generation import CarriedGeneration
from hybridflow.workers.generation import (build_agent_loop, build_vllm_rollout, generate_batch, load_adapters,
                                           load_generation_shard, sampling_settings)


class ActorRolloutRefWorker(Worker):
    def __init__(self, spec):
        """``spec``: the run plan's ``ActorSpec`` (the actor's and the rollout's sections, what the run needs:
        a reference model, the actor's sum_pi_squared)."""
        super().__init__()
        self.spec, self.needs, p = spec, spec.needs, spec.process
        mp = spec.actor.megatron
        hf_config, state = init_megatron_worker(self, spec, mp)
        self.replay = mp.router_replay.mode  # MoE routing replay (megatron/routing.py)
        self.actor = MegatronRole(
            hf_config, state, model_build(mp, routing_replay=self.replay != "disabled",
                                          lora_settings=lora_settings(spec.lora, p.seed)),
            optim=optim_settings(spec.actor.optim, mp, p.total_steps, "actor.optim"), offload=offload_settings(mp),
            start_weights=start_weights(mp, "actor", spec.lora and spec.lora.adapter_path))
        # The reference lives in the actor's processes, with the actor's layout and its own param offload; under
        # R3 it replays vLLM's routes too. With LoRA it is the actor with its adapters off: no second copy.
        self.ref = MegatronRole(
            hf_config, state, model_build(mp, routing_replay=self.replay == "R3"),
            offload=ref_offload_settings(spec.actor), start_weights=start_weights(mp, "actor"),
        ) if self.needs.reference and not spec.lora else None
        self.teachers = Teachers(spec) if spec.teachers else None  # distillation's, at the actor's layout too
        del state
        from transformers import AutoTokenizer

        # CP ranks hold the same weights as data-parallel ones, numbered inside that dimension (tp-cp-dp-pp)
        train = Layout(spec.layout.pp, spec.layout.tp, spec.layout.weight_replicas)
        r = spec.rollout
        self.tokenizer = AutoTokenizer.from_pretrained(p.model_path, trust_remote_code=p.trust_remote_code)
        self.rollout = self.agent = self.feeds = None
        if spec.rollout_pool:  # separate_async: the checkpoint engine feeds a rollout pool of its own
            self.separate = SeparatePlan(train, spec.rollout_pool, r.tensor_model_parallel_size)
            self.hybrid_plan = self.separate.trainer
            self.resharder = Resharder(self.actor.module, hf_config, self.hybrid_plan, "hybrid",
                                       self.actor.shard.stages)
            return
        self.hybrid_plan = HybridPlan(train, p_g=1, t_g=r.tensor_model_parallel_size)
        self.resharder = Resharder(self.actor.module, hf_config, self.hybrid_plan, r.resharding,
                                   self.actor.shard.stages)
        # ranks of one generation TP group must sample identically: seed per replica
        self.rollout = build_vllm_rollout(spec, seed=p.seed + self.hybrid_plan.ranks[self.rank].replica,
                                          generation_groups=self.hybrid_plan.replicas, colocated=True)
        self.agent = (build_agent_loop(r.multi_turn, spec.max_response_length, spec.chat_template_kwargs, self.tokenizer)
                      if r.multi_turn.enable else None)
        self.version = 0  # the policy version the engine holds (the driver's count of updates)
        self.base_synced = False  # LoRA with merge false: the frozen base reaches vLLM once
        self.carried = (CarriedGeneration(spec.max_response_length, spec.max_off_policy_threshold, self.agent)
                        if spec.carry_unfinished else None)

    def dispatch_info(self, mesh: str = "train") -> dict:
        """'train': megatron's DP shards; 'rollout': one shard per generation replica."""
        if mesh == "rollout":
            return self.hybrid_plan.dispatch_info(self.rank)
        return parallel.dispatch_info()

    # --- rollout ----------------------------------------------------------------------------------

    @register(Dispatch.ONE_TO_ALL)
    def sync_weights(self, version: int = 0) -> dict:
        """Push the actor's current weights (policy ``version``) into this rank's vLLM engine through the
        configured transition (streamed, one layer at a time for ``hybrid``); returns its accounting as metrics.
        With LoRA and ``merge`` false the frozen base goes through the transition once, the adapters alone into
        vLLM's LoRA at every sync (``reshard/lora_sync_bytes``, the resharding's bytes 0 after the first): vLLM's sleep
        (level 1) keeps the base on host, and its in-place reload resolves LoRA-wrapped layers' names to their base
        layer (model_loader/reload/inplace.py get_parameter_for_reload), so the base's GPU shards load as they are."""
        self.version = version
        stats = TransitionStats(self.resharder.scheme)
        start = time.perf_counter()
        self.rollout.wake_up(["weights"])
        adapters_only = self.spec.lora is not None and not self.spec.lora.merge
        out = {}
        with torch.no_grad(), self.actor.resident():
            if not (adapters_only and self.base_synced):
                me = self.hybrid_plan.ranks[self.rank]
                with lora.disabled(self.actor.module) if adapters_only else contextlib.nullcontext():
                    load_generation_shard(self.rollout, self.resharder.stream(stats), self.actor.hf_config,
                                          me.gen_tp_rank, self.hybrid_plan.t_g, stats)
                self.base_synced = True
            if adapters_only:
                out["reshard/lora_sync_bytes"] = float(load_adapters(self.rollout, self.actor, self.spec.lora,
                                                                     self.spec.process.model_path))
        stats.seconds = time.perf_counter() - start
        out.update(stats.as_metrics(), **device.memory_stats("memory/reshard"))
        if self.spec.lora is not None:  # this rank's adapters, next to the transition's bytes
            out["reshard/lora_adapter_bytes"] = float(lora.adapter_bytes(self.actor.module))
        return out

    @register(Dispatch.ONE_TO_ALL, blocking=False)
    def connect_rollout(self, host: str, port: int, prefix: str, timeout_s: float) -> None:
        """separate_async: open the checkpoint engine's feeds this rank sends on (with the rollout pool's
        ``RolloutWorker.connect_rollout``, called together)."""
        self.feeds = [checkpoint_engine.FeedGroup(f, 0, host, port, prefix, timeout_s)
                      for f in self.separate.feeds_of_trainer(self.rank)]

    @register(Dispatch.ONE_TO_ALL, blocking=False)
    def send_weights(self) -> dict:
        """separate_async: the hybrid transition inside the training pool (to vLLM TP t_s), then each feed's
        slice streamed to its rollout ranks (resharding/checkpoint_engine.py); with the rollout pool's
        ``receive_weights``, called together. Returns this rank's accounting."""
        inside, sent = TransitionStats("hybrid"), TransitionStats("checkpoint_engine")
        start = time.perf_counter()
        r = self.spec.rollout
        with torch.no_grad(), self.actor.resident():
            # every rank walks its whole shard (the transition's collectives), sending where it feeds someone
            checkpoint_engine.send(self.resharder.stream(inside), self.feeds, self.actor.hf_config,
                                   self.hybrid_plan.ranks[self.rank].gen_tp_rank, self.separate.t_s, self.separate.t_g,
                                   device.torch_dtype(r.dtype), r.checkpoint_engine.update_weights_bucket_megabytes << 20,
                                   sent)
        inside.seconds = time.perf_counter() - start
        return {**inside.as_metrics("weight_sync/trainer_reshard"), "weight_sync/bytes_sent": float(sent.bytes_sent)}

    @register(Dispatch.DP_COMPUTE_3D, mesh="rollout")
    def generate(self, prompts: Batch) -> Batch:
        """Sample one response per row (repeat rows beforehand for n > 1); each generation replica
        gets its own prompts (workers/generation.py). The weights are the last ``sync_weights``'. In
        colocate_async a sampled batch with ``meta["groups_to_finish"]`` goes on with the responses carried from
        the last call and returns that many complete groups (workers/carried_generation.py)."""
        sampling = sampling_settings(self.spec, prompts.meta)
        if self.carried is None or "groups_to_finish" not in prompts.meta or sampling.temperature == 0:
            return generate_batch(self.rollout, self.agent, prompts, self.spec, self.tokenizer)
        self.rollout.wake_up(["weights", "kv_cache"])
        out = self.carried.generate(self.rollout, prompts, sampling, self.version, prompts.meta["groups_to_finish"],
                                    self.tokenizer.pad_token_id, self.tokenizer.eos_token_id)
        self.rollout.sleep()
        return out.replace(meta={"memory": device.memory_stats("memory/generate")})

    # --- log-probs and update -------------------------------------------------------------------

    @register(Dispatch.DP_COMPUTE_3D)
    def compute_log_prob(self, batch: Batch) -> Batch:
        """The old log-probs and entropy; under R2 the routes the routers chose (``routed_experts``, replayed by
        the update), under R3 how many of vLLM's replayed routes the routers would have chosen otherwise."""
        # the optimal token baselines also need sum_vocab p^2 per position (verl's actor.calculate_sum_pi_squared)
        otb = self.needs.sum_pi_squared
        out = role_ops.log_probs(self.actor, batch, role_ops.log_prob_batching(self.spec.actor), with_entropy=True,
                                 with_sum_pi_squared=otb, temperature=self.spec.logit_temperature,
                                 record_routes=self.replay == "R2", entropy_chunk=self.spec.actor.entropy_chunk)
        extra = {k: out[k] for k in ("sum_pi_squared", "routed_experts", "routing_differing", "routing_counted")
                 if k in out}
        return role_ops.last_stage_batch(old_log_probs=out["log_probs"], entropy=out["entropy"], **extra)

    @register(Dispatch.DP_COMPUTE_3D)
    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        base = lora.disabled(self.actor.module) if self.ref is None else contextlib.nullcontext()  # LoRA: no copy
        with base:
            out = role_ops.log_probs(self.ref or self.actor, batch, role_ops.log_prob_batching(self.spec.actor, ref=True),
                                     temperature=self.spec.logit_temperature)
        return role_ops.last_stage_batch(ref_log_prob=out["log_probs"])

    @register(Dispatch.DP_COMPUTE_3D)
    def compute_teacher_log_prob(self, batch: Batch) -> Batch:
        """Each row's distillation teacher's scores of its response tokens (workers/teachers.py): their log-probs, or
        the teacher's top-k at each position for forward_kl_topk."""
        d = self.spec.distillation
        scores = self.teachers.scores(batch, role_ops.log_prob_batching(self.spec.actor, ref=True),
                                      d.topk if d.uses_topk else None)
        return None if scores is None else role_ops.last_stage_batch(**scores)

    @register(Dispatch.DP_COMPUTE_3D)
    def update_actor(self, batch: Batch) -> dict:
        s = self.spec
        metrics = role_ops.update_policy(self.actor, batch, s.actor, s.layout.dp, s.rollout.n,
                                         rollout_correction=s.rollout_correction, temperature=s.logit_temperature,
                                         distillation=s.distillation)
        return {**metrics, **device.memory_stats("memory/update_actor")}

    @register(Dispatch.ONE_TO_ALL)
    def close(self) -> None:
        """Release the rollout engine's shared resources before the process is killed."""
        if self.agent is not None:
            self.agent.close()
        if self.rollout is not None:
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
