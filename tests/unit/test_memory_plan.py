"""The memory planner: parameter counts, per-item bytes checked by hand, offload phases, and the shipped configs."""

import dataclasses
import json
import os

import pytest

from hybridflow.plan import load_experiment
from hybridflow.tools import memory_plan as mp

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GiB = 2 ** 30
# one process on each actor GPU (the critic has a pool of its own) and its one NCCL communicator: the actor's data 2
FIXED = {"CUDA contexts (1 process)": GiB, "NCCL buffers (1 communicator: actor data 2)": 0.3 * GiB}
CTX = sum(FIXED.values())
GRAPHS = 2 * GiB  # a sleeping vLLM's CUDA-graph pool, by default

# A tiny Llama (no qkv bias), small enough to count by hand.
TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100, "tie_word_embeddings": False}
# per layer: q 64*64 + k,v 2*(64*32) + o 64*64 = 12288; gate/up/down 3*64*128 = 24576; norms 2*64 = 128
TINY_LAYER = 12288 + 24576 + 128  # 36992
TINY_P = 100 * 64 + 2 * TINY_LAYER + 64 + 100 * 64  # embeddings + layers + final norm + lm_head = 86848
TINY_CRITIC_P = 100 * 64 + 2 * TINY_LAYER + 64 + 64  # value head 64 x 1 instead of lm_head = 80512

TINY_YAML = """
data: {batch_size: 4, max_prompt_length: 6, max_response_length: 2}
model: {path: /nonexistent/tiny}
actor:
  megatron: {use_distributed_optimizer: true}
  ppo_mini_batch_size: 4
  ppo_micro_batch_size_per_gpu: 2
  log_prob_micro_batch_size_per_gpu: 2
critic: {megatron: {use_distributed_optimizer: false}, ppo_mini_batch_size: 4, ppo_micro_batch_size_per_gpu: 2,
         log_prob_micro_batch_size_per_gpu: 2}
rollout: {gpu_memory_utilization: 0.5}
algorithm: {adv_estimator: grpo, use_kl_in_reward: false}
resources: {n_workers: 2, critic_n_workers: 2}
"""


@pytest.fixture
def tiny(tmp_path):
    (tmp_path / "tiny.yaml").write_text(TINY_YAML)
    (tmp_path / "tiny.json").write_text(json.dumps(TINY))

    def load(*overrides):
        return load_experiment([str(tmp_path / "tiny.yaml")], list(overrides))
    load.dir = tmp_path
    return load


def rows(result, phase):
    return dict(result[phase])


def shipped_shape(name):
    with open(os.path.join(REPO, "configs", "models", name)) as f:
        return mp.Shape.from_hf(json.load(f))


def test_param_counts_of_the_shipped_qwen2_5_shapes():
    assert mp.count_params(shipped_shape("qwen2.5-0.5b-instruct.json")) == 494_032_768  # tied embeddings
    assert mp.count_params(shipped_shape("qwen2.5-7b-instruct.json")) == 7_615_616_512


def test_tiny_model_counted_by_hand():
    shape = mp.Shape.from_hf(TINY)
    assert mp.layer_params(shape) == TINY_LAYER
    assert mp.count_params(shape) == TINY_P
    assert mp.count_params(shape, value_head=True) == TINY_CRITIC_P


def test_every_item_of_a_tiny_config_by_hand(tiny):
    r = mp.plan(tiny(), mp.Shape.from_hf(TINY), gpu_mem_gib=1)
    params, grads = TINY_P * 2, TINY_P * 4  # bf16 params, fp32 grads, t = p = 1
    optimizer = TINY_P * 12 / 2  # fp32 main + Adam m, v; distributed optimizer over d = 2
    # s = 6 + 2 = 8 tokens, b = 2: 34 * s*b*h per layer x 2 layers, logits b*s*vocab*(2 + 4 + 4)
    activations = 34 * 8 * 2 * 64 * 2 + 2 * 8 * 100 * 10
    assert activations == 85_632
    assert rows(r, "training") == {
        **FIXED, "vLLM (asleep: its CUDA-graph pool stays)": GRAPHS,
        "actor params": params, "actor grads": grads, "actor optimizer": optimizer,
        "actor activations (backward 2 x 8 tokens)": activations}
    assert rows(r, "transition") == {
        **FIXED, "vLLM weights (awake)": params, "vLLM CUDA-graph pool": GRAPHS,
        "actor params (loaded for the sync)": params, "resharding: gathered generation shard": params,
        "resharding: largest piece assembled (hybrid)": TINY_LAYER * 2,  # a layer outweighs the 100 x 64 embeddings
        "actor grads": grads, "actor optimizer": optimizer}
    assert rows(r, "generation") == {
        **FIXED, "vLLM (0.5 x 1 GiB: weights + KV cache)": GiB / 2,
        "actor params": params, "actor grads": grads, "actor optimizer": optimizer}
    assert r["kv_cache"] == GiB / 2 - params
    assert mp.peaks(r)["training"] == CTX + GRAPHS + params + grads + optimizer + activations


