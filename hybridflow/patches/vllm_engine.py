"""vLLM in the trainer's own processes: its process groups, shared memory and process-wide side effects.

The engine is built in-process over the trainer's torch.distributed world (external launcher). What
vLLM assumes there (consecutive TP ranks, one engine per init method, its own thread count) is adjusted
here, each only while the engine is built.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from hybridflow.patches.registry import declare

VLLM = ">=0.32,<0.33"
GROUP_RANKS = declare(
    "vllm.init_model_parallel_group", "vllm", VLLM, "vllm.distributed.parallel_state:init_model_parallel_group",
    "vLLM builds its TP groups from consecutive ranks; the resharding planner's generation groups are "
    "strided over the training ranks: map each consecutive ('virtual') rank onto the planner's")
SHM_NAMES = declare(
    "vllm.cpu_shm_group_name", "vllm", VLLM,
    "vllm.distributed.device_communicators.cpu_communicator:_CPUSHMDistributed.make_group_name",
    "vLLM-CPU names its TP communicator's /dev/shm segments after the init method, the same ('env://') "
    "for every engine under the external launcher: a segment a killed process leaked makes the next "
    "engine fail (EEXIST); prefix the names with one unique to the engine")
SET_NUM_THREADS = declare(
    "vllm.cpu_worker_set_num_threads", "vllm", VLLM, "torch:set_num_threads",
    "vLLM's CPU worker replaces torch.set_num_threads with a no-op for the whole process and reseeds "
    "the global RNG: put back the function, the trainer's thread count and its RNG stream")
EAGER_VOCAB_MASK = declare(
    "vllm.cpu_eager_vocab_mask", "vllm", VLLM,
    "vllm.model_executor.layers.vocab_parallel_embedding:get_masked_input_and_mask",
    "CPU, generation TP > 1: vLLM compiles this id-masking helper with inductor, whose C++ code is "
    "generated per vector ISA (ATEN_CPU_CAPABILITY picks it) by a compiler at run time and cached in "
    "/tmp; every rank's embedding lookup depends on it. Its eager original gives the same ids on any CPU "
    "without a compiler, and costs nothing for a batch of token ids")
EAGER_LOGPROB_RANKS = declare(
    "vllm.cpu_eager_logprob_ranks", "vllm", VLLM, "vllm.v1.sample.sampler:batched_count_greater_than",
    "CPU: each engine's first request for log-probs compiles this rank count (x >= value per row) with "
    "dynamo and inductor, a C++ build in a cold cache per process: 5-7 s of a 2-core machine's first step "
    "in every run (measured, py-spy: 11 of 14 samples of the first generate). Its eager original counts the "
    "same integers; the sampler looks the name up in its own module at each call")
CPU_EXPERTS_REPACK = declare(
    "vllm.cpu_moe_repack_after_reload", "vllm", VLLM,
    "vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method:UnquantizedFusedMoEMethod._setup_kernel",
    "CPU, MoE: an in-place weight reload re-runs _setup_kernel, which calls the experts' own "
    "process_weights_after_loading (vLLM-CPU's grouped-GEMM prepack, fused_moe/experts/cpu_moe.py) only on "
    "the first load: reloaded experts stay in checkpoint layout under a kernel that reads the prepacked one "
    "(measured: every log-prob off, held-out accuracy 0.43 -> 0.04). Run that prepack after each reload")

SEEDED_PARTIAL_PREFILL_WHY = (
    "CPU: a seeded request (SamplingParams.seed: every training row's sample_seed) whose prompt is prefilled over "
    "several engine steps (chunked prefill: a long prompt, or more prompt tokens waiting than "
    "max_num_batched_tokens) draws a sample at each partial step that is discarded, and the V1 runner rewinds its "
    "generator with Generator.set_offset (GPUModelRunner._bookkeeping_sync), which a CPU generator refuses ('CPU "
    "Generator does not use offset'): the engine fails. On CPU the generators of those requests are saved before "
    "sampling and restored after it, the same rewind, and the offset rewind skips them")
SEEDED_PARTIAL_PREFILL = declare(
    "vllm.cpu_seeded_partial_prefill", "vllm", VLLM, "vllm.v1.worker.cpu_model_runner:CPUModelRunner.sample_tokens",
    SEEDED_PARTIAL_PREFILL_WHY)
SEEDED_PARTIAL_PREFILL_OFFSET = declare(
    "vllm.cpu_seeded_partial_prefill_offset", "vllm", VLLM,
    "vllm.v1.worker.cpu_model_runner:CPUModelRunner._bookkeeping_sync", SEEDED_PARTIAL_PREFILL_WHY)

ROUTES_ON_EVERY_RANK = declare(
    "vllm.aux_output_on_every_tp_rank", "vllm", VLLM, "vllm.distributed.aux_output_connector.worker:get_tp_group",
    "GPU, MoE routing replay (R3) at generation TP > 1: vLLM builds the routed-experts output plane (store and buffer) "
    "on the first rank of a TP group only (AuxOutputWorkerConnector.__init__ returns early where "
    "get_tp_group().is_first_rank is false), the rank whose output its multiprocessing executor hands the one "
    "scheduler. Under the external launcher every rank runs a scheduler of its own, which asserts that output at "
    "the first step (AuxOutputSchedulerConnector.take_output: 'auxiliary output worker output is missing'). Each "
    "rank's capturer already holds every token's routes (the router runs whole on every TP rank; under sequence "
    "parallel the capture all-gathers over TP): the plane is built on every rank")

_installed: set[str] = set()


@contextlib.contextmanager
def routes_on_every_rank(active: bool) -> Iterator[None]:
    """While a GPU engine is built with ``active`` (R3 at generation TP > 1 under the external launcher), vLLM's
    routed-experts output plane sees every rank as the first of its TP group (``ROUTES_ON_EVERY_RANK``)."""
    if not active:
        yield
        return
    real = ROUTES_ON_EVERY_RANK.require()

    class _FirstRank:  # the rank's own TP group, answering "first rank" for the output plane's one question
        def __init__(self, group):
            self._group = group

        is_first_rank = True

        def __getattr__(self, name):
            return getattr(self._group, name)

    with ROUTES_ON_EVERY_RANK.swapped(lambda: _FirstRank(real())):
        yield


def repack_cpu_experts(model) -> int:
    """After an in-place reload on CPU: each MoE layer's experts prepacked again, as their first load did
    (``CPU_EXPERTS_REPACK``); returns how many layers. Nothing to do on GPU (no prepack there)."""
    CPU_EXPERTS_REPACK.require()
    count = 0
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        fused = getattr(kernel, "fused_experts", None)
        if fused is not None and hasattr(fused, "process_weights_after_loading"):
            fused.process_weights_after_loading(module)
            count += 1
    return count


def eager_vocab_mask() -> None:
    """Use the eager original of vLLM's compiled vocab-parallel id mask (CPU only; once per process)."""
    _use_eager_original(EAGER_VOCAB_MASK)


