"""Everything that knows DeepSpeed: its file names, tag directories, pickled structures, the
live engine, the CK2xx checks of a checkpoint's files, and embedding manifests into them.

``save_checkpoint`` and ``manifest_from_engine`` import torch and DeepSpeed only when called,
so importing this package needs neither. They are loaded on first use, as the models are: a
command that only reads a tag directory's files (``generate``) starts its pickle scans before
pydantic is imported (``checkpoint/prescan.py``).
"""

from ..errors import UnsupportedEngine

__all__ = ["UnsupportedEngine", "manifest_from_engine", "save_checkpoint"]


def __getattr__(name: str):
    if name in ("manifest_from_engine", "save_checkpoint"):
        from . import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'ckptspec.deepspeed' has no attribute {name!r}")
