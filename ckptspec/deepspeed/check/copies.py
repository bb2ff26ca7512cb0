"""The manifest copies a DeepSpeed checkpoint directory carries: find them, and CK301/CK302 when they
disagree or cannot be read (``embed.py`` writes them). The sidecar is ``ckptspec.json``/``.msgpack``; the
file-level readers are in ``ckptspec.checkpoint.embedded`` (docs/embedding.md).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ...checkpoint.embedded import (
    EmbeddedCopy,
    agreement_findings,
    copies_in_file,
    read_client_state_copy,
    read_index_copy,
    read_safetensors_copy,
    read_sidecar_copy,
)
from ...checkpoint.sidecar import find_sidecars
from ...checkpoint.states import StateCache
from ...errors import CkptspecError, InputOutputError, InvalidCheckpoint
from ...findings import Finding, finding
from ...location import AnyPath, RemotePath, location, not_found
from ..layout.names import MODEL_RE, file_order, role_of
from ..layout.tag_dir import resolve_tag_dir


def copies_in_dir(
    directory: AnyPath,
    tag: str | None = None,
    errors: list[CkptspecError] | None = None,
    states: StateCache | None = None,
    read: Iterable[EmbeddedCopy] = (),
) -> list[EmbeddedCopy]:
    """Every manifest copy of a checkpoint directory (or of a directory of safetensors files).

    A DeepSpeed save or tag directory: its sidecar(s) and each model-states file's client
    state. Any other directory: its sidecar(s), the ``metadata`` of its ``*.index.json`` and the
    ``__metadata__`` of its ``*.safetensors`` that hold the manifest themselves.
    With ``errors``, a file that cannot be read is appended there and skipped instead of raising.
    ``states``: model states already read (and where the ones read here are kept); ``read``: copies
    the caller already read (a sidecar it validated), not read again.
    """
    root = location(directory)
    try:
        tag_dir = resolve_tag_dir(root, tag)
    except InvalidCheckpoint:
        if tag is not None or not root.is_dir():
            raise
        tag_dir = None
    where = tag_dir or root
    known = {c.source: c for c in read}
    candidates: list[tuple[Path | RemotePath, Any]] = [
        (p, lambda p: [known[str(p)]] if str(p) in known else [read_sidecar_copy(p)]) for p in find_sidecars(where)
    ]
    if tag_dir is not None:
        models = [p for p in tag_dir.iterdir() if p.is_file() and MODEL_RE.match(p.name)]
        models.sort(key=lambda p: file_order(*role_of(p.name), p.name))
        cache = states if states is not None else StateCache()
        candidates += [(p, lambda p: [c for c in [read_client_state_copy(p, cache.state(p))] if c]) for p in models]
    else:
        # A reconstruction: the index of a sharded output holds the manifest (its shards name it).
        indexes: list[Path | RemotePath] = sorted(root.glob("*.index.json"))
        safetensors: list[Path | RemotePath] = sorted(root.glob("*.safetensors"))
        candidates += [(p, lambda p: [c for c in [read_index_copy(p)] if c]) for p in indexes]
        candidates += [
            (p, lambda p: [c for c in [read_safetensors_copy(p)] if c and (not indexes or c.source == str(p))])
            for p in safetensors
        ]
    copies: list[EmbeddedCopy] = []
    for path, reader in candidates:
        try:
            copies += reader(path)
        except CkptspecError as exc:
            if errors is None:
                raise
            errors.append(exc)
    return copies


def find_copies(target: AnyPath, tag: str | None = None) -> list[EmbeddedCopy]:
    p = location(target)
    if not p.exists():
        if isinstance(p, RemotePath):
            raise not_found(str(p), "file or directory not found")
        raise InputOutputError("CK901", "file or directory not found", "check the path", str(p))
    return copies_in_dir(p, tag) if p.is_dir() else copies_in_file(p)


def embedded_findings(
    checkpoint: AnyPath,
    tag: str | None = None,
    states: StateCache | None = None,
    read: Iterable[EmbeddedCopy] = (),
) -> list[Finding]:
    """For validation: CK302 for an embedded copy that cannot be read, CK301 for copies that disagree.

    Files that cannot be read at all (CK204, CK205, CK9xx) are skipped: the shard checks
    report them. ``states`` and ``read`` as for ``copies_in_dir``.
    """
    errors: list[CkptspecError] = []
    copies = (
        copies_in_dir(checkpoint, tag, errors, states, read)
        if location(checkpoint).is_dir()
        else find_copies(checkpoint, tag)
    )
    findings = [finding(e.code, "$", e.message, e.hint, file=e.file) for e in errors if e.code == "CK302"]
    return findings + agreement_findings(copies)
