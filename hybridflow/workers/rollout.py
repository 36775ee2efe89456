"""The standalone rollout worker of separate_async: a vLLM engine and nothing else (no megatron), in a pool of
its own, fed the actor's weights by the checkpoint engine (resharding/checkpoint_engine.py).

The pool's ranks form one torch.distributed world, over which vLLM builds its TP groups (replicas of
consecutive ranks, resharding/separate.py); each rank knows the policy version its engine holds and stamps it
on every token it samples.
"""

from __future__ import annotations

import time

import torch

from hybridflow.controller import Dispatch, Worker, register
from hybridflow.protocol import Batch
from hybridflow.resharding import checkpoint_engine
from hybridflow.resharding.plan import Layout
from hybridflow.resharding.separate import SeparatePlan
from hybridflow.resharding.transition import TransitionStats
from hybridflow.workers.carry import CarriedGeneration
from hybridflow.workers.generation import (build_agent_loop, build_vllm_rollout, generate_batch, load_generation_shard,
                                           sampling_settings)

NO_WEIGHTS = -1  # the policy version of an engine that has received none (its dummy weights)


class RolloutWorker(Worker):
    def __init__(self, spec):
        """``spec``: the run plan's ``RolloutSpec``."""
        super().__init__()
        from transformers import AutoConfig, AutoTokenizer

        p, r = spec.process, spec.rollout
        self.spec = spec
        self.init_distributed(timeout_s=p.dist_timeout_s)
        self.hf_config = AutoConfig.from_pretrained(p.model_path)
        self.tokenizer = AutoTokenizer.from_pretrained(p.model_path)
        self.plan = SeparatePlan(Layout(*spec.train_layout), self.world_size, r.tensor_model_parallel_size)
        # the ranks of one vLLM TP group sample identically: seeded per replica
        self.rollout = build_vllm_rollout(p.model_path, spec, seed=p.seed + self.rank // self.plan.t_g,
                                          generation_groups=self.plan.replicas)
        # multi-turn trajectories (tools) run against this engine; with partial rollouts carried across pushes too
        self.agent = (build_agent_loop(r.multi_turn, spec.max_response_length, spec.chat_template_kwargs, self.tokenizer)
                      if r.multi_turn.enable else None)
        self.carried = (CarriedGeneration(spec.max_response_length, spec.carry_threshold, self.agent) if spec.partial_rollout
                        else None)
        self.feed: checkpoint_engine.FeedGroup | None = None
        self.version = NO_WEIGHTS
        self.busy_s = 0.0  # seconds spent generating, reported with each batch

    def dispatch_info(self, mesh: str = "train") -> dict:  # noqa: ARG002 (one mesh: the vLLM replicas)
        return self.plan.dispatch_info(self.rank)

    @register(Dispatch.ONE_TO_ALL, blocking=False)
    def connect_rollout(self, host: str, port: int, prefix: str, timeout_s: float) -> None:
        """Open this rank's feed of the checkpoint engine (with the actor's ``connect_rollout``, called together)."""
        feed = self.plan.feed_of_rollout(self.rank)
        self.feed = checkpoint_engine.FeedGroup(feed, 1 + feed.receivers.index(self.rank), host, port, prefix, timeout_s)

    @register(Dispatch.ONE_TO_ALL, blocking=False)
    def receive_weights(self, version: int) -> dict:
        """Receive this rank's vLLM shard of policy ``version`` from its feed and load it in place (with the
        actor's ``send_weights``, called together); returns the accounting."""
        stats = TransitionStats("checkpoint_engine")
        start = time.perf_counter()
        self.rollout.wake_up(["weights"])
        with torch.no_grad():
            load_generation_shard(self.rollout, checkpoint_engine.receive(self.feed, stats), self.hf_config,
                                  self.rank % self.plan.t_g, self.plan.t_g, stats)
        self.version = version
        return {"weight_sync/bytes_received": float(stats.bytes_received),
                "weight_sync/staging_bytes": float(stats.staging_bytes),
                "weight_sync/receive_s": time.perf_counter() - start}

    @register(Dispatch.DP_COMPUTE_3D, mesh="rollout")
    def generate(self, prompts: Batch) -> Batch:
        """One response (or multi-turn trajectory) per row under the engine's current weights
        (workers/generation.py), each sampled token stamped with its policy version (``token_policy_versions``, -1
        elsewhere: padding, tool messages); with partial rollouts, a sampled batch with ``meta["groups_to_finish"]``
        returns that many complete groups, carrying the rest (workers/carry.py). ``meta`` carries the seconds this
        rank has spent generating (``rollout/busy_s``) for the driver's idle accounting."""
        start = time.perf_counter()
        sampling = sampling_settings(self.spec, prompts.meta)
        if self.carried is not None and "groups_to_finish" in prompts.meta and sampling.temperature > 0:
            self.rollout.wake_up(["weights", "kv_cache"])  # partial rollouts (workers/carry.py): versions per token
            out = self.carried.generate(self.rollout, prompts, sampling, self.version, prompts.meta["groups_to_finish"],
                                        self.tokenizer.pad_token_id, self.tokenizer.eos_token_id)
            self.rollout.sleep()
        else:
            out = generate_batch(self.rollout, self.agent, prompts, self.spec, self.tokenizer)
            mask = out.tensors["response_mask"].bool()
            versions = torch.full(mask.shape, -1, dtype=torch.int64)
            versions[mask] = self.version
            out.tensors["token_policy_versions"] = versions
        self.busy_s += time.perf_counter() - start
        out.meta["rollout/busy_s"] = self.busy_s
        return out

    @register(Dispatch.ONE_TO_ALL)
    def close(self) -> None:
        """Release the engine's shared resources before the process is killed."""
        self.feed = None
        if self.agent is not None:
            self.agent.close()
        self.rollout.close()

