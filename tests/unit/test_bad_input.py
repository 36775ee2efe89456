"""Bad input, as a new user would give it: each case is one line naming the key, file or row, returned
before Ray or any worker starts (`hybridflow train` exits 2)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import tempfile

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hybridflow.config import ConfigError
from hybridflow.trainer.main import main

QUICKSTART = "configs/quickstart_cpu.yaml"


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    from hybridflow.data.arithmetic import write_arithmetic_parquet
    from hybridflow.models.char_tokenizer import build_char_tokenizer
    from hybridflow.models.tiny_qwen2 import build_tiny_qwen2

    root = tmp_path_factory.mktemp("badinput")
    write_arithmetic_parquet(root / "data", max_operand=20, n_val=16, seed=1)
    build_tiny_qwen2(root / "model", build_char_tokenizer(root / "model"), hidden_size=64, num_layers=1, seed=1,
                     max_position_embeddings=22)
    return root


def _write(path, **columns):
    pq.write_table(pa.table(columns), str(path))
    return str(path)


def _file_at(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("x")
    return path


def _old_run(tmp_path):
    """An output_dir in which a run already wrote metrics."""
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "metrics.jsonl").write_text('{"step": 0}\n')
    return []


def _copy_model(good, tmp_path, drop=(), corrupt=None):
    dst = tmp_path / "model"
    shutil.copytree(good / "model", dst)
    for name in drop:
        for f in dst.glob(name):
            f.unlink()
    if corrupt:
        (dst / corrupt).write_text("{oops")
    return str(dst)


def _model_with(good, tmp_path, **config_changes):
    """The good model folder, its config.json changed (the weights kept)."""
    dst = _copy_model(good, tmp_path)
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    (tmp_path / "model" / "config.json").write_text(json.dumps({**config, **config_changes}))
    return dst


def _damaged_weights(good, tmp_path, how):
    dst = _copy_model(good, tmp_path)
    weights = tmp_path / "model" / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:len(data) // 2] if how == "truncated" else bytes(range(256)) * 4)
    return dst


def _teacher_with_another_vocabulary(good, tmp_path) -> str:
    from transformers import AutoTokenizer

    dst = tmp_path / "teacher"
    shutil.copytree(good / "model", dst)
    tokenizer = AutoTokenizer.from_pretrained(str(dst))
    tokenizer.add_tokens(["<think>"])
    tokenizer.save_pretrained(str(dst))
    return str(dst)


_DISTILL = "distillation.enabled=true"


def _verl_tool_config(tmp_path) -> str:
    path = tmp_path / "verl_tools.yaml"
    path.write_text("tools:\n  - class_name: verl.tools.gsm8k_tool.Gsm8kTool\n    config: {type: native}\n"
                    "    tool_schema: {type: function, function: {name: calc_gsm8k_reward, parameters: {type: object}}}\n")
    return str(path)


def _non_utf8_config(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"trainer:\n  experiment_name: caf\xe9\n")  # Latin-1, as an old editor saves it
    return str(path)


def _closed_port() -> int:
    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(good, tmp_path, *overrides, capsys):
    import ray

    args = ["--config", QUICKSTART, "prepare.enable=false", f"model.path={good}/model",
            f"data.train_files=[{good}/data/train.parquet]", f"data.val_files=[{good}/data/val.parquet]",
            f"trainer.output_dir={tmp_path}/out", *overrides]
    assert main(args) == 2
    assert not ray.is_initialized()  # nothing started
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("config error: "), err
    return err


CASES = {
    # data files
    "fewer rows than a batch": (lambda g, t: [f"data.train_files=[{_write(t / 'few.parquet', prompt=['Q: 1+1= A:'], answer=['2'])}]"],
                                "data.train_files: 1 prompts cannot fill one batch of data.batch_size=128"),
    "missing prompt column": (lambda g, t: [f"data.train_files=[{_write(t / 'x.parquet', question=['a'], answer=['2'])}]"],
                              "column 'prompt' missing"),
    "prompt_key not a column": (lambda g, t: ["data.prompt_key=question"], "column 'question' missing"),
    "answer_key not a column": (lambda g, t: ["data.answer_key=solution"], "column 'solution' missing"),
    "empty parquet": (lambda g, t: [f"data.train_files=[{_write(t / 'e.parquet', prompt=pa.array([], pa.string()), answer=pa.array([], pa.string()))}]"],
                      "e.parquet has no rows"),
    "csv file": (lambda g, t: [f"data.train_files=[{(t / 'd.csv').write_text('prompt,answer') and t / 'd.csv'}]"],
                 "d.csv is not a readable parquet file"),
    "json file": (lambda g, t: [f"data.train_files=[{(t / 'd.json').write_text(json.dumps([{'prompt': 1}])) and t / 'd.json'}]"],
                  "d.json is not a readable parquet file"),
    "zero-byte file": (lambda g, t: [f"data.train_files=[{(t / 'z.parquet').write_text('') == 0 and t / 'z.parquet'}]"],
                       "z.parquet is not a readable parquet file"),
    "empty prompt": (lambda g, t: [f"data.train_files=[{_write(t / 'e.parquet', prompt=['Q: 1+1= A:', ''], answer=['2', '3'])}]"],
                     "e.parquet row 1: 'prompt' is empty (blank text)"),
    "blank prompt": (lambda g, t: [f"data.val_files=[{_write(t / 'b.parquet', prompt=['  ', 'Q: 1+1= A:'], answer=['2', '3'])}]"],
                     "data.val_files: {t}/b.parquet row 0: 'prompt' is empty (blank text)"),
    "prompts not text": (lambda g, t: [f"data.train_files=[{_write(t / 'i.parquet', prompt=[1, 2], answer=['2', '3'])}]"],
                         "i.parquet: column 'prompt' holds int64, not text"),
    "null prompt": (lambda g, t: [f"data.train_files=[{_write(t / 'n.parquet', prompt=['Q: 1+1= A:', None], answer=['2', '3'])}]"],
                    "n.parquet row 1: 'prompt' is empty (null)"),
    "prompt too long": (lambda g, t: [f"data.train_files=[{_write(t / 'l.parquet', prompt=['Q: ' + '1+' * 20 + '1= A:'], answer=['2'])}]"],
                        "l.parquet row 0: prompt has"),
    "directory as train file": (lambda g, t: [f"data.train_files=[{g}/data]"], "is not a file (a parquet file is expected)"),
    "missing val file": (lambda g, t: [f"data.val_files=[{t}/nope.parquet]"], "data.val_files: file not found"),
    "no train files": (lambda g, t: ["data.train_files=[]"], "data.train_files: at least one parquet file is required"),
    "bad val file": (lambda g, t: [f"data.val_files=[{_write(t / 'v.parquet', prompt=['a'])}]"], "data.val_files: "),
    # model folder
    "model folder missing": (lambda g, t: [f"model.path={t}/nomodel"], "model.path: not a model folder"),
    "config.json missing": (lambda g, t: [f"model.path={_copy_model(g, t, ['config.json'])}"], "model.path: cannot read"),
    "config.json corrupt": (lambda g, t: [f"model.path={_copy_model(g, t, corrupt='config.json')}"], "model.path: cannot read"),
    "weights missing": (lambda g, t: [f"model.path={_copy_model(g, t, ['*.safetensors'])}"], "model.path: no *.safetensors weights"),
    "truncated weights": (lambda g, t: [f"model.path={_damaged_weights(g, t, 'truncated')}"],
                          "model/model.safetensors is not a readable safetensors file (Error while deserializing header: "
                          "incomplete metadata, file not fully covered)"),
    "garbage weights": (lambda g, t: [f"model.path={_damaged_weights(g, t, 'garbage')}"],
                        "model/model.safetensors is not a readable safetensors file (Error while deserializing header"),
    "vocab disagrees with the weights": (lambda g, t: [f"model.path={_model_with(g, t, vocab_size=80)}"],
                                         "model.path: model.embed_tokens.weight in {t}/model/model.safetensors has shape "
                                         "[64, 64], but config.json says [vocab_size 80, hidden_size 64]"),
    "hidden size disagrees with the weights": (lambda g, t: [f"model.path={_model_with(g, t, hidden_size=128)}"],
                                               "has shape [64, 64], but config.json says [vocab_size 64, hidden_size 128]"),
    "head count disagrees with the weights": (lambda g, t: [f"model.path={_model_with(g, t, num_attention_heads=8)}"],
                                              "model.layers.0.self_attn.k_proj.weight in {t}/model/model.safetensors has shape "
                                              "[32, 64], but config.json says [num_key_value_heads 2 x head_dim 8 "
                                              "(hidden_size / 8 heads), hidden_size 64]"),
    "KV head count disagrees with the weights": (lambda g, t: [f"model.path={_model_with(g, t, num_key_value_heads=4)}"],
                                                 "k_proj.weight in {t}/model/model.safetensors has shape [32, 64], but "
                                                 "config.json says [num_key_value_heads 4 x head_dim 16"),
    "more layers than the weights": (lambda g, t: [f"model.path={_model_with(g, t, num_hidden_layers=2, layer_types=['full_attention'] * 2)}"],
                                     "lack model.layers.1.self_attn.q_proj.weight, which its config.json (2 layers) needs"),
    "weights conversion would drop": (lambda g, t: [f"model.path={_model_with(g, t, model_type='llama', architectures=['LlamaForCausalLM'])}"],
                                      "model.path: {t}/model/model.safetensors holds model.layers.0.self_attn.k_proj.bias "
                                      "(and 2 more), which hybridflow's LlamaForCausalLM does not have"),
    "tokenizer missing": (lambda g, t: [f"model.path={_copy_model(g, t, ['tokenizer*'])}"],
                          "model.path: no tokenizer files (tokenizer.json, tokenizer.model or vocab.json)"),
    "dist checkpoint missing": (lambda g, t: ["actor.megatron.use_dist_checkpointing=true",
                                              f"actor.megatron.dist_checkpointing_path={t}/mcore"],
                                "actor.megatron.dist_checkpointing_path: {t}/mcore is not a whole megatron dist "
                                "checkpoint (mcore/ is missing)"),
    "context too long": (lambda g, t: ["data.max_response_length=10"],
                         "data.max_prompt_length + data.max_response_length (26) exceeds the model's max_position_embeddings (22)"),
    # output
    "output_dir not writable": (lambda g, t: [f"trainer.output_dir={(t / 'file').write_text('x') and t / 'file'}/run"],
                                "trainer.output_dir: cannot write to"),
    "checkpoints folder is a file": (lambda g, t: [f"trainer.output_dir={_file_at(t / 'run' / 'checkpoints').parent}"],
                                     "checkpoints is a file; the run writes a folder there"),
    "export folder is a file": (lambda g, t: [f"trainer.output_dir={_file_at(t / 'run' / 'actor_hf').parent}"],
                                "actor_hf is a file; the run writes a folder there"),
    # sizes and counts
    "total_epochs zero": (lambda g, t: ["trainer.total_epochs=0"], "trainer: total_epochs must be >= 1, got 0"),
    "total_steps zero": (lambda g, t: ["trainer.total_steps=0"], "trainer: total_steps must be >= 1, got 0"),
    "negative seed": (lambda g, t: ["trainer.seed=-1"], "trainer: seed must be in [0, 2**32) (vLLM seeds numpy with it), got -1"),
    "seed beyond 64 bits": (lambda g, t: [f"trainer.seed={2**64}"], f"trainer: seed must be in [0, 2**32) (vLLM seeds numpy with it), got {2**64}"),
    "seed plus replica beyond 32 bits": (lambda g, t: [f"trainer.seed={2**32 - 1}", "resources.n_workers=2",
                                                              "actor.ppo_micro_batch_size_per_gpu=32",
                                                              "critic.ppo_micro_batch_size_per_gpu=32"],
                                         "trainer.seed (4294967295) + 1 (the last generation replica's offset) must stay below 2**32"),
    # numbers: NaN passes `x <= 0`, so every range check tests finiteness first
    "NaN learning rate": (lambda g, t: ["actor.optim.lr=nan"], "actor.optim: lr must be a finite number, got nan"),
    "infinite learning rate": (lambda g, t: ["critic.optim.lr=.inf"], "critic.optim: lr must be a finite number, got inf"),
    "zero learning rate": (lambda g, t: ["actor.optim.lr=0"], "actor.optim: lr must be in (0, 1], got 0.0"),
    "Adam beta of 1": (lambda g, t: ["actor.optim.betas=[0.9,1.0]"], "actor.optim: betas[1] must be in [0, 1), got 1.0"),
    "negative Adam beta": (lambda g, t: ["critic.optim.betas=[-0.1,0.999]"], "critic.optim: betas[0] must be in [0, 1), got -0.1"),
    "NaN Adam beta": (lambda g, t: ["actor.optim.betas=[nan,0.999]"], "actor.optim: betas[0] must be a finite number, got nan"),
    "negative weight decay": (lambda g, t: ["actor.optim.weight_decay=-0.01"], "actor.optim: weight_decay must be >= 0, got -0.01"),
    "negative grad clip": (lambda g, t: ["actor.optim.clip_grad=-1"], "actor.optim: clip_grad must be >= 0, got -1.0"),
    "infinite dist timeout": (lambda g, t: ["trainer.dist_timeout_s=.inf"], "trainer: dist_timeout_s must be a finite number, got inf"),
    "NaN stage timeout": (lambda g, t: ["trainer.stage_timeout_s=nan"], "trainer: stage_timeout_s must be a finite number, got nan"),
    "dist timeout past int64 nanoseconds": (lambda g, t: ["trainer.dist_timeout_s=1e12"],
                                            "trainer: dist_timeout_s must be in (0, 1e+09], got 1000000000000.0"),
    "adaptive KL horizon zero": (lambda g, t: ["algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.horizon=0"],
                                 "algorithm.kl_ctrl: horizon must be >= 1, got 0"),
    "negative KL horizon": (lambda g, t: ["algorithm.kl_ctrl.horizon=-5"], "algorithm.kl_ctrl: horizon must be >= 1, got -5"),
    "zero target KL": (lambda g, t: ["algorithm.kl_ctrl.target_kl=0"], "algorithm.kl_ctrl: target_kl must be > 0, got 0.0"),
    "NaN KL coefficient": (lambda g, t: ["algorithm.kl_ctrl.kl_coef=nan"], "algorithm.kl_ctrl: kl_coef must be a finite number"),
    "gamma above one": (lambda g, t: ["algorithm.gamma=1.5"], "algorithm: gamma must be in [0, 1], got 1.5"),
    "negative clip_ratio_low": (lambda g, t: ["actor.clip_ratio_low=-0.2"], "actor: clip_ratio_low must be >= 0, got -0.2"),
    "negative clip_ratio_high": (lambda g, t: ["actor.clip_ratio_high=-0.1"], "actor: clip_ratio_high must be >= 0, got -0.1"),
    "NaN clip_ratio_c": (lambda g, t: ["actor.clip_ratio_c=nan"], "actor: clip_ratio_c must be a finite number, got nan"),
    "negative KL loss coef": (lambda g, t: ["actor.kl_loss_coef=-1"], "actor: kl_loss_coef must be >= 0, got -1.0"),
    "negative value clip": (lambda g, t: ["critic.cliprange_value=-0.5"], "critic: cliprange_value must be >= 0, got -0.5"),
    "top_p zero": (lambda g, t: ["rollout.top_p=0"], "rollout: top_p must be in (0, 1], got 0.0"),
    "top_p above one": (lambda g, t: ["rollout.top_p=1.5"], "rollout: top_p must be in (0, 1], got 1.5"),
    "top_p NaN": (lambda g, t: ["rollout.top_p=nan"], "rollout: top_p must be a finite number, got nan"),
    "top_k below -1": (lambda g, t: ["rollout.top_k=-2"], "rollout: top_k must be >= -1, got -2"),
    "NaN temperature": (lambda g, t: ["rollout.temperature=nan"], "rollout: temperature must be a finite number, got nan"),
    "reward timeout zero": (lambda g, t: ["custom_reward_function.timeout_s=0"], "custom_reward_function: timeout_s must be > 0"),
    # config files and verl command lines
    "non-UTF-8 config file": (lambda g, t: ["--config", _non_utf8_config(t)],
                              "latin1.yaml is not UTF-8 text: byte 31 (line 2) is 0xe9; save the file as UTF-8"),
    "verl integer key given 1.5": (lambda g, t: ["--verl-overrides", "data.train_batch_size=1.5"],
                                   "key 'data.batch_size' expects int, got float 1.5 (in verl override 'data.train_batch_size=1.5')"),
    "verl integer key given text": (lambda g, t: ["--verl-overrides", "actor_rollout_ref.rollout.n=abc"],
                                    "key 'rollout.n' expects int, got str 'abc' (in verl override 'actor_rollout_ref.rollout.n=abc')"),
    "verl GPU count given text": (lambda g, t: ["--verl-overrides", "trainer.n_gpus_per_node=abc"],
                                  "verl override 'trainer.n_gpus_per_node=abc': expects a whole number >= 1, got 'abc'"),
    "ppo_micro zero": (lambda g, t: ["actor.ppo_micro_batch_size_per_gpu=0"], "actor: ppo_micro_batch_size_per_gpu must be >= 1"),
    "ppo_mini zero": (lambda g, t: ["actor.ppo_mini_batch_size=0"], "actor: ppo_mini_batch_size must be >= 1"),
    "ppo_mini negative": (lambda g, t: ["critic.ppo_mini_batch_size=-4"], "critic: ppo_mini_batch_size must be >= 1"),
    "n_workers zero": (lambda g, t: ["resources.n_workers=0"], "resources: n_workers must be >= 1, got 0"),
    "negative cpus": (lambda g, t: ["resources.cpus_per_worker=-1"], "resources: cpus_per_worker must be > 0, got -1.0"),
    "zero cpus": (lambda g, t: ["resources.cpus_per_worker=0"], "resources: cpus_per_worker must be > 0, got 0.0"),
    "negative gpus": (lambda g, t: ["resources.gpus_per_worker=-1"], "resources: gpus_per_worker must be >= 0, got -1.0"),
    "batch_size zero": (lambda g, t: ["data.batch_size=0"], "data: batch_size must be >= 1"),
    "max_prompt_length negative": (lambda g, t: ["data.max_prompt_length=-3"], "data: max_prompt_length must be >= 1"),
    "log-prob micro zero": (lambda g, t: ["critic.log_prob_micro_batch_size_per_gpu=0"],
                            "critic: log_prob_micro_batch_size_per_gpu must be >= 1"),
    "epochs zero": (lambda g, t: ["actor.ppo_epochs=0"], "actor: ppo_epochs must be >= 1"),
    "gpu memory utilization": (lambda g, t: ["rollout.gpu_memory_utilization=1.5"], "rollout: gpu_memory_utilization must be in (0, 1]"),
    "rollout n zero": (lambda g, t: ["rollout.n=0"], "rollout: n must be >= 1"),
    "unknown dtype": (lambda g, t: ["actor.megatron.dtype=fp8"], "key 'actor.megatron.dtype' expects one of"),
    # layouts against the model
    "tp does not divide kv heads": (lambda g, t: ["actor.megatron.tensor_model_parallel_size=4", "resources.n_workers=4",
                                                  "critic.megatron.tensor_model_parallel_size=4"],
                                    "actor.megatron.tensor_model_parallel_size (4) does not divide the model's num_key_value_heads (2)"),
    "pp does not divide layers": (lambda g, t: ["actor.megatron.pipeline_model_parallel_size=2", "resources.n_workers=2",
                                                "critic.megatron.pipeline_model_parallel_size=2"],
                                  "actor.megatron.pipeline_model_parallel_size (2) does not divide the model's 1 layers"),
    "uneven stages leave a stage no layer": (lambda g, t: ["actor.megatron.pipeline_model_parallel_size=2", "resources.n_workers=2",
                                                           "actor.megatron.override_transformer_config={num_layers_in_last_pipeline_stage: 1}"],
                                             "num_layers_in_last_pipeline_stage: every stage's layers [0, 1] must divide into "
                                             "the 1 virtual stages, a layer each at least"),
    "verl key unsupported": (lambda g, t: ["--verl-overrides", "actor_rollout_ref.actor.checkpoint.async_save=True"],
                             "verl keys not supported by hybridflow: actor_rollout_ref.actor.checkpoint.async_save"),
    # resources (checked against the machine before Ray starts)
    "more CPUs than the cluster": (lambda g, t: ["resources.cpus_per_worker=4"],
                                   "resources: the worker pools need 4 CPUs (n_workers x cpus_per_worker), the embedded Ray cluster has 2"),
    "more GPUs than the machine": (lambda g, t: ["resources.gpus_per_worker=1"], "need 1 GPUs (n_workers x gpus_per_worker), this machine has 0"),
    "joined cluster with num_cpus": (lambda g, t: ["ray.address=auto"], "ray: num_cpus and temp_dir size an embedded cluster"),
    "unreachable ray.address": (lambda g, t: [f"ray.address=127.0.0.1:{_closed_port()}", "ray.num_cpus=null"],
                                "ray.address: no Ray cluster answers at 127.0.0.1:"),
    "unreachable ray client address": (lambda g, t: [f"ray.address=ray://127.0.0.1:{_closed_port()}", "ray.num_cpus=null"],
                                       "ray.address: no Ray cluster answers at 127.0.0.1:"),
    "ray.address without a port": (lambda g, t: ["ray.address=headnode", "ray.num_cpus=null"],
                                   "ray.address: expected host:port, ray://host:port or auto, got 'headnode'"),
    "ray temp_dir is a file": (lambda g, t: [f"ray.temp_dir={_file_at(t / 'raytmp')}"], "raytmp is a file; Ray needs a folder there"),
    "ray temp_dir too long for Unix sockets": (lambda g, t: [f"ray.temp_dir=/tmp/{'x' * 40}"],
                                               f"ray.temp_dir: /tmp/{'x' * 40} is too long: Ray's socket paths in it reach 109 "
                                               "bytes (<temp_dir>/session_2000-01-01_00-00-00_000000_4194304/sockets/plasma_store), "
                                               "over the 107-byte limit of Unix sockets; keep the absolute path within 43 bytes"),
    # multi-turn rollouts with tools
    "multi-turn without a tool config": (lambda g, t: ["rollout.multi_turn.enable=true"],
                                         "tool_config_path is required when rollout.multi_turn.enable is true"),
    "tool config not found": (lambda g, t: ["rollout.multi_turn.enable=true", f"rollout.multi_turn.tool_config_path={t}/tools.yaml"],
                              "rollout.multi_turn.tool_config_path: {t}/tools.yaml: cannot read the tool config"),
    "verl's own tool class": (lambda g, t: ["rollout.multi_turn.enable=true",
                                            f"rollout.multi_turn.tool_config_path={_verl_tool_config(t)}"],
                              "tools[0].class_name 'verl.tools.gsm8k_tool.Gsm8kTool' is one of verl's tools"),
    "unknown tool-call format": (lambda g, t: ["rollout.multi_turn.enable=true", "rollout.multi_turn.format=xml",
                                               "rollout.multi_turn.tool_config_path=configs/tools/calculator.yaml"],
                                 "rollout.multi_turn.format: unknown tool-call format 'xml'"),
    "multi-turn with a tokenizer without chat template": (
        lambda g, t: ["rollout.multi_turn.enable=true", "rollout.multi_turn.tool_config_path=configs/tools/calculator.yaml"],
        "model.path: rollout.multi_turn needs a chat template"),
    # runs, checkpoints and trackers
    "output_dir holds a run, resume disabled": (lambda g, t: [*_old_run(t), "trainer.resume_mode=disable"],
                                                "already holds a run; continue it with trainer.resume_mode=auto"),
    "output_dir holds a run without checkpoint": (lambda g, t: _old_run(t), "holds a run with no complete checkpoint to resume"),
    "resume from a non-checkpoint": (lambda g, t: ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={g}/data"], "data is not a complete checkpoint (no trainer_state.json"),
    "unknown logger": (lambda g, t: ["trainer.logger=[console,mlflow]"], "trainer: logger: unknown ['mlflow']"),
    "unknown nonfinite policy": (lambda g, t: ["trainer.on_nonfinite=ignore"], "key 'trainer.on_nonfinite' expects one of"),
    "prepare with a mistyped model.path": (lambda g, t: ["prepare.enable=true", f"model.path={t}/elsewhere/sft_mdoel"],
                                           "model.path: not a model folder: {t}/elsewhere/sft_mdoel (prepare.enable "
                                           "builds the warm start only in prepare.model_dir, "),
    "prepare with a typo beside the base model": (  # was trained as a new warm start into the typo's folder
        lambda g, t: ["prepare.enable=true", f"prepare.base_model_dir={t}/qs/base_model", f"model.path={t}/qs/sft_modle"],
        "model.path: not a model folder: {t}/qs/sft_modle (prepare.enable builds the warm start only in "
        "prepare.model_dir, {t}/qs/sft_model; to build it here, set prepare.model_dir={t}/qs/sft_modle)"),
    # values that trained normally (or failed only once the workers ran)
    "clip_cov bounds crossed": (lambda g, t: ["actor.policy_loss.clip_cov_lb=6"],
                                "actor.policy_loss.clip_cov_lb (6.0) must be below clip_cov_ub (5.0)"),
    "negative sapo tau": (lambda g, t: ["actor.tau_neg=-1"], "actor: tau_neg must be > 0, got -1.0"),
    "zero sapo tau": (lambda g, t: ["actor.policy_loss.loss_mode=sapo", "actor.tau_neg=0"],
                      "actor: tau_neg must be > 0, got 0.0"),
    "absurd learning rate": (lambda g, t: ["actor.optim.lr=10"], "actor.optim: lr must be in (0, 1], got 10.0"),
    "negative learning rate": (lambda g, t: ["critic.optim.lr=-1e-5"], "critic.optim: lr must be in (0, 1], got -1e-05"),
    "KV cache larger than the machine": (lambda g, t: ["rollout.kv_cache_gib=1000000"],
                                         "rollout.kv_cache_gib=1000000 does not fit in this machine's"),
    "multi-turn with an empty tool list": (
        lambda g, t: ["rollout.multi_turn.enable=true",
                      f"rollout.multi_turn.tool_config_path={(t / 'none.yaml').write_text('tools: []') and t / 'none.yaml'}"],
        "rollout.multi_turn.tool_config_path: {t}/none.yaml lists no tools (tools: []); name at least one"),
    "mini batch vs data batch": (lambda g, t: ["actor.ppo_mini_batch_size=48"], "actor.ppo_mini_batch_size (48 prompts) must divide data.batch_size (128)"),
    # on-policy distillation's teachers
    "distillation teacher not a folder": (
        lambda g, t: [_DISTILL, f"distillation.teacher_models.t.model_path={t}/nope"],
        "distillation.teacher_models.t.model_path: not a model folder: {t}/nope"),
    "distillation teacher with another vocabulary": (
        lambda g, t: [_DISTILL, f"distillation.teacher_models.t.model_path={_teacher_with_another_vocabulary(g, t)}"],
        "distillation.teacher_models.t.model_path: the tokenizer in {t}/teacher differs from model.path's"),
    "distillation rows no teacher is keyed by": (
        lambda g, t: [_DISTILL, f"distillation.teacher_models.t1.model_path={g}/model", "distillation.teacher_models.t1.key=a",
                      f"distillation.teacher_models.t2.model_path={g}/model", "distillation.teacher_models.t2.key=b"],
        "row 0 names no teacher (keys: ['a', 'b'])"),
    "distillation k1 as a supervised loss": (
        lambda g, t: [_DISTILL, f"distillation.teacher_models.t.model_path={g}/model",
                      "distillation.distillation_loss.loss_mode=k1", "distillation.distillation_loss.use_policy_gradient=false"],
        "loss_mode k1 as a supervised loss (use_policy_gradient false) has a gradient that does not depend on the teacher"),
    "distillation without a teacher": (lambda g, t: [_DISTILL], "distillation.enabled needs distillation.teacher_models"),
    # sizes that would make an endless first step
    "absurd rollout.n": (lambda g, t: ["rollout.n=10000000"], "rollout.n: data.batch_size x rollout.n = 1,280,000,000 "
                                                               "sequences of up to 22 tokens need ~"),
}


def _has_gpu() -> bool:
    from hybridflow import device

    return device.has_gpu()


if not _has_gpu():  # megatron's fp16 loss scaler is CUDA-only
    CASES["fp16 on CPU"] = (lambda g, t: ["critic.megatron.dtype=float16"],
                            "critic.megatron.dtype: float16 needs a GPU (megatron's fp16 loss scaler lives on CUDA)")


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_is_one_line_before_anything_starts(case, good, tmp_path, capsys):
    make, message = CASES[case]
    err = run(good, tmp_path, *make(good, tmp_path), capsys=capsys)
    assert message.replace("{t}", str(tmp_path)) in err, err


def test_the_good_input_passes_the_checks(good, tmp_path):
    from hybridflow.trainer.main import load
    from hybridflow.trainer.preflight import check_run

    check_run(load(["--config", QUICKSTART, "prepare.enable=false", f"model.path={good}/model",
                      f"data.train_files=[{good}/data/train.parquet]", f"data.val_files=[{good}/data/val.parquet]",
                      f"trainer.output_dir={tmp_path}/out"]))
    assert os.path.isdir(tmp_path / "out")


def _load(good, tmp_path, *overrides):
    from hybridflow.trainer.main import load

    return load(["--config", QUICKSTART, "prepare.enable=false", f"model.path={good}/model",
                 f"data.train_files=[{good}/data/train.parquet]", f"data.val_files=[{good}/data/val.parquet]",
                 f"trainer.output_dir={tmp_path}/out", *overrides])


def test_prompts_the_tokenizer_cannot_represent_are_counted_in_one_warning(good, tmp_path, caplog):
    from hybridflow.trainer.preflight import check_run

    prompts = ["Q: 1+1= A:"] * 64 + ["Q: 1€1= A:", "Q: 2+2= A:", "Q: 1é1= A:"]  # € and é: not in its vocab
    train = _write(tmp_path / "train.parquet", prompt=prompts, answer=["2"] * len(prompts))
    with caplog.at_level(logging.WARNING, logger="hybridflow.trainer.preflight"):
        checked = check_run(_load(good, tmp_path, f"data.train_files=[{train}]", "data.batch_size=64",
                                  "actor.ppo_mini_batch_size=64"))
    assert len(checked.train_data) == len(prompts)  # kept: a warning, not an error
    assert [r.getMessage() for r in caplog.records] == [
        f"data.train_files: 2 prompts in {train} hold characters the tokenizer of {good}/model cannot represent "
        "(unknown tokens, or dropped); the first is row 64"]


@pytest.fixture
def no_wandb_credentials(tmp_path, monkeypatch):
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_MODE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    netrc = tmp_path / "netrc"
    netrc.write_text("machine example.com login user password secret\n")
    monkeypatch.setenv("NETRC", str(netrc))
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb_home"))  # nothing of wandb's lands in $HOME
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # nor the temp folders it makes on import
    return netrc


@pytest.mark.parametrize("setting, offline", [
    ({}, True),
    ({"WANDB_MODE": "online"}, True),
    ({"WANDB_MODE": "offline"}, False),
    ({"WANDB_MODE": "disabled"}, False),
    ({"WANDB_API_KEY": "x" * 40}, False),
    ({"netrc": "machine api.wandb.ai login user password " + "x" * 40}, False),
    ({"netrc": "machine wandb.example.org login user password k", "WANDB_BASE_URL": "https://wandb.example.org"}, False),
])
def test_wandb_falls_back_offline_exactly_without_credentials(no_wandb_credentials, monkeypatch, setting, offline):
    from hybridflow.trainer.tracking import wandb_falls_back_offline

    for name, value in setting.items():
        if name == "netrc":
            no_wandb_credentials.write_text(value + "\n")
        else:
            monkeypatch.setenv(name, value)
    assert wandb_falls_back_offline() is offline


def test_wandb_without_credentials_logs_offline_after_one_warning(good, tmp_path, no_wandb_credentials, caplog):
    from hybridflow.config import config_to_dict
    from hybridflow.trainer.preflight import check_run
    from hybridflow.trainer.tracking import Tracker

    cfg = _load(good, tmp_path, "trainer.logger=[wandb]")
    with caplog.at_level(logging.WARNING, logger="hybridflow.trainer.preflight"):
        check_run(cfg)
    assert [r.getMessage() for r in caplog.records] == [
        "trainer.logger: wandb finds no credentials (WANDB_API_KEY, or an entry in ~/.netrc) and WANDB_MODE is not "
        f"offline: logging offline to {tmp_path}/out/wandb (upload later with `wandb sync`)"]
    tracker = Tracker(cfg.trainer, config_to_dict(cfg), resume_step=None)  # raised "No API key configured" before
    tracker.log(1, {"reward/score_mean": 0.5})
    tracker.close()
    assert list((tmp_path / "out" / "wandb").glob("offline-run-*"))


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_checkpoints_folder_is_found_before_training(good, tmp_path, capsys):
    (tmp_path / "out" / "checkpoints").mkdir(parents=True)
    (tmp_path / "out" / "checkpoints").chmod(0o500)
    try:
        err = run(good, tmp_path, capsys=capsys)
    finally:
        (tmp_path / "out" / "checkpoints").chmod(0o700)
    assert f"trainer.output_dir: cannot write to {tmp_path}/out/checkpoints (Permission denied)" in err, err


def test_ray_address_auto_is_checked_where_ray_would_look(good, tmp_path, capsys, monkeypatch):
    port = _closed_port()
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")  # what ray.init(address="auto") joins first
    err = run(good, tmp_path, "ray.address=auto", "ray.num_cpus=null", capsys=capsys)
    assert "config error: ray.address: no Ray cluster answers at " in err and f":{port} within 5 s (" in err, err


def test_a_sequence_that_cannot_fit_the_cpu_kv_cache_is_refused(tmp_path):
    """vLLM-CPU's KV cache has a fixed size (rollout.kv_cache_gib): a 70B-shaped model's 4096-token
    sequence does not fit into 1 GiB of it."""
    from transformers import Qwen2Config

    from hybridflow.plan import resolve
    from hybridflow.trainer.main import load
    from hybridflow.trainer.preflight import check_step_fits

    big = Qwen2Config(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                      num_key_value_heads=8, vocab_size=152064)
    cfg = load(["--config", QUICKSTART, "data.max_prompt_length=2048", "data.max_response_length=2048",
                "rollout.dtype=bfloat16"])
    with pytest.raises(ConfigError, match=r"^rollout.kv_cache_gib=1 holds 3,276 tokens of this model, but one "
                                          r"sequence takes up to 4,096"):
        check_step_fits(cfg, big, resolve(cfg))
    cfg = load(["--config", QUICKSTART, "data.max_prompt_length=1024", "data.max_response_length=2048",
                "rollout.dtype=bfloat16"])
    check_step_fits(cfg, big, resolve(cfg))


def test_max_position_embeddings_overrides_the_folders_everywhere(good, tmp_path):
    """model.max_position_embeddings (verl's model.override_config.model_config.max_position_embeddings) replaces
    config.json's (22) in the preflight's length check, the workers' config and vLLM's (hf_overrides)."""
    from transformers import AutoConfig

    from hybridflow.plan import resolve
    from hybridflow.rollout.vllm_rollout import _overridden
    from hybridflow.trainer.preflight import check_run
    from hybridflow.workers.common import open_hf_folder

    cfg = _load(good, tmp_path, "data.max_response_length=10", "model.max_position_embeddings=26")
    check_run(cfg)  # 16 + 10 positions: refused with config.json's 22 ("context too long")
    process = resolve(cfg).actor_spec.process
    assert open_hf_folder(process.model_path, config_overrides=process.config_overrides)[0].max_position_embeddings == 26
    vllm_config = _overridden(process.config_overrides, False, AutoConfig.from_pretrained(f"{good}/model"))
    assert vllm_config.max_position_embeddings == 26