def test_a_sleeping_vllm_keeps_its_cuda_graph_pool_unless_eager(tiny):
    shape = mp.Shape.from_hf(TINY)
    r = mp.plan(tiny(), shape, 1, cuda_graph_gib=0.5)
    assert rows(r, "training")["vLLM (asleep: its CUDA-graph pool stays)"] == GiB / 2
    assert rows(r, "transition")["vLLM CUDA-graph pool"] == GiB / 2
    eager = mp.plan(tiny("rollout.enforce_eager=true"), shape, 1, cuda_graph_gib=0.5)
    assert rows(eager, "training")["vLLM (asleep, eager)"] == 0
    assert "vLLM CUDA-graph pool" not in rows(eager, "transition")
    for phase in ("training", "transition"):
        assert mp.peaks(r)[phase] - mp.peaks(eager)[phase] == GiB / 2
    # In generation the pool is inside vLLM's gpu_memory_utilization budget (vLLM profiles it there).
    assert mp.peaks(r)["generation"] == mp.peaks(eager)["generation"]


def test_reference_and_critic_items(tiny):
    cfg = tiny("algorithm.adv_estimator=gae", "algorithm.use_kl_in_reward=true", "critic.megatron.dtype=float32")
    gen = rows(mp.plan(cfg, mp.Shape.from_hf(TINY), 1), "generation")
    assert gen["ref params"] == TINY_P * 2  # actor dtype and layout, no grads or optimizer
    assert "ref grads" not in gen
    assert gen["critic params"] == TINY_CRITIC_P * 4
    assert gen["critic grads"] == TINY_CRITIC_P * 4
    assert gen["critic optimizer"] == TINY_CRITIC_P * 8  # fp32: Adam m, v only; no distributed optimizer


def test_muon_keeps_one_momentum_buffer_for_the_matrices(tiny):
    """Muon: the 2D weights keep a momentum buffer (4 B) where Adam keeps m and v (8 B); embeddings, lm_head and the
    norms stay with Adam (megatron-core's get_megatron_muon_optimizer); the state is on every data-parallel rank."""
    cfg = tiny("algorithm.adv_estimator=gae", "actor.megatron.use_distributed_optimizer=false",
               "actor.optim.optimizer=muon", "critic.optim.optimizer=muon")
    gen = rows(mp.plan(cfg, mp.Shape.from_hf(TINY), 1), "generation")
    adam = 100 * 64 * 2 + 2 * 128 + 64  # embeddings, lm_head, the layers' two norms, the final norm
    assert gen["actor optimizer"] == (TINY_P - adam) * (4 + 4) + adam * (4 + 8)  # bf16: fp32 main params too
    adam = 100 * 64 + 64 + 2 * 128 + 64  # embeddings, the value head, norms
    assert gen["critic optimizer"] == (TINY_CRITIC_P - adam) * (4 + 4) + adam * (4 + 8)


def test_tensor_parallel_and_pipeline_split_the_state(tiny):
    cfg = tiny("resources.n_workers=4", "actor.megatron.tensor_model_parallel_size=2",
               "actor.megatron.pipeline_model_parallel_size=2", "rollout.tensor_model_parallel_size=2")
    r = mp.plan(cfg, mp.Shape.from_hf(TINY), 1)
    gen, tr = rows(r, "generation"), rows(r, "transition")
    assert gen["actor params"] == TINY_P * 2 / 4
    assert gen["actor optimizer"] == TINY_P * 12 / 4  # d = 4 / (2 * 2) = 1
    assert tr["vLLM weights (awake)"] == tr["resharding: gathered generation shard"] == TINY_P * 2 / 2


