"""vLLM's layerwise weight reload, its per-sync warnings reported once per process.

vLLM's layerwise reload warns "<layer>: Failed to load weights" at every sync for layers it was given no weights
for, and puts their tensors back as they were (model_loader/reload/layerwise.py), which is right for these: the
rotary cos/sin cache is computed, never in a checkpoint, and a FusedMoE's experts are written in place
(rollout/fused_experts.py). A filter on that module's logger lets each through once per process, not every step.
"""

from __future__ import annotations

import logging

from hybridflow.patches.registry import declare
from hybridflow.patches.vllm_engine import VLLM

RELOAD_WARNINGS_ONCE = declare(
    "vllm.reload_warnings_once", "vllm", VLLM, "vllm.model_executor.model_loader.reload.layerwise:logger",
    "the layerwise reload warns at every weight sync that layers whose tensors are computed (rotary caches) or "
    "written in place (FusedMoE experts) got no weights; a filter on its logger reports each once per process")


class _ReportOnce(logging.Filter):
    WHY = {"RotaryEmbedding": "its cos/sin cache is computed, not loaded",
           "FusedMoE": "its experts are written in place, not loaded"}

    def __init__(self):
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        layer = message.split(":", 1)[0]
        if not message.endswith("Failed to load weights") or layer not in self.WHY:
            return True
        if message in self.seen:
            return False
        self.seen.add(message)
        record.msg, record.args = f"{message} ({self.WHY[layer]}; reported once)", ()
        return True


def report_reload_warnings_once() -> None:
    """Filter the layerwise reload's logger (``RELOAD_WARNINGS_ONCE``), once per process."""
    logger = RELOAD_WARNINGS_ONCE.require()
    if not any(isinstance(f, _ReportOnce) for f in logger.filters):
        logger.addFilter(_ReportOnce())
