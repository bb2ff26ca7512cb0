"""Load: the validated resume, ``engine.load_checkpoint`` of a tag ckptspec has checked first.

``load_checkpoint`` below refuses what it cannot check, has rank 0 choose the tag (``choice.py``: validated, in
``ckptspec scan``'s order) and every rank receive that verdict (``verdict.py``), then calls DeepSpeed's
``engine.load_checkpoint`` with that tag on every rank, or raises the same error on every rank before DeepSpeed
reads a byte.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Any

from ..._forked import no_forks
from ...checkpoint.embedded import CLIENT_STATE_KEY
from ...errors import UnsupportedEngine
from ...findings import Finding

__all__ = ["Resumed", "SkippedTag", "load_checkpoint"]


@dataclass(frozen=True)
class SkippedTag:
    """A tag tried before the one loaded, and why it was not loaded: its first finding's ``code`` and ``message``,
    and every finding (each ``file`` under the tag: ``global_step2/<file>``)."""

    tag: str
    code: str
    message: str
    findings: tuple[Finding, ...]


@dataclass(frozen=True)
class Resumed:
    """What ``load_checkpoint`` did, the same on every rank but ``client_state`` (each rank's, as DeepSpeed gives it).

    ``load_path`` and ``client_state`` are what ``engine.load_checkpoint`` returned (``client_state`` without the
    manifest the save hook embeds under ``"ckptspec_manifest"``); ``tag`` is the tag loaded, ``skipped`` the tags
    tried before it, newest first (empty when the first was valid)."""

    load_path: str | None
    client_state: dict | None
    tag: str
    skipped: tuple[SkippedTag, ...]


def load_checkpoint(
    engine, load_dir, tag: str | None = None, fallback: bool = True, *, verify_hashes: bool = True, **load_kwargs
) -> Resumed:
    """``engine.load_checkpoint(load_dir, tag)`` of a tag validated first; with ``fallback``, of the newest valid one.

    Call it on every rank, where ``engine.load_checkpoint`` would be called. Rank 0 lists the run's tags
    (``ckptspec scan``'s order) and validates the one to load, as ``ckptspec validate`` does (``verify_hashes``:
    every file's recorded SHA-256 too); every rank receives its verdict, then DeepSpeed loads that tag, on every
    rank. The tag tried first is ``tag``, or the run's newest tag (which ``latest`` names, unless a save stopped
    before writing it). With ``fallback``, an invalid tag is skipped for the next older one, newest first, until
    one is valid (never a tag newer than the first); rank 0 warns which it skipped and why. Without it, only the
    first is tried.

    ``load_kwargs`` are ``engine.load_checkpoint``'s own (``load_optimizer_states``, ``load_module_only``, ...).
    DeepSpeed reads the files on each rank: every rank must see the files rank 0 validated (a shared file system).

    Returns:
        ``Resumed``: DeepSpeed's ``load_path`` and ``client_state``, the tag loaded and the tags skipped.

    Raises:
        NoValidTag: CK260, on every rank and before DeepSpeed reads a byte: no tag tried is valid (its
            ``findings``: those of every tag tried), ``tag`` is not a tag of the run, or the run has none.
        CkptspecError: CK901, on every rank: ``load_dir`` cannot be read.
        UnsupportedEngine: an engine that loads universal checkpoints (``checkpoint.load_universal``).
        ValueError: ``load_dir`` is a URL (DeepSpeed reads local files; ``ckptspec scan URL`` checks a run there).
    """
    from ...location import is_remote

    load_dir = os.fspath(load_dir)
    if is_remote(load_dir):
        raise ValueError(
            f"{load_dir} is a URL: DeepSpeed's load_checkpoint reads local files; copy the run (or its tag) to a "
            "local or shared file system first (`ckptspec scan URL` checks a run where it is)"
        )
    if getattr(engine, "load_universal_checkpoint", lambda: False)():
        raise UnsupportedEngine(
            "this engine loads universal checkpoints (checkpoint.load_universal), which load_checkpoint does not "
            "choose among",
            "validate the universal folder with `ckptspec validate`, then call engine.load_checkpoint",
        )
    with no_forks():  # a training rank's process holds threads a fork would copy mid-work
        verdict, rank = _verdict(load_dir, tag, fallback, verify_hashes)
    skipped = tuple(_skipped(s) for s in verdict["skipped"])
    if skipped and rank == 0:
        said = "; ".join(f"{s.tag} ({s.code}: {s.message})" for s in skipped)
        warnings.warn(f"ckptspec: resuming from {verdict['tag']} of {load_dir}; skipped {said}", stacklevel=2)
    load_path, client_state = engine.load_checkpoint(load_dir, tag=verdict["tag"], **load_kwargs)
    if isinstance(client_state, dict):
        client_state.pop(CLIENT_STATE_KEY, None)
    return Resumed(load_path, client_state, verdict["tag"], skipped)


def _verdict(load_dir: str, tag: str | None, fallback: bool, verify_hashes: bool) -> tuple[dict[str, Any], int]:
    """Rank 0's choice, received by every rank (this process's own, outside a distributed job), and this rank."""
    import torch.distributed as dist

    from .choice import choose
    from .verdict import on_rank_0

    def decide() -> tuple[None, dict[str, Any]]:
        return None, choose(load_dir, tag, fallback, verify_hashes)

    if not (dist.is_available() and dist.is_initialized()):
        return decide()[1], 0
    return on_rank_0(decide, what=load_dir)[1], dist.get_rank()


def _skipped(skipped: dict[str, Any]) -> SkippedTag:
    findings = tuple(Finding(**f) for f in skipped["findings"])
    return SkippedTag(skipped["tag"], skipped["code"], skipped["message"], findings)
