"""emerging_optimizers 0.1.0 (third_party/README.md) without triton: its ``triton_kernels`` module imports triton at
import time, so on the CPU install (which removes triton) ``import emerging_optimizers.orthogonalized_optimizers``
fails and megatron-core's Muon reports the package missing (optimizer/muon.py ``HAVE_EMERGING_OPTIMIZERS``).

Where triton cannot be imported, the module is declared here with ``HAS_TRITON_340 = False``: what the package
itself sets when triton is older than 3.4, and the only attribute its Muon code reads before it would call a kernel
(orthogonalized_optimizers/muon.py: ``use_syrk`` falls back to False). megatron-core 0.16.1 never asks for the SYRK
kernel (``newton_schulz_tp`` leaves ``use_syrk`` at False), so Muon's Newton-Schulz runs on torch matmuls on CPU and
GPU alike. Where triton imports (GPU installs), nothing is changed."""

from __future__ import annotations

import importlib.util
import sys
import types

from hybridflow.patches.registry import declare

TRITON_KERNELS = declare(
    "emerging_optimizers.triton_kernels_without_triton", "emerging-optimizers", "==0.1.0",
    "emerging_optimizers.orthogonalized_optimizers.muon_utils:newton_schulz_tp",
    "where triton is not installed, emerging_optimizers.triton_kernels is declared without kernels "
    "(HAS_TRITON_340 = False) so that megatron-core's Muon imports; newton_schulz_tp then runs on torch matmuls")

_MODULE = "emerging_optimizers.triton_kernels"


def importable() -> bool:
    """Make ``emerging_optimizers``' Muon importable (see the module docstring); False when the package is not
    installed."""
    if importlib.util.find_spec("emerging_optimizers") is None:
        return False
    if _MODULE not in sys.modules and importlib.util.find_spec("triton") is None:
        TRITON_KERNELS.check_version()
        import emerging_optimizers

        kernels = types.ModuleType(_MODULE, "triton is not installed: no kernels (hybridflow/patches/"
                                            "emerging_optimizers.py)")
        kernels.HAS_TRITON_340 = False
        sys.modules[_MODULE] = emerging_optimizers.triton_kernels = kernels
    return True
