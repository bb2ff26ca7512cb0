"""The steps of ``embed`` that read and check, shared by the local embed (``embed.py``) and the sidecar written to a
URL (``embed_url.py``), so that both record the same manifest for the same checkpoint."""

from __future__ import annotations

import os
from pathlib import Path

from ..checkpoint.embedded import (
    NOT_LAYOUT,
    agreement_findings,
    as_document,
    first_difference,
    read_client_state_copy,
)
from ..checkpoint.states import StateCache
from ..errors import CkptspecError, EmbedError, InputOutputError
from ..format.index_validate import is_index, validate_index_document
from ..format.models import Manifest
from ..format.tolerant import from_document
from ..format.validate import validate_document
from ..format.version import version_key
from .describe.digests import add_digests
from .describe.zero import describe_files
from .layout.tag_dir import ShardSet

REHASH_HINT = (
    "restore the files the record describes; if they changed on purpose, record them as they are now with "
    "`ckptspec embed CHECKPOINT --rehash`"
)


def embedded_document(
    shards: ShardSet, states: StateCache, described: Manifest, manifest: Manifest | dict | None, tag_dir
) -> dict:
    """The layout to record: ``manifest`` when given (CK304 unless it describes the files), else the one the
    model states carry (a live engine's from save_checkpoint: it knows the excluded names, so a sidecar lost when
    only the .pt files were copied comes back the same; CK301 when their copies disagree), else the files'."""
    derived = described.to_dict()
    if manifest is None:
        read = [read_client_state_copy(path, states.state(path)) for _, path in sorted(shards.model_files.items())]
        embedded = [c for c in read if c is not None]
        disagree = agreement_findings(embedded)
        if disagree:
            first = disagree[0]
            name = os.path.basename(first.file or "")
            raise EmbedError("CK301", f"{name}: {first.path}: {first.message}", first.hint, str(tag_dir))
        if not embedded:
            return derived
        manifest = embedded[0].document
    doc = as_document(manifest)
    if is_index(doc):
        raise another_kind("a checkpoint index", "ZeRO data-parallel checkpoint (a format 1.x manifest)", tag_dir)
    ignore = NOT_LAYOUT + ("excluded",)  # the files cannot know exclude_frozen_parameters' names, nor the producer
    layout_agrees(
        {k: v for k, v in derived.items() if k not in ignore},
        {k: v for k, v in doc.items() if k not in ignore},
        tag_dir,
    )
    return doc


def layout_agrees(on_disk: dict, given: dict, tag_dir) -> None:
    """CK304 at the first place the layout the files give differs from the one given (keys on one side only are
    not compared)."""
    diff = first_difference(on_disk, given, lenient=True)
    if diff:
        where, says, in_manifest = diff
        raise EmbedError(
            "CK304",
            f"the manifest does not describe this checkpoint: at {where} the files say {says}, "
            f"the manifest {in_manifest}",
            "embed the manifest of this checkpoint, or omit --manifest to generate it",
            str(tag_dir),
        )


def another_kind(given: str, checkpoint: str, tag_dir) -> EmbedError:
    """CK304 for a document of the other kind: a checkpoint index given for a plain ZeRO checkpoint, or the reverse."""
    return EmbedError(
        "CK304",
        f"the manifest given is {given}, but this is a {checkpoint}",
        "embed the manifest of this checkpoint, or omit --manifest to generate it",
        str(tag_dir),
    )


def digested_sections(
    shards: ShardSet, described: Manifest, doc: dict, states: StateCache, hash_algorithm: str | None
) -> tuple[Manifest | None, dict]:
    """For a format 1.1 ``doc``: its model, and (hashed) the sections whose tensor digests the files give
    (read from the files as they are: embedding moves bytes, it does not change them)."""
    if version_key(str(doc.get("format_version", "1.0"))) == "1.0":
        return None, {}
    target = from_document(Manifest, doc)
    if not hash_algorithm:
        return target, {}
    target.files = describe_files(shards, described.layout.zero_stage, None, states, target)
    add_digests(target, shards.tag_dir)
    return target, {key: target.to_dict()[key] for key in ("groups", "frozen", "buffers")}


def check_completed(complete: dict, where) -> None:
    """CK304 when the manifest (or checkpoint index) about to be written is not valid."""
    report = validate_index_document(complete) if is_index(complete) else validate_document(complete)
    if not report.ok:
        first = next(f for f in report.findings if f.severity == "error")
        raise EmbedError(
            "CK304",
            f"the completed manifest is not valid: {first.path}: {first.code} {first.message}",
            "check the manifest with `ckptspec validate`",
            str(where),
        )


def write_failed(exc: OSError, tag_dir: Path) -> CkptspecError:
    """CK906 for a write into the tag directory that failed (the journal lets the next embed finish a commit)."""
    return InputOutputError(
        "CK906",
        f"cannot write: {exc.strerror or exc}",
        "check free space and permissions; an interrupted embed is finished by the next one",
        str(tag_dir),
    )
