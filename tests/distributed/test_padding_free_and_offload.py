"""The GPU path's memory and attention contracts, run on CPU with the same code.

- Padding-free attention: the workers' forward passes no padding mask (causal only, as TE's flash/cuDNN
  attention runs it); on batches with very uneven prompt and response lengths its log-probs, entropies and
  values equal a forward with the full padding mask in the original left-padded layout.
- Offload: parameters, gradients and optimizer state moved to host memory between uses (storage freed)
  give bit-identical training to keeping them resident, in fp32 and bf16.
- bf16: the same roles train in bf16 (megatron's fp32 main params) with finite, moving losses.
"""

from __future__ import annotations

import pytest
import torch

from hybridflow.spawn import run_ranks
from tests.numerics import assert_close, used_fraction

pytestmark = pytest.mark.distributed

P, R = 12, 6
PROMPT_PADS = [0, 11, 5, 9, 2, 7]  # left padding per row: prompts of 12, 1, 7, 3, 10 and 5 tokens
RESPONSE_LENS = [6, 1, 4, 0, 3, 6]


def uneven_batch():
    from hybridflow.protocol import Batch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 40, (len(PROMPT_PADS), P + R), generator=g)
    mask = torch.ones_like(ids)
    for i, (pad, n) in enumerate(zip(PROMPT_PADS, RESPONSE_LENS)):
        mask[i, :pad] = 0
        mask[i, P + n:] = 0
    ids = ids * mask  # pad id 0 everywhere a token is missing
    rm = mask[:, P:]
    return Batch.from_dict(tensors=dict(
        input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0), responses=ids[:, P:],
        response_mask=rm, old_log_probs=-torch.rand(len(ids), R, generator=g) * rm,
        advantages=torch.randn(len(ids), R, generator=g) * rm, values=torch.randn(len(ids), R, generator=g) * rm,
        returns=torch.randn(len(ids), R, generator=g) * rm))


def attention_mask_4d(attention_mask: torch.Tensor) -> torch.Tensor:
    """[b, s] {0,1} padding mask -> megatron's [b, 1, s, s] bool mask (True = not attended), causal."""
    s = attention_mask.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    return ~(causal[None] & attention_mask.bool()[:, None, :])[:, None]


def _masked_reference(role, batch, temperature: float = 1.0):
    """Log-probs, entropy and values with the padding mask, in the original (left-padded) layout; log-probs and
    entropy of the policy at ``temperature`` (log-softmax of logits / T)."""
    from hybridflow.megatron.role import token_log_probs, vocab_parallel_entropy

    t = batch.tensors
    with torch.no_grad(), role.resident():
        out = role.module(input_ids=t["input_ids"], position_ids=t["position_ids"],
                          attention_mask=attention_mask_4d(t["attention_mask"]))
    valid = t["response_mask"].bool()
    if role.value_head:
        return {"values": torch.where(valid, out[..., 0][:, P - 1:P - 1 + R].float(), 0.0)}
    out = out / temperature
    lp = token_log_probs(out, torch.roll(t["input_ids"], -1, 1))[:, P - 1:P - 1 + R]
    ent = vocab_parallel_entropy(out)[:, P - 1:P - 1 + R]
    return {"log_probs": torch.where(valid, lp, 0.0), "entropy": torch.where(valid, ent, 0.0)}


def _settings():
    from hybridflow.config.schema import Actor, Critic

    actor = Actor(ppo_mini_batch_size=3, ppo_micro_batch_size_per_gpu=1)
    # the critic's keys that default to the actor's (ExperimentConfig.resolve_defaults), given here
    critic = Critic(ppo_mini_batch_size=3, ppo_micro_batch_size_per_gpu=1, ppo_epochs=1, use_dynamic_bsz=False)
    return actor, critic