def test_offload_moves_items_out_of_generation(tiny):
    flags = [f"actor.megatron.{k}_offload=true" for k in ("param", "grad", "optimizer")]
    r = mp.plan(tiny(*flags, "actor.use_kl_loss=true"), mp.Shape.from_hf(TINY), 1)
    assert set(rows(r, "generation")) == {*FIXED,
                                         "vLLM (0.5 x 1 GiB: weights + KV cache)"}  # the ref follows param_offload
    train = rows(r, "training")
    assert train["actor grads (loaded while it computes)"] == TINY_P * 4
    assert "ref params" not in train  # the actor computes here, the reference (offloaded) does not
    transition = rows(r, "transition")
    assert transition["actor params (loaded for the sync)"] == TINY_P * 2  # loaded back for the sync
    assert "actor grads" not in transition
    plain = mp.plan(tiny("actor.use_kl_loss=true"), mp.Shape.from_hf(TINY), 1)
    assert mp.peaks(r)["generation"] < mp.peaks(plain)["generation"]


def test_awake_vllm_counts_in_every_phase(tiny):
    r = mp.plan(tiny("rollout.free_cache_engine=false"), mp.Shape.from_hf(TINY), 1)
    assert rows(r, "training")["vLLM (awake: free_cache_engine false)"] == GiB / 2
    assert rows(r, "transition")["vLLM (awake, whole budget)"] == GiB / 2


def test_main_with_a_model_config_and_no_kv_room(tiny, capsys):
    args = ["--config", str(tiny.dir / "tiny.yaml"), "--model-config", str(tiny.dir / "tiny.json")]
    assert mp.main(args + ["--gpu-mem", "8"]) == 0
    assert "fits on 8 GiB: yes (peak 5.3 GiB in generation)" in capsys.readouterr().out  # 4 GiB of vLLM + 1.3 fixed
    # 1e-5 x 8 GiB is smaller than the vLLM weights: no KV cache, even though every phase fits
    assert mp.main(args + ["--gpu-mem", "8", "rollout.gpu_memory_utilization=0.00001"]) == 1
    assert "fits on 8 GiB: no (no room left for vLLM's KV cache" in capsys.readouterr().out


def test_missing_shapes_name_the_file(tiny, capsys, monkeypatch):
    monkeypatch.chdir(tiny.dir)
    assert mp.main(["--config", "tiny.yaml"]) == 2
    err = capsys.readouterr().err
    assert "/nonexistent/tiny/config.json" in err and "configs/models/tiny.json" in err and "\n" not in err.strip()


SHIPPED = ["gsm8k_qwen2.5_0.5b_ppo", "gsm8k_qwen2.5_0.5b_grpo", "gsm8k_qwen2.5_7b_ppo", "gsm8k_qwen2.5_7b_grpo",
           "gsm8k_qwen2.5_7b_dapo", "gsm8k_qwen3_8b_grpo", "gsm8k_qwen3_8b_tools_grpo", "gsm8k_qwen3_30b_a3b_gspo",
           "gsm8k_qwen2.5_32b_lora_grpo", "gsm8k_glm4.5_air_lora_grpo", "gsm8k_gpt_oss_20b_grpo",
           "gsm8k_moonlight_16b_a3b_grpo"]