def eager_logprob_ranks() -> None:
    """Use the eager original of vLLM's compiled log-prob rank count (CPU only; once per process)."""
    _use_eager_original(EAGER_LOGPROB_RANKS)


def rewind_seeded_partial_prefills() -> None:
    """CPU only, once per process: a seeded request's sample discarded at a partial prefill step leaves its
    generator as it was (``SEEDED_PARTIAL_PREFILL``), so its response does not depend on how its prompt was
    chunked, as on GPU."""
    if SEEDED_PARTIAL_PREFILL.name in _installed:
        return
    sample_tokens, bookkeeping = SEEDED_PARTIAL_PREFILL.require(), SEEDED_PARTIAL_PREFILL_OFFSET.require()

    def discarded(runner) -> list[int]:  # the batch rows of seeded requests whose sample this step is discarded
        rows = runner.discard_request_mask.np[:runner.input_batch.num_reqs].nonzero()[0]
        return [int(i) for i in rows if int(i) in runner.input_batch.generators]

    def sample_keeping_discarded(self, *args, **kwargs):
        generators = [self.input_batch.generators[i] for i in discarded(self)]
        states = [g.get_state() for g in generators]
        try:
            return sample_tokens(self, *args, **kwargs)
        finally:
            for g, state in zip(generators, states):
                g.set_state(state)

    def bookkeeping_without_offsets(self, *args, **kwargs):
        generators = self.input_batch.generators
        held = {i: generators.pop(i) for i in discarded(self)}
        try:
            return bookkeeping(self, *args, **kwargs)
        finally:
            generators.update(held)

    SEEDED_PARTIAL_PREFILL.replace(sample_keeping_discarded)
    SEEDED_PARTIAL_PREFILL_OFFSET.replace(bookkeeping_without_offsets)
    _installed.add(SEEDED_PARTIAL_PREFILL.name)


def _use_eager_original(patch) -> None:
    if patch.name in _installed:
        return
    compiled = patch.require()
    patch.replace(compiled._torchdynamo_orig_callable)  # what torch.compile wrapped
    _installed.add(patch.name)


@contextlib.contextmanager
def generation_groups(groups: list[tuple[int, ...]] | None) -> Iterator[None]:
    """While vLLM builds its process groups, map its consecutive rank layout (ExternalDP x ... x TP, TP
    fastest) onto ``groups``: virtual rank replica * t_g + i is real rank groups[replica][i]."""
    if not groups or len(groups[0]) == 1:
        yield
        return
    real = [r for group in groups for r in group]
    original = GROUP_RANKS.require()

    def remapped(group_ranks, *args, **kwargs):
        return original([[real[r] for r in ranks] for ranks in group_ranks], *args, **kwargs)

    with GROUP_RANKS.swapped(remapped):
        yield


