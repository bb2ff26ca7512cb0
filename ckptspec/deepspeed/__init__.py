"""Everything that knows DeepSpeed, by direction: ``layout`` (its file names, tag directories and
pickled structures; builds no document), ``describe`` (files -> document), ``check`` (files against a
document: CK2xx), ``live`` (engine -> document), ``save`` (the save hook) and ``load`` (the validated resume:
``load_checkpoint``); ``embed`` and ``upgrade`` write manifests into checkpoints.

``save_checkpoint``, ``load_checkpoint`` and ``manifest_from_engine`` import torch and DeepSpeed only when called,
so importing this package needs neither. They are loaded on first use, as the models are: a
command that only reads a tag directory's files (``generate``) starts its pickle scans before
pydantic is imported (``checkpoint/prescan.py``).
"""

from ..errors import UnsupportedEngine

__all__ = [
    "Resumed",
    "UnsupportedEngine",
    "index_from_engine",
    "load_checkpoint",
    "manifest_from_engine",
    "save_checkpoint",
]

# name -> the sub-package that defines it (see docs/architecture.md for the five directions)
_LAZY = {
    "save_checkpoint": "save",
    "load_checkpoint": "load",
    "Resumed": "load",
    "manifest_from_engine": "live.zero",
    "index_from_engine": "live",
}


def __getattr__(name: str):
    if name in _LAZY:
        from importlib import import_module

        return getattr(import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'ckptspec.deepspeed' has no attribute {name!r}")
