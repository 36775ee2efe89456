"""Config sections of validation sampling and of remote code scoring (kept out of schema.py, which holds the
rest of the experiment config)."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlparse

from hybridflow.config.checks import check_numbers, check_sizes


@dataclass
class ValKwargs:
    """Validation sampling (verl 0.9.1 rollout.val_kwargs, same names and defaults): each validation prompt is
    answered ``n`` times with these settings (temperature 0: greedy, the default) and ``val/accuracy`` is the
    mean score of all answers (verl's mean@n). verl's ``do_sample`` is accepted and, as in verl 0.9.1's vLLM
    agent loop (experimental/agent_loop/agent_loop.py), changes nothing: the temperature decides."""

    temperature: float = 0.0
    top_p: float = 1.0  # in (0, 1]
    top_k: int = -1  # -1 or 0: off (vLLM's meaning)
    n: int = 1

    def validate(self):
        check_sizes(self, "n")
        check_numbers(self, temperature=dict(ge=0), top_p=dict(gt=0, le=1), top_k=dict(ge=-1))


@dataclass
class SandboxFusion:
    """A SandboxFusion service (github.com/bytedance/SandboxFusion) that runs code answers against their test
    cases (verl 0.9.1 reward.sandbox_fusion, same names and defaults). With ``url`` set, rows of verl's code
    sources (codecontests, apps, codeforces, taco) are scored by it as verl's default scorer does: the pass
    rate of the first 10 test cases (rewards/sandbox_fusion.py)."""

    url: str | None = None  # e.g. http://host:8080/run_code
    max_concurrent: int = 64  # requests in flight at once, all rows together
    memory_limit_mb: int = 1024  # per test-case process in the sandbox

    def validate(self):
        check_sizes(self, "max_concurrent", "memory_limit_mb")
        if self.url is not None:
            parsed = urlparse(self.url)
            if parsed.scheme not in ("http", "https") or not parsed.netloc:
                raise ValueError(f"sandbox_fusion.url must be an http(s) URL such as http://host:8080/run_code, "
                                 f"got {self.url!r}")
