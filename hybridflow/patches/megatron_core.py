"""megatron-core: running it without CUDA, and the few places where its behaviour is replaced.

Without CUDA (``enable_cpu``, ``cpu_scope``): megatron-core allocates with ``device='cuda'`` or an int
device, calls ``Tensor.cuda()``, compares ``p.type()`` with 'torch.cuda.FloatTensor' and keeps CUDA RNG
states. A TorchFunctionMode scoped to megatron calls rewrites CUDA devices to CPU (torch function modes
are thread-local: a global one would leak into, or miss, other threads), and the RNG tracker keeps its
named states on the CPU generator; activation recompute saves and replays those, with no CUDA generator
state, and re-runs its forwards inside that mode. All of it is inert when a GPU is visible.

Everywhere: MoE's router GEMM without Transformer Engine (``define_missing_router_gemm``), grouped-GEMM
experts without the grouped_gemm package (``torch_grouped_gemm``), the pipeline's shape exchange at size 2, and
an optimizer step that never applies a non-finite update. The layers' own patches (norm, RoPE, attention) are in
megatron_layers.py.
"""

from __future__ import annotations

import contextlib
import math
import threading

from hybridflow.patches import torch_cuda
from hybridflow.patches.registry import declare

MCORE = ">=0.16.1,<0.17"
_RANDOM = "megatron.core.tensor_parallel.random"
RNG_TRACKER_CLASS = declare(
    "megatron.cpu_rng_tracker_class", "megatron-core", MCORE, f"{_RANDOM}:CudaRNGStatesTracker",
    "CPU: named RNG states on the CPU generator (attention dropout and recompute fork them)")
RNG_TRACKER = declare("megatron.cpu_rng_tracker", "megatron-core", MCORE, f"{_RANDOM}:_CUDA_RNG_STATE_TRACKER",
                      "CPU: the tracker instance megatron's get_cuda_rng_tracker() returns")
RNG_TRACKER_READY = declare(
    "megatron.cpu_rng_tracker_initialized", "megatron-core", MCORE, f"{_RANDOM}:_CUDA_RNG_STATE_TRACKER_INITIALIZED",
    "CPU: marks the tracker above as built, so megatron never builds its CUDA one")
RNG_TRACKER_INIT = declare("megatron.cpu_initialize_rng_tracker", "megatron-core", MCORE,
                           f"{_RANDOM}:initialize_rng_tracker", "CPU: a no-op, the tracker above stays")
MANUAL_SEED = declare(
    "megatron.cpu_model_parallel_seed", "megatron-core", MCORE, f"{_RANDOM}:model_parallel_cuda_manual_seed",
    "stood in for, not replaced, on CPU: the same tracker names and seed offsets, on the CPU generator "
    "(megatron's own seeds only the CUDA generators)")
CUDA_RNG_GET = declare(
    "megatron.cpu_get_cuda_rng_state", "megatron-core", MCORE, f"{_RANDOM}:_get_cuda_rng_state",
    "CPU: activation recompute (tensor_parallel.checkpoint, CheckpointWithoutOutput) saves the CUDA "
    "generator's state beside the CPU one; without CUDA there is none: an empty placeholder")
CUDA_RNG_SET = declare(
    "megatron.cpu_set_cuda_rng_state", "megatron-core", MCORE, f"{_RANDOM}:_set_cuda_rng_state",
    "CPU: a no-op for that placeholder (megatron's would queue a CUDA call that never runs, one per "
    "recomputed layer, for good)")
RECOMPUTE_SCOPE = declare(
    "megatron.cpu_recompute_in_device_scope", "megatron-core", MCORE, f"{_RANDOM}:_fork_rng",
    "CPU: activation recompute re-runs layers' forwards inside the backward, where the device-rewriting "
    "mode below is not active (they allocate on 'cuda'); both recompute paths run them inside this fork")
DEVICE_SCOPE = declare(
    "megatron.cpu_device_rewrite", "megatron-core", MCORE, "torch.overrides:TorchFunctionMode",
    "CPU: inside megatron calls, tensor factories and .to()/.cuda() with a CUDA device (or an int) make "
    "CPU tensors, and Tensor.type() reports the CUDA type names megatron's optimizer checks")
OPTIMIZER_STEP = declare(
    "megatron.optimizer_step_skips_nonfinite", "megatron-core", MCORE,
    "megatron.core.optimizer.optimizer:MegatronOptimizer.step",
    "stood in for: the same calls in the same order (prepare_grads, get_grad_norm, clip, "
    "step_with_ready_grads) except that a non-finite grad norm skips the update; megatron skips only on "
    "an fp16 loss-scaler overflow and would write NaN into bf16/fp32 weights")
