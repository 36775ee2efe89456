"""What fails while a run runs ends in one line, with the last good checkpoint, not a traceback: a full disk
during a checkpoint save, dynamic sampling that cannot fill its batch, a reward function failing during
validation, a step still running after SIGTERM's grace period; and a ray.address that answers TCP but is
not Ray is refused before start, within seconds. (A real Trainer, built without starting Ray.)"""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import threading
import time

import pytest

from hybridflow.config import ConfigError
from hybridflow.trainer import checkpoint

QUICKSTART = "configs/quickstart_cpu.yaml"


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    from hybridflow.data.arithmetic import write_arithmetic_parquet
    from hybridflow.models.char_tokenizer import build_char_tokenizer
    from hybridflow.models.tiny_qwen2 import build_tiny_qwen2

    root = tmp_path_factory.mktemp("runfailures")
    write_arithmetic_parquet(root / "data", max_operand=20, n_val=16, seed=1)
    build_tiny_qwen2(root / "model", build_char_tokenizer(root / "model"), hidden_size=64, num_layers=1, seed=1,
                     max_position_embeddings=22)
    return root


@pytest.fixture
def trainer(good, tmp_path):
    """A checked Trainer whose Ray and workers are not started (nothing here needs them)."""
    from hybridflow.trainer.session import Trainer

    t = Trainer(QUICKSTART, ["prepare.enable=false", f"model.path={good}/model",
                             f"data.train_files=[{good}/data/train.parquet]",
                             f"data.val_files=[{good}/data/val.parquet]", f"trainer.output_dir={tmp_path}/out"])
    yield t
    t.close()


# --- a checkpoint save on a full disk ---------------------------------------------------------------

def _saved(out: str, step: int) -> None:
    checkpoint.save(out, step, lambda tmp: (tmp / "weights.bin").write_bytes(b"w" * 1000), {}, None)


def _fill(tmp) -> None:
    """Write until the disk is full: the OSError is the file system's own."""
    with open(tmp / "weights.bin", "wb") as f:
        while True:
            f.write(b"\0" * 2**16)
            f.flush()
            os.fsync(f.fileno())


def _assert_refused_keeping_the_previous(out: str, raised: pytest.ExceptionInfo) -> None:
    message = str(raised.value)
    assert "\n" not in message and message.startswith(f"checkpoint {out}/checkpoints/step_2 could not be written"), \
        message
    assert message.endswith(": No space left on device"), message
    assert raised.value.errno == errno.ENOSPC
    assert checkpoint.latest(out) == checkpoint.root(out) / "step_1"
    assert sorted(p.name for p in checkpoint.root(out).iterdir()) == ["latest", "step_1"], "the partial save is gone"


def test_a_full_disk_during_a_save_is_one_line_and_keeps_the_previous_checkpoint(tmp_path):
    out = str(tmp_path / "out")
    _saved(out, 1)

    def full(tmp):  # what the driver's write of its own parts meets on a full disk
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp / "hf" / "config.json"))

    with pytest.raises(checkpoint.CheckpointWriteError) as raised:
        checkpoint.save(out, 2, full, {}, None)
    _assert_refused_keeping_the_previous(out, raised)


