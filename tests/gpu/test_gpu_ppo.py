"""PPO and GRPO on GPUs: megatron-core actor/critic/reference in bf16, vLLM rollout with CUDA graphs and
sleep mode, the 3D-HybridEngine transition over nccl, at the actor/rollout layouts users run.

Each case runs 2 steps through the real worker groups (its own Ray cluster, one process per GPU and role) on
a random Qwen2.5-0.5B-shaped model (conftest.py). After each step: the losses are finite; the step's weight
transition took time and moved what the layout implies (per rank (d_g - 1)/(t*p) * M with d_g = t*p/t_g,
nothing when d_g = 1); vLLM's greedy output on 8 validation prompts equals Hugging Face's greedy output (bf16
on the GPU, one prompt at a time) from the actor's exported weights; and the peak memory of every phase is
printed (``-s``). At the end the actor's linear weights must have moved.

Other architectures (``test_architecture_steps_on_gpu``): dense Qwen3 (QK-norm) on one GPU, and Qwen3-MoE on two
GPUs with expert parallelism 2, the actor's parameters offloaded between phases and token-budget micro-batches
(the layout whose Resharder met offloaded experts; tiny models, conftest.build_gpu_tiny), and Qwen3-MoE on one GPU
with routing replay R3 (vLLM's own routed-experts output, through its V2 model runner) and grouped-GEMM experts;
R3 at generation TP 2 and LoRA on the routed experts at EP 2 (two GPUs); GRPO sampling at temperature 0.7.

Run: ``bash tests/gpu/run.sh`` (1-8 GPUs; cases needing more GPUs than are visible are skipped).
"""

from __future__ import annotations

import math

import pytest

from tests.gpu.conftest import REPO, SCORER, gpu_ray_cluster, require_gpus

pytestmark = pytest.mark.gpu

STEPS = 2
N_PROBE = 8  # validation prompts whose greedy output is compared after each step
# Greedy outputs may part at a genuine near-tie: bf16 vLLM (flash attention, CUDA graphs, fused kernels)
# and bf16 HF round differently. On this random model bf16 moves each logit by ~0.017 standard deviations
# (of that position's logits; measured against fp32), which flips about 1 greedy token in 128. A divergence
# is accepted when HF's logit for vLLM's token is within NEAR_TIE standard deviations of HF's top logit
# (~6x that noise on a difference of two logits); with garbled weights vLLM's token typically lies a standard
# deviation or more below. At most half of the prompts may part this way.
NEAR_TIE = 0.15
SECOND_GENERATE_TIMEOUT_S = 90  # a healthy greedy generate of 8 short prompts takes about a second

TP2 = ["actor.megatron.tensor_model_parallel_size=2", "actor.megatron.sequence_parallel=true"]
LAYOUTS = {  # name -> (GPUs = resources.n_workers, overrides)
    "single": (1, []),
    # d_g = 2: each rank's generation shard is the whole model; the critic takes the same layout
    "actor_tp2": (2, [*TP2, "critic.megatron.tensor_model_parallel_size=2", "critic.megatron.sequence_parallel=true"]),
    "actor_pp2": (2, ["actor.megatron.pipeline_model_parallel_size=2",
                      "critic.megatron.pipeline_model_parallel_size=2"]),
    # one vLLM engine over both GPUs; d_g = 1: no transfer at all. The critic stays TP 1 x DP 2.
    "rollout_tp2": (2, [*TP2, "rollout.tensor_model_parallel_size=2"]),
    # generation TP above training TP: each engine's shard is cut from what its DP rank holds; nothing moves
    "rollout_tp2_from_dp2": (2, ["rollout.tensor_model_parallel_size=2"]),
    # context parallel 2 (actor, reference, critic): Transformer Engine's CP attention (p2p ring) on causal rows;
    # the CP ranks hold the same weights: d_g = 1 as at DP 2
    "cp2": (2, [f"{role}.megatron.context_parallel_size=2" for role in ("actor", "critic")]),
    # virtual pipeline stages: 2 stages of 2 chunks each through megatron's interleaved schedule over NCCL p2p
    # (the model's 24 layers divide by 4); the transition moves what PP 2 moves
    "vpp2": (2, [f"{role}.megatron.{key}=2" for role in ("actor", "critic")
                 for key in ("pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size")]),
}
ALGORITHMS = {
    "ppo": [],  # GAE with a critic; KL to the reference in the reward
    "grpo": ["algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=false", "actor.use_kl_loss=true",
             "rollout.n=2"],
}
OFFLOAD = [f"{role}.megatron.{kind}_offload=true" for role in ("actor", "critic")
           for kind in ("param", "grad", "optimizer")]
