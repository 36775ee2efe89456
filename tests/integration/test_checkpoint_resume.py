"""Checkpoints resume exactly: a run of N steps equals k steps, a checkpoint, and a resumed run to N (final
weights bit-identical, per-step metrics identical) — PPO with a critic and KL in the reward (its controller's
state too), at TP=2, checked on the CLI rerun of a run stopped by SIGTERM (by path when that run named no
checkpoint). One uninterrupted run serves every test. A checkpoint resumed at another layout is covered below the
driver: tests/distributed/test_checkpoint.py (TP 2 -> TP 1, the same losses within the fp32 tolerance) and
test_lora.py (adapters at any layout); per-sample sampling seeds make a layout's rollouts the same
(test_async_modes.py). The checkpoint's HF export loads in transformers and vLLM with the actor's greedy outputs.
TensorBoard and wandb (offline) files are written and readable."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from tests.integration.conftest import make_cfg

pytestmark = pytest.mark.integration

N, K = 3, 2  # one step after the resumed checkpoint proves it exact; the last validation is at N
RUN = [f"trainer.total_steps={N}", f"trainer.save_every={K}", "trainer.val_every=2", "trainer.max_checkpoints=null"]
TP2 = ["actor.megatron.tensor_model_parallel_size=2", "critic.megatron.tensor_model_parallel_size=2",
       "resources.n_workers=2", "resources.cpus_per_worker=1"]
VARYING = ("time/", "perf/", "memory/")  # wall-clock and memory readings differ run to run


def fit(cfg) -> list[dict]:
    from hybridflow import Trainer

    with Trainer(cfg) as trainer:
        return trainer.fit()


def comparable(rows: list[dict], after: int) -> dict[int, dict]:
    return {r["step"]: {k: v for k, v in r.items() if not (k.startswith(VARYING) or k.endswith("seconds"))}
            for r in rows if r["step"] > after}


def weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), f"{k} differs"


@pytest.fixture(scope="module")
def straight(assets, tmp_path_factory, ray_cluster):
    """The uninterrupted run of N steps at TP=2 (checkpoints every K steps)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("WANDB_MODE", "offline")  # no network here: wandb writes its run under output_dir/wandb
    mp.setenv("WANDB_SILENT", "true")
    out = tmp_path_factory.mktemp("straight")
    cfg = make_cfg(assets, out, *RUN, *TP2, "reward.name=arithmetic", "trainer.logger=[console,jsonl,tensorboard,wandb]")
    run = (Path(cfg.trainer.output_dir), fit(cfg), TP2)
    mp.undo()
    return run


def assert_resumed_exactly(resumed: list[dict], straight: list[dict], after: int) -> None:
    """A run resumed from the checkpoint of step ``after`` logs the uninterrupted run's metrics for every later
    step (wall-clock and memory readings aside)."""
    got, want = comparable(resumed, after), comparable(straight, after)
    assert sorted(got) == sorted(want) == list(range(after + 1, N + 1)), (sorted(got), sorted(want))
    for step in want:
        differ = {k: (got[step].get(k), v) for k, v in want[step].items() if got[step].get(k) != v}
        assert not differ and got[step].keys() == want[step].keys(), f"step {step}: {differ}"


def resume_from_path(straight, assets, out: Path) -> None:
    """The straight run's checkpoint of step K resumed by path (trainer.resume_mode=resume_path): it starts after
    it and equals the straight run from there, weights and metrics."""
    cfg = make_cfg(assets, out, *RUN, *TP2, "reward.name=arithmetic", "trainer.resume_mode=resume_path",
                   f"trainer.resume_from_path={straight[0]}/checkpoints/step_{K}")
    resumed = fit(cfg)
    assert [r["step"] for r in resumed] == list(range(K + 1, N + 1)), "a resumed run starts after its checkpoint"
    assert_resumed_exactly(resumed, straight[1], K)
    assert_same_weights(straight[0] / "actor_hf", Path(cfg.trainer.output_dir) / "actor_hf")


def test_export_command_round_trip(straight, assets, tmp_path):
    """`hybridflow export` of the last checkpoint equals the trainer's own export bit for bit; transformers
    and vLLM load it and their greedy responses equal the actor's (its logged validation samples)."""
    from hybridflow.cli import main

    out, _, _ = straight
    assert main(["export", "--checkpoint", str(out), "--out", str(tmp_path / "hf")]) == 0
    assert_same_weights(out / "actor_hf", tmp_path / "hf")
    assert (tmp_path / "hf" / "tokenizer.json").exists() and (tmp_path / "hf" / "config.json").exists()
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    samples = [s for s in samples if s["step"] == N]
    assert samples, "validation samples are logged at the last step"
    from hybridflow.spawn import run_ranks

    import pyarrow.parquet as pq

    prompts = pq.read_table(f"{assets}/data/val.parquet")["prompt"].to_pylist()[:len(samples)]  # the first ones
    hf, vllm = run_ranks(_greedy_both, 1, str(tmp_path / "hf"), prompts)[0]
    assert hf == vllm == [s["response"] for s in samples]


