"""Only an engine colocated with training sleeps outside generation (rollout.free_cache_engine): the rollout pool's
engine has the GPU to itself, and sleeping it around each batch generation (validation, ReMax's greedy baseline)
only moved its weights to the host and back (workers/generation.build_vllm_rollout)."""

from types import SimpleNamespace

from hybridflow.plan import load_experiment
from hybridflow.workers import generation


def test_only_an_engine_colocated_with_training_sleeps(monkeypatch):
    built = []
    monkeypatch.setattr(generation, "VLLMRollout", lambda *args, **kwargs: built.append(args[1].free_cache_engine))
    cfg = load_experiment(["configs/quickstart_cpu.yaml"], ["rollout.free_cache_engine=true"])
    spec = SimpleNamespace(rollout=cfg.rollout, max_prompt_length=16, max_response_length=6)
    generation.build_vllm_rollout("model", spec, seed=0, generation_groups=None, colocated=True)
    generation.build_vllm_rollout("model", spec, seed=0, generation_groups=None, colocated=False)
    assert built == [True, False]
