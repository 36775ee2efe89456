"""RoPE types megatron does not reproduce are refused at preflight, in one line naming the folder and type."""

import json

import pytest

from hybridflow.config import ConfigError


def _model_folder(path, rope_scaling):
    """A Llama config.json as the hub writes it (legacy ``rope_scaling`` key); no weights needed."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1, "vocab_size": 64,
        "max_position_embeddings": 131072, "rope_theta": 500000.0, "rope_scaling": rope_scaling}))
    return str(path)


def _cfg(model_path):
    from hybridflow.trainer.main import load

    return load(["--config", "configs/quickstart_cpu.yaml", "prepare.enable=false", f"model.path={model_path}"])


@pytest.mark.parametrize("rope_type, rope_scaling", [
    ("yarn", {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}),
    ("dynamic", {"rope_type": "dynamic", "factor": 2.0}),
])
def test_unsupported_rope_type_is_one_line(tmp_path, rope_type, rope_scaling):
    from hybridflow.trainer.model_files import check_model_folder

    folder = _model_folder(tmp_path / "model", rope_scaling)
    with pytest.raises(ConfigError) as e:
        check_model_folder(_cfg(folder))
    assert str(e.value) == (f"model.path: rope_type '{rope_type}' is not supported yet (supported: default, "
                            f"linear, llama3) in {folder}/config.json")


def test_llama31_rope_passes(tmp_path):
    from transformers import AutoConfig

    from hybridflow.megatron.attention_config import check_rope_supported

    llama31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    check_rope_supported(AutoConfig.from_pretrained(_model_folder(tmp_path / "model", llama31)))