def _greedy_both(rank, world, folder, prompts):
    """Greedy responses of transformers and vLLM from an exported folder."""
    import os

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    hf = []
    for p in prompts:
        ids = torch.tensor([tok(p).input_ids])
        g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                           eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        hf.append(tok.decode(g[0, ids.shape[1]:], skip_special_tokens=True))
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=folder, dtype="float32", max_model_len=22, enforce_eager=True, disable_log_stats=True,
              gpu_memory_utilization=0.2)
    outs = llm.generate([TokensPrompt(prompt_token_ids=tok(p).input_ids) for p in prompts],
                        SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    vllm = [tok.decode(o.outputs[0].token_ids, skip_special_tokens=True) for o in outs]
    return hf, vllm


def test_tensorboard_and_wandb_files(straight):
    out, rows, _ = straight
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard")).Reload()
    steps = [e.step for e in events.Scalars("actor/pg_loss")]
    assert steps == list(range(1, N + 1))
    assert [e.value for e in events.Scalars("val/accuracy")] == pytest.approx(
        [r["val/accuracy"] for r in rows if "val/accuracy" in r])
    assert "val/samples/text_summary" in events.Tags()["tensors"]  # add_text is stored as a tensor summary
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb")), "one offline wandb run with its records"
    assert next(runs[0].glob("*.wandb")).read_bytes()[:4] == b":W&B"  # wandb's record log, for `wandb sync`
    tables = sorted((runs[0] / "files" / "media" / "table" / "val").glob("samples_*.table.json"))
    assert len(tables) == 3  # validations at steps 0, 2 and N (the last)
    for table in tables:
        data = json.loads(table.read_text())
        assert data["columns"] == ["prompt", "response", "score"] and len(data["data"]) == 4


def test_sigterm_checkpoints_and_resumes_to_the_same_weights(straight, assets, tmp_path):
    """SIGTERM mid-run: the step ends, a checkpoint is written, the exit status is EXIT_PREEMPTED with no
    crash banner and nothing left running; rerunning the same command finishes with the weights of the
    uninterrupted run."""
    import signal

    from hybridflow.trainer.signals import EXIT_PREEMPTED
    from tests.integration.cli_run import launch, logged_steps, process_tree, wait_for, wait_gone

    out = tmp_path / "run"
    args = (*RUN, *TP2, "reward.name=arithmetic")
    proc = launch(assets, out, *args)
    try:
        wait_for(lambda: 1 in logged_steps(out), 240, "step 1", proc)
        tree = process_tree(proc.pid)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == EXIT_PREEMPTED, err[-3000:]
    assert wait_gone(tree, timeout_s=10) == []
    stopped = [line for line in err.splitlines() if line.startswith("preempted: stopped by SIGTERM after step ")]
    assert stopped and "Traceback" not in err, err[-3000:]
    # The checkpoint named is that of the step which ended or, when the step in progress outlived the grace
    # period and was abandoned, the last one written before: the rerun starts from it. With none yet, the run's
    # metrics are set aside and the rerun starts over.
    named = re.search(r"; checkpoint (\S+);", stopped[0])[1]
    if named == "None":
        assert "the rerun starts over" in stopped[0] and (out / "metrics.preempted.jsonl").is_file(), stopped[0]
    else:
        assert Path(named).is_dir() and Path(named).parent == out / "checkpoints", stopped[0]
        assert logged_steps(out)[-1] < N, stopped[0]
    again = launch(assets, out, *args)
    _, err = again.communicate(timeout=300)
    assert again.returncode == 0, err[-3000:]
    assert logged_steps(out) == list(range(N + 1))
    assert_same_weights(straight[0] / "actor_hf", out / "actor_hf")
    # The rerun's steps after the named checkpoint (the whole run when none was named) are the straight run's
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert_resumed_exactly(rows, straight[1], 0 if named == "None" else int(Path(named).name.split("_")[1]))
    if named == "None":  # the rerun started over: resume from a checkpoint is checked by path instead
        resume_from_path(straight, assets, tmp_path / "by_path")
