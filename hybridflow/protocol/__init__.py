"""Data protocol exchanged between the controller and workers."""

from .batch import Batch

__all__ = ["Batch"]