CASES = [pytest.param(layout, algo, [], id=f"{layout}-{algo}") for layout in LAYOUTS for algo in ALGORITHMS]
CASES.insert(2, pytest.param("single", "ppo", OFFLOAD, id="single-ppo-offload"))
# token-budget micro-batches: one packed row each, through TE's packed-sequence (THD) attention
DYNAMIC_BSZ = ["actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=4096", "critic.ppo_max_token_len_per_gpu=4096"]
CASES.append(pytest.param("single", "ppo", DYNAMIC_BSZ, id="single-ppo-dynamic_bsz"))
CASES.append(pytest.param("actor_tp2", "grpo", DYNAMIC_BSZ, id="actor_tp2-grpo-dynamic_bsz"))
# THD rows under TE's CP: each sequence padded to 2 x CP and split into its own chunks (TE's partition)
CASES.append(pytest.param("cp2", "grpo", DYNAMIC_BSZ, id="cp2-grpo-dynamic_bsz"))
# LoRA on TE's LayerNorm-linears with sequence parallelism (megatron/lora.py: the norm's output taken per rank);
# the reference is the actor with its adapters off; vLLM gets the merged weights
LORA = ["model.lora.rank=8", "actor.optim.lr=1e-3"]
CASES.append(pytest.param("actor_tp2", "grpo", LORA, id="actor_tp2-grpo-lora"))
# adapter-only sync: the base once, then the adapters into vLLM's LoRA (punica's GPU kernels) at every sync
CASES.append(pytest.param("actor_tp2", "grpo", [*LORA, "model.lora.merge=false"], id="actor_tp2-grpo-lora_adapters"))
# megatron's HybridDeviceOptimizer: half the distributed optimizer's Adam state stepped in host memory
OPTIMIZER_CPU_OFFLOAD = [f"actor.optim.override_optimizer_config.{k}" for k in (
    "optimizer_cpu_offload=true", "optimizer_offload_fraction=0.5", "overlap_cpu_optimizer_d2h_h2d=true")]
CASES.append(pytest.param("actor_tp2", "grpo", OPTIMIZER_CPU_OFFLOAD, id="actor_tp2-grpo-optimizer_cpu_offload"))
# sampling at temperature 0.7: vLLM's log-probs are of the tempered policy (processed_logprobs) and so are the
# trainer's; rollout correction measures the two (run_checked_steps bounds their KL)
CASES.append(pytest.param("single", "grpo", ["rollout.temperature=0.7"], id="single-grpo-temperature_0.7"))
R3 = ["actor.megatron.router_replay.mode=R3", "rollout.enable_rollout_routing_replay=true"]
ARCH_CASES = [  # (architecture, GPUs, overrides): GRPO with the KL loss, so the reference runs too
    pytest.param("qwen3", 1, [], id="qwen3-single-grpo"),
    pytest.param("qwen3_moe", 2, ["actor.megatron.expert_model_parallel_size=2", "actor.megatron.param_offload=true",
                                  *DYNAMIC_BSZ], id="qwen3_moe-ep2-param_offload-dynamic_bsz-grpo"),
    # routing replay R3: vLLM's own enable_return_routed_experts (its V2 model runner) feeds the trainer's routers;
    # the experts are TE's grouped GEMMs (TEGroupedMLP: weight{i} names, megatron/convert.py)
    pytest.param("qwen3_moe", 1, ["actor.megatron.router_replay.mode=R3", "rollout.enable_rollout_routing_replay=true",
                                  "actor.megatron.override_transformer_config.moe_grouped_gemm=true"],
                 id="qwen3_moe-single-r3-grouped_gemm-grpo"),
    # R3 at generation TP 2 under the external launcher: both ranks' schedulers need the routed-experts output plane
    # (patches/vllm_engine.py routes_on_every_rank)
    pytest.param("qwen3_moe", 2, [*R3, "rollout.tensor_model_parallel_size=2"], id="qwen3_moe-rollout_tp2-r3-grpo"),
    # LoRA on the routed experts at EP 2: TE's expert linears are built with TE's split off (megatron/lora.py _split)
    pytest.param("qwen3_moe", 2, ["actor.megatron.expert_model_parallel_size=2", "model.lora.rank=8",
                                  "actor.optim.lr=1e-3"], id="qwen3_moe-ep2-lora-grpo"),
]
MAX_ROLLOUT_KL = 0.05  # vLLM's and the trainer's log-probs of the sampled tokens, both bf16: their KL stays far below


