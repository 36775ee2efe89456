"""Controllers for the KL-penalty coefficient used in reward shaping."""

from __future__ import annotations

from typing import Optional, Union

import numpy as np

from .registry import KL_CONTROLLERS, register_kl_controller


@register_kl_controller("fixed")
class FixedKLController:
    """Constant coefficient; ``update`` is a no-op kept for a uniform interface."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def __repr__(self) -> str:
        return f"FixedKLController(value={self.value})"


@register_kl_controller("adaptive")
class AdaptiveKLController:
    """Proportional controller steering the measured KL towards ``target_kl``.

    Ziegler et al. 2019: ``coef *= 1 + clip(kl / target - 1, -0.2, 0.2) *
    n_steps / horizon``; the clip bounds the change per update so one noisy KL
    measurement cannot swing the coefficient.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float) -> None:
        if target_kl <= 0:
            raise ValueError(f"target_kl must be > 0, got {target_kl}")
        if horizon <= 0:
            raise ValueError(f"horizon must be > 0, got {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """``current_kl``: mean KL of the batch (float); ``n_steps``: samples in it."""
        proportional_error = float(np.clip(float(current_kl) / self.target - 1, -0.2, 0.2))
        self.value *= 1 + proportional_error * n_steps / self.horizon

    def __repr__(self) -> str:
        return f"AdaptiveKLController(value={self.value}, target={self.target}, horizon={self.horizon})"


def make_kl_controller(
    kind: str,
    *,
    kl_coef: Optional[float] = None,
    init_kl_coef: Optional[float] = None,
    target_kl: Optional[float] = None,
    horizon: Optional[float] = None,
) -> Union[FixedKLController, AdaptiveKLController]:
    """Build a controller by name (``fixed`` or ``adaptive``).

    ``kl_coef`` and ``init_kl_coef`` are synonyms so a whole config section
    (``kl_coef``, ``target_kl``, ``horizon``) can be splatted in for either
    kind; ``fixed`` ignores ``target_kl``/``horizon``.
    """
    cls = KL_CONTROLLERS.get(kind)
    if kl_coef is not None and init_kl_coef is not None and kl_coef != init_kl_coef:
        raise ValueError(f"kl_coef={kl_coef} and init_kl_coef={init_kl_coef} disagree")
    coef = kl_coef if kl_coef is not None else init_kl_coef
    if coef is None:
        raise ValueError(f"kl controller {kind!r} requires kl_coef")
    if cls is AdaptiveKLController:
        if target_kl is None or horizon is None:
            raise ValueError("adaptive kl controller requires target_kl and horizon")
        return AdaptiveKLController(coef, target_kl, horizon)
    if cls is FixedKLController:
        return FixedKLController(coef)
    # user-registered controllers get every argument that was given
    extra = {k: v for k, v in dict(target_kl=target_kl, horizon=horizon).items() if v is not None}
    return cls(coef, **extra)
