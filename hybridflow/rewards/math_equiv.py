"""MATH scorer: answer equivalence by the maintained ``math-verify`` package, as verl's
``verl/utils/reward_score/math_verify.py`` computes it (ground truth parsed as ``\\boxed{<truth>}``, the
response as an expression or LaTeX; 1.0 when any parse of one verifies against any of the other, else 0.0).

Deliberate difference: verl's default scorer for the MATH sources is ``math_reward`` (the last ``\\boxed{}``
string-normalized and compared, lm-eval's hendrycks rules); verl names math-verify as the more accurate
option (comment in ``default_compute_score``), which is what this suite uses for those sources.

Time limits: math-verify bounds parsing and comparison with ``signal.alarm``, which works on the main
thread only (``math_verify/utils.py`` ``timeout``); verl therefore runs it in a process pool. Here the
driver scores on its main thread, so math-verify's own limits apply; on another thread they are off.
"""

from __future__ import annotations

import threading

from hybridflow.rewards.registry import register_scorer

TIMEOUT_S = 5  # math-verify's default per parse and per comparison


def compute_score(response: str, ground_truth: str) -> float:
    from math_verify import parse, verify
    from math_verify.parser import ExprExtractionConfig, LatexExtractionConfig

    limit = TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    try:
        gold = parse("\\boxed{" + ground_truth + "}", (LatexExtractionConfig(),), parsing_timeout=limit)
        pred = parse(response, (ExprExtractionConfig(), LatexExtractionConfig()), parsing_timeout=limit)
        return 1.0 if gold and pred and verify(gold, pred, timeout_seconds=limit) else 0.0
    except Exception:  # math-verify's timeouts and sympy failures: no credit, as verl scores them
        return 0.0


@register_scorer("math_verify")
def math_verify_score(response: str, ground_truth: str) -> float:
    return compute_score(response, ground_truth)