@pytest.fixture
def tiny_disk(tmp_path):
    """A real 1 MiB file system (tmpfs), where this process may mount one (root in a container)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M", "tmpfs", str(disk)],
                                           capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    yield disk
    subprocess.run(["umount", str(disk)], check=True)


def test_a_really_full_disk_during_a_save(tiny_disk):
    out = str(tiny_disk / "out")
    _saved(out, 1)
    with pytest.raises(checkpoint.CheckpointWriteError) as raised:
        checkpoint.save(out, 2, _fill, {}, None)
    _assert_refused_keeping_the_previous(out, raised)
    _saved(out, 3)  # the failed save freed what it took: the next one fits again
    assert checkpoint.latest(out) == checkpoint.root(out) / "step_3"


def test_a_full_disk_outside_a_checkpoint_is_one_line(good, tmp_path, capsys, monkeypatch):
    """The driver's other writes (metrics.jsonl, the trackers) on a full disk: one line naming the output
    folder (a buffered write names no file) and the last good checkpoint, exit 1; it was four chained
    tracebacks (the write, then the trackers' close on the same disk, ...). The write fails in ``fit``."""
    from hybridflow.trainer.main import main
    from hybridflow.trainer.session import Trainer

    last = tmp_path / "out" / "checkpoints" / "step_1"

    def fit(self):
        self.last_checkpoint = last
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(Trainer, "fit", fit)
    assert main(["--config", QUICKSTART, "prepare.enable=false", f"model.path={good}/model",
                 f"data.train_files=[{good}/data/train.parquet]", f"data.val_files=[{good}/data/val.parquet]",
                 f"trainer.output_dir={tmp_path}/out"]) == 1
    assert capsys.readouterr().err == (f"error: cannot write in trainer.output_dir={tmp_path}/out: No space left on "
                                       f"device; last good checkpoint: {last}\n")


# --- the Trainer's one line for each failure ----------------------------------------------------------

def _failure(trainer, error: BaseException, where: str = "") -> BaseException:
    with pytest.raises(BaseException) as raised:
        with trainer._failures_named(where):
            raise error
    return raised.value


def test_run_failures_are_one_line_naming_the_last_checkpoint(trainer, tmp_path):
    from hybridflow.rewards.custom import RewardFunctionError
    from hybridflow.trainer.dynamic_sampling import DynamicSamplingError
    from hybridflow.trainer.session import RunFailed

    trainer.last_checkpoint = tmp_path / "out" / "checkpoints" / "step_3"
    last = f"; last good checkpoint: {trainer.last_checkpoint}"
    reward = RewardFunctionError("custom reward function 'f' from x.py returned None on row 2 of 8", row=2)
    cases = [
        (reward, "validation before training: ", "validation before training: custom reward function 'f' from x.py "
                                                 "returned None on row 2 of 8" + last),
        (DynamicSamplingError("dynamic sampling: 0 of data.batch_size=6 ..."), "",
         "dynamic sampling: 0 of data.batch_size=6 ..." + last),
        (checkpoint.CheckpointWriteError(errno.ENOSPC, "checkpoint c could not be written: No space left on device"),
         "", "checkpoint c could not be written: No space left on device" + last),
    ]
    for error, where, line in cases:
        failed = _failure(trainer, error, where)
        assert isinstance(failed, RunFailed) and str(failed) == line, (type(failed), str(failed))


def test_a_step_still_running_after_sigterms_grace_is_abandoned(trainer):
    """SIGTERM asks the step to end; a step that goes on past signals.STOP_GRACE_S (an endless generation) is
    abandoned: every wait on the workers gives up, and the run ends as preempted naming the last checkpoint."""
    from hybridflow.controller import worker_group
    from hybridflow.controller.worker_group import WaitAbandoned
    from hybridflow.trainer.signals import STOP_GRACE_S, Preempted

    trainer.stops._handle(signal.SIGTERM, None)
    assert trainer.stops.give_up_reason() is None  # within the grace period the step may end
    trainer.stops.at -= STOP_GRACE_S
    reason = trainer.stops.give_up_reason()
    assert reason == f"the step in progress did not end within {STOP_GRACE_S:g} s of SIGTERM and was abandoned"
    seen = []

    def wait_on_workers():  # what DispatchFuture.get asks between its waits (the installed check)
        seen.append(worker_group._give_up())
        raise WaitAbandoned(seen[-1])

    with pytest.raises(Preempted) as raised:
        with trainer._failures_named():
            wait_on_workers()
    assert seen == [reason] and worker_group._give_up is None  # installed for the trainer's calls only
    assert str(raised.value) == (f"stopped by SIGTERM after step 0 ({reason}); checkpoint None; rerun the same "
                                 "command to resume (trainer.resume_mode=auto)")


def test_a_checkpoint_being_written_after_sigterms_grace_is_not_abandoned(trainer, tmp_path):
    """The checkpoint a stop asked for keeps the step that ended: it is written to the end (a SIGKILL in the
    middle leaves the previous one whole), while the waits of a step are given up; a run stopped before its
    first checkpoint sets its metrics aside, so that the rerun of the same command starts over."""
    from hybridflow.controller import worker_group
    from hybridflow.trainer.signals import STOP_GRACE_S, set_aside_metrics

    trainer.stops._handle(signal.SIGTERM, None)
    trainer.stops.at -= STOP_GRACE_S
    with trainer._failures_named():
        assert worker_group._give_up() is not None  # a step's waits give up
        with trainer._failures_named(give_up=False):  # the checkpoint's (save_checkpoint)
            assert worker_group._give_up() is None
    out = tmp_path / "run"
    assert set_aside_metrics(str(out)) is None  # nothing logged yet
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 0}\n')
    assert set_aside_metrics(str(out)) == "metrics.preempted.jsonl"
    assert not (out / "metrics.jsonl").exists() and (out / "metrics.preempted.jsonl").read_text() == '{"step": 0}\n'


