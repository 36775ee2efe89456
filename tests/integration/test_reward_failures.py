"""A user reward function that fails ends the run in one line (exit status 1) naming the function, the row and
the value, and the last good checkpoint — at a training step and during validation (the step-0 one too); one
that never returns ends it within custom_reward_function.timeout_s, and the call left blocked does not keep the
driver alive."""

from __future__ import annotations

import pytest

from tests.integration.cli_run import NO_CRITIC, launch

pytestmark = pytest.mark.integration

# body of compute_score -> (what the line says about it, when it fails: the step-0 validation or step 1)
REWARDS = {
    "raises": ("raise ValueError('cannot parse ' + solution_str)", "raised ValueError: cannot parse ",
               "validation before training: "),
    "never returns": ("import time; time.sleep(1e9)", "did not return within custom_reward_function.timeout_s=3 s", ""),
}


@pytest.mark.parametrize("kind", sorted(REWARDS))
def test_failing_reward_function_ends_the_run_in_one_line(kind, assets, tmp_path):
    body, problem, when = REWARDS[kind]
    reward = tmp_path / "my_reward.py"
    reward.write_text(f"def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    {body}\n")
    proc = launch(assets, tmp_path / "run", *NO_CRITIC, f"custom_reward_function.path={reward}",
                  "custom_reward_function.timeout_s=3",
                  f"trainer.val_before_train={str(bool(when)).lower()}", "trainer.total_steps=2")
    try:
        _, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err[-3000:]
    lines = [x for x in err.splitlines() if x.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    assert lines[0].startswith(f"error: {when}custom reward function 'compute_score' from {reward} {problem}"), lines[0]
    rows = "32 of the batch" if when else "16 of the batch"  # the validation batch, or a step's
    assert f" on row 0 of {rows} (data_source 'arithmetic', prompt '" in lines[0], lines[0]
    assert lines[0].endswith("; last good checkpoint: none"), lines[0]
