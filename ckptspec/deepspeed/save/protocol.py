"""The atomic save protocol of the save hooks (``engine.save_checkpoint`` for a ZeRO manifest,
``engine_index_save`` for a checkpoint index): DeepSpeed writes into a temporary tag directory,
the files are described, and rank 0 writes the sidecar, publishes the tag under its name and
writes ``latest``, or removes the temporary directory; readers see the old save or the new one."""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

from ..._fs import publish_dir, sweep, temp_dir, write_atomic
from ...checkpoint.embedded import CLIENT_STATE_KEY
from ...checkpoint.sidecar import SIDECAR_NAMES, write_sidecar
from ...errors import InvalidManifest
from .captured_state import capturing


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
    model-states file handed to ``torch.save``, by file name (``saved_state.capturing``)."""
    distributed = dist.is_available() and dist.is_initialized()
    staging = [None]
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
    return Path(save_dir) / staging[0]


def publish_on_rank_0(
    staged: Path, save_dir, tag: str, describe, sidecar_encoding: str, save_latest: bool
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
