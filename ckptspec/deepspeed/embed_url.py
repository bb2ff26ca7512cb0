"""``embed URL --sidecar-only``: the sidecar of a DeepSpeed checkpoint at an object store's URL (``s3://``...).

The manifest is the one the local ``embed --sidecar-only`` writes (``embed.py``), from the same steps: the
checkpoint described from the bytes it needs (ranged reads, restricted unpickling), a layout manifest the model
states carry (or one given) kept when it describes them, and every record already there (the sidecar, a manifest
given that lists files) checked against the files first: ``RecordMismatch`` unless ``rehash``. So its bytes are
the local sidecar's for the same checkpoint and options.

It is uploaded as one object (``location.upload.put``: in parts, size and bytes verified, CK915/CK920 naming it),
after everything was read and checked: an object appears whole when its upload completes, so a run stopped
anywhere leaves readers the previous sidecar or none, never a part. A sidecar of the other encoding is removed
after (as the local commit removes it after its renames); stopped between the two, the tag has both, and readers
take ``ckptspec.json`` first (their layouts agree: both describe these files). Two writers at once are not refused as
a local tag directory's lock refuses them: the last upload wins, whole.

The model-states objects are not rewritten: an object store cannot replace several objects together, and a
checkpoint half rewritten is what embedding must never leave. So without ``--sidecar-only`` a URL is refused by
name (CK916); HTTP is read-only (CK916) either way.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from ..checkpoint.embedded import (
    NOT_LAYOUT,
    agreement_findings,
    as_document,
    first_difference,
    read_client_state_copy,
)
from ..checkpoint.sidecar import SIDECAR_NAMES
from ..checkpoint.states import StateCache
from ..errors import EmbedError, RemoteError
from ..findings import Finding
from ..format.codec import Encoding, dumps
from ..format.models import Manifest
from ..format.tolerant import from_document
from ..format.validate import validate_document
from ..format.version import version_key
from ..location import RemotePath, upload, writable
from ..location.store import store_for
from .check.recorded import check_records, recorded_manifests
from .describe.digests import add_digests
from .describe.zero import describe_files, manifest_from_states
from .embed import REHASH_HINT
from .layout.tag_dir import ShardSet, resolve_tag_dir, scan_tag_dir


@dataclass
class SidecarUploaded:
    manifest: dict  # the complete manifest, the sidecar's bytes decoded
    sidecar: str  # its URL
    replaced: list[Finding] = field(default_factory=list)  # rehash: how the files differed from the old record
    model_states: list[Path] = field(default_factory=list)  # none: a URL's model states are not rewritten


def embed_at_url(
    url: str,
    manifest: Manifest | dict | None = None,
    *,
    tag: str | None = None,
    hash_algorithm: str | None = "sha256",
    encoding: Encoding = "json",
    model_states: bool = False,
    rehash: bool = False,
) -> SidecarUploaded:
    """Write the sidecar of the DeepSpeed checkpoint at ``url`` (arguments as ``embed_checkpoint``'s), uploaded
    last as one verified object. ``model_states`` is refused (CK916): at a URL only the sidecar is written."""
    writable(url, "the sidecar")  # HTTP: CK916; a backend missing: CK917
    if model_states:
        raise RemoteError(
            "CK916",
            "embed cannot rewrite the model-states objects at a URL: an object store replaces objects one at a time, "
            "so a run stopped part way would leave the checkpoint half rewritten",
            f"write the sidecar only: `ckptspec embed {url} --sidecar-only` (the model states keep their bytes)",
            url,
        )
    tag_dir = resolve_tag_dir(url, tag)
    assert isinstance(tag_dir, RemotePath)  # the CLI's dispatch: a remote URL (file:// is embed_checkpoint's)
    complete, replaced = sidecar_manifest(tag_dir, manifest, hash_algorithm, rehash)
    target = tag_dir / SIDECAR_NAMES[encoding]
    upload.put(str(target), dumps(complete, encoding))  # the one object readers look for: written last
    try:
        _remove_other_encodings(tag_dir, target.name)
    except BaseException as stopped:  # an error, Ctrl-C, SIGTERM: the CLI says what readers see now
        stopped.ckptspec_upload = (  # type: ignore[attr-defined]  # any exception
            f"{target} was written; the earlier sidecar of the other encoding is still there (the next embed "
            "removes it)"
        )
        raise
    return SidecarUploaded(complete, str(target), replaced)


def sidecar_manifest(
    tag_dir: Path | RemotePath, manifest: Manifest | dict | None, hash_algorithm: str | None, rehash: bool
) -> tuple[dict, list[Finding]]:
    """The complete manifest ``embed --sidecar-only`` writes for ``tag_dir`` (reads only), and what ``rehash``
    re-recorded (``check_records``). These are ``embed_checkpoint``'s steps without its rewrites, repeated here
    (tests/remote/test_remote_output.py checks that both sidecars are the same bytes)."""
    shards = scan_tag_dir(tag_dir)
    states = StateCache()  # each file is read once, here
    described = manifest_from_states(shards, states)
    doc = _embedded_document(shards, states, described, manifest, tag_dir)
    records = recorded_manifests(tag_dir, manifest)  # type: ignore[arg-type]  # a RemotePath reads as a Path
    replaced = check_records(tag_dir, records, states, rehash=rehash, hint=REHASH_HINT)
    target, digested = _digested(shards, described, doc, states) if hash_algorithm else (None, {})
    if target is None and version_key(str(doc.get("format_version", "1.0"))) != "1.0":
        target = from_document(Manifest, doc)
    files = describe_files(shards, described.layout.zero_stage, hash_algorithm, states, target)
    complete = {**doc, **digested, "files": [f.model_dump(mode="json", exclude_unset=True) for f in files]}
    report = validate_document(complete)
    if not report.ok:
        first = next(f for f in report.findings if f.severity == "error")
        raise EmbedError(
            "CK304",
            f"the completed manifest is not valid: {first.path}: {first.code} {first.message}",
            "check the manifest with `ckptspec validate`",
            str(tag_dir),
        )
    return complete, replaced


def _embedded_document(
    shards: ShardSet, states: StateCache, described: Manifest, manifest: Manifest | dict | None, tag_dir
) -> dict:
    """The layout to record: ``manifest`` when given (CK304 unless it describes the files), else the one the
    model states carry (a live engine's: it knows the excluded names; CK301 when their copies disagree), else
    the one the files give."""
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
    ignore = NOT_LAYOUT + ("excluded",)  # the files cannot know exclude_frozen_parameters' names, nor the producer
    diff = first_difference(
        {k: v for k, v in derived.items() if k not in ignore},
        {k: v for k, v in doc.items() if k not in ignore},
        lenient=True,
    )
    if diff:
        where, on_disk, in_manifest = diff
        raise EmbedError(
            "CK304",
            f"the manifest does not describe this checkpoint: at {where} the files say {on_disk}, "
            f"the manifest {in_manifest}",
            "embed the manifest of this checkpoint, or omit --manifest to generate it",
            str(tag_dir),
        )
    return doc


def _digested(shards: ShardSet, described: Manifest, doc: dict, states: StateCache) -> tuple[Manifest | None, dict]:
    """For a format 1.1 ``doc``: its model, and the sections whose tensor digests the files give."""
    if version_key(str(doc.get("format_version", "1.0"))) == "1.0":
        return None, {}
    target = from_document(Manifest, doc)
    target.files = describe_files(shards, described.layout.zero_stage, None, states, target)
    add_digests(target, shards.tag_dir)
    return target, {key: target.to_dict()[key] for key in ("groups", "frozen", "buffers")}


def _remove_other_encodings(tag_dir: RemotePath, written: str) -> None:
    """A sidecar of the other encoding: a stale copy once this one is there (the local commit removes it too)."""
    for name in SIDECAR_NAMES.values():
        if name != written and (tag_dir / name).is_file():
            store = store_for(str(tag_dir))
            upload._delete(store, store.key(str(tag_dir / name)))  # its failure: the code, naming the object
