"""Only an engine colocated with training sleeps outside generation (rollout.free_cache_engine): the rollout pool's
engine has the GPU to itself, and sleeping it around each batch generation (validation, ReMax's greedy baseline)
only moved its weights to the host and back (workers/generation.build_vllm_rollout)."""

from types import SimpleNamespace

from hybridflow.plan import load_experiment
from hybridflow.plan.specs import ProcessSpec
from hybridflow.workers import generation


def test_only_an_engine_colocated_with_training_sleeps(monkeypatch):
    built = []
    monkeypatch.setattr(generation, "VLLMRollout", lambda *args, **kwargs: built.append(args[1].free_cache_engine))
    cfg = load_experiment(["configs/quickstart_cpu.yaml"], ["rollout.free_cache_engine=true"])
    spec = SimpleNamespace(rollout=cfg.rollout, max_prompt_length=16, max_response_length=6,
                           process=ProcessSpec("model", 0, 60, None))
    generation.build_vllm_rollout(spec, seed=0, generation_groups=None, colocated=True)
    generation.build_vllm_rollout(spec, seed=0, generation_groups=None, colocated=False)
    assert built == [True, False]


def test_the_engine_runs_the_folders_own_code_only_with_trust_remote_code(monkeypatch):
    built = []
    monkeypatch.setattr(generation, "VLLMRollout", lambda *args, **kwargs: built.append(args[1].trust_remote_code))
    cfg = load_experiment(["configs/quickstart_cpu.yaml"], [])
    for trust in (False, True):
        spec = SimpleNamespace(rollout=cfg.rollout, max_prompt_length=16, max_response_length=6,
                               process=ProcessSpec("model", 0, 60, None, trust))
        generation.build_vllm_rollout(spec, seed=0, generation_groups=None, colocated=True)
    assert built == [False, True]