@contextlib.contextmanager
def shm_names(prefix: str | None) -> Iterator[None]:
    """vLLM-CPU's shared-memory segment names start with ``prefix`` for engines built inside."""
    if prefix is None:
        yield
        return
    name = staticmethod(lambda comm: f"{prefix}-{comm.unique_name}-[{'-'.join(str(r) for r in comm.ranks)}]-cpushm")
    with SHM_NAMES.swapped(name):
        yield


@contextlib.contextmanager
def keep_threads_and_rng() -> Iterator[None]:
    """The trainer's torch thread count, ``torch.set_num_threads`` and global RNG state, as they were
    before the block (vLLM's CPU worker changes all three while it starts)."""
    import torch

    set_threads = SET_NUM_THREADS.require()
    threads, rng = torch.get_num_threads(), torch.get_rng_state()
    try:
        yield
    finally:
        torch.set_num_threads = set_threads
        torch.set_num_threads(threads)
        torch.set_rng_state(rng)


ROUTE_CAPTURE = declare(
    "vllm.cpu_routed_experts_capture", "vllm", VLLM, "vllm.v1.worker.gpu_model_runner:GPUModelRunner.execute_model",
    "CPU, MoE routing replay (R3): vLLM returns the experts it routed each token to only from its V2 model runner "
    "(enable_return_routed_experts needs VLLM_USE_V2_MODEL_RUNNER, which needs Triton), which vLLM-CPU does not "
    "run. Its routers take a capture callback everywhere (BaseRouter.set_capture_fn, bound by "
    "routed_experts_capturer.bind_routed_experts_capturer): wrap the V1 runner's execute_model to file each "
    "forward's captured top-k under its requests' token positions, as the V2 runner's aux-output connector does")


class RouteCapture:
    """The experts vLLM-CPU's routers chose for every token it computed, per request: ``routes(request_id,
    length)`` -> [length, layers, k] int16. Bound to one engine's model runner (``ROUTE_CAPTURE``); the engine must
    not use prefix caching (a cached prefix is never computed, so never captured here)."""

    def __init__(self, runner, num_layers: int, top_k: int):
        from vllm.model_executor.layers.fused_moe.routed_experts_capturer import bind_routed_experts_capturer

        self.num_layers, self.top_k = num_layers, top_k
        self._step: dict[int, object] = {}  # layer -> this forward's top-k [tokens, k]
        self._routed: set[int] = set()  # the layers that route (a model's dense layers never capture)
        self._by_request: dict[str, object] = {}  # request id -> np.int16 [positions, layers, k]
        bind_routed_experts_capturer(runner.get_model(), self)
        original = ROUTE_CAPTURE.require(runner)

        def execute_model(scheduler_output, *args, **kwargs):
            self._step.clear()
            out = original(scheduler_output, *args, **kwargs)
            self._file(runner, scheduler_output)
            return out

        runner.execute_model = execute_model

    def capture(self, layer_id: int, topk_ids) -> None:  # vLLM's capturer interface
        self._step[layer_id] = topk_ids.detach().to("cpu", copy=True)
        self._routed.add(layer_id)

    def _file(self, runner, scheduler_output) -> None:
        import numpy as np

        if not self._step:
            return
        batch = runner.input_batch
        at = 0
        for i, rid in enumerate(batch.req_ids[:batch.num_reqs]):
            n = scheduler_output.num_scheduled_tokens.get(rid, 0)
            start = int(batch.num_computed_tokens_cpu[i])
            # a dense layer (GLM-4.5's first, Qwen-MoE's mlp_only_layers) routes nothing: -1, the trainer's NO_ROUTE
            rows = np.stack([self._step[layer][at:at + n].numpy() if layer in self._step else
                             np.full((n, self.top_k), -1, dtype=np.int16) for layer in range(self.num_layers)], 1)
            rid = rid.rsplit("-", 1)[0]  # the caller's id (InputProcessor.assign_request_id appends "-<8 hex>")
            held = self._by_request.get(rid)
            if held is None or len(held) < start + n:
                grown = np.full((max(start + n, 2 * len(held) if held is not None else 0), self.num_layers,
                                 self.top_k), -1, dtype=np.int16)
                if held is not None:
                    grown[:len(held)] = held
                held = self._by_request[rid] = grown
            held[start:start + n] = rows
            at += n

    def routes(self, request_id: str, length: int):
        """The routes of the request the caller named ``request_id``, for its first ``length`` tokens (forgotten
        afterwards)."""
        held = self._by_request.pop(request_id)
        if (held[:length, sorted(self._routed)] < 0).any():
            raise RuntimeError(f"vLLM request {request_id}: routes of some of its first {length} tokens were not "
                               "captured (a cached prefix?)")
        return held[:length]

    def forget(self) -> None:
        self._by_request.clear()
