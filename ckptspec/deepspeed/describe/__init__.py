"""Describe: a DeepSpeed tag directory's files -> the document that describes them.

A plain ZeRO checkpoint is described by a format 1.x manifest (``zero.py``); every other kind by a
checkpoint index (``model_parallel.py``, ``moe.py``, ``pipeline_stage0.py``, and stage 0 and
universal folders in ``index_builder.py``). ``describe`` below is the one verb for any kind, and
``generate_index`` the one place that chooses among the index kinds; the kind modules never import
them. Imports are inside the functions, so that importing a kind module (``generate`` preloads
``describe.zero`` while it reads pickles) stays cheap.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ...checkpoint.states import StateCache
    from ...format.index_models import CheckpointIndex
    from ...format.models import Manifest


# Kind (its value) -> the module of this package that describes it as a checkpoint index.
_INDEX_PRODUCERS = {
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
    from ...location import is_remote
    from ..kinds import needs_index
    from ..layout.tag_dir import resolve_tag_dir

    if not is_remote(checkpoint) and needs_index(resolve_tag_dir(checkpoint, tag)):
        return index_from_checkpoint(checkpoint, tag, hash_algorithm=hash_algorithm, states=states)
    from .zero import manifest_from_checkpoint

    return manifest_from_checkpoint(checkpoint, tag, hash_algorithm=hash_algorithm, states=states)


def generate_index(tag_dir: Path, states: StateCache, *, hash_algorithm: str | None = None) -> CheckpointIndex:
    """The checkpoint index of any tag directory that needs one (``kinds.kind_of_dir(tag_dir).needs_index``)."""
    from importlib import import_module

    from ..kinds import kind_of_dir

    kind = kind_of_dir(tag_dir)  # a plain ZeRO directory asked for an index: the model-parallel producer, as before
    module = import_module(f"{__name__}.{_INDEX_PRODUCERS.get(kind, 'model_parallel')}")
    return module.describe(tag_dir, states, hash_algorithm)


def index_from_checkpoint(
    checkpoint: str | os.PathLike,
    tag: str | None = None,
    *,
    hash_algorithm: str | None = None,
    states: StateCache | None = None,
) -> CheckpointIndex:
    """Describe a saved DeepSpeed checkpoint that needs an index (tensor/pipeline parallel, MoE, stage 0,
    universal)."""
    from ...checkpoint.states import StateCache
    from ..layout.parallel_files import index_tag_dir

    tag_dir = index_tag_dir(checkpoint, tag)
    return generate_index(tag_dir, states or StateCache(), hash_algorithm=hash_algorithm)
