"""Every change hybridflow makes to a third-party library, behind one door.

One module per library and concern holds its patches (``torch_cuda``, ``megatron_core``, ``megatron_layers``,
``megatron_mla``, ``megatron_save``, ``vllm_engine``, ``vllm_reload_log``, ``transformers_rope``, ``ray_daemons``,
``emerging_optimizers``); each patch is declared in ``registry`` with the library version range it was
written for and the attribute it replaces or relies on. ``check_versions()`` runs when hybridflow is
imported, so an upgrade outside a patch's range fails there, in one line naming the patch, instead of
deep inside a run. tests/unit/test_patches.py lists them all and checks each range against versions.py.
"""

from hybridflow.patches.registry import PATCHES, Patch, PatchError, check_versions

__all__ = ["PATCHES", "Patch", "PatchError", "check_versions"]
