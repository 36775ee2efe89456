"""HF export: streamed into safetensors shards with an index that transformers loads, written atomically."""

from __future__ import annotations

import json

import pytest
import torch


def test_streamed_shards_load_in_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    from hybridflow.models.tiny_qwen2 import build_tiny_qwen2
    from hybridflow.models.char_tokenizer import build_char_tokenizer
    from hybridflow.workers.common import load_hf_folder
    from hybridflow.workers.export import save_hf_folder

    tok = build_char_tokenizer(tmp_path / "src")
    build_tiny_qwen2(tmp_path / "src", tok, hidden_size=64, num_layers=2, seed=1)
    cfg, state = load_hf_folder(str(tmp_path / "src"))
    consumed = []

    def stream():  # a generator, consumed as produced: the exporter never sees the whole dict
        for item in state.items():
            consumed.append(item[0])
            yield item

    save_hf_folder(str(tmp_path / "out"), cfg, stream(), tok, max_shard_bytes=100_000)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert set(index["weight_map"]) == set(state) == set(consumed)
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in state.values())
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32)
    loaded = model.state_dict()
    for k, v in state.items():
        assert torch.equal(loaded[k], v), k
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]  # no temp dir left


def test_failed_export_keeps_the_previous_folder(tmp_path):
    from hybridflow.models.tiny_qwen2 import build_tiny_qwen2
    from hybridflow.models.char_tokenizer import build_char_tokenizer
    from hybridflow.workers.common import load_hf_folder
    from hybridflow.workers.export import save_hf_folder

    build_tiny_qwen2(tmp_path / "m", build_char_tokenizer(tmp_path / "m"), hidden_size=64, num_layers=1, seed=1)
    cfg, state = load_hf_folder(str(tmp_path / "m"))
    save_hf_folder(str(tmp_path / "out"), cfg, state)

    def broken():
        yield next(iter(state.items()))
        raise RuntimeError("rank died mid-export")

    with pytest.raises(RuntimeError, match="mid-export"):
        save_hf_folder(str(tmp_path / "out"), cfg, broken())
    _, again = load_hf_folder(str(tmp_path / "out"))
    assert set(again) == set(state)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m", "out"]


# --- `hybridflow export`: never loses data, names a damaged checkpoint --------------------------------

@pytest.fixture(scope="module")
def made(tmp_path_factory):
    from tests.unit.run_checkpoint import build_model_and_data, make_run

    root = tmp_path_factory.mktemp("export_cli")
    build_model_and_data(root)
    make_run(root)
    return root


@pytest.fixture
def run_copy(made, tmp_path):
    """A copy of the run, per test: <tmp_path>/runs/run (checkpoints step_1, step_2, metrics, config)."""
    import shutil

    shutil.copytree(made / "run", tmp_path / "runs" / "run")
    return tmp_path / "runs" / "run"


def _plain(folder):
    folder.mkdir(parents=True)
    (folder / "notes.txt").write_text("mine")
    (folder / "data.bin").write_bytes(b"\x00\x01")
    return folder


def _file(path):
    path.write_bytes(b"keep me")
    return path


def _run_hf(run):
    _plain(run / "actor_hf")
    return run / "actor_hf"