MOE_DTOH = declare(
    "megatron.cpu_moe_dispatch_without_streams", "megatron-core", MCORE,
    "megatron.core.transformer.moe.token_dispatcher:MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize",
    "CPU: the all-to-all MoE dispatcher copies its split sizes to the host on a side CUDA stream and waits "
    "on an event (a torch.cuda.Stream made in __init__); on CPU the same values become the same host "
    "types (numpy split sizes, which all_to_all_single takes) with no stream or event")
MOE_DTOH_STREAM = declare(
    "megatron.cpu_moe_dispatch_stream", "megatron-core", MCORE,
    "megatron.core.transformer.moe.token_dispatcher:MoEAlltoAllTokenDispatcher.cuda_dtoh_stream",
    "CPU: set to a placeholder so that the dispatcher's __init__ does not create a torch.cuda.Stream")
MOE_ROUTER_GEMM = declare(
    "megatron.moe_router_gemm_without_te", "megatron-core", MCORE,
    "megatron.core.transformer.moe.moe_utils:te_general_gemm",
    "without Transformer Engine moe_utils never defines te_general_gemm (its import sits in the failed TE "
    "try block) but RouterGatingLinearFunction reads it for any router dtype but fp64 (NameError): "
    "defined as None, so the router takes its torch.mm path; on every device (a GPU without TE too: "
    "megatron.model.layer_spec defines it for MoE layers). Untouched where TE's import succeeded")

GROUPED_GEMM = declare(
    "megatron.grouped_gemm_from_torch", "megatron-core", MCORE, "megatron.core.transformer.moe.grouped_gemm_util:ops",
    "megatron's GroupedMLP (moe_grouped_gemm where Transformer Engine is absent) calls grouped_gemm.ops.gmm, a CUDA "
    "extension (fanshiqing/grouped_gemm) that CPUs and most GPU images lack; torch has the same grouped GEMM "
    "(torch.nn.functional.grouped_mm, bf16 on CPU; its autograd gives both gradients): used where the package is "
    "missing, untouched where it imports")
GROUPED_MLP_EAGER = declare(
    "megatron.cpu_grouped_mlp_eager", "megatron-core", MCORE, "megatron.core.transformer.moe.experts:jit_fuser",
    "CPU: GroupedMLP wraps its GLU and probability scaling in jit_fuser (torch.compile), which on CPU builds C++ "
    "with inductor in every process (a compiler, seconds, code per vector ISA); eager computes the same")
SHAPE_EXCHANGE = declare(
    "megatron.p2p_shape_exchange_order", "megatron-core", MCORE,
    "megatron.core.pipeline_parallel.p2p_communication:P2PCommunicator._communicate_shapes",
    "with variable_seq_lengths, the interleaved schedule's two-way exchange at pipeline size 2 (previous rank == "
    "next rank) crosses the shapes: every rank posts send_prev before send_next and recv_prev before recv_next, so "
    "a rank's first send to its peer (its grad's shape) meets the peer's first receive (an activation's); the "
    "buffers get the wrong sizes (NVIDIA/Megatron-LM#5271, #1485). Posting send_next before send_prev pairs them; "
    "at other sizes each op has a peer of its own and the order changes nothing")

_lock = threading.Lock()
_cpu_enabled = False
_shape_exchange_fixed = False


def fix_shape_exchange_order() -> None:
    """Install the pipeline's shape exchange that pairs a two-way exchange between two ranks (``SHAPE_EXCHANGE``):
    sends to the next rank before sends to the previous one, receives from the previous rank before the next,
    so one rank's k-th send to its peer is the peer's k-th receive from it. Same ops as megatron's otherwise."""
    global _shape_exchange_fixed
    with _lock:
        if _shape_exchange_fixed:
            return
        SHAPE_EXCHANGE.require()
        SHAPE_EXCHANGE.replace(_communicate_shapes_paired)
        _shape_exchange_fixed = True


def _communicate_shapes_paired(self, tensor_send_next, tensor_send_prev, recv_prev, recv_next):
    import torch
    import torch.distributed as dist

    def shape_of(t):
        return torch.tensor(t.size(), device=torch.cuda.current_device(), dtype=torch.int64)

    recv_prev_shape = torch.empty((3,), device=torch.cuda.current_device(), dtype=torch.int64) if recv_prev else None
    recv_next_shape = torch.empty((3,), device=torch.cuda.current_device(), dtype=torch.int64) if recv_next else None
    ops = []
    if tensor_send_next is not None:
        ops.append(dist.P2POp(dist.isend, shape_of(tensor_send_next), self.next_rank, self.pp_group))
    if recv_prev_shape is not None:
        ops.append(dist.P2POp(dist.irecv, recv_prev_shape, self.prev_rank, self.pp_group))
    if tensor_send_prev is not None:
        ops.append(dist.P2POp(dist.isend, shape_of(tensor_send_prev), self.prev_rank, self.pp_group))
    if recv_next_shape is not None:
        ops.append(dist.P2POp(dist.irecv, recv_next_shape, self.next_rank, self.pp_group))
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
        torch.cuda.synchronize()  # as megatron: batch_isend_irecv's race (p2p_communication.py)
    return (recv_prev_shape.tolist() if recv_prev_shape is not None else [0, 0, 0],
            recv_next_shape.tolist() if recv_next_shape is not None else [0, 0, 0])


