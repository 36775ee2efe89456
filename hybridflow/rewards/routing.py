"""Each row's rule scorer, picked by its data source as verl's default scorer picks it
(``verl/utils/reward_score/__init__.py`` ``default_compute_score``):

    openai/gsm8k                                                     -> gsm8k (strict, verl-identical)
    lighteval/MATH, DigitalLearningGmbH/MATH-lighteval, HuggingFaceH4/MATH-500 -> math_verify
    math_dapo, math, math_dapo_reasoning, aime*                      -> math_dapo

The source is the row's ``data.reward_fn_key`` column. Rows without one (the column absent, or null) and
rows of this suite's own quickstart tasks (sources "arithmetic", "multiplication") use ``reward.name``, so the quickstart's
scorer stays configurable. Any other source is an error when the data is loaded (``check``), before a run
starts; verl's further sources (code, geometry, search, numina) are not implemented here: a
custom_reward_function scores them.
"""

from __future__ import annotations

from typing import Iterable

from hybridflow.rewards.registry import get_scorer

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
    ``source_key`` data.reward_fn_key (the batch column ``score_responses`` reads the sources from)."""

    def __init__(self, default: str, source_key: str = "data_source"):
        get_scorer(default)  # unknown names fail here, not at the first batch
        self.default, self.source_key = default, source_key

    def scorer_name(self, source) -> str:
        if source is None or source in OWN_SOURCES:
            return self.default
        name = verl_scorer_name(source) if isinstance(source, str) else None
        if name is None:
            raise ValueError(f"data source {self._unknown(source)}")
        return name

    def _unknown(self, source) -> str:
        why = ("verl routes it to a scorer hybridflow does not carry" if source in VERL_ONLY_SOURCES else
               "no scorer is routed to it")
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

    def score_all(self, responses: list[str], ground_truths, sources=None, extra_infos=None) -> list[float]:
        sources = [None] * len(responses) if sources is None else sources
        return [float(get_scorer(self.scorer_name(s))(r, str(g))) for r, g, s in zip(responses, ground_truths, sources)]
