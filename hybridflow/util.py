"""Small helpers with no dependencies on the rest of the package."""

from __future__ import annotations


def mean_by_key(dicts: list[dict]) -> dict[str, float]:
    """Key-wise mean of metric dicts; a key counts only the dicts that have it (e.g. a metric that
    only the last pipeline stage reports)."""
    keys = {k for d in dicts for k in d}
    return {k: sum(float(d[k]) for d in dicts if k in d) / sum(1 for d in dicts if k in d) for k in keys}
