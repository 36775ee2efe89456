"""Bad input, as a new user would give it: each case is one line naming the key, file or row, returned
before Ray or any worker starts (`hybridflow train` exits 2)."""

from __future__ import annotations

import json
import os
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

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
                                "data.train_files: 1 prompts cannot fill one batch of data.batch_size=64"),
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
    "tokenizer missing": (lambda g, t: [f"model.path={_copy_model(g, t, ['tokenizer*'])}"],
                          "model.path: no tokenizer files (tokenizer.json, tokenizer.model or vocab.json)"),
    "context too long": (lambda g, t: ["data.max_response_length=10"],
                         "data.max_prompt_length + data.max_response_length (26) exceeds the model's max_position_embeddings (22)"),
    # output
    "output_dir not writable": (lambda g, t: [f"trainer.output_dir={(t / 'file').write_text('x') and t / 'file'}/run"],
                                "trainer.output_dir: cannot write to"),
    # sizes and counts
    "val_every zero": (lambda g, t: ["trainer.val_every=0"], "trainer: val_every must be >= 1, got 0"),
    "total_steps zero": (lambda g, t: ["trainer.total_steps=0"], "trainer: total_steps must be >= 1, got 0"),
    "negative seed": (lambda g, t: ["trainer.seed=-1"], "trainer: seed must be >= 0, got -1"),
    "ppo_micro zero": (lambda g, t: ["actor.ppo_micro_batch_size_per_gpu=0"], "actor: ppo_micro_batch_size_per_gpu must be >= 1"),
    "ppo_mini zero": (lambda g, t: ["actor.ppo_mini_batch_size=0"], "actor: ppo_mini_batch_size must be >= 1"),
    "ppo_mini negative": (lambda g, t: ["critic.ppo_mini_batch_size=-4"], "critic: ppo_mini_batch_size must be >= 1"),
    "n_workers zero": (lambda g, t: ["resources.n_workers=0"], "resources: n_workers must be >= 1, got 0"),
    "negative cpus": (lambda g, t: ["resources.cpus_per_worker=-1"], "resources: cpus_per_worker and gpus_per_worker must be >= 0"),
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
    "verl key unsupported": (lambda g, t: ["--verl-overrides", "actor_rollout_ref.actor.strategy=fsdp"],
                             "verl keys not supported by hybridflow: actor_rollout_ref.actor.strategy"),
    # resources (checked against the machine before Ray starts)
    "more CPUs than the cluster": (lambda g, t: ["resources.cpus_per_worker=4"],
                                   "resources: the worker pools need 4 CPUs (n_workers x cpus_per_worker), the embedded Ray cluster has 2"),
    "more GPUs than the machine": (lambda g, t: ["resources.gpus_per_worker=1"], "need 1 GPUs (n_workers x gpus_per_worker), this machine has 0"),
    "joined cluster with num_cpus": (lambda g, t: ["ray.address=auto"], "ray: num_cpus and temp_dir size an embedded cluster"),
    # runs, checkpoints and trackers
    "output_dir holds a run, resume disabled": (lambda g, t: [*_old_run(t), "trainer.resume=disable"],
                                                "already holds a run; continue it with trainer.resume=auto"),
    "output_dir holds a run without checkpoint": (lambda g, t: _old_run(t), "holds a run with no complete checkpoint to resume"),
    "resume from a non-checkpoint": (lambda g, t: [f"trainer.resume={g}/data"], "data is not a complete checkpoint (no trainer_state.json"),
    "unknown logger": (lambda g, t: ["trainer.logger=[console,mlflow]"], "trainer: logger: unknown ['mlflow']"),
    "unknown nonfinite policy": (lambda g, t: ["trainer.on_nonfinite=ignore"], "key 'trainer.on_nonfinite' expects one of"),
    "prepare with a mistyped model.path": (lambda g, t: ["prepare.enable=true", f"model.path={t}/elsewhere/sft_mdoel"],
                                           "prepare.enable builds the warm start only next to prepare.base_model_dir"),
    "mini batch vs data batch": (lambda g, t: ["actor.ppo_mini_batch_size=48"], "actor.ppo_mini_batch_size (48 prompts) must divide data.batch_size (64)"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_is_one_line_before_anything_starts(case, good, tmp_path, capsys):
    make, message = CASES[case]
    err = run(good, tmp_path, *make(good, tmp_path), capsys=capsys)
    assert message in err, err


def test_the_good_input_passes_the_checks(good, tmp_path):
    from hybridflow.trainer.main import load
    from hybridflow.trainer.preflight import check_run

    check_run(load(["--config", QUICKSTART, "prepare.enable=false", f"model.path={good}/model",
                      f"data.train_files=[{good}/data/train.parquet]", f"data.val_files=[{good}/data/val.parquet]",
                      f"trainer.output_dir={tmp_path}/out"]))
    assert os.path.isdir(tmp_path / "out")
