"""Embed a manifest into a DeepSpeed checkpoint directory (finding and comparing the copies it already
carries is ``check/copies.py``).

A tag directory carries its manifest as the sidecar (``ckptspec.json``/``.msgpack``) and
in each model-states file's client state (docs/embedding.md); the file-level readers and
writers are in ``ckptspec.checkpoint.embedded`` and ``ckptspec.checkpoint.pt_rewrite``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from .._commit import commit, recover
from .._fs import exclusive, sweep
from ..checkpoint.embedded import (
    CLIENT_STATE_KEY,
    NOT_LAYOUT,
    agreement_findings,
    as_document,
    client_state_value,
    first_difference,
    read_client_state_copy,
)
from ..checkpoint.pt_rewrite import rewritten_pt
from ..checkpoint.sidecar import sidecar_commit
from ..checkpoint.states import StateCache
from ..errors import CkptspecError, EmbedError, InputOutputError
from ..findings import Finding
from ..format.codec import Encoding
from ..format.models import Manifest
from ..format.tolerant import from_document
from ..format.validate import validate_document
from ..format.version import version_key
from ..location import refuse_write
from .check.recorded import check_records, recorded_manifests
from .describe.digests import add_digests
from .describe.zero import describe_files, manifest_from_states
from .layout.tag_dir import ShardSet, resolve_tag_dir, scan_tag_dir


@dataclass
class EmbedResult:
    manifest: dict  # the complete manifest written as the sidecar
    sidecar: Path
    model_states: list[Path]  # files whose client state now holds the layout manifest
    replaced: list[Finding] = field(default_factory=list)  # rehash: how the files differed from the old record


REHASH_HINT = (
    "restore the files the record describes; if they changed on purpose, record them as they are now with "
    "`ckptspec embed CHECKPOINT --rehash`"
)


def embed_checkpoint(
    checkpoint: str | os.PathLike,
    manifest: Manifest | dict | None = None,
    *,
    tag: str | None = None,
    hash_algorithm: str | None = "sha256",
    encoding: Encoding = "json",
    model_states: bool = True,
    rehash: bool = False,
) -> EmbedResult:
    """Add a manifest to an existing DeepSpeed checkpoint: model-states client state, then the sidecar.

    ``manifest`` (valid, already checked by the caller) is used when given; it must describe
    this checkpoint's layout (CK304 otherwise). Without it the manifest is generated from the
    directory. Every new file (rewritten model states, the sidecar) is written under a
    temporary name, then all are committed together, the sidecar last (``_commit.commit``): a run
    killed at any point leaves the checkpoint as it was, or (rolled forward by the next write
    into the tag directory) complete. A second writer into the same tag directory is refused.
    A checkpoint at a URL is refused (CK916): ckptspec writes only local files.

    What is recorded already (the sidecar, and ``manifest`` when it lists files) is checked against
    the files first, hashes and digests included: on any error ``RecordMismatch`` (exit 1, nothing
    written), unless ``rehash``, which records the files as they are and returns those errors.
    """
    refuse_write(checkpoint, "a manifest (embed rewrites the model states and writes the sidecar)")
    tag_dir = resolve_tag_dir(checkpoint, tag)
    assert isinstance(tag_dir, Path)  # a URL is refused just above: embed writes in a local directory
    given = manifest
    shards = scan_tag_dir(tag_dir)
    states = StateCache()  # each file is read once, here
    described = manifest_from_states(shards, states)
    derived = described.to_dict()
    if manifest is None:
        # A layout the live engine embedded (save_checkpoint) is more exact than what the
        # directory tells (it knows the excluded names): keep it, e.g. to restore a sidecar
        # lost when only the .pt files were copied.
        read = [read_client_state_copy(path, states.state(path)) for _, path in sorted(shards.model_files.items())]
        embedded = [c for c in read if c is not None]
        disagree = agreement_findings(embedded)
        if disagree:
            first = disagree[0]
            raise EmbedError(
                "CK301", f"{Path(first.file or '').name}: {first.path}: {first.message}", first.hint, str(tag_dir)
            )
        if embedded:
            manifest = embedded[0].document
    if manifest is None:
        doc = derived
    else:
        doc = as_document(manifest)
        # The directory cannot know the names exclude_frozen_parameters dropped, nor who produced it.
        ignore = NOT_LAYOUT + ("excluded",)
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
    with exclusive(tag_dir):
        recover(tag_dir)  # a killed embed's half-finished commit: finish it first
        sweep(tag_dir)
        records = recorded_manifests(tag_dir, given)
        replaced = check_records(tag_dir, records, states, rehash=rehash, hint=REHASH_HINT)
        target, digested = _digested(shards, described, doc, states) if hash_algorithm else (None, {})
        if target is None and version_key(str(doc.get("format_version", "1.0"))) != "1.0":
            target = from_document(Manifest, doc)
        renames: list[tuple[Path, Path]] = []
        try:
            if model_states:
                value = client_state_value(doc)
                for _, path in sorted(shards.model_files.items()):
                    assert isinstance(path, Path)  # in the local tag directory
                    tmp = rewritten_pt(path, CLIENT_STATE_KEY, value, state=states.state(path), read_back=states)
                    if tmp is not None:
                        renames.append((tmp, path))
            stage = described.layout.zero_stage
            complete = {**doc, **digested, "files": _described(shards, stage, hash_algorithm, states, renames, target)}
            report = validate_document(complete)
            if not report.ok:
                first = next(f for f in report.findings if f.severity == "error")
                raise EmbedError(
                    "CK304",
                    f"the completed manifest is not valid: {first.path}: {first.code} {first.message}",
                    "check the manifest with `ckptspec validate`",
                    str(tag_dir),
                )
            sidecar_renames, removals = sidecar_commit(tag_dir, complete, encoding)
        except BaseException as exc:
            for tmp, _ in renames:
                tmp.unlink(missing_ok=True)
            if isinstance(exc, OSError):
                raise _write_failed(exc, tag_dir) from None
            raise
        try:  # model states first, the sidecar last: it marks the checkpoint complete
            commit(tag_dir, renames + sidecar_renames, removals)
        except OSError as exc:
            raise _write_failed(exc, tag_dir) from None
    return EmbedResult(complete, sidecar_renames[0][1], [final for _, final in renames], replaced)


def _write_failed(exc: OSError, tag_dir: Path) -> CkptspecError:
    return InputOutputError(
        "CK906",
        f"cannot write: {exc.strerror or exc}",
        "check free space and permissions; an interrupted embed is finished by the next one",
        str(tag_dir),
    )


def _digested(shards: ShardSet, described: Manifest, doc: dict, states: StateCache) -> tuple[Manifest | None, dict]:
    """For a format 1.1 ``doc``: its model, and the sections whose tensor digests the files give
    (read from the files as they are: embedding moves bytes, it does not change them)."""
    if version_key(str(doc.get("format_version", "1.0"))) == "1.0":
        return None, {}
    target = from_document(Manifest, doc)
    target.files = describe_files(shards, described.layout.zero_stage, None, states, target)
    add_digests(target, shards.tag_dir)
    return target, {key: target.to_dict()[key] for key in ("groups", "frozen", "buffers")}


def _described(shards, stage: int, hash_algorithm, states: StateCache, renames, target: Manifest | None) -> list:
    """The file list as it will be once ``renames`` are committed: a rewritten model-states file
    is described from its temporary (size, hash, format 1.1's locators: every member moved), under
    its own name; the optimizer files did not change and are described from the states already read."""
    # the temporary's name under the final's parent as given (the temporary's own path may be absolute)
    temporary = {final: final.with_name(tmp.name) for tmp, final in renames}
    future = ShardSet(shards.tag_dir, dict(shards.model_files), dict(shards.optim_files), list(shards.other_files))
    future.model_files = {rank: temporary.get(path, path) for rank, path in shards.model_files.items()}
    files = describe_files(future, stage, hash_algorithm, states, target)
    names = {tmp.name: final.name for tmp, final in renames}
    for entry in files:
        entry.path = names.get(entry.path, entry.path)
    return [f.model_dump(mode="json", exclude_unset=True) for f in files]
