"""Per-field checks the config sections share: sizes >= 1, finite numbers within bounds."""

from __future__ import annotations

import math
import operator


def check_sizes(section, *names: str) -> None:
    for name in names:
        value = getattr(section, name)
        if value is not None and value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


_COMPARISONS = {">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le}


def check_number(name: str, value, **bounds) -> None:
    """``value`` (unless None) is finite and within ``bounds`` (gt/ge/lt/le). Finiteness comes first: NaN
    compares false with everything, so a plain ``lr <= 0`` check lets it through."""
    if value is None:
        return
    if isinstance(value, float) and not math.isfinite(value):  # ints are finite (and may exceed a float)
        raise ValueError(f"{name} must be a finite number, got {value}")
    ops = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}
    given = [(ops[k], b) for k, b in bounds.items()]
    if all(_COMPARISONS[op](value, b) for op, b in given):
        return
    if len(given) == 2:  # a lower and an upper bound: interval notation
        (low_op, low), (high_op, high) = given
        allowed = f"in {'(' if low_op == '>' else '['}{low:g}, {high:g}{')' if high_op == '<' else ']'}"
    else:
        allowed = " and ".join(f"{op} {b:g}" for op, b in given)
    raise ValueError(f"{name} must be {allowed}, got {value}")


def check_numbers(section, **bounds_by_name: dict) -> None:
    for name, bounds in bounds_by_name.items():
        check_number(name, getattr(section, name), **bounds)
