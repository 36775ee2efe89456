"""On-policy distillation's teachers in the actor's processes (config/distillation.py): each a frozen megatron-core
role at the actor's layout, as the reference is, built from its own HF folder; it scores the sampled tokens of the
rows routed to it at temperature 1 (verl 0.9.1 asks its teacher for prompt log-probs at temperature 1 whatever the
rollout's: teacher_loop/teacher_manager.py)."""

from __future__ import annotations

import numpy as np
import torch

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
        keys = np.asarray([str(k) for k in batch.non_tensors[self.routing_key]], dtype=object)
        unknown = sorted(set(keys) - set(self.roles))
        if unknown:
            raise ValueError(f"distillation.teacher_key: no teacher for {self.routing_key}={unknown[0]!r} (teachers: "
                             f"{sorted(self.roles)})")
        return {key: np.flatnonzero(keys == key) for key in self.roles}

    def log_probs(self, batch: Batch, micro) -> torch.Tensor | None:
        """[B, R] each row's teacher's log-probs of its response tokens (None off the last pipeline stage). Every
        teacher runs on every rank, a row at least: the micro-batch counts are agreed over the data-parallel ranks
        and the pipeline runs one schedule, so a rank with no rows of a teacher must not skip its forward."""
        out = None
        for key, rows in self.rows_of(batch).items():
            picked = rows if len(rows) else np.arange(1)
            lp = role_ops.log_probs(self.roles[key], batch[picked], micro)["log_probs"]
            if lp is None:
                continue
            if out is None:
                out = torch.zeros(len(batch), lp.shape[1], dtype=lp.dtype, device=lp.device)
            if len(rows):
                out[torch.as_tensor(rows, device=lp.device)] = lp
        return out
