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
from typing import TYPE_CHECKING

from .._commit import commit, recover
from .._fs import exclusive, sweep
from ..checkpoint.embedded import (
    CLIENT_STATE_KEY,
    client_state_value,
)
from ..checkpoint.pt_rewrite import rewritten_pt
from ..checkpoint.sidecar import sidecar_commit
from ..checkpoint.states import StateCache
from ..findings import Finding
from ..format.codec import Encoding
from ..format.models import Manifest
from ..location import is_remote
from .check.recorded import check_records, recorded_manifests
from .describe.zero import describe_files, manifest_from_states
from .embed_index import refuse_model_states, write_index_sidecar
from .embed_steps import REHASH_HINT, check_completed, digested_sections, embedded_document, write_failed
from .kinds import needs_index
from .layout.tag_dir import ShardSet, resolve_tag_dir, scan_tag_dir

if TYPE_CHECKING:
    from .embed_url import SidecarUploaded


@dataclass
class EmbedResult:
    manifest: dict  # the complete manifest (or checkpoint index) written as the sidecar
    sidecar: Path
    model_states: list[Path]  # files whose client state now holds the layout manifest
    replaced: list[Finding] = field(default_factory=list)  # rehash: how the files differed from the old record


def embed_checkpoint(
    checkpoint: str | os.PathLike,
    manifest: Manifest | dict | None = None,
    *,
    tag: str | None = None,
    hash_algorithm: str | None = "sha256",
    encoding: Encoding = "json",
    model_states: bool = True,
    rehash: bool = False,
) -> EmbedResult | SidecarUploaded:
    """Add a manifest to an existing DeepSpeed checkpoint: model-states client state, then the sidecar.

    A checkpoint a checkpoint index describes (tensor/pipeline parallel, MoE, stage 0) gets its index as the sidecar
    only (``embed_index.py``; ``model_states`` is refused for it, CK202); ``manifest`` may then be its index.

    ``manifest`` (valid, already checked by the caller) is used when given; it must describe
    this checkpoint's layout (CK304 otherwise). Without it the manifest is generated from the
    directory. Every new file (rewritten model states, the sidecar) is written under a
    temporary name, then all are committed together, the sidecar last (``_commit.commit``): a run
    killed at any point leaves the checkpoint as it was, or (rolled forward by the next write
    into the tag directory) complete. A second writer into the same tag directory is refused.
    A checkpoint at an object store's URL gets its sidecar only (``model_states=False``; CK916 otherwise, and for
    HTTP): ``embed_url.embed_at_url``, uploaded last as one verified object.

    What is recorded already (the sidecar, and ``manifest`` when it lists files) is checked against
    the files first, hashes and digests included: on any error ``RecordMismatch`` (exit 1, nothing
    written), unless ``rehash``, which records the files as they are and returns those errors.
    """
    if is_remote(checkpoint):
        from .embed_url import embed_at_url  # it uses this module's steps

        return embed_at_url(
            str(checkpoint),
            manifest,
            tag=tag,
            hash_algorithm=hash_algorithm,
            encoding=encoding,
            model_states=model_states,
            rehash=rehash,
        )
    tag_dir = resolve_tag_dir(checkpoint, tag)
    assert isinstance(tag_dir, Path)  # a URL went to embed_at_url just above
    if needs_index(tag_dir):  # tensor/pipeline parallel, MoE, stage 0: its checkpoint index, as the sidecar only
        if model_states:
            raise refuse_model_states(tag_dir, str(checkpoint))
        index, sidecar, replaced = write_index_sidecar(tag_dir, manifest, hash_algorithm, encoding, rehash)
        return EmbedResult(index, sidecar, [], replaced)
    given = manifest
    shards = scan_tag_dir(tag_dir)
    states = StateCache()  # each file is read once, here
    described = manifest_from_states(shards, states)
    doc = embedded_document(shards, states, described, manifest, tag_dir)
    with exclusive(tag_dir):
        recover(tag_dir)  # a killed embed's half-finished commit: finish it first
        sweep(tag_dir)
        records = recorded_manifests(tag_dir, given)
        replaced = check_records(tag_dir, records, states, rehash=rehash, hint=REHASH_HINT)
        target, digested = digested_sections(shards, described, doc, states, hash_algorithm)
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
            check_completed(complete, tag_dir)
            sidecar_renames, removals = sidecar_commit(tag_dir, complete, encoding)
        except BaseException as exc:
            for tmp, _ in renames:
                tmp.unlink(missing_ok=True)
            if isinstance(exc, OSError):
                raise write_failed(exc, tag_dir) from None
            raise
        try:  # model states first, the sidecar last: it marks the checkpoint complete
            commit(tag_dir, renames + sidecar_renames, removals)
        except OSError as exc:
            raise write_failed(exc, tag_dir) from None
    return EmbedResult(complete, sidecar_renames[0][1], [final for _, final in renames], replaced)


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
