"""Save: DeepSpeed's ``engine.save_checkpoint`` plus the document of what it wrote (the save hook).

``save_checkpoint`` below refuses what cannot be saved, then dispatches on the engine's kind to one of
``zero.py`` (a format 1.x manifest), ``model_parallel.py`` and ``masters.py`` (a checkpoint index); each
follows the call sequence of ``protocol.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..._forked import no_forks
from ...errors import UnsupportedEngine
from ...format.codec import gc_paused

if TYPE_CHECKING:
    from ...format.index_models import CheckpointIndex
    from ...format.models import Manifest

__all__ = ["save_checkpoint"]


def save_checkpoint(
    engine,
    save_dir,
    tag=None,
    client_state=None,
    hash=True,
    *,
    save_latest: bool = True,
    exclude_frozen_parameters: bool = False,
    sidecar_encoding: str = "json",
) -> Manifest | CheckpointIndex:
    """``engine.save_checkpoint`` plus the manifest, embedded where it travels with the files.

    Call it on every rank, exactly where ``engine.save_checkpoint`` would be called. It:

    1. describes the layout from the live engine (``manifest_from_engine``: the exact
       partition layout of the optimizer) and refuses unsupported engines before
       anything is written;
    2. calls ``engine.save_checkpoint`` with the layout manifest (``files: []``) added to
       ``client_state`` under ``"ckptspec_manifest"`` as a JSON string, so it is inside
       the model-states file(s) and survives when only the ``.pt`` files are copied;
    3. after every rank has written its files (DeepSpeed's closing barrier), has each
       rank describe the files it wrote (size, locators, ``sha256`` when ``hash``) and
       gathers the descriptions (one ``all_gather_object``);
    4. on rank 0, validates the complete manifest and writes it last, atomically, as
       ``ckptspec.json`` (``sidecar_encoding="msgpack"``: ``ckptspec.msgpack``), then
       writes ``latest`` (atomically, after the sidecar, so ``latest`` never names a
       checkpoint without its manifest).

    DeepSpeed writes into a temporary tag directory, which takes the tag's name (swapped in
    atomically where the tag exists) once every file and the sidecar are complete: killed at
    any instant, the save leaves the earlier checkpoint or the new one complete.

    Arguments are those of ``engine.save_checkpoint`` (``client_state`` may not use
    the ``"ckptspec_manifest"`` key); ``hash`` records a SHA-256 of every file (each
    rank hashes its own files, in parallel). Never forks the training rank's process, whatever
    ``CKPTSPEC_WORKERS`` says.

    Returns:
        The complete manifest, identical on every rank: a ``Manifest`` for a plain ZeRO engine, a
        ``CheckpointIndex`` for a tensor/pipeline-parallel, MoE or ZeRO stage-0 one.

    Raises:
        UnsupportedEngine: before saving, for engines format 1.0 cannot describe (and
            decoupled/asynchronous checkpoint engines, whose files are not final on return).
        ValueError: ``client_state`` already holds ``"ckptspec_manifest"``.
        RuntimeError: describing or writing failed on some rank; raised on every rank
            (no rank is left waiting), and neither the sidecar nor ``latest`` is written.
    """
    # The layout, DeepSpeed's pickling and the sidecar make ~1M acyclic objects: without the pause the
    # collector rescanned them all over and over (codec.gc_paused), slowing DeepSpeed's own save too.
    # A training rank's process holds CUDA/NCCL/OpenMP threads a fork would copy mid-work: never fork here.
    with gc_paused(), no_forks():
        args = (client_state, hash, save_latest, exclude_frozen_parameters, sidecar_encoding)
        return _save_checkpoint(engine, save_dir, tag, *args)


def _save_checkpoint(
    engine, save_dir, tag, client_state, hash, save_latest, exclude_frozen_parameters, sidecar_encoding
) -> Manifest | CheckpointIndex:
    checkpoint_engine = getattr(engine, "checkpoint_engine", None)
    if checkpoint_engine is not None and getattr(checkpoint_engine, "is_decoupled", lambda: False)():
        raise UnsupportedEngine(
            "a decoupled checkpoint engine writes files after save_checkpoint returns; "
            "ckptspec cannot describe them then"
        )
    if sidecar_encoding not in ("json", "msgpack"):
        raise ValueError(f"sidecar_encoding must be 'json' or 'msgpack', not {sidecar_encoding!r}")
    from ..kinds import Kind, kind_of_engine
    from ..live.refusals import refuse_unsaveable

    refuse_unsaveable(engine)  # whatever describes it: nothing is written for these
    kind = kind_of_engine(engine)

    if kind.masters_kind is not None:  # stage 0, MoE: an index locating the masters (masters.py)
        from .masters import save_masters_checkpoint

        args = (client_state, hash, save_latest, exclude_frozen_parameters, sidecar_encoding)
        return save_masters_checkpoint(engine, save_dir, tag, *args)
    if kind is Kind.MODEL_PARALLEL:  # a checkpoint index, not a manifest (model_parallel.py)
        from .model_parallel import save_index_checkpoint

        args = (client_state, hash, save_latest, exclude_frozen_parameters, sidecar_encoding)
        return save_index_checkpoint(engine, save_dir, tag, *args)
    from .zero import save_zero_checkpoint

    args = (client_state, hash, save_latest, exclude_frozen_parameters, sidecar_encoding)
    return save_zero_checkpoint(engine, save_dir, tag, *args)