def test_sigusr1_lets_the_step_and_its_checkpoint_finish():
    """SIGUSR1 comes with the lead time the user chose (Slurm's --signal): the step is not cut short."""
    from hybridflow.trainer.signals import STOP_GRACE_S, StopRequests

    stops = StopRequests()
    stops._handle(signal.SIGUSR1, None)
    stops.at -= 100 * STOP_GRACE_S
    assert stops.requested and stops.give_up_reason() is None


# --- a ray.address that is not Ray ----------------------------------------------------------------------

@pytest.fixture(params=[b"HTTP/1.1 400 Bad Request\r\n\r\nnot ray", b""], ids=["answers garbage", "closes"])
def not_ray(request):
    """A TCP server on 127.0.0.1 that accepts, sends its bytes and closes (a proxy, a web server)."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                conn.sendall(request.param)

    threading.Thread(target=serve, daemon=True).start()
    yield server.getsockname()[1]
    server.close()


@pytest.mark.parametrize("scheme, what", [("", "a Ray cluster (its GCS)"), ("ray://", "a Ray client server")])
def test_a_ray_address_that_is_not_ray_is_refused_within_seconds(not_ray, scheme, what):
    from hybridflow.trainer.ray_checks import check_ray_address

    start = time.monotonic()
    with pytest.raises(ConfigError) as raised:
        check_ray_address(f"{scheme}127.0.0.1:{not_ray}")
    assert time.monotonic() - start < 10
    message = str(raised.value)
    assert "\n" not in message and message.startswith(f"ray.address: 127.0.0.1:{not_ray} answers, but not as "
                                                      f"{what}: UNAVAILABLE ("), message
    assert message.endswith("); check the address and port"), message


def test_a_silent_ray_address_is_refused_after_the_connect_timeout():
    """A server that accepts and never answers: the gRPC call's deadline, not Ray's minute of retries."""
    from hybridflow.trainer.ray_checks import _RAY_CONNECT_TIMEOUT_S, check_ray_address

    with socket.create_server(("127.0.0.1", 0)) as server:
        start = time.monotonic()
        with pytest.raises(ConfigError, match=r"answers, but not as a Ray cluster \(its GCS\): (DEADLINE_EXCEEDED|"
                                              r"UNAVAILABLE) \("):
            check_ray_address(f"127.0.0.1:{server.getsockname()[1]}")
        assert time.monotonic() - start < 2 * _RAY_CONNECT_TIMEOUT_S + 5


def test_json_state_is_untouched_by_a_failed_save(tmp_path):
    """The marker and the previous checkpoint's state are byte for byte what they were."""
    out = str(tmp_path / "out")
    _saved(out, 1)
    before = {p: p.read_bytes() for p in checkpoint.root(out).rglob("*") if p.is_file()}
    with pytest.raises(checkpoint.CheckpointWriteError):
        checkpoint.save(out, 2, lambda tmp: (_ for _ in ()).throw(OSError(errno.EDQUOT, "Disk quota exceeded")), {}, 1)
    assert {p: p.read_bytes() for p in checkpoint.root(out).rglob("*") if p.is_file()} == before
    assert json.loads((checkpoint.root(out) / "step_1" / checkpoint.STATE_FILE).read_text())["step"] == 1


# --- a rollout so large that no step ends for a long while ------------------------------------------------

@pytest.mark.parametrize("n, warned", [(8, False), (1024, True)])
def test_a_huge_rollout_n_is_one_warning_before_start(n, warned, good, caplog):
    """rollout.n=1024 fits in memory (the size check passes) but one step is 256 rounds of what the rollout
    engine runs at once: one line says so before anything starts, and the run goes on as asked."""
    from transformers import AutoConfig

    from hybridflow.plan import resolve
    from hybridflow.trainer.main import load
    from hybridflow.trainer.preflight import check_step_fits

    cfg = load(["--config", QUICKSTART, f"rollout.n={n}", "data.batch_size=64", "actor.ppo_mini_batch_size=64"])
    with caplog.at_level("WARNING", logger="hybridflow.trainer.preflight"):
        check_step_fits(cfg, AutoConfig.from_pretrained(good / "model"), resolve(cfg))
    lines = [r.getMessage() for r in caplog.records]
    expected = ["rollout.n=1024: one step generates and trains on 65,536 responses (data.batch_size 64 x rollout.n "
                "1024), about 256 rounds of the 256 sequences 1 rollout engine(s) run at once: each step will be "
                "long; lower rollout.n or data.batch_size for shorter steps"]
    assert lines == (expected if warned else []), lines