# --out (made from the run copy), whether --force is passed, the refusal, and the path whose files must stay.
REFUSED = {
    "non-empty folder": (lambda r: _plain(r.parent / "plain"), False, "is a folder that is not empty (2 entries); "
                         "pass --force to replace it"),
    "existing file": (lambda r: _file(r.parent / "file.bin"), False, "is an existing file; pass --force to replace it"),
    "the run folder": (lambda r: r, False, "is a run folder (it holds checkpoints); a run's files are never replaced"),
    "the run folder, forced": (lambda r: r, True, "is a run folder (it holds checkpoints); a run's files are never "
                               "replaced, even with --force"),
    "a folder holding the run, forced": (lambda r: r.parent, True,
                                         "contains the run folder {run} (it holds checkpoints)"),
    "a run's export, forced": (_run_hf, True, "lies inside the run folder {run} (it holds checkpoints)"),
    "a run's metrics file, forced": (lambda r: r / "metrics.jsonl", True, "lies inside the run folder {run}"),
    "the run's checkpoints, forced": (lambda r: r / "checkpoints", True, "is a run folder (it holds latest)"),
    "the checkpoint, forced": (lambda r: r / "checkpoints" / "step_2", True,
                               "lies inside a run's checkpoints ({run}/checkpoints)"),
    "inside the checkpoint, forced": (lambda r: r / "checkpoints" / "step_2" / "hf", True,
                                      "lies inside a run's checkpoints ({run}/checkpoints/step_2)"),
    "new folder inside the checkpoint": (lambda r: r / "checkpoints" / "step_2" / "export", False,
                                         "lies inside a run's checkpoints ({run}/checkpoints/step_2)"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_export_refuses_to_overwrite_in_one_line(case, run_copy, capsys):
    from hybridflow.tools.export import main
    from tests.unit.run_checkpoint import digest

    make_out, force, message = REFUSED[case]
    out = make_out(run_copy)
    everything = run_copy.parent  # the run and the destination
    before, paths = digest(everything), sorted(everything.rglob("*"))
    args = ["--checkpoint", str(run_copy), "--out", str(out), *(["--force"] if force else [])]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: --out {out} "), err
    assert message.format(run=run_copy) in err, err
    assert digest(everything) == before and sorted(everything.rglob("*")) == paths, "nothing written or removed"


@pytest.mark.parametrize("damage, what", [("cut", "is cut short: 1000 of"), ("delete", ".distcp is missing"),
                                          ("hf", "hf/config.json is missing")])
@pytest.mark.parametrize("name_run", [True, False], ids=["run folder", "checkpoint"])
def test_export_of_a_damaged_checkpoint_is_one_line(damage, what, name_run, run_copy, tmp_path, capsys):
    import os
    import shutil

    from hybridflow.tools.export import main

    step = run_copy / "checkpoints" / "step_2"  # the latest
    shard = max((step / "actor").glob("*.distcp"), key=os.path.getsize)
    {"cut": lambda: os.truncate(shard, 1000), "delete": lambda: os.remove(shard),
     "hf": lambda: shutil.rmtree(step / "hf")}[damage]()
    out = tmp_path / "hf_out"
    assert main(["--checkpoint", str(run_copy if name_run else step), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: --checkpoint: checkpoint {step} is damaged: "), err
    assert what in err, err
    assert not out.exists()


def _export(*args):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "hybridflow.cli", "export", *map(str, args)],
                          capture_output=True, text=True, timeout=300)


def test_force_replaces_a_plain_folder_with_the_export(made, run_copy):
    """The real export: the plain folder's files are gone, the checkpoint's (untrained) actor is there with
    the model's own weights, no temp folder is left, the run is untouched."""
    from hybridflow.workers.common import load_hf_folder
    from tests.unit.run_checkpoint import digest

    out = _plain(run_copy.parent / "plain")
    before = digest(run_copy)
    done = _export("--checkpoint", run_copy, "--out", out, "--force")
    assert done.returncode == 0, done.stderr[-3000:]
    assert not {"notes.txt", "data.bin"} & {p.name for p in out.iterdir()}
    _, exported = load_hf_folder(str(out))
    _, source = load_hf_folder(str(made / "model"))
    assert exported.keys() == source.keys()
    for k, v in source.items():
        assert torch.equal(exported[k], v), k
    assert sorted(p.name for p in run_copy.parent.iterdir()) == ["plain", "run"]
    assert digest(run_copy) == before


def test_export_of_garbage_found_only_when_loading_is_one_line(run_copy, tmp_path):
    """Garbage of the right size passes the checks; the load names the checkpoint and the cause (exit 1)."""
    import os

    step = run_copy / "checkpoints" / "step_2"
    with open(max((step / "actor").glob("*.distcp"), key=os.path.getsize), "r+b") as f:
        f.write(b"\xff" * 4096)
    done = _export("--checkpoint", step, "--out", tmp_path / "hf_out")
    assert done.returncode == 1, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert errors == [line for line in errors if line.startswith(f"error: checkpoint {step} cannot be loaded: ")]
    assert len(errors) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert not (tmp_path / "hf_out").exists()


@pytest.mark.parametrize("out, where", [("/proc/x", "/proc"), ("/proc/x/hf", "/proc/x")])
def test_export_where_nothing_can_be_written_is_one_line_before_loading(out, where, run_copy, capsys):
    """--out in a folder that cannot be made or written (here /proc) is refused before the checkpoint is
    loaded, naming the folder (it was a FileNotFoundError traceback after the load)."""
    from hybridflow.tools.export import main

    assert main(["--checkpoint", str(run_copy), "--out", out]) == 2
    err = capsys.readouterr().err
    assert err == f"error: --out {out}: cannot write in {where} (No such file or directory)\n", err


def test_save_hf_folder_never_replaces_a_run_folder_and_replaces_a_file(run_copy, tmp_path):
    from hybridflow.models.char_tokenizer import build_char_tokenizer
    from hybridflow.models.tiny_qwen2 import build_tiny_qwen2
    from hybridflow.workers.common import load_hf_folder
    from hybridflow.workers.export import save_hf_folder
    from tests.unit.run_checkpoint import digest

    build_tiny_qwen2(tmp_path / "m", build_char_tokenizer(tmp_path / "m"), hidden_size=64, num_layers=1, seed=1)
    cfg, state = load_hf_folder(str(tmp_path / "m"))
    before = digest(run_copy)
    with pytest.raises(FileExistsError, match=rf"^{run_copy} holds a training run \(checkpoints\); a run folder is"):
        save_hf_folder(str(run_copy), cfg, state)
    assert digest(run_copy) == before
    save_hf_folder(str(_file(tmp_path / "was_a_file")), cfg, state)
    assert set(load_hf_folder(str(tmp_path / "was_a_file"))[1]) == set(state)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "no temp or old copy left"


def test_an_export_without_force_never_replaces_one_written_meanwhile_and_is_readable_by_the_group(tmp_path):
    """Two exports to one --out: both found it free; the one finishing second is refused (hybridflow export exits 2)
    instead of silently replacing the first. The folder and files take the umask's modes, not mkdtemp's 0700."""
    import os
    import stat

    from hybridflow.models.char_tokenizer import build_char_tokenizer
    from hybridflow.models.tiny_qwen2 import build_tiny_qwen2
    from hybridflow.workers.common import load_hf_folder
    from hybridflow.workers.export import save_hf_folder

    build_tiny_qwen2(tmp_path / "m", build_char_tokenizer(tmp_path / "m"), hidden_size=64, num_layers=1, seed=1)
    cfg, state = load_hf_folder(str(tmp_path / "m"))
    out = tmp_path / "out"
    old = os.umask(0o022)
    try:
        save_hf_folder(str(out), cfg, state, replace=False)
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    assert {stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()} == {0o644}
    first = (out / "config.json").stat().st_mtime_ns
    with pytest.raises(FileExistsError, match=rf"^{out} was written by another export meanwhile; pass --force"):
        save_hf_folder(str(out), cfg, state, replace=False)
    assert (out / "config.json").stat().st_mtime_ns == first
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "no temp folder left"
    (tmp_path / "empty").mkdir()
    save_hf_folder(str(tmp_path / "empty"), cfg, state, replace=False)  # an empty folder is taken
    assert set(load_hf_folder(str(tmp_path / "empty"))[1]) == set(state)
