"""The experiment config's agent section: an agent program that talks to the policy over the OpenAI API
(agent/endpoint.py serves it; trainer/agent_source.py runs its episodes)."""

from __future__ import annotations

from dataclasses import dataclass

from hybridflow.config.checks import check_numbers


@dataclass
class AgentService:
    """An agent program trained unchanged: for each task (a prompt row) the trainer runs ``rollout.n`` episodes of
    ``entrypoint`` -- ``path/to/file.py:function`` or ``package.module:function`` -- each called as
    ``function(task, base_url, api_key, session_id)`` in a Ray worker process; it talks to the policy at
    ``base_url`` (OpenAI chat/completions, naming ``session_id``) and returns its reward, posts it to
    ``/rl/reward``, or returns None to have the run's reward function score the episode's final text. The
    episodes of one task are a GRPO group."""

    entrypoint: str | None = None  # None: no agent program (the trainer generates itself)
    episode_timeout_s: float = 600.0  # an episode running longer is stopped, dropped and counted
    host: str = "127.0.0.1"  # where the endpoint listens (0.0.0.0 serves other machines: mind the key)
    port: int = 0  # 0: a free port
    api_key: str = ""  # "": a random key per run
    model_name: str = "policy"  # the model /v1/models lists
    batch_window_s: float = 0.02  # how long a request waits for others to join its engine batch
    max_sessions: int = 1024  # sessions (episodes) open at once; also the agent processes' threads, all told

    @property
    def enable(self) -> bool:
        return self.entrypoint is not None

    def validate(self):
        check_numbers(self, episode_timeout_s=dict(gt=0), batch_window_s=dict(ge=0, le=10), port=dict(ge=0, le=65535),
                      max_sessions=dict(gt=0))
        if self.entrypoint is not None and (":" not in self.entrypoint or not all(self.entrypoint.rsplit(":", 1))):
            raise ValueError(f"agent.entrypoint {self.entrypoint!r}: expected path/to/file.py:function or "
                             "package.module:function")
