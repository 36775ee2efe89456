"""The standalone rollout worker of separate_async: a vLLM engine and nothing else (no megatron), in a pool of
its own, fed the actor's weights by the checkpoint engine (resharding/checkpoint_engine.py). With partial
rollouts it serves the admitted samples continuously (workers/serving.py); without, it generates a batch a call.

The pool's ranks form one torch.distributed world, over which vLLM builds its TP groups (replicas of
consecutive ranks, resharding/separate.py); each rank knows the policy version its engine holds and stamps it
on every token it samples.
"""

from __future__ import annotations

import time

import torch

from hybridflow.controller import Dispatch, Worker, register
from hybridflow.protocol import Batch
from hybridflow.resharding import checkpoint_engine, vllm_layout
from hybridflow.resharding.plan import Layout
from hybridflow.resharding.separate import SeparatePlan
from hybridflow.resharding.transition import TransitionStats
from hybridflow.workers.carried_generation import SampleSet
from hybridflow.workers.generation import (build_agent_loop, build_vllm_rollout, generate_batch, load_generation_shard,
                                           sampling_settings)
from hybridflow.workers.serving import Agreement, ContinuousServing

NO_WEIGHTS = -1  # the policy version of an engine that has received none (its dummy weights)


class RolloutWorker(Worker):
    def __init__(self, spec):
        """``spec``: the run plan's ``RolloutSpec``."""
        super().__init__()
        from transformers import AutoConfig, AutoTokenizer

        p, r = spec.process, spec.rollout
        self.spec = spec
        self.init_distributed(timeout_s=p.dist_timeout_s)
        self.hf_config = AutoConfig.from_pretrained(p.model_path, trust_remote_code=p.trust_remote_code,
                                                    **p.config_overrides)
        self.tokenizer = AutoTokenizer.from_pretrained(p.model_path, trust_remote_code=p.trust_remote_code)
        # what preflight checked, again where the shards land (as the hybrid engine's Resharder does): vLLM's vocab
        # and head shards must be the ones the checkpoint engine cuts
        vllm_layout.check_supported(self.hf_config, r.tensor_model_parallel_size)
        self.plan = SeparatePlan(Layout(*spec.train_layout), self.world_size, r.tensor_model_parallel_size)
        # the ranks of one vLLM TP group sample identically: seeded per replica
        self.rollout = build_vllm_rollout(spec, seed=p.seed + self.rank // self.plan.t_g,
                                          generation_groups=self.plan.replicas, colocated=False)
        # multi-turn trajectories (tools) run against this engine; with partial rollouts carried across pushes too
        self.agent = (build_agent_loop(r.multi_turn, spec.max_response_length, spec.chat_template_kwargs, self.tokenizer)
                      if r.multi_turn.enable else None)
        self.feed: checkpoint_engine.FeedGroup | None = None
        self.version = NO_WEIGHTS
        self.busy_s = 0.0  # seconds spent generating batches, reported with each batch
        self.serving = self._start_serving() if spec.partial_rollout else None

    def _start_serving(self) -> ContinuousServing:
        """The engine's serving thread; the ranks of a vLLM TP group agree on its commands over a gloo group of
        their own (every rank of the pool takes part in creating each group)."""
        group = None
        for ranks in self.plan.replicas:
            g = torch.distributed.new_group(list(ranks), backend="gloo") if len(ranks) > 1 else None
            if self.rank in ranks:
                group, leader = g, ranks[0]
        samples = SampleSet(self.spec.max_response_length, self.spec.staleness_threshold, self.agent)
        return ContinuousServing(self.rollout, samples, sampling_settings(self.spec, {}),
                                 self.agent.chat.stop_token_ids if self.agent is not None else None,
                                 self.tokenizer.pad_token_id, self.tokenizer.eos_token_id,
                                 Agreement(group, leader if group is not None else 0), self.version)

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
        actor's ``send_weights``, called together); returns the accounting. While serving, the running requests
        stop for it and resume under the new weights."""
        if self.serving is not None:
            return self.serving.exclusive(lambda: self._receive_weights(version), version)
        return self._receive_weights(version)

    def _receive_weights(self, version: int) -> dict:
        stats = TransitionStats("checkpoint_engine")
        start = time.perf_counter()
        with torch.no_grad():
            load_generation_shard(self.rollout, checkpoint_engine.receive(self.feed, stats), self.hf_config,
                                  self.rank % self.plan.t_g, self.plan.t_g, stats)
        self.version = version
        return {"weight_sync/bytes_received": float(stats.bytes_received),
                "weight_sync/staging_bytes": float(stats.staging_bytes),
                "weight_sync/receive_s": time.perf_counter() - start}

    @register(Dispatch.DP_COMPUTE_3D, mesh="rollout")
    def admit(self, rows: Batch) -> None:
        """Partial rollouts: serve ``rows`` (rollout.n consecutive rows per group, ``uid`` and ``sample_seed``)
        from now on (workers/serving.py); ``take`` returns them by complete groups."""
        self.serving.admit(rows)

    @register(Dispatch.DP_COMPUTE_3D, mesh="rollout")
    def take(self, groups: int) -> Batch:
        """Partial rollouts: this replica's ``groups`` oldest complete groups as soon as they are there, each sampled
        token stamped with its policy version (``token_policy_versions``, -1 elsewhere: padding, tool messages) and
        its restarts for staleness (``stale_restarts``); ``meta`` carries the seconds this rank has spent stepping
        its engine (``rollout/busy_s``) for the driver's idle accounting."""
        return self.serving.take(groups)

    @register(Dispatch.DP_COMPUTE_3D, mesh="rollout")
    def generate(self, prompts: Batch) -> Batch:
        """One response (or multi-turn trajectory) per row under the engine's current weights
        (workers/generation.py), each sampled token stamped with its policy version (``token_policy_versions``, -1
        elsewhere: padding, tool messages). While serving (partial rollouts: validation, ReMax's greedy baseline)
        the served requests stop for it and resume after. ``meta`` carries the seconds this rank has spent
        generating (``rollout/busy_s``) for the driver's idle accounting."""
        if self.serving is not None:
            return self.serving.exclusive(lambda: self._generate(prompts))
        return self._generate(prompts)

    def _generate(self, prompts: Batch) -> Batch:
        start = time.perf_counter()
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
        """Stop serving and release the engine's shared resources before the process is killed."""
        if self.serving is not None:
            self.serving.close()
        self.feed = None
        if self.agent is not None:
            self.agent.close()
        self.rollout.close()