def gpu_config(assets, tmp_path, n_workers: int, *overrides, model_dir=None):
    from hybridflow.plan import load_experiment

    return load_experiment([str(REPO / "configs" / "ppo_megatron.yaml")], [
        f"model.path={model_dir or assets.model_dir}", f"data.train_files=[{assets.train_file}]",
        f"data.val_files=[{assets.val_file}]", f"trainer.output_dir={tmp_path}/run", "trainer.save_hf_at_end=false",
        "prepare.enable=false", f"reward.name={SCORER}",
        "data.batch_size=8", "data.val_batch_size=8", "data.max_prompt_length=16", "data.max_response_length=8",
        "actor.ppo_mini_batch_size=8", "actor.ppo_micro_batch_size_per_gpu=4", "actor.log_prob_micro_batch_size_per_gpu=8",
        "critic.ppo_mini_batch_size=8", "critic.ppo_micro_batch_size_per_gpu=4", "critic.log_prob_micro_batch_size_per_gpu=8",
        "actor.optim.lr=1.0e-4", "critic.optim.lr=1.0e-4",
        "actor.megatron.dtype=bfloat16", "critic.megatron.dtype=bfloat16", "rollout.dtype=bfloat16",
        f"resources.n_workers={n_workers}", "resources.gpus_per_worker=1", "resources.cpus_per_worker=1",
        "rollout.gpu_memory_utilization=0.3", "rollout.free_cache_engine=true", "rollout.enforce_eager=false",
        *overrides])


# --- helpers --------------------------------------------------------------------------------------

def with_meta(batch, **meta):
    from hybridflow.protocol import Batch

    return Batch(tensors=dict(batch.tensors), non_tensors=dict(batch.non_tensors), meta={**batch.meta, **meta})


def _vllm_tokens(batch) -> list[list[int]]:
    return [r[m.bool()].tolist() for r, m in zip(batch.tensors["responses"], batch.tensors["response_mask"])]


def _prompt_tokens(batch) -> list[list[int]]:
    return [r[m.bool()].tolist() for r, m in zip(batch.tensors["input_ids"], batch.tensors["attention_mask"])]


class HFReference:
    """Hugging Face's Qwen2 in bf16 on the driver's GPU, loaded with the actor's exported weights."""

    def __init__(self, model_dir):
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(model_dir))
        self.eos, self.pad = tok.eos_token_id, tok.pad_token_id
        config = AutoConfig.from_pretrained(str(model_dir))
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        with torch.device("cuda"):  # initialise on the GPU: random init of 0.5B params on the CPU is slow
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        self.model = model.to(device="cuda", dtype=torch.bfloat16).eval()  # a no-op where both took effect

    def load(self, state: dict) -> None:
        if any(".mlp.experts." in k for k in state):
            return self._load_through_checkpoint(state)
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        allowed = {"lm_head.weight"} if self.tied else set()  # the tied head is the embedding itself
        assert not unexpected and set(missing) <= allowed, \
            f"export vs HF names: missing {missing}, unexpected {unexpected}"

    def _load_through_checkpoint(self, state: dict) -> None:
        """MoE: transformers 5 keeps each layer's experts fused (``mlp.experts.gate_up_proj``) and converts
        the per-expert checkpoint names only in from_pretrained, so the state goes through a checkpoint."""
        import tempfile

        import torch
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM

        config = self.model.config
        with tempfile.TemporaryDirectory() as folder:
            config.save_pretrained(folder)
            save_file({k: v.detach().cpu().contiguous() for k, v in state.items()}, f"{folder}/model.safetensors",
                      metadata={"format": "pt"})
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
        self.model = model.to("cuda").eval()

    def greedy(self, prompt: list[int], max_new_tokens: int):
        """(tokens, per-step logits) of HF's greedy continuation of one prompt (no padding involved)."""
        import torch

        ids = torch.tensor([prompt], device="cuda")
        with torch.no_grad():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                      do_sample=False, eos_token_id=self.eos, pad_token_id=self.pad,
                                      output_logits=True, return_dict_in_generate=True)
        return out.sequences[0, len(prompt):].tolist(), out.logits

    def close(self) -> None:
        import torch

        self.model = None
        torch.cuda.empty_cache()  # give GPU 0 back before the next case's vLLM checks its free memory


