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

from dataclasses import dataclass, field
from pathlib import Path

from ..checkpoint.sidecar import SIDECAR_NAMES
from ..checkpoint.states import StateCache
from ..errors import RemoteError
from ..findings import Finding
from ..format.codec import Encoding, dumps
from ..format.models import Manifest
from ..location import RemotePath, upload, writable
from ..location.store import store_for
from .check.recorded import check_records, recorded_manifests
from .describe.zero import describe_files, manifest_from_states
from .embed_index import checked_index
from .embed_steps import REHASH_HINT, check_completed, digested_sections, embedded_document
from .kinds import needs_index
from .layout.tag_dir import resolve_tag_dir, scan_tag_dir


@dataclass
class SidecarUploaded:
    manifest: dict  # the complete manifest (or checkpoint index), the sidecar's bytes decoded
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
    assert isinstance(tag_dir, RemotePath)  # embed_checkpoint's dispatch: a remote URL (file:// is its own)
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
    re-recorded (``check_records``): ``embed_checkpoint``'s steps (embed_steps.py), without its rewrites. A checkpoint
    a checkpoint index describes: its index (``embed_index.py``)."""
    if needs_index(tag_dir):
        return checked_index(tag_dir, manifest, hash_algorithm, rehash)
    shards = scan_tag_dir(tag_dir)
    states = StateCache()  # each file is read once, here
    described = manifest_from_states(shards, states)
    doc = embedded_document(shards, states, described, manifest, tag_dir)
    records = recorded_manifests(tag_dir, manifest)  # type: ignore[arg-type]  # a RemotePath reads as a Path
    replaced = check_records(tag_dir, records, states, rehash=rehash, hint=REHASH_HINT)
    target, digested = digested_sections(shards, described, doc, states, hash_algorithm)
    files = describe_files(shards, described.layout.zero_stage, hash_algorithm, states, target)
    complete = {**doc, **digested, "files": [f.model_dump(mode="json", exclude_unset=True) for f in files]}
    check_completed(complete, tag_dir)
    return complete, replaced


def _remove_other_encodings(tag_dir: RemotePath, written: str) -> None:
    """A sidecar of the other encoding: a stale copy once this one is there (the local commit removes it too)."""
    for name in SIDECAR_NAMES.values():
        if name != written and (tag_dir / name).is_file():
            store = store_for(str(tag_dir))
            upload.delete(store, store.key(str(tag_dir / name)))  # its failure: the code, naming the object
