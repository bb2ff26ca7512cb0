"""Describe: a DeepSpeed tag directory's files -> the document that describes them.

A plain ZeRO checkpoint is described by a format 1.x manifest (``zero.py``); every other kind by a
checkpoint index (``model_parallel.py``, ``moe.py``, ``stage0.py``, ``pipeline_stage0.py``,
``universal.py``). Each kind module has a ``describe(tag_dir, states, hash_algorithm)``; ``describe``
below is the one verb for any checkpoint, and ``describe_tag_dir`` the one place that chooses among
the kinds. The kind modules never import this one. Imports are inside the functions, so that
importing a kind module (``generate`` preloads ``describe.zero`` while it reads pickles) stays cheap.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ...checkpoint.states import StateCache
    from ...format.index_models import CheckpointIndex
    from ...format.models import Manifest
    from ...location import RemotePath


# Kind (its value) -> the module of this package that describes it. Each has a ``describe(tag_dir, states,
# hash_algorithm)``; a plain ZeRO directory asked for an index gets the model-parallel producer's.
_PRODUCERS = {
    "zero": "zero",
    "stage0": "stage0",
    "universal": "universal",
    "pipeline_stage0": "pipeline_stage0",
    "moe": "moe",
    "model_parallel": "model_parallel",
}


def describe(
    checkpoint: str | os.PathLike,
    tag: str | None = None,
    *,
    hash_algorithm: str | None = None,
    states: StateCache | None = None,
) -> Manifest | CheckpointIndex:
    """The document of a saved DeepSpeed checkpoint, from its files: a format 1.x ``Manifest`` for a plain
    ZeRO checkpoint (stage 1-3), a ``CheckpointIndex`` for every other kind (``kinds.Kind``), as
    ``ckptspec generate`` writes it. A URL is read as a ZeRO checkpoint (indexes are read locally only).
    ``states``: files already read (and where the files read here are kept)."""
    from ...checkpoint.states import StateCache
    from ..kinds import described_by_index
    from ..layout.tag_dir import resolve_tag_dir

    tag_dir = resolve_tag_dir(checkpoint, tag)
    states = states if states is not None else StateCache()
    return describe_tag_dir(tag_dir, states, hash_algorithm=hash_algorithm, as_index=described_by_index(tag_dir))


def describe_tag_dir(
    tag_dir: Path | RemotePath, states: StateCache, *, hash_algorithm: str | None = None, as_index: bool = False
) -> Manifest | CheckpointIndex:
    """The document of one resolved tag directory: a ``Manifest``, or with ``as_index`` the ``CheckpointIndex``
    of its kind (``kinds.kind_of_dir``; a plain ZeRO directory gets the model-parallel producer's, one domain),
    as ``validate`` compares a checkpoint index with its files."""
    from importlib import import_module

    from ..kinds import Kind, kind_of_dir

    kind = Kind.ZERO
    if as_index:
        kind = kind_of_dir(tag_dir)
        kind = Kind.MODEL_PARALLEL if kind is Kind.ZERO else kind
    return import_module(f"{__name__}.{_PRODUCERS[kind.value]}").describe(tag_dir, states, hash_algorithm)