def compare_greedy(hf: HFReference, prompts, vllm_out, max_new_tokens: int) -> tuple[list, list]:
    """(near-ties, failures): prompts whose vLLM and HF greedy outputs part, as readable lines."""
    ties, failures = [], []
    for i, (prompt, got) in enumerate(zip(prompts, vllm_out)):
        want, logits = hf.greedy(prompt, max_new_tokens)
        if got == want:
            continue
        j = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if j is None:  # one stops (EOS) where the other goes on with no differing token: never a tie
            failures.append(f"prompt {i}: vLLM {got} vs HF {want} (lengths differ)")
            continue
        row = logits[j][0].float()
        gap = float(row[want[j]] - row[got[j]]) / float(row.std())
        line = f"prompt {i} token {j}: vLLM {got[j]} vs HF {want[j]}, HF logit gap {gap:.3f} std ({got} vs {want})"
        (ties if gap <= NEAR_TIE else failures).append(line)
    return ties, failures


def print_phases(label: str, metrics: dict, timings: dict) -> None:
    """The step's peak memory per phase (GiB, rank 0 or the collecting ranks), transition and timings."""
    mem = {k: v for k, v in metrics.items() if k.startswith("memory/")}
    print(f"\n[{label}] peak memory per phase (GiB):")
    for phase in sorted({k.split("/")[1] for k in mem}):
        values = "  ".join(f"{k.rsplit('/', 1)[1]}={v:.2f}" for k, v in sorted(mem.items()) if k.split("/")[1] == phase)
        print(f"    {phase:<14} {values}")
    r = {k.split("/", 1)[1]: v for k, v in metrics.items() if k.startswith("reshard/")}
    mib = {k: r.get(k, 0) / 2**20 for k in ("bytes_received", "bytes_sent", "peak_extra_bytes")}
    print(f"    transition: {mib['bytes_received']:.1f} MiB received, {mib['bytes_sent']:.1f} MiB sent, "
          f"peak extra {mib['peak_extra_bytes']:.1f} MiB, {r.get('seconds', 0):.2f} s")
    print("    time: " + "  ".join(f"{k[5:-2]}={v:.2f}s" for k, v in sorted(timings.items())))


# --- the cases -------------------------------------------------------------------------------------

def run_checked_steps(cfg, label: str, model_dir, check_transition) -> None:
    """STEPS steps of ``cfg``; after each: finite losses, a transition that ran (``check_transition(bytes
    received per rank)`` judges its size), vLLM greedy == HF greedy from the actor's exported weights; at the
    end, the actor's linear weights moved."""
    import torch

    from hybridflow.workers.common import load_hf_folder
    from tests.integration.conftest import run_steps

    initial = load_hf_folder(str(model_dir))[1]
    last: dict = {}
    hf = HFReference(model_dir)

    def check(trainer, step, metrics):
        timings = trainer.timer.pop()
        print_phases(f"{label} step {step}", metrics, timings)
        keys = ["actor/pg_loss", "actor/grad_norm"]
        keys += ["critic/vf_loss", "critic/grad_norm"] if trainer.critic is not None else []
        keys += ["actor/kl_loss"] if cfg.actor.use_kl_loss else []
        for key in keys:
            assert key in metrics and math.isfinite(metrics[key]), (key, metrics.get(key))
        assert metrics["reshard/seconds"] > 0, "the update was not followed by a weight transition"
        if "rollout_corr/kl" in metrics:  # the same tempered policy on both sides, whatever the temperature
            assert abs(metrics["rollout_corr/kl"]) < MAX_ROLLOUT_KL, ("rollout_corr/kl", metrics["rollout_corr/kl"])
        check_transition(metrics["reshard/bytes_received"])

        actor = trainer.actor_rollout
        probe = with_meta(trainer.val_data.batch(list(range(N_PROBE))), temperature=0.0)
        state = actor.export_hf_state_dict()[0]
        greedy = actor.generate(probe)
        # Work-around: generate() puts vLLM to sleep (weights and KV cache) but wakes only the KV cache,
        # so a second generate without a sync in between finds the weights asleep and never returns
        # (test_rollout_after_validation_without_sync). Re-sync so that the next step can roll out.
        actor.sync_weights()
        hf.load(state)
        ties, failures = compare_greedy(hf, _prompt_tokens(probe), _vllm_tokens(greedy), cfg.data.max_response_length)
        for line in ties:
            print(f"    near-tie accepted: {line}")
        assert not failures, f"step {step}: vLLM greedy != HF greedy from the actor's weights:\n" + "\n".join(failures)
        assert len(ties) <= N_PROBE // 2, f"step {step}: {len(ties)} of {N_PROBE} prompts part at near-ties"
        last.clear()
        last.update(state)

    try:
        with gpu_ray_cluster():
            history = run_steps(cfg, STEPS, check)
    finally:
        hf.close()
    if any(h["actor/grad_norm"] > 0 for h in history):
        linear = [k for k in initial if k.endswith("proj.weight")]
        unchanged = [k for k in linear if torch.equal(initial[k], last[k])]
        assert not unchanged, f"actor weights the updates did not move: {unchanged[:5]}"