# --- without CUDA -----------------------------------------------------------------------------------

class CpuRNGStatesTracker:
    """Named RNG states on the CPU generator, with the interface of megatron's CudaRNGStatesTracker."""

    def __init__(self, *_, **__):
        self.reset()
        self.use_cudagraphable_rng = False

    def reset(self):
        self._is_initialized = False
        self.states_ = {}
        self.seeds_ = set()

    def is_initialized(self):
        return self._is_initialized

    def get_states(self):
        return dict(self.states_)

    def set_states(self, states):
        self._is_initialized = True
        self.states_ = states

    def add(self, name, seed):
        import torch

        self._is_initialized = True
        if seed in self.seeds_ or name in self.states_:
            raise ValueError(f"rng state {name!r} / seed {seed} already registered")
        self.seeds_.add(seed)
        saved = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(saved)

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        import torch

        if name not in self.states_:
            raise KeyError(f"rng state {name!r} was not added")
        saved = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)


def enable_cpu() -> None:
    """Install the process-wide CPU patches once (nothing when a GPU is visible)."""
    global _cpu_enabled
    from hybridflow import device  # lazy: torch; the patches load with `import hybridflow`

    if device.has_gpu():
        return
    with _lock:
        if _cpu_enabled:
            return
        torch_cuda.install_cpu_shims()
        RNG_TRACKER_CLASS.replace(CpuRNGStatesTracker)
        RNG_TRACKER.replace(CpuRNGStatesTracker())
        RNG_TRACKER_READY.replace(True)
        RNG_TRACKER_INIT.replace(lambda *a, **k: None)
        # Recompute restores the CPU generator and the tracker's states (both on the CPU generator here)
        # itself; only the CUDA generator's part has nothing to hold.
        CUDA_RNG_GET.replace(_no_cuda_rng_state)
        CUDA_RNG_SET.replace(lambda *a, **k: None)
        fork = RECOMPUTE_SCOPE.require()

        @contextlib.contextmanager
        def fork_in_cpu_scope():
            with fork(), _cuda_to_cpu()():
                yield

        RECOMPUTE_SCOPE.replace(fork_in_cpu_scope)
        define_missing_router_gemm()
        MOE_DTOH.replace(_moe_split_sizes_on_host)
        MOE_DTOH_STREAM.replace("no CUDA stream on CPU")
        _cpu_enabled = True


def _moe_split_sizes_on_host(self, point, tokens_per_expert=None):
    """MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize without CUDA streams: at the copy point, the
    split sizes as numpy arrays (megatron's moe_utils.maybe_move_tensor_to_cpu converts only CUDA tensors,
    and gloo's all_to_all_single rejects tensor split sizes)."""
    if self.drop_and_pad or point != self.cuda_dtoh_point:
        return tokens_per_expert
    for name in ("input_splits", "output_splits", "output_splits_tp"):
        value = getattr(self, name, None)
        if value is not None and hasattr(value, "numpy"):
            setattr(self, name, value.numpy())
    return tokens_per_expert


def torch_grouped_gemm() -> None:
    """Give megatron's GroupedMLP torch's grouped GEMM where the grouped_gemm package is missing
    (``GROUPED_GEMM``), and on CPU its activations eagerly (``GROUPED_MLP_EAGER``)."""
    from megatron.core.transformer.moe import experts, grouped_gemm_util

    from hybridflow import device

    if not grouped_gemm_util.grouped_gemm_is_available():
        ops = _TorchGroupedGemm()
        GROUPED_GEMM.replace(ops)
        grouped_gemm_util.grouped_gemm = ops  # what grouped_gemm_is_available() tests: the package's stand-in
    if not device.has_gpu():
        GROUPED_MLP_EAGER.replace(lambda fn: fn, experts)


