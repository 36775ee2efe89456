"""trainer.on_nonfinite: a NaN/inf loss or grad norm stops the run naming the step and the last good
checkpoint, or is counted as a skipped update."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridflow.trainer.session import RunFailed, check_finite


def test_finite_metrics_pass():
    assert check_finite({"actor/pg_loss": 0.1, "actor/grad_norm": 2.0, "critic/vf_loss": 1.0}, 3, "stop", None) is False


@pytest.mark.parametrize("key, value", [("actor/pg_loss", float("nan")), ("critic/grad_norm", float("inf"))])
def test_stop_names_the_step_and_checkpoint(key, value):
    with pytest.raises(RunFailed) as err:
        check_finite({key: value, "actor/grad_norm": 1.0}, 7, "stop", Path("out/checkpoints/step_5"))
    assert str(err.value) == (f"step 7: non-finite {key}; stopping (trainer.on_nonfinite=stop); "
                              "last good checkpoint: out/checkpoints/step_5")


def test_skip_reports_the_skipped_update():
    assert check_finite({"actor/grad_norm": float("nan")}, 2, "skip", None) is True
