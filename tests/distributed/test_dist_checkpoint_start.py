"""Starting from a megatron dist checkpoint (actor/critic.megatron.use_dist_checkpointing, dist_checkpointing_path):
a Megatron-LM-style save folder (latest_checkpointed_iteration.txt naming iter_0000007, megatron's sharded keys,
written as verl's converter_hf_to_mcore writes them: the model's sharded_state_dict, no wrapper) saved at TP 2 loads
at TP 1 x PP 2 into the policy bit for bit, and into a critic whose value head keeps its initialization; with a key
prefix (dist_checkpointing_prefix) too. In bf16 with the distributed optimizer, the weights are loaded before the
optimizer copies them to its fp32 main parameters: an update at learning rate 0 leaves them as loaded; so it leaves
a LoRA actor's adapters started from a peft folder (model.lora.adapter_path)."""

from __future__ import annotations

import pytest
import torch

from hybridflow.spawn import run_ranks
from tests.distributed.test_padding_free_and_offload import write_policy_and_critic

pytestmark = pytest.mark.distributed
PREFIX = "module."


def _rank_fn(rank, world, hf_dir, ckpt, save):
    import os
    from types import SimpleNamespace

    from megatron.core import dist_checkpointing

    from hybridflow.megatron import parallel
    from hybridflow.megatron.role import MegatronRole, ModelBuild, OptimSettings
    from hybridflow.patches import megatron_core
    from hybridflow.workers import role_ops
    from hybridflow.workers.common import load_hf_folder, start_weights
    from tests.distributed.test_padding_free_and_offload import _settings, uneven_batch

    parallel.init_model_parallel(*((2, 1) if save else (1, 2)), seed=1)
    cfg, state = load_hf_folder(hf_dir)
    if save:
        folders = {"plain/iter_0000007": ("", torch.float32), "prefixed": (PREFIX, torch.float32),
                   "bf16": ("", torch.bfloat16)}
        for folder in folders:
            os.makedirs(f"{ckpt}/{folder}", exist_ok=True)
        torch.distributed.barrier()
        for folder, (prefix, dtype) in folders.items():
            role = MegatronRole(cfg, state, ModelBuild(dtype=dtype))
            with megatron_core.cpu_scope():
                dist_checkpointing.save(role.module.sharded_state_dict(prefix=prefix), f"{ckpt}/{folder}")
        if rank == 0:
            open(f"{ckpt}/plain/latest_checkpointed_iteration.txt", "w").write("7\n")
        return None
    out = {}
    for folder, prefix in (("plain", ""), ("prefixed", PREFIX)):
        m = SimpleNamespace(use_dist_checkpointing=True, dist_checkpointing_path=f"{ckpt}/{folder}",
                            dist_checkpointing_prefix=prefix)
        actor = MegatronRole(cfg, None, start_weights=start_weights(m, "actor"))
        critic = MegatronRole(cfg, None, ModelBuild(value_head=True), start_weights=start_weights(m, "critic"))
        out[folder] = {"actor": actor.hf_state_dict(), "critic": critic.hf_state_dict()}
    m = SimpleNamespace(use_dist_checkpointing=True, dist_checkpointing_path=f"{ckpt}/bf16", dist_checkpointing_prefix="")
    actor = MegatronRole(cfg, None, ModelBuild(dtype=torch.bfloat16), start_weights=start_weights(m, "actor"),
                         optim=OptimSettings(lr=0.0, use_distributed_optimizer=True))
    loaded = actor.hf_state_dict()
    role_ops.update_policy(actor, uneven_batch(), _settings()[0], dp_size=1)
    out["bf16"] = {"loaded": loaded, "updated": actor.hf_state_dict()}
    from hybridflow.megatron import lora_peft
    from tests.distributed.test_lora import _settings as lora_settings

    off = SimpleNamespace(use_dist_checkpointing=False)
    actor = MegatronRole(cfg, state, ModelBuild(dtype=torch.bfloat16, lora_settings=lora_settings()[1]),
                         start_weights=start_weights(off, "actor", f"{ckpt}/adapter"),
                         optim=OptimSettings(lr=0.0, use_distributed_optimizer=True))
    role_ops.update_policy(actor, uneven_batch(), _settings()[0], dp_size=1)
    out["adapters"] = lora_peft.gathered(actor.module, cfg, actor.shard)
    return out


def test_a_dist_checkpoint_saved_at_tp2_starts_the_roles_at_pp2(tmp_path):
    from hybridflow.workers.common import load_hf_folder

    root = write_policy_and_critic(tmp_path)
    args = (str(root / "policy"), str(tmp_path / "ckpt"))
    adapter = _peft_adapter(root / "policy", tmp_path / "ckpt" / "adapter")
    run_ranks(_rank_fn, 2, *args, True)
    loaded = run_ranks(_rank_fn, 2, *args, False)[0]
    _, want = load_hf_folder(str(root / "policy"))
    adapters = loaded.pop("adapters")
    assert adapters.keys() == adapter.keys()
    for k, v in adapter.items():  # bf16 adapters: the file's, rounded, and not moved by an update at lr 0
        assert torch.equal(adapters[k], v.to(torch.bfloat16)), f"adapter {k} differs from the peft folder's"
    bf16 = loaded.pop("bf16")
    for k, v in want.items():
        assert torch.equal(bf16["loaded"][k], v.to(torch.bfloat16)), f"bf16: {k} differs from the checkpoint's"
        assert torch.equal(bf16["updated"][k], bf16["loaded"][k]), f"bf16: {k} moved in an update at lr 0"
    for folder, roles in loaded.items():
        actor, critic = roles["actor"], roles["critic"]
        assert actor.keys() == want.keys(), sorted(actor.keys() ^ want.keys())
        for k, v in want.items():
            assert torch.equal(actor[k], v), f"{folder}: {k} differs from the checkpoint's"
            if k != "lm_head.weight":
                assert torch.equal(critic[k], v), f"{folder}: the critic's {k} differs from the checkpoint's"
        assert critic["score.weight"].shape == (1, want["model.embed_tokens.weight"].shape[1])


def _peft_adapter(base, folder) -> dict:
    """A random peft adapter of the test LoRA's rank and targets (one A for q/k/v and for gate/up, as megatron's
    fused linears take it) written as a peft folder; returns its tensors."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from hybridflow.megatron.lora_peft import adapter_config, peft_names
    from hybridflow.workers.export import save_peft_folder
    from tests.distributed.test_lora import ALPHA, RANK

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), LoraConfig(
        r=RANK, lora_alpha=ALPHA, init_lora_weights=False,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    params, g = dict(model.named_parameters()), torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in params.items():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        for name, p in params.items():
            for takes, source in (("k_proj", "q_proj"), ("v_proj", "q_proj"), ("up_proj", "gate_proj")):
                if f".{takes}.lora_A." in name:
                    p.copy_(params[name.replace(takes, source)])
    tensors = peft_names(get_peft_model_state_dict(model))
    save_peft_folder(str(folder), tensors, adapter_config(tensors, RANK, ALPHA, 0.0, str(base)))
    return tensors
