"""The suite's tolerance policy: every float comparison in the tests goes through ``assert_close``.

Why: a fixed seed does not fix the float result. Another CPU (AVX2 vs AVX-512 kernels), another thread
count or another summation order changes the last bits of every sum, so a comparison holds on any x86-64
machine only if its tolerance scales with the size of the values and with the dtype's precision.

The rules:
1. Bit-for-bit (``torch.equal``, ``==``) only where both sides run the same kernels in the same order on
   the same machine, and exactness is the claim (a resumed run at the same layout, an export reimported).
2. Everything else: ``|actual - expected| <= rtol * (|expected| + magnitude)`` element-wise, where
   ``magnitude`` is max |expected| over the compared quantity (a value near zero inside a tensor of O(1)
   values is held to the tensor's scale, not to its own; a dict of tensors, e.g. a model's weights or
   gradients, is one quantity: a bias that one Adam step moved off zero is held to the model's scale) and ``rtol = RTOL[dtype] * slack``. ``slack``
   says how much arithmetic separates the two sides (other kernels, layers, an optimizer step, a reduction
   over ranks) and is set once per comparison, with the reason beside it.
3. Never a bare absolute epsilon on values that are not O(1): a loss of 224 differs by 1e-5 on another CPU.
4. Hand-computed expectations on a few elements (the unit tests of algorithms) may use ``pytest.approx``,
   whose default is the same kind of rule: relative (1e-6), not absolute.

``HYBRIDFLOW_TOL_REPORT=1`` prints how much of its tolerance each comparison used (what
``tests/numerics_sweep.sh`` reports), so a slack can be chosen with a measured margin.
"""

from __future__ import annotations

import os
from numbers import Real

import torch

# Relative tolerance per dtype for "the same computation, other kernels": ~100 ulps for fp32 (eps 1.2e-7),
# a few ulps for the 8-bit mantissa of bf16 (eps 7.8e-3) and the 11-bit one of fp16 (eps 9.8e-4).
RTOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def _as_tensor(x) -> torch.Tensor:
    return x.detach().cpu() if isinstance(x, torch.Tensor) else torch.tensor(float(x), dtype=torch.float64)


def _max_abs(x) -> float:
    if isinstance(x, dict):
        return max((_max_abs(v) for v in x.values()), default=0.0)
    t = _as_tensor(x).double()
    return float(t.abs().max()) if t.numel() else 0.0


def used_fraction(actual, expected, *, dtype=torch.float32, slack: float = 1.0,
                  magnitude: float | None = None) -> float:
    """max over elements of |actual - expected| / allowed: <= 1 passes."""
    a, e = _as_tensor(actual).double(), _as_tensor(expected).double()
    if a.shape != e.shape:
        raise AssertionError(f"shapes differ: {tuple(a.shape)} vs {tuple(e.shape)}")
    if e.numel() == 0:
        return 0.0
    if not (torch.isfinite(a).all() and torch.isfinite(e).all()):
        same = torch.equal(torch.nan_to_num(a, nan=0.5), torch.nan_to_num(e, nan=0.5))
        return 0.0 if same and torch.equal(a.isnan(), e.isnan()) else float("inf")
    rtol = RTOL[dtype] * slack
    allowed = rtol * (e.abs() + (e.abs().max() if magnitude is None else magnitude))
    diff = (a - e).abs()
    if not (allowed > 0).any():  # all-zero expected: only an exact zero passes
        return 0.0 if not diff.any() else float("inf")
    return float((diff / allowed.clamp_min(torch.finfo(torch.float64).tiny)).max())


def assert_close(actual, expected, *, dtype=torch.float32, slack: float = 1.0, what: str = "",
                 magnitude: float | None = None) -> None:
    """Assert ``actual`` equals ``expected`` under the policy above.

    Both may be tensors, Python numbers, or dicts of them with the same keys (each entry its own
    magnitude). ``dtype`` is the precision the values were computed in (not the dtype they are stored in).
    """
    if isinstance(expected, dict):
        assert isinstance(actual, dict) and set(actual) == set(expected), \
            f"{what}: keys differ: {sorted(set(actual) ^ set(expected))}"
        magnitude = _max_abs(expected) if magnitude is None else magnitude
        for key in expected:
            assert_close(actual[key], expected[key], dtype=dtype, slack=slack, what=f"{what}[{key}]",
                         magnitude=magnitude)
        return
    if not isinstance(expected, (torch.Tensor, Real)):
        raise TypeError(f"assert_close compares tensors, numbers or dicts of them, not {type(expected)}")
    used = used_fraction(actual, expected, dtype=dtype, slack=slack, magnitude=magnitude)
    if os.environ.get("HYBRIDFLOW_TOL_REPORT"):
        print(f"\n[tolerance] {what or 'value'}: used {used:.3g} of rtol {RTOL[dtype] * slack:.1e}")
    if used > 1:
        a, e = _as_tensor(actual).double(), _as_tensor(expected).double()
        worst = float((a - e).abs().max()) if a.numel() else 0.0
        scale = float(e.abs().max()) if magnitude is None else magnitude
        raise AssertionError(
            f"{what or 'value'} differs by {worst:.3g} (magnitude {scale:.3g}): "
            f"{used:.3g}x the tolerance rtol={RTOL[dtype] * slack:.1e} ({dtype}, slack {slack:g})")
