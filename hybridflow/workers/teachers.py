"""On-policy distillation's teachers in the actor's processes (config/distillation.py): each a frozen megatron-core
role at the actor's layout, as the reference is, built from its own HF folder; it scores the sampled tokens of the
rows routed to it at temperature 1 (verl 0.9.1 asks its teacher for prompt log-probs at temperature 1 whatever the
rollout's: teacher_loop/teacher_manager.py): the log-prob of each sampled token, or for forward_kl_topk its k most
likely tokens at each position (verl's vLLM prompt_logprobs=topk; workers/topk_ops.py)."""

from __future__ import annotations

import numpy as np
import torch

from hybridflow.config.distillation import routing_keys
from hybridflow.megatron import vocab_topk
from hybridflow.megatron.role import MegatronRole
from hybridflow.protocol import Batch
from hybridflow.workers import role_ops
from hybridflow.workers.common import model_build, open_hf_folder, ref_offload_settings


class Teachers:
    """{routing key: teacher role}; key None is the one teacher of every row."""

    def __init__(self, spec):
        """``spec``: the run plan's ``ActorSpec`` (its ``teachers``: routing key -> model path, and the actor's
        layout and megatron settings, which the teachers share)."""
        p, mp = spec.process, spec.actor.megatron
        self.routing_key = spec.teacher_key
        self.roles: dict[str | None, MegatronRole] = {}
        for key, path in spec.teachers.items():
            config, weights = open_hf_folder(path, p.trust_remote_code)
            self.roles[key] = MegatronRole(config, weights, model_build(mp), offload=ref_offload_settings(spec.actor))

    def rows_of(self, batch: Batch) -> dict[str | None, np.ndarray]:
        """Each teacher's rows of ``batch``; a row whose key names no teacher is an error naming it."""
        if None in self.roles:
            return {None: np.arange(len(batch))}
        if self.routing_key not in batch.non_tensors:
            raise ValueError(f"distillation.teacher_key: the rows have no {self.routing_key!r} column to route "
                             f"them to the teachers {sorted(self.roles)}")
        keys = np.asarray(routing_keys(batch.non_tensors[self.routing_key]), dtype=object)
        unknown = sorted(set(keys) - set(self.roles))
        if unknown:
            raise ValueError(f"distillation.teacher_key: no teacher for {self.routing_key}={unknown[0]!r} (teachers: "
                             f"{sorted(self.roles)})")
        return {key: np.flatnonzero(keys == key) for key in self.roles}

    def scores(self, batch: Batch, micro, topk: int | None = None) -> dict | None:
        """Each row's teacher's scores of its response (None off the last pipeline stage): {'teacher_log_probs':
        [B, R]} of the sampled tokens, or with ``topk`` {'teacher_topk_log_probs', 'teacher_topk_ids': [B, R, k]} of
        its k most likely tokens at each position (forward_kl_topk). Every teacher runs on every rank, a row at
        least: the micro-batch counts are agreed over the data-parallel ranks and the pipeline runs one schedule, so
        a rank with no rows of a teacher must not skip its forward."""
        out = None
        for key, rows in self.rows_of(batch).items():
            got = self._score(self.roles[key], batch[rows if len(rows) else np.arange(1)], micro, topk)
            if got is None:
                continue
            if out is None:
                out = {name: torch.zeros((len(batch), *t.shape[1:]), dtype=t.dtype, device=t.device)
                       for name, t in got.items()}
            if len(rows):
                for name, t in got.items():
                    out[name][torch.as_tensor(rows, device=t.device)] = t
        return out

    @staticmethod
    def _score(role: MegatronRole, batch: Batch, micro, topk: int | None) -> dict | None:
        if topk is None:
            lp = role_ops.log_probs(role, batch, micro)["log_probs"]
            return None if lp is None else {"teacher_log_probs": lp}
        def output_fn(mb, logits):  # at temperature 1, as verl's teacher (module docstring); not under CP (plan/rules)
            lp, ids = vocab_topk.topk(role_ops.picked(logits.detach(), mb), topk)
            return {"teacher_topk_log_probs": role_ops.zero_past_end(lp, mb),
                    "teacher_topk_ids": role_ops.zero_past_end(ids, mb)}

        mbs, order = role_ops.micro_batches_of(role, batch, micro)
        outs = role.forward(mbs, output_fn)
        got = {key: role_ops.gathered(outs, key, order) for key in ("teacher_topk_log_probs", "teacher_topk_ids")}
        return None if got["teacher_topk_log_probs"] is None else got
