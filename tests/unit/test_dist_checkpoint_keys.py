"""Starting from a megatron dist checkpoint: verl's keys translate (the reference's agree with the actor's), and a
folder that is not a whole dist checkpoint is refused before start in one line naming the key. (The load itself:
tests/distributed/test_dist_checkpoint_start.py.)"""

from __future__ import annotations

import pytest

from hybridflow.config import ConfigError
from hybridflow.megatron.checkpoint_files import resolve_dist_checkpoint
from tests.unit.test_verl_overrides import resolve

KEY = "actor.megatron.dist_checkpointing_path"


def test_verl_keys_translate(tmp_path):
    a, c = "actor_rollout_ref.actor.megatron.", "critic.megatron."
    cfg = resolve([f"{a}use_dist_checkpointing=True", f"{a}dist_checkpointing_path={tmp_path}",
                   f"{a}dist_checkpointing_prefix=module.", "actor_rollout_ref.ref.megatron.use_dist_checkpointing=True",
                   f"{c}use_dist_checkpointing=True", f"{c}dist_checkpointing_path={tmp_path}"])
    m = cfg.actor.megatron
    assert (m.use_dist_checkpointing, m.dist_checkpointing_path, m.dist_checkpointing_prefix) == (True, str(tmp_path),
                                                                                                  "module.")
    assert cfg.critic.megatron.use_dist_checkpointing and cfg.critic.megatron.dist_checkpointing_path == str(tmp_path)
    with pytest.raises(ConfigError, match="use_dist_checkpointing needs dist_checkpointing_path"):
        resolve([f"{a}use_dist_checkpointing=True"])
    with pytest.raises(ConfigError, match="use_dist_checkpointing"):  # the reference starts where the actor does
        resolve(["actor_rollout_ref.ref.megatron.use_dist_checkpointing=True"])


def test_a_folder_that_is_no_dist_checkpoint_is_named_in_one_line(tmp_path):
    legacy = tmp_path / "legacy" / "iter_0000100" / "mp_rank_00"  # Megatron-LM's torch.save format
    legacy.mkdir(parents=True)
    (legacy / "model_optim_rng.pt").write_bytes(b"x")
    (tmp_path / "legacy" / "latest_checkpointed_iteration.txt").write_text("100\n")
    with pytest.raises(ValueError) as err:
        resolve_dist_checkpoint(str(tmp_path / "legacy"), KEY)
    assert str(err.value).startswith(f"{KEY}: {tmp_path}/legacy/iter_0000100 is not a whole megatron dist checkpoint "
                                     "(iter_0000100/metadata.json is missing)"), err.value
    (tmp_path / "legacy" / "latest_checkpointed_iteration.txt").write_text("latest\n")
    with pytest.raises(ValueError, match=f"{KEY}: .*latest_checkpointed_iteration.txt names no iteration"):
        resolve_dist_checkpoint(str(tmp_path / "legacy"), KEY)
    with pytest.raises(ValueError, match="nowhere/ is missing"):
        resolve_dist_checkpoint(str(tmp_path / "nowhere"), KEY)