@pytest.mark.timeout(420)
@pytest.mark.parametrize("layout,algorithm,extra", CASES)
def test_ppo_steps_on_gpu(layout, algorithm, extra, gpu_assets, tmp_path):
    n_gpus, layout_overrides = LAYOUTS[layout]
    require_gpus(n_gpus)
    cfg = gpu_config(gpu_assets, tmp_path, n_gpus, *layout_overrides, *ALGORITHMS[algorithm], *extra)
    label = f"{layout}-{algorithm}" + ("-offload" if extra else "")
    mp = cfg.actor.megatron
    t, p, t_g = mp.tensor_model_parallel_size, mp.pipeline_model_parallel_size, cfg.rollout.tensor_model_parallel_size
    d_g = t * p // t_g
    expected_bytes = (d_g - 1) / (t * p) * gpu_assets.param_bytes  # per rank, the paper's formula

    def check_transition(received):
        if d_g > 1:
            assert received > 0, f"d_g = {d_g}: the transition received nothing"
            ratio = received / expected_bytes
            print(f"    received / ((d_g-1)/(t*p) * M) = {ratio:.3f}")
            assert 0.9 <= ratio <= 1.1, f"received {received:.0f} B per rank, formula {expected_bytes:.0f} B"
        else:
            assert received == 0, f"d_g = 1: each rank holds its generation shard, yet {received:.0f} B arrived"

    run_checked_steps(cfg, label, gpu_assets.model_dir, check_transition)


@pytest.mark.timeout(420)
@pytest.mark.parametrize("arch,n_gpus,extra", ARCH_CASES)
def test_architecture_steps_on_gpu(arch, n_gpus, extra, gpu_assets, arch_models, tmp_path, request):
    """Each would have caught a crash of the GPU path: a dense Qwen3 on megatron's local spec where TE is
    absent, and EP 2 with param_offload (the Resharder built while the experts were offloaded)."""
    require_gpus(n_gpus)
    model_dir = arch_models(arch)
    cfg = gpu_config(gpu_assets, tmp_path, n_gpus, *ALGORITHMS["grpo"], *extra, model_dir=model_dir)
    ep = cfg.actor.megatron.expert_model_parallel_size

    def check_transition(received):
        if ep > 1:  # every vLLM engine (TP 1) holds every expert: the other rank's arrive by all-to-all
            assert received > 0, f"EP {ep}: the experts of the other ranks never arrived"
        else:
            assert received == 0, f"one rank, TP 1 -> TP 1: nothing should move, yet {received:.0f} B arrived"

    run_checked_steps(cfg, request.node.callspec.id, model_dir, check_transition)


