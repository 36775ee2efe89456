"""Each row's rule scorer, picked by its data source as verl's default scorer picks it
(``verl/utils/reward_score/__init__.py`` ``default_compute_score``):

    openai/gsm8k                                                     -> gsm8k (strict, verl-identical)
    lighteval/MATH, DigitalLearningGmbH/MATH-lighteval, HuggingFaceH4/MATH-500 -> math_verify
    math_dapo, math, math_dapo_reasoning, aime*                      -> math_dapo

    codecontests, apps, codeforces, taco (with reward.sandbox_fusion.url) -> the SandboxFusion service

The source is the row's ``data.reward_fn_key`` column. Rows without one (the column absent, or null) and
rows of this suite's own quickstart tasks (sources "arithmetic", "multiplication") use ``reward.name``, so the quickstart's
scorer stays configurable. Any other source is an error when the data is loaded (``check``), before a run
starts; verl's further sources (code, geometry, search, numina) are not implemented here: a
custom_reward_function scores them.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Iterable

from hybridflow.rewards.registry import get_scorer
from hybridflow.rewards.sandbox_fusion import CODE_SOURCES, SandboxScorer

log = logging.getLogger(__name__)
SANDBOX = "sandbox_fusion"  # the scorer name of code rows when a sandbox URL is configured
# verl's PrimeRewardManager (workers/reward_manager/prime.py): 64 rows at once, each given 300 s
PRIME_WORKERS, PRIME_ROW_TIMEOUT_S = 64, 300.0

MATH_SOURCES = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")
DAPO_SOURCES = ("math_dapo", "math", "math_dapo_reasoning")  # and every source starting with "aime"
OWN_SOURCES = ("arithmetic", "multiplication")  # the quickstarts' tasks (hybridflow/data): scored by reward.name
# verl routes these to scorers this suite does not carry
VERL_ONLY_SOURCES = ("numina_aops_forum", "numina_synthetic_math", "numina_amc_aime", "numina_synthetic_amc",
                     "numina_cn_k12", "numina_olympiads", "codecontests", "apps", "codeforces", "taco",
                     "hiyouga/geometry3k", "searchR1_nq", "searchR1_triviaqa", "searchR1_popqa", "searchR1_hotpotqa",
                     "searchR1_2wikimultihopqa", "searchR1_musique", "searchR1_bamboogle")


def verl_scorer_name(source: str) -> str | None:
    """The registered scorer verl's routing gives ``source``, or None when it is not one of ours."""
    if source == "openai/gsm8k":
        return "gsm8k"
    if source in MATH_SOURCES:
        return "math_verify"
    if source in DAPO_SOURCES or source.startswith("aime"):
        return "math_dapo"
    return None


class SourceRouter:
    """Rule scores per row: ``score_all(responses, ground_truths, sources)``; ``default`` is reward.name,
    ``source_key`` data.reward_fn_key (the batch column ``score_responses`` reads the sources from);
    ``sandbox`` scores verl's code sources; ``manager`` "prime" scores rows concurrently (``score_all``)."""

    def __init__(self, default: str, source_key: str = "data_source", sandbox: SandboxScorer | None = None,
                 manager: str = "naive"):
        get_scorer(default)  # unknown names fail here, not at the first batch
        self.default, self.source_key, self.sandbox, self.manager = default, source_key, sandbox, manager

    @classmethod
    def from_config(cls, reward, source_key: str) -> SourceRouter:
        """The router of a ``reward`` config section (reward.name, .manager, .sandbox_fusion)."""
        sf = reward.sandbox_fusion
        sandbox = SandboxScorer(sf.url, sf.max_concurrent, sf.memory_limit_mb) if sf.url else None
        return cls(reward.name, source_key, sandbox, reward.manager)

    def scorer_name(self, source) -> str:
        if source is None or source in OWN_SOURCES:
            return self.default
        if self.sandbox is not None and source in CODE_SOURCES:
            return SANDBOX
        name = verl_scorer_name(source) if isinstance(source, str) else None
        if name is None:
            raise ValueError(f"data source {self._unknown(source)}")
        return name

    def _unknown(self, source) -> str:
        why = ("verl routes it to a scorer hybridflow does not carry" if source in VERL_ONLY_SOURCES else
               "no scorer is routed to it")
        if source in CODE_SOURCES:
            why = "a code source: set reward.sandbox_fusion.url to score it in a SandboxFusion service"
        return (f"{source!r} is not scorable ({why}; known: openai/gsm8k, {', '.join(MATH_SOURCES)}, "
                f"{', '.join(DAPO_SOURCES)}, aime*, or none for reward.name={self.default!r}); "
                "score it with custom_reward_function.path")

    def check(self, sources: Iterable, where=lambda row: f"row {row}") -> None:
        """Every source routable, else a one-line ValueError naming the first bad row via ``where(row)``."""
        seen = set()
        for row, source in enumerate(sources):
            key = source if isinstance(source, (str, type(None))) else repr(source)
            if key in seen:
                continue
            seen.add(key)
            try:
                self.scorer_name(source)
            except ValueError:
                raise ValueError(f"{where(row)}: {self.source_key} {self._unknown(source)}") from None

    def check_dataset(self, data) -> None:
        """``check`` over a ``PromptDataset``, naming the file and row of the first unroutable source."""
        self.check(data.columns.get(self.source_key, ()), data.where)

    def scorer(self, source):
        name = self.scorer_name(source)
        return self.sandbox if name == SANDBOX else get_scorer(name)

    def score_all(self, responses: list[str], ground_truths, sources=None, extra_infos=None) -> list[float]:
        sources = [None] * len(responses) if sources is None else sources
        rows = [(self.scorer(s), r, g) for r, g, s in zip(responses, ground_truths, sources)]
        if self.manager == "prime":
            return score_concurrently(rows)
        return [float(scorer(r, _truth(scorer, g))) for scorer, r, g in rows]


def _truth(scorer, ground_truth):
    """The ground truth as a scorer takes it: text for the rule scorers, as given (a dict of test cases or
    its JSON) for the sandbox."""
    return ground_truth if isinstance(scorer, SandboxScorer) else str(ground_truth)


def score_concurrently(rows: list, workers: int = PRIME_WORKERS, timeout_s: float = PRIME_ROW_TIMEOUT_S) -> list[float]:
    """verl's prime manager (workers/reward_manager/prime.py ``parallel_compute_score_async``): the rows'
    ``(scorer, response, ground truth)`` scored at once, a row whose scorer raises, returns no number or takes
    over ``timeout_s`` from the batch's start scoring 0 and logged. verl uses processes; these are
    threads (the sandbox's rows wait on the network; a thread that overran is left to finish unawaited)."""
    pool = ThreadPoolExecutor(max_workers=max(1, min(workers, len(rows))))
    deadline = time.monotonic() + timeout_s  # verl's wait_for per row starts with the batch: queueing counts
    futures = [pool.submit(scorer, r, _truth(scorer, g)) for scorer, r, g in rows]
    scores = []
    try:
        for i, future in enumerate(futures):
            try:
                value = future.result(timeout=max(0.0, deadline - time.monotonic()))
                scores.append(float(value[0] if isinstance(value, (tuple, list)) else value))
            except FutureTimeout:
                log.warning("reward.manager prime: row %d took over %g s: scored 0", i, timeout_s)
                scores.append(0.0)
            except Exception as e:  # noqa: BLE001  (verl's manager scores any failure 0)
                log.warning("reward.manager prime: row %d failed (%s: %s): scored 0", i, type(e).__name__, e)
                scores.append(0.0)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    return scores