def _rank_fn(rank, world, hf_dir, critic_dir):
    from hybridflow.megatron import parallel
    from hybridflow.megatron.role import MegatronRole, ModelBuild, OffloadSettings, OptimSettings
    from hybridflow.workers import role_ops
    from hybridflow.workers.common import load_hf_folder

    parallel.init_model_parallel(1, 1, seed=1)
    cfg, state = load_hf_folder(hf_dir)
    _, critic_state = load_hf_folder(critic_dir)
    batch = uneven_batch()
    actor_cfg, critic_cfg = _settings()
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).split(".")[1]
        policy = MegatronRole(cfg, state, ModelBuild(dtype=dtype))
        value = MegatronRole(cfg, critic_state, ModelBuild(value_head=True, dtype=dtype))
        got = role_ops.log_probs(policy, batch, 4, with_entropy=True)
        got["values"] = role_ops.values(value, batch, 4)
        want = {**_masked_reference(policy, batch), **_masked_reference(value, batch)}
        out[f"padding_{name}"] = {k: (got[k], want[k]) for k in want}
        # the rollout's temperature: the trainer's policy is the tempered one vLLM samples from
        got = role_ops.log_probs(policy, batch, 4, with_entropy=True, temperature=0.7)
        want = _masked_reference(policy, batch, temperature=0.7)
        out[f"tempered_{name}"] = {k: (got[k], want[k]) for k in ("log_probs", "entropy")}
        untempered = role_ops.log_probs(policy, batch, 4)["log_probs"]
        out[f"tempered_{name}"]["untempered"] = (untempered, got["log_probs"])

        trained = {}
        for offload in (False, True):
            torch.manual_seed(0)
            settings = OffloadSettings(params=offload, grads=offload, optimizer=offload)
            actor = MegatronRole(cfg, state, ModelBuild(dtype=dtype), optim=OptimSettings(lr=1e-3), offload=settings)
            critic = MegatronRole(cfg, critic_state, ModelBuild(value_head=True, dtype=dtype),
                                  optim=OptimSettings(lr=1e-3), offload=settings)
            metrics, counts = [], [_offload_counts(actor, critic)]
            for _ in range(2):
                metrics.append(role_ops.update_policy(actor, batch, actor_cfg, dp_size=1))
                metrics.append(role_ops.update_value(critic, batch, critic_cfg, dp_size=1))
                counts.append(_offload_counts(actor, critic))
            roles = {"actor": actor, "critic": critic}
            idle = {"host_bytes": {n: r.host_bytes() for n, r in roles.items()},
                    "freed": all(p.untyped_storage().nbytes() == 0 for p in actor.module.parameters()),
                    "grads_freed": all(p.main_grad.untyped_storage().nbytes() == 0
                                       for r in roles.values() for p in r.module.parameters()),
                    "counts": counts, "state_bytes": {n: _state_bytes(r) for n, r in roles.items()}}
            trained[offload] = dict(idle, metrics=metrics, actor=actor.hf_state_dict(), critic=critic.hf_state_dict(),
                                    log_probs=role_ops.log_probs(actor, batch, 6)["log_probs"])
        out[f"offload_{name}"] = trained
    out["cache_releases"] = _cache_releases_per_compute(MegatronRole(cfg, critic_state,
                                                                     ModelBuild(value_head=True)), batch)
    return out


def _offload_counts(*roles) -> list[dict]:
    """(moves back to the device, host buffers allocated) of each offloader of each role."""
    return [{kind: (o.reloads, o.host_allocations) for kind, o in role._offloaders.items()} for role in roles]


def _state_bytes(role) -> int:
    """Bytes of the role's params and optimizer state (not its grads), measured while they are resident."""
    from hybridflow.megatron.offload import optimizer_tensors

    with role.resident(training=True):
        tensors = [*role.module.parameters(), *optimizer_tensors(role.optimizer)]
        return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def _cache_releases_per_compute(role, batch) -> list[int]:
    """How often a role on a (stand-in) CUDA device hands the allocator's cached blocks back, per forward:
    the GPU path's release after each compute, which keeps a role's activation peak from lingering into
    another role's phase (no CUDA here: the device is named, empty_cache counted)."""
    from hybridflow.workers import role_ops

    calls = []
    torch.cuda.empty_cache = lambda: calls.append(1)  # this rank's process ends with the test
    role.device = torch.device("cuda")
    per_call = []
    for _ in range(2):
        before = len(calls)
        role_ops.values(role, batch, 2)
        per_call.append(len(calls) - before)
    return per_call