MARGIN = 0.9  # the plan is an estimate: every phase of a shipped config leaves a tenth of the card free


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_gpu_configs_fit_on_80_gib(name, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # no models/ folder here: the shapes come from configs/models
    assert mp.main(["--config", os.path.join(REPO, "configs", f"{name}.yaml"), "--gpu-mem", "80"]) == 0
    out = capsys.readouterr().out
    assert all(f"\n{phase}\n" in out for phase in ("training", "transition", "generation"))
    assert "fits on 80 GiB: yes" in out
    peaks = [float(line.split()[-1]) for line in out.splitlines() if line.strip().startswith("peak ")]
    assert len(peaks) == 3 and max(peaks) <= MARGIN * 80, peaks
    with open(os.path.join(REPO, "configs", f"{name}.yaml")) as f:
        peak = out.rsplit("(peak ", 1)[1].split(" GiB")[0]
        assert f"peak {peak} GiB" in f.read()  # the file's comment states what the tool prints


def test_separate_async_config_plans_both_pools(capsys, monkeypatch, tmp_path):
    """separate_async: the trainer's GPUs hold no vLLM; the push holds the training-pool leg's shard (TP gcd(2, 1)
    = 1: the whole model) and one bucket; the rollout pool's GPUs vLLM's budget and one bucket."""
    monkeypatch.chdir(tmp_path)
    name = "gsm8k_qwen3_8b_grpo_separate_async"
    assert mp.main(["--config", os.path.join(REPO, "configs", f"{name}.yaml"), "--gpu-mem", "80"]) == 0
    out = capsys.readouterr().out
    assert all(f"\n{phase}\n" in out for phase in ("training", "weight push (trainer GPUs)", "rollout GPUs (separate pool)"))
    assert "vLLM (none: a pool of its own)" in out and "checkpoint engine: one bucket" in out
    peaks = [float(line.split()[-1]) for line in out.splitlines() if line.strip().startswith("peak ")]
    assert len(peaks) == 3 and max(peaks) <= MARGIN * 80, peaks
    with open(os.path.join(REPO, "configs", f"{name}.yaml")) as f:
        peak = out.rsplit("(peak ", 1)[1].split(" GiB")[0]
        assert f"peak {peak} GiB" in f.read()


def test_7b_ppo_without_offload_on_tp1_does_not_fit(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    overrides = [f"{role}.megatron.{k}" for role in ("actor", "critic") for k in (
        "tensor_model_parallel_size=1", "sequence_parallel=false", "param_offload=false", "grad_offload=false",
        "optimizer_offload=false")]
    assert mp.main(["--config", os.path.join(REPO, "configs", "gsm8k_qwen2.5_7b_ppo.yaml"), *overrides]) == 1
    assert "fits on 80 GiB: no" in capsys.readouterr().out


RM = {**TINY, "model_type": "qwen2", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
      "vocab_size": 50}


def test_the_reward_model_sits_on_the_actor_gpus(tiny):
    cfg = tiny("reward_model.enable=true", "reward_model.path=/nonexistent/rm", "reward_model.micro_batch_size=4",
               "reward_model.max_length=16")
    rm = mp.Shape.from_hf(RM)
    r = mp.plan(cfg, mp.Shape.from_hf(TINY), 1, rm_shape=rm)
    params = mp.count_params(rm, value_head=True) * 2  # bf16 by default, a 32 x 1 score head
    for phase in ("training", "transition", "generation"):
        assert rows(r, phase)["reward model params"] == params, phase
    # scoring holds one layer of 4 x 16 tokens and the 1-wide scores: 34*s*b*h + b*s*(2 + 8)
    assert mp.reward_model_role(cfg.reward_model, rm).activations == 34 * 16 * 4 * 32 + 4 * 16 * 10
    with pytest.raises(ValueError, match="reward model's shapes"):
        mp.plan(cfg, mp.Shape.from_hf(TINY), 1)


def test_main_reads_the_reward_model_shapes(tiny, capsys):
    (tiny.dir / "rm.json").write_text(json.dumps(RM))
    args = ["--config", str(tiny.dir / "tiny.yaml"), "--model-config", str(tiny.dir / "tiny.json"), "--gpu-mem", "8",
            "reward_model.enable=true", "reward_model.path=/nonexistent/rm"]
    assert mp.main(args + ["--reward-model-config", str(tiny.dir / "rm.json")]) == 0
    assert "reward model params" in capsys.readouterr().out
    assert mp.main(args) == 2
    err = capsys.readouterr().err
    assert "reward_model.path /nonexistent/rm" in err and "--reward-model-config" in err


def test_moe_counts_and_expert_sharding():
    """Qwen3-30B-A3B's and Qwen3-8B's sizes as transformers counts them (their models built on the meta
    device: 30,532,122,624 and 8,190,735,360), and the experts split over EP x expert TP with their optimizer
    state over the expert-data-parallel ranks, the dense rest over TP x DP."""
    shape = shipped_shape("qwen3-30b-a3b.json")
    assert mp.count_params(shape) == 30_532_122_624
    assert mp.count_params(shipped_shape("qwen3-8b.json")) == 8_190_735_360
    experts = mp.expert_params(shape)
    assert experts == 48 * 128 * 3 * 2048 * 768
    cfg = load_experiment(["configs/gsm8k_qwen3_30b_a3b_gspo.yaml"], [])
    role = mp.make_role("actor", cfg.actor, mp.count_params(shape), shape, 1024, 16, shape.vocab, rollout_n=cfg.rollout.n)
    dense = mp.count_params(shape) - experts
    per_gpu = dense / 2 + experts / 8  # TP 2; EP 8 x expert TP 1
    assert role.items["params"] == per_gpu * 2  # bf16
    assert role.items["grads"] == per_gpu * 4
    assert role.items["optimizer"] == (dense / 2 / 8 + experts / 8 / 2) * 12  # DP 8; expert DP 16 / 8 = 2


# A tiny Qwen3-MoE: layer 0 sparse (8 experts, top-4, each 32 wide), layer 1 dense (mlp_only_layers).
TINY_MOE = {**TINY, "model_type": "qwen3_moe", "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 4,
            "moe_intermediate_size": 32, "mlp_only_layers": [1], "decoder_sparse_step": 1}


def test_moe_params_respect_mlp_only_layers():
    """As transformers counts them (built on the meta device): one sparse layer, one dense."""
    import torch
    import transformers

    cfg = transformers.Qwen3MoeConfig(**{k: v for k, v in TINY_MOE.items() if k != "model_type"})
    with torch.device("meta"):
        model = transformers.Qwen3MoeForCausalLM(cfg)
    shape = mp.Shape.from_hf(TINY_MOE)
    assert (shape.moe_layers, shape.layers) == (1, 2)
    assert mp.count_params(shape) == sum(p.numel() for p in model.parameters())
    assert mp.expert_params(shape) == 1 * 8 * 3 * 64 * 32


def test_glm_4_5_air_counts_as_transformers_builds_it():
    """GLM-4.5-Air's shapes (its config.json; the MTP layer aside, which transformers does not build): its first
    layer dense, the rest 128 routed experts beside one ungated shared expert, a float32 expert bias per router."""
    import torch
    import transformers

    air = dict(model_type="glm4_moe", vocab_size=151552, hidden_size=4096, intermediate_size=10944,
               moe_intermediate_size=1408, num_hidden_layers=46, num_attention_heads=96, num_key_value_heads=8,
               head_dim=128, n_routed_experts=128, n_shared_experts=1, num_experts_per_tok=8, first_k_dense_replace=1,
               attention_bias=True, use_qk_norm=False, partial_rotary_factor=0.5, tie_word_embeddings=False)
    with torch.device("meta"):
        model = transformers.Glm4MoeForCausalLM(transformers.Glm4MoeConfig(**air))
    biases = sum(b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    shape = mp.Shape.from_hf(air)
    assert (shape.moe_layers, shape.shared_intermediate, biases) == (45, 1408, 45 * 128)
    assert mp.count_params(shape) == sum(p.numel() for p in model.parameters()) + biases
    assert mp.expert_params(shape) == 45 * 128 * 3 * 4096 * 1408


def test_gpt_oss_20b_counts_as_transformers_builds_it():
    """gpt-oss-20b's shapes (configs/models/gpt-oss-20b.json): every layer sparse, biases on every linear and expert,
    a sink per head: 20,914,757,184 parameters, as transformers builds it."""
    import json

    import torch
    import transformers

    with open(os.path.join(REPO, "configs", "models", "gpt-oss-20b.json")) as f:
        oss = json.load(f)
    with torch.device("meta"):
        model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**oss))
    shape = mp.Shape.from_hf(oss)
    assert (shape.moe_layers, shape.moe_intermediate, shape.linear_bias, shape.sinks) == (24, 2880, True, True)
    assert mp.count_params(shape) == sum(p.numel() for p in model.parameters()) == 20_914_757_184
    assert mp.expert_params(shape) == 24 * 32 * (3 * 2880 * 2880 + 3 * 2880)


def test_moe_activations_count_every_token_top_k_times():
    """s = 8 tokens, b = 2, h = 64, t = 1. A dense layer: 34 s b h. A sparse one: its MLP's 19 h per token
    replaced by top_k x (4h + 8f) + 4 x experts (router logits, fp32) = 4 x (256 + 256) + 32 = 2080."""
    from types import SimpleNamespace

    mg = SimpleNamespace(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, context_parallel_size=1,
                         sequence_parallel=False, dtype="bfloat16")
    dense, sparse, logits = 34 * 8 * 2 * 64, 8 * 2 * (15 * 64 + 2080), 2 * 8 * 100 * 10
    assert sparse == 48_640
    shape = dataclasses.replace(mp.Shape.from_hf(TINY_MOE), routing_skew=1.0)  # balanced routing
    assert mp.activation_bytes(shape, 2, 8, mg, 100, backward=True) == dense + sparse + logits
    assert mp.activation_bytes(shape, 2, 8, mg, 100, backward=False) == sparse + logits  # one layer: the larger
    every_layer_sparse = dataclasses.replace(mp.Shape.from_hf({**TINY_MOE, "mlp_only_layers": []}), routing_skew=1.0)
    assert mp.activation_bytes(every_layer_sparse, 2, 8, mg, 100, backward=True) == 2 * sparse + logits
    # routing skew 1.5: the busiest rank's experts compute 1.5 x its share of the top_k copies (4 x 512 of 2080)
    skewed = dataclasses.replace(shape, routing_skew=1.5)
    assert mp.activation_bytes(skewed, 2, 8, mg, 100, backward=False) == sparse + 8 * 2 * 0.5 * 4 * 512 + logits
    # context parallel 2: each rank computes half of every sequence
    cp2 = SimpleNamespace(**{**vars(mg), "context_parallel_size": 2})
    assert mp.activation_bytes(shape, 2, 8, cp2, 100, backward=True) == (dense + sparse + logits) / 2


def test_routing_skew_is_a_flag_and_at_least_balanced(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    config = os.path.join(REPO, "configs", "gsm8k_qwen3_30b_a3b_gspo.yaml")
    assert mp.main(["--config", config, "--moe-routing-skew", "0.5"]) == 2
    assert "--moe-routing-skew must be >= 1" in capsys.readouterr().err
    assert mp.main(["--config", config, "--moe-routing-skew", "1"]) == 0
    balanced = capsys.readouterr().out
    assert mp.main(["--config", config]) == 0  # the plan's skew: the busiest rank's experts draw twice their share
    def activations(out):
        return float(next(line for line in out.splitlines() if "actor activations" in line).split()[-1])

    assert activations(capsys.readouterr().out) > activations(balanced)


def test_a_moe_models_transition_counts_the_piece_staged_for_vllms_loaders(capsys, monkeypatch, tmp_path):
    """A MoE model's dense weights reach vLLM-GPU through its loaders: the largest piece, the embedding
    (151936 x 2048 bf16 for Qwen3-30B-A3B), staged whole; a dense model's go in place (no such line)."""
    monkeypatch.chdir(tmp_path)
    assert mp.main(["--config", os.path.join(REPO, "configs", "gsm8k_qwen3_30b_a3b_gspo.yaml")]) == 0
    staged = [line for line in capsys.readouterr().out.splitlines() if "staged for vLLM's loaders" in line]
    assert len(staged) == 1 and float(staged[0].split()[-1]) == round(151936 * 2048 * 2 / 2**30, 2)
    assert mp.main(["--config", os.path.join(REPO, "configs", "gsm8k_qwen3_8b_grpo.yaml")]) == 0
    assert "staged for vLLM's loaders" not in capsys.readouterr().out


def test_lora_counts_the_adapters_alone_as_trained_and_no_reference_copy(tiny):
    """model.lora: the frozen base in bf16 plus rank-4 adapters, whose gradients (fp32) and optimizer state alone
    are counted; the reference is the actor with its adapters off (no role of its own, even with a KL loss); the
    sync holds the adapted weights merged once more. By hand, per layer at TP 1: qkv 4 x (64 + 128), proj
    4 x (64 + 64), fc1 4 x (64 + 256), fc2 4 x (128 + 64) = 3328 adapter parameters."""
    r = mp.plan(tiny("model.lora.rank=4", "actor.use_kl_loss=true"), mp.Shape.from_hf(TINY), gpu_mem_gib=1)
    adapters = 2 * 3328
    training = rows(r, "training")
    assert training["actor params"] == (TINY_P + adapters) * 2
    assert training["actor grads"] == adapters * 4
    assert training["actor optimizer"] == adapters * 12 / 2  # distributed optimizer over d = 2
    assert not any(k.startswith("ref ") for k in training)
    adapted = 2 * (12288 + 24576)  # the four linears' weights of both layers
    assert rows(r, "transition")["resharding: LoRA-merged weights"] == adapted * 2
    full = mp.plan(tiny("actor.use_kl_loss=true"), mp.Shape.from_hf(TINY), gpu_mem_gib=1)
    assert any(k.startswith("ref ") for k in rows(full, "training"))


def test_adapter_only_lora_holds_the_whole_adapters_instead_of_merged_weights(tiny):
    """model.lora.merge false: no merged copy; the sync gathers a stage's adapters whole in peft's format (one A per
    HF projection), and vLLM's LoRA slots hold them at max_lora_rank (4 -> 8) beside its weights. By hand, per layer:
    q, k, v 3 x 4 x 64 + 4 x 128, o 4 x (64 + 64), gate, up 2 x 4 x 64 + 4 x 256, down 4 x (128 + 64) = 4096."""
    r = mp.plan(tiny("model.lora.rank=4", "model.lora.merge=false"), mp.Shape.from_hf(TINY), gpu_mem_gib=1)
    transition = rows(r, "transition")
    assert "resharding: LoRA-merged weights" not in transition
    assert transition["resharding: adapters gathered whole (adapter-only LoRA)"] == 2 * 4096 * 2
    merged = mp.plan(tiny("model.lora.rank=4"), mp.Shape.from_hf(TINY), gpu_mem_gib=1)
    assert r["vllm_weights"] - merged["vllm_weights"] == 2 * 4096 * 2 * 2  # rank 8, bf16


def test_lora_on_a_moe_model_counts_every_routed_experts_adapters_over_expert_parallelism():
    """Routed experts' adapters are whole per expert (expert TP 1) and split over EP: by hand for 2 MoE layers of 4
    experts (hidden 64, expert width 32), rank 4: fc1 4 x (64 + 64) + fc2 4 x (32 + 64) = 896 per expert."""
    from hybridflow.plan.model_shape import lora_expert_params

    shape = mp.Shape.from_hf({**TINY, "model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2,
                              "moe_intermediate_size": 32})
    targets = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
    assert lora_expert_params(shape, 4, targets) == 2 * 4 * 896
    assert lora_expert_params(shape, 4, ["linear_qkv"]) == 0


def test_context_parallel_fits_the_32k_config():
    """configs/longctx_qwen3_8b_grpo_cp4.yaml: at CP 4 one 32k-token row's activations are a quarter of CP 1's and
    the optimizer state is sharded over the 4 CP ranks; it fits 80 GiB cards, at CP 1 (DP 4) it does not."""
    path = os.path.join(REPO, "configs", "longctx_qwen3_8b_grpo_cp4.yaml")
    with open(os.path.join(REPO, "configs", "models", "qwen3-8b.json")) as f:
        shape = mp.Shape.from_hf(json.load(f))
    cp4 = mp.plan(load_experiment([path], []), shape, gpu_mem_gib=80)
    cp1 = mp.plan(load_experiment([path], ["actor.megatron.context_parallel_size=1"]), shape, gpu_mem_gib=80)
    act = [next(v for k, v in rows(r, "training").items() if k.startswith("actor activations")) for r in (cp4, cp1)]
    assert act[0] == pytest.approx(act[1] / 4)
    assert rows(cp4, "training")["actor optimizer"] == pytest.approx(rows(cp1, "training")["actor optimizer"])
    assert mp.peaks(cp4)["training"] <= 80 * 2**30 < mp.peaks(cp1)["training"]


@pytest.mark.parametrize("name,processes,communicators", [
    # a colocated critic is a process (a CUDA context) of its own with its own groups; the hybrid engine's micro-DP
    # group gathers TP 2 into vLLM TP 1
    ("gsm8k_qwen2.5_7b_ppo", 2, ["actor tensor 2", "actor data 4", "critic tensor 2", "critic data 4",
                                "resharding micro-DP 2"]),
    # experts: EP and expert-DP groups; vLLM's TP 4 group; no micro-DP (TP 2 -> vLLM TP 4 slices a training shard)
    ("gsm8k_qwen3_30b_a3b_gspo", 1, ["actor tensor 2", "actor data 8", "actor expert 8", "actor expert_data 2",
                                     "vLLM tensor 4"]),
])
def test_every_gpu_counts_its_cuda_contexts_and_nccl_communicators(name, processes, communicators):
    cfg = load_experiment([os.path.join(REPO, "configs", f"{name}.yaml")], [])
    shape = mp._read_shape(mp.find_shapes(cfg.model.path, None))
    fixed = rows(mp.plan(cfg, shape, 80), "training")
    assert fixed[f"CUDA contexts ({processes} process{'es' if processes > 1 else ''})"] == processes * GiB
    label = f"NCCL buffers ({len(communicators)} communicators: {', '.join(communicators)})"
    assert fixed[label] == pytest.approx(len(communicators) * 0.3 * GiB)


def test_the_rollout_pool_counts_its_feed_and_the_trainer_its_feeds():
    cfg = load_experiment([os.path.join(REPO, "configs", "gsm8k_qwen3_8b_grpo_separate_async.yaml")], [])
    r = mp.plan(cfg, mp._read_shape(mp.find_shapes(cfg.model.path, None)), 80)
    assert "NCCL buffers (1 communicator: checkpoint-engine feed)" in rows(r, "rollout GPUs (separate pool)")
    assert "NCCL buffers (3 communicators: actor tensor 2, actor data 2, checkpoint-engine feed)" in rows(r, "training")


def test_pipeline_activations_count_every_sample_of_the_mini_batch(tiny):
    """A mini-batch of 8 prompts x 8 samples over DP 2 in micro-batches of 4 is 8 micro-batches per rank (role_ops
    trains ppo_mini_batch_size x rollout.n rows), so 1F1B holds 4 on the first of 4 pipeline stages; counting prompts
    only (1 micro-batch) undercounted them 4x."""
    cfg = tiny("actor.megatron.pipeline_model_parallel_size=4", "actor.ppo_mini_batch_size=8", "rollout.n=8",
               "actor.ppo_micro_batch_size_per_gpu=4", "actor.log_prob_micro_batch_size_per_gpu=1", "data.batch_size=8",
               "resources.n_workers=8")
    shape, mg = mp.Shape.from_hf(TINY), cfg.actor.megatron
    role = mp.make_role("actor", cfg.actor, TINY_P, shape, 8, 8, shape.vocab, rollout_n=cfg.rollout.n)
    assert role.activations == mp.activation_bytes(shape, 4, 8, mg, shape.vocab, True, in_flight=4)
    assert role.activations > mp.activation_bytes(shape, 4, 8, mg, shape.vocab, True, in_flight=1)


def test_moonlight_counts_as_transformers_builds_it_and_caches_its_latent():
    """Moonlight-16B-A3B (configs/models/moonlight-16b-a3b.json): multi-latent attention without a q latent, its
    first layer dense, 64 routed experts beside two shared ones: 15,960,110,208 parameters as transformers builds
    it (its float32 expert biases counted); vLLM caches one 512 + 64 latent per layer and token, whole on every
    generation rank."""
    import json

    import torch
    import transformers

    with open(os.path.join(REPO, "configs", "models", "moonlight-16b-a3b.json")) as f:
        moon = json.load(f)
    with torch.device("meta"):
        model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**moon))
    biases = sum(b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    shape = mp.Shape.from_hf(moon)
    assert (shape.moe_layers, shape.kv_lora, shape.q_lora, biases) == (26, 512, 0, 26 * 64)
    assert mp.count_params(shape) == sum(p.numel() for p in model.parameters()) + biases == 15_960_110_208
    assert mp.kv_bytes_per_token(shape, 2) == mp.kv_bytes_per_token(shape, 2, t_g=4) == 27 * 576 * 2


def test_uneven_pipeline_stages_count_the_most_loaded_stage():
    """Moonlight's 27 layers at PP 2 as verl's script splits them (14 + 13, num_layers_in_last_pipeline_stage=13):
    each GPU's parameters, gradients and optimizer state are the first stage's 14/27 of the model, not half."""
    from dataclasses import replace

    shape = shipped_shape("moonlight-16b-a3b.json")
    cfg = load_experiment(["configs/gsm8k_moonlight_16b_a3b_grpo.yaml"], [])
    mg = cfg.actor.megatron
    two = replace(cfg.actor, megatron=replace(mg, pipeline_model_parallel_size=2))
    uneven = replace(cfg.actor, megatron=replace(mg, pipeline_model_parallel_size=2, override_transformer_config={
        **mg.override_transformer_config, "num_layers_in_last_pipeline_stage": 13}))
    P = mp.count_params(shape)
    even, heavy = (mp.make_role("actor", a, P, shape, 1024, 16, shape.vocab, rollout_n=cfg.rollout.n)
                   for a in (two, uneven))
    for item in ("params", "grads", "optimizer"):
        assert heavy.items[item] == pytest.approx(even.items[item] * 14 / 13.5, rel=1e-12), item


def test_distillation_teachers_are_forward_only_roles_at_the_actors_layout(tiny):
    """Each teacher holds its bf16 parameters on every GPU of the actor (resident unless the reference offloads) and
    adds its forward's activations; a larger teacher counts its own layers."""
    teacher = mp.Shape.from_hf({**TINY, "num_hidden_layers": 4})
    cfg = tiny("distillation.enabled=true", "distillation.teacher_models.t.model_path=/unused")
    r = mp.plan(cfg, mp.Shape.from_hf(TINY), 1, teacher_shapes={"a": teacher, None: mp.Shape.from_hf(TINY)})
    teacher_p = 100 * 64 + 4 * TINY_LAYER + 64 + 100 * 64
    for phase in ("training", "generation"):
        assert rows(r, phase)["teacher a params"] == teacher_p * 2
        assert rows(r, phase)["teacher params"] == TINY_P * 2
    plain = mp.plan(tiny(), mp.Shape.from_hf(TINY), 1)
    assert mp.peaks(r)["generation"] - mp.peaks(plain)["generation"] == (teacher_p + TINY_P) * 2
    offloaded = mp.plan(tiny("actor.megatron.param_offload=true"), mp.Shape.from_hf(TINY), 1, teacher_shapes={"a": teacher})
    assert "teacher a params" not in rows(offloaded, "generation")