@pytest.mark.timeout(420)
@pytest.mark.parametrize("partial_rollout", [True, False], ids=["serving", "per_call"])
def test_separate_async_on_gpu(partial_rollout, gpu_assets, tmp_path):
    """separate_async on two GPUs: one trainer and one standalone vLLM rollout worker, the checkpoint engine over
    NCCL, a batch generated ahead. With partial rollouts the pool serves continuously (workers/serving.py: vLLM's
    engine stepped from a thread of its own, which binds the worker's GPU, device.bind_thread); without, one
    batch a call. After every push: the pool's greedy output equals HF greedy at the trainer's weights (near-ties
    as above) and the rollout rank received exactly its vLLM shard in bf16."""
    require_gpus(2)
    from transformers import AutoConfig

    from tests.integration.conftest import run_steps
    from tests.integration.test_async_modes import _shard_formula

    cfg = gpu_config(gpu_assets, tmp_path, 1, *ALGORITHMS["grpo"], "schedule.mode=separate_async",
                     "resources.rollout_n_workers=1", "schedule.num_warmup_batches=1", "schedule.parameter_sync_step=1",
                     f"schedule.partial_rollout={str(partial_rollout).lower()}")
    hf_cfg, hf = AutoConfig.from_pretrained(str(gpu_assets.model_dir)), HFReference(gpu_assets.model_dir)

    def check(trainer, step, metrics):
        print_phases(f"separate_async step {step}", metrics, trainer.timer.pop())
        assert math.isfinite(metrics["actor/pg_loss"]) and metrics["async/version_lag_max"] <= 1, metrics
        state = trainer.actor_rollout.export_hf_state_dict()[0]
        measured, formula = _shard_formula(state, hf_cfg, 1, 2)
        assert metrics["weight_sync/bytes_received_per_rank"] == measured == formula, (metrics, measured, formula)
        probe = with_meta(trainer.val_data.batch(list(range(N_PROBE))), temperature=0.0)
        greedy = trainer.generator.generate(probe)
        hf.load(state)
        ties, failures = compare_greedy(hf, _prompt_tokens(probe), _vllm_tokens(greedy), cfg.data.max_response_length)
        assert not failures, f"step {step}: the pool's greedy != HF greedy at the trainer's weights:\n" + "\n".join(failures)
        assert len(ties) <= N_PROBE // 2, f"step {step}: {len(ties)} of {N_PROBE} prompts part at near-ties"

    try:
        with gpu_ray_cluster():
            run_steps(cfg, STEPS + 1, check)
    finally:
        hf.close()


@pytest.mark.timeout(300)
def test_rollout_after_validation_without_sync(gpu_assets, tmp_path):
    """Two generates without a weight sync between them: ``fit()`` validates at step 0 and then rolls out,
    ``validate()`` generates once per ``data.val_batch_size`` chunk, ReMax adds a greedy baseline per step.
    The first generate ends with vLLM asleep; the second must wake what it needs and return."""
    require_gpus(1)
    from transformers import AutoTokenizer

    from hybridflow.controller.decorator import get_register_spec
    from hybridflow.plan import resolve
    from hybridflow.trainer.placement import build_worker_groups
    from hybridflow.trainer.ppo import PPODriver
    from hybridflow.trainer.preflight import load_prompts
    from hybridflow.workers.actor_rollout_ref import ActorRolloutRefWorker

    cfg = gpu_config(gpu_assets, tmp_path, 1, "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=false",
                     "rollout.n=2")  # no critic, no reference: the smallest build
    with gpu_ray_cluster():
        plan, tokenizer = resolve(cfg), AutoTokenizer.from_pretrained(cfg.model.path)
        workers = build_worker_groups(cfg, plan)
        stuck = False
        try:
            trainer = PPODriver(cfg, plan, tokenizer, workers, *load_prompts(cfg, tokenizer))
            probe = with_meta(trainer.val_data.batch(list(range(N_PROBE))), temperature=0.0)
            first = _vllm_tokens(trainer.actor_rollout.generate(probe))
            # The second call through a future with a deadline: if it hangs, the test fails instead.
            spec = get_register_spec(ActorRolloutRefWorker.generate)
            future = trainer.actor_rollout._run("generate", spec.dispatch_mode, False, (probe,), {})
            try:
                second = _vllm_tokens(future.get(timeout=SECOND_GENERATE_TIMEOUT_S))
            except TimeoutError:
                stuck = True
                pytest.fail(f"a second generate without a sync in between did not return within "
                            f"{SECOND_GENERATE_TIMEOUT_S}s: the first one left vLLM's weights asleep "
                            "(ActorRolloutRefWorker.generate wakes only the KV cache)", pytrace=False)
            assert second == first, "greedy output changed between two generates with the same weights"
        finally:
            if not stuck:  # a stuck rank never answers close(); the cluster's shutdown kills it
                workers.shutdown()