def write_policy_and_critic(root, num_layers: int = 2):
    """A tiny policy in <root>/policy and a critic from it (with a random value head) in <root>/critic."""
    from hybridflow.models.char_tokenizer import build_char_tokenizer
    from hybridflow.models.tiny_qwen2 import build_tiny_qwen2
    from hybridflow.workers.common import load_hf_folder
    from hybridflow.workers.export import save_hf_folder

    build_tiny_qwen2(root / "policy", build_char_tokenizer(root / "policy"), hidden_size=64, num_layers=num_layers,
                     seed=5)
    cfg, state = load_hf_folder(str(root / "policy"))
    state["score.weight"] = torch.randn(1, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    save_hf_folder(str(root / "critic"), cfg, state)
    return root


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = write_policy_and_critic(tmp_path_factory.mktemp("padfree"))
    return run_ranks(_rank_fn, 1, str(root / "policy"), str(root / "critic"))[0]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_causal_only_forward_equals_masked_forward(results, dtype):
    valid = uneven_batch().tensors["response_mask"].bool()
    for key, (got, want) in results[f"padding_{dtype}"].items():
        assert got.shape == want.shape == valid.shape, key
        assert torch.equal(got[~valid], torch.zeros_like(got[~valid])), f"{key}: outputs past a response's end"
        assert_close(got[valid].float(), want[valid].float(), dtype=getattr(torch, dtype),
                     what=f"{key} ({dtype}) vs the masked forward")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_log_probs_at_the_rollout_temperature_are_the_tempered_policy(results, dtype):
    """log-softmax(logits / 0.7) of the response tokens and its entropy, as vLLM's processed log-probs."""
    valid = uneven_batch().tensors["response_mask"].bool()
    case = dict(results[f"tempered_{dtype}"])
    untempered, tempered = case.pop("untempered")
    for key, (got, want) in case.items():
        assert_close(got[valid].float(), want[valid].float(), dtype=getattr(torch, dtype),
                     what=f"{key} at T=0.7 ({dtype}) vs log-softmax(logits / T)")
    if dtype == "float32":  # the comparison tells the two apart (the tiny model's logits are near-uniform)
        assert used_fraction(untempered[valid], tempered[valid]) > 10, "the temperature changed nothing"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_offload_trains_bit_identically(results, dtype):
    plain, offloaded = results[f"offload_{dtype}"][False], results[f"offload_{dtype}"][True]
    assert set(plain["host_bytes"].values()) == {0}
    # Idle roles hold nothing on the device: params and optimizer state went to host, grads were freed.
    assert offloaded["freed"] and offloaded["grads_freed"] and not plain["grads_freed"]
    for role in ("actor", "critic"):
        assert set(plain[role]) == set(offloaded[role])
        for k, v in plain[role].items():
            assert v.dtype == getattr(torch, dtype), k
            assert torch.equal(v, offloaded[role][k]), f"{role} {k} differs after offloaded training"
    assert torch.equal(plain["log_probs"], offloaded["log_probs"])
    for m in plain["metrics"]:
        assert all(torch.isfinite(torch.tensor(v)) for v in m.values()), m
    losses = [m["actor/pg_loss"] for m in plain["metrics"] if "actor/pg_loss" in m]
    assert losses[0] != losses[1], "the actor did not move"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_offload_moves_state_once_per_update_and_never_copies_grads(results, dtype):
    offloaded = results[f"offload_{dtype}"][True]
    # Host memory holds exactly the params and optimizer state: the grads were freed, not copied.
    assert offloaded["host_bytes"] == offloaded["state_bytes"]
    counts = offloaded["counts"]  # before the first update, then after each update call of actor and critic
    for before, after in zip(counts, counts[1:]):
        for role_before, role_after in zip(before, after):
            # One residency per update call, although each call runs two mini-batches.
            assert role_after["params"][0] - role_before["params"][0] == 1, (role_before, role_after)
            assert role_after["optimizer"][0] - role_before["optimizer"][0] <= 1, (role_before, role_after)
    # Host buffers are allocated once and reused: the first update creates Adam's state, the second
    # update allocates nothing.
    assert [{k: n for k, (_, n) in role.items()} for role in counts[1]] == \
        [{k: n for k, (_, n) in role.items()} for role in counts[2]]


def test_a_role_releases_cached_device_memory_after_each_compute(results):
    assert results["cache_releases"] == [1, 1]


@pytest.mark.parametrize("actor_offload, ref_offload, want", [
    (False, None, False), (True, None, True),  # unset: as the actor's megatron.param_offload
    (False, True, True), (True, False, False),  # set: the reference's own (verl's ref.megatron.param_offload)
])
def test_reference_offload_is_its_own_key(actor_offload, ref_offload, want):
    from hybridflow.config.schema import ExperimentConfig
    from hybridflow.megatron.role import OffloadSettings
    from hybridflow.workers.common import ref_offload_settings

    cfg = ExperimentConfig()
    cfg.actor.megatron.param_offload = cfg.actor.megatron.grad_offload = cfg.actor.megatron.optimizer_offload = actor_offload
    cfg.actor.ref_param_offload = ref_offload
    assert ref_offload_settings(cfg.actor) == OffloadSettings(params=want)  # params only: it has no grads or optimizer
    cfg.resolve_defaults()
    assert cfg.actor.ref_param_offload is want and ref_offload_settings(cfg.actor) == OffloadSettings(params=want)