class _TorchGroupedGemm:
    """grouped_gemm's ``ops.gmm(a [T, K], b [E, K, N] (trans_b: [E, N, K]), batch_sizes [E]) -> [T, N]``: the rows
    of ``a`` in ``batch_sizes`` consecutive groups, group e times b[e]."""

    @property
    def ops(self):
        return self

    @staticmethod
    def gmm(a, b, batch_sizes, trans_b: bool = False):
        import torch

        offsets = batch_sizes.to(device=a.device).cumsum(0).to(torch.int32)
        return torch.nn.functional.grouped_mm(a, b.transpose(-1, -2) if trans_b else b, offs=offsets)


def define_missing_router_gemm() -> None:
    """``moe_utils.te_general_gemm = None`` where megatron's TE import failed, on any device: the GPU path
    without TE (megatron-core 0.16.1 moe_utils.py imports it inside ``try: import transformer_engine``;
    RouterGatingLinearFunction.forward tests ``te_general_gemm is not None``, a NameError when undefined)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, MOE_ROUTER_GEMM.attribute):  # nothing to replace: defined
        setattr(moe_utils, MOE_ROUTER_GEMM.attribute, None)


def _no_cuda_rng_state(*_, **__):
    import torch

    return torch.empty(0, dtype=torch.uint8)


def model_parallel_seed(seed: int) -> None:
    """megatron's model_parallel_cuda_manual_seed; on CPU the same tracker states on the CPU generator."""
    import torch

    from hybridflow import device  # lazy: torch; the patches load with `import hybridflow`

    torch.manual_seed(seed)
    seed_cuda = MANUAL_SEED.require()
    if device.has_gpu():
        seed_cuda(seed)
        return
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mrandom

    tracker = mrandom._CUDA_RNG_STATE_TRACKER
    tracker.reset()
    tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + ps.get_tensor_model_parallel_rank())
    tracker.add(mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024)


_cuda_to_cpu_mode = None


def _cuda_to_cpu():
    """The TorchFunctionMode class (built on first use: importing torch here would make
    ``import hybridflow`` heavy)."""
    global _cuda_to_cpu_mode
    if _cuda_to_cpu_mode is not None:
        return _cuda_to_cpu_mode
    import torch

    base = DEVICE_SCOPE.require()
    cpu = torch.device("cpu")
    cuda_type_names = {"torch.FloatTensor": "torch.cuda.FloatTensor", "torch.HalfTensor": "torch.cuda.HalfTensor",
                       "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor"}

    def is_cuda(dev) -> bool:
        if isinstance(dev, bool):
            return False
        if isinstance(dev, int):
            return True  # megatron passes torch.cuda.current_device() (an int) as a device
        if isinstance(dev, str):
            return dev.startswith("cuda")
        return isinstance(dev, torch.device) and dev.type == "cuda"

    class CudaToCpu(base):
        """Rewrites CUDA devices to CPU for every torch call made inside it."""

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if func is torch.Tensor.cuda:
                return args[0]
            if func is torch.Tensor.type and len(args) == 1 and not kwargs:
                name = func(*args)
                return cuda_type_names.get(name, name)
            if "device" in kwargs and is_cuda(kwargs["device"]):
                kwargs["device"] = cpu
            if func is torch.Tensor.to and len(args) > 1 and is_cuda(args[1]):
                args = (args[0], cpu, *args[2:])
            return func(*args, **kwargs)

    _cuda_to_cpu_mode = CudaToCpu
    return CudaToCpu


def cpu_scope():
    """Context for megatron calls: rewrites CUDA devices to CPU when no GPU is visible."""
    from hybridflow import device  # lazy: torch; the patches load with `import hybridflow`

    if device.has_gpu():
        return contextlib.nullcontext()
    enable_cpu()
    return _cuda_to_cpu()()


# --- everywhere -------------------------------------------------------------------------------------

def optimizer_step(optimizer) -> tuple[bool, float]:
    """megatron-core's ``optimizer.step()`` that skips a non-finite update; (applied, grad norm). The
    norm is reduced over the model-parallel (and distributed-optimizer) ranks, so every rank decides alike."""
    OPTIMIZER_STEP.require()
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    if optimizer.prepare_grads():  # fp16 overflow: megatron's scaler has already lowered the scale
        return False, float("nan")
    grad_norm = float(optimizer.get_grad_norm())
    if not math.isfinite(grad_norm):
        return False, grad_norm
    # One optimizer per parameter kind (dense, experts) under a ChainedOptimizer, each clipped by the total
    # norm, as ChainedOptimizer.step does
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        params = [] if getattr(part, "is_stub_optimizer", False) else part.get_parameters()
        if params and part.config.clip_grad > 0.0:
            clip_grad_by_total_norm_fp32(
                params, max_norm=part.config.clip_grad, total_norm=grad_norm,
                use_decoupled_grad=part.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
    return bool(optimizer.step_with_ready_grads()), grad_norm
