"""Everything that knows DeepSpeed: its file names, tag directories, pickled structures, the
live engine, the CK2xx checks of a checkpoint's files, and embedding manifests into them.

``save_checkpoint`` and ``manifest_from_engine`` import torch and DeepSpeed only when called,
so importing this package needs neither.
"""

from ..errors import UnsupportedEngine
from .engine import manifest_from_engine, save_checkpoint

__all__ = ["UnsupportedEngine", "manifest_from_engine", "save_checkpoint"]
