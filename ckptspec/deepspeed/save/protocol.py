"""The save protocol every save hook follows (``zero.py``, ``model_parallel.py``, ``masters.py``).

DeepSpeed writes into a temporary tag directory, each rank describes the files it wrote, and rank 0
writes the sidecar, publishes the tag under its name and writes ``latest``, or removes the temporary
directory: killed at any instant, readers see the old save or the new one. A hook is this call
sequence, on every rank (the way ``torch.distributed.checkpoint`` documents its ``StorageWriter``):

1. describe the layout from the live engine and refuse what cannot be described (``live/``), before
   anything is written: on every rank alike, so no rank is left in a collective;
2. ``save_request(engine, client_state, tag)``: the client state DeepSpeed saves (the hook may add
   the layout under ``"ckptspec_manifest"``) and the tag;
3. ``save_staged(...)``: DeepSpeed's own ``engine.save_checkpoint`` into a temporary tag directory
   that rank 0 names; returns it;
4. ``describe_own_files(dist, staged, describe)``: each rank describes the files it wrote (sizes,
   locators, hashes); one gather; a failure on any rank is raised on every rank and rank 0 removes
   the temporary directory;
5. the hook assembles the complete document from what was gathered (rank 0 adds what only it
   reads, such as tensor digests);
6. ``publish_and_broadcast(...)``: rank 0 validates the document and ``publish_on_rank_0`` writes the
   sidecar, publishes the tag and writes ``latest``; its status (and, for an index, the document)
   is broadcast, and a failure is raised on every rank.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..._fs import publish_dir, sweep, temp_dir, write_atomic
from ...checkpoint.embedded import CLIENT_STATE_KEY
from ...checkpoint.sidecar import SIDECAR_NAMES, write_sidecar
from ...errors import InvalidManifest
from .captured_state import capturing

if TYPE_CHECKING:
    from ...format.codec import Encoding


def save_request(engine, client_state, tag) -> tuple[dict, str]:
    """The client state DeepSpeed is to save (ckptspec's key refused: it is ours) and the tag
    (DeepSpeed's default when none is given)."""
    state = dict(client_state or {})
    if CLIENT_STATE_KEY in state:
        raise ValueError(f"client_state key {CLIENT_STATE_KEY!r} is reserved for ckptspec")
    return state, str(tag) if tag is not None else f"global_step{engine.global_steps}"


def save_staged(
    engine, dist, save_dir, tag: str, state: dict, exclude_frozen_parameters: bool, captured: dict | None = None
) -> Path:
    """DeepSpeed's own save, into a temporary tag directory that rank 0 names (the next save removes a
    killed one's: _fs.sweep); returns the temporary directory. ``captured``: receives the state of each
    model-states file handed to ``torch.save``, by file name (``captured_state.capturing``)."""
    distributed = dist.is_available() and dist.is_initialized()
    staging: list[str | None] = [None]
    if not distributed or dist.get_rank() == 0:
        Path(save_dir).mkdir(parents=True, exist_ok=True)
        sweep(save_dir)
        staging[0] = temp_dir(Path(save_dir) / tag).name
    if distributed:
        dist.broadcast_object_list(staging, src=0)
    with capturing(engine, captured) if captured is not None else contextlib.nullcontext():
        engine.save_checkpoint(
            save_dir,
            tag=staging[0],
            client_state=state,
            save_latest=False,
            exclude_frozen_parameters=exclude_frozen_parameters,
        )
    assert staging[0] is not None  # named by rank 0, broadcast to every rank
    return Path(save_dir) / staging[0]


def publish_on_rank_0(
    staged: Path, save_dir, tag: str, describe, sidecar_encoding: Encoding, save_latest: bool
) -> str | None:
    """Rank 0's commit: ``describe()`` gives the document and its validation report; a valid one is written
    as the sidecar, the tag published under its name and ``latest`` written. Returns what failed, if
    anything (the temporary directory is then removed), for the caller to broadcast."""
    tag_dir = Path(save_dir) / tag
    try:
        document, report = describe()
        if not report.ok:
            raise InvalidManifest(str(tag_dir / SIDECAR_NAMES[sidecar_encoding]), report.findings)
        write_sidecar(staged, document, sidecar_encoding)
        publish_dir(staged, tag_dir)  # complete, with its sidecar: now under its name
        if save_latest:
            write_atomic(Path(save_dir) / "latest", tag.encode("utf-8"))
    except Exception as exc:
        shutil.rmtree(staged, ignore_errors=True)  # gone already when it took the tag's name
        return f"rank 0: {type(exc).__name__}: {exc}"
    return None


def _rank(dist) -> tuple[bool, int]:
    distributed = dist.is_available() and dist.is_initialized()
    return distributed, dist.get_rank() if distributed else 0


def describe_own_files(dist, staged: Path, describe: Callable[[], Any]) -> list:
    """Step 4: ``describe()`` on every rank, gathered in rank order. A failure on any rank is raised on
    every rank (never left hanging in the gather), after rank 0 has removed the temporary directory."""
    distributed, rank = _rank(dist)
    try:
        mine, error = describe(), None
    except Exception as exc:  # reported on every rank below, never left hanging in a collective
        mine, error = None, f"rank {rank}: {type(exc).__name__}: {exc}"
    gathered: list = [None] * (dist.get_world_size() if distributed else 1)
    if distributed:
        dist.all_gather_object(gathered, (mine, error))
    else:
        gathered = [(mine, error)]
    errors = [e for _, e in gathered if e]
    if errors:
        if rank == 0:  # every rank has finished writing (the gather above): nothing is left half-saved
            shutil.rmtree(staged, ignore_errors=True)
        raise RuntimeError("ckptspec could not describe the saved files (no sidecar written): " + "; ".join(errors))
    return [m for m, _ in gathered]


def publish_and_broadcast(
    dist,
    staged: Path,
    save_dir,
    tag: str,
    describe,
    sidecar_encoding: Encoding,
    save_latest: bool,
    *,
    what: str,
    shared: Callable[[], Any] = lambda: None,
) -> Any:
    """Step 6: rank 0 publishes (``publish_on_rank_0``; ``describe()`` gives the document and its report);
    its status and ``shared()`` (rank 0's, after publishing) are broadcast. Raises on every rank if rank 0
    failed; else returns the shared value (``shared()`` itself when not distributed)."""
    distributed, rank = _rank(dist)
    status = publish_on_rank_0(staged, save_dir, tag, describe, sidecar_encoding, save_latest) if rank == 0 else None
    box = [status, shared() if rank == 0 else None]
    if distributed:
        dist.broadcast_object_list(box, src=0)
    status, value = box
    if status:
        raise RuntimeError(f"ckptspec could not write the {what} sidecar: " + status)
    return value
