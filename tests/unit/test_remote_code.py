"""model.trust_remote_code (verl's actor_rollout_ref.model.trust_remote_code): a model folder whose tokenizer is its
own Python code (tokenizer_config.json's auto_map, reading a file of its own as Moonlight's tiktoken tokenizer does)
is refused in one line naming the key without it, and loads with it; verl's second names for it must agree."""

from __future__ import annotations

import json

import pytest

from hybridflow.config import ConfigError

OWN_CODE = '''from transformers import PreTrainedTokenizerFast


class OwnTokenizer(PreTrainedTokenizerFast):
    vocab_files_names = {"vocab_file": "own_tokenizer.json"}

    def __init__(self, vocab_file=None, **kwargs):
        super().__init__(tokenizer_file=vocab_file, **kwargs)
'''


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from hybridflow.models.char_tokenizer import build_char_tokenizer
    from hybridflow.models.tiny_qwen2 import build_tiny_qwen2

    root = tmp_path_factory.mktemp("remote_code")
    build_tiny_qwen2(root, build_char_tokenizer(root), hidden_size=32, num_layers=1, seed=0)
    (root / "tokenizer.json").rename(root / "own_tokenizer.json")
    (root / "tokenization_own.py").write_text(OWN_CODE)
    config = json.loads((root / "tokenizer_config.json").read_text())
    config.update(auto_map={"AutoTokenizer": [None, "tokenization_own.OwnTokenizer"]}, tokenizer_class="OwnTokenizer")
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    return str(root)


def _cfg(model_path, *overrides):
    from hybridflow.trainer.main import load

    return load(["--config", "configs/quickstart_cpu.yaml", "prepare.enable=false", f"model.path={model_path}",
                 *overrides])


def test_a_tokenizer_of_the_folders_own_code_needs_trust_remote_code(folder):
    from hybridflow.trainer.model_files import check_model_folder

    with pytest.raises(ConfigError) as e:
        check_model_folder(_cfg(folder))
    assert str(e.value) == (f"model.path: no usable tokenizer in {folder} (it needs its own Python code: set "
                            "model.trust_remote_code=true if you trust the folder)")
    _, tokenizer = check_model_folder(_cfg(folder, "model.trust_remote_code=true"))
    assert type(tokenizer).__name__ == "OwnTokenizer" and tokenizer("ab")["input_ids"] == [24, 25]


def test_verls_trust_remote_code_keys_name_one_setting(folder):
    """verl's Moonlight scripts set it for the model, the data and the critic: one tokenizer and config here."""
    verl = ["--verl-overrides", "actor_rollout_ref.model.trust_remote_code=True", "data.trust_remote_code=True",
            "critic.model.trust_remote_code=True", "actor_rollout_ref.nccl_timeout=1200"]
    cfg = _cfg(folder, *verl)
    assert cfg.model.trust_remote_code is True and cfg.trainer.dist_timeout_s == 1200
    with pytest.raises(ConfigError, match=r"verl override 'data.trust_remote_code=True' must equal "
                                          r"model.trust_remote_code \(False\)"):
        _cfg(folder, "--verl-overrides", "data.trust_remote_code=True")
