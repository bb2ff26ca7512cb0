"""``embed --sidecar-only`` of a checkpoint a checkpoint index describes (tensor/pipeline parallel, MoE, ZeRO stage 0,
a universal folder): its index, as ``ckptspec generate`` makes it, written as the sidecar.

The steps are the plain embed's (``embed_steps.py``, ``check/recorded.py``): what the tag records already (its
sidecar, a document given that lists files) is checked against the files first, hashes and digests included
(``RecordMismatch`` unless ``rehash``); a document given must describe this checkpoint (CK304: a format 1.x manifest,
or an index of another layout); the index is validated before it is written. Locally the sidecar is written under a
temporary name and renamed (``sidecar_commit``, under the tag directory's lock); at a URL it is uploaded as one object
(``embed_url.py``). The bytes are the same: one index, one encoder.

The model-states files of these kinds are not rewritten: one layout manifest in each file's client state has no place
for the index of several model-parallel ranks, so ``embed`` without ``--sidecar-only`` is refused by name (CK202).
"""

from __future__ import annotations

from pathlib import Path

from .._commit import commit, recover
from .._fs import exclusive, sweep
from ..checkpoint.embedded import as_document, layout_part
from ..checkpoint.sidecar import sidecar_commit
from ..checkpoint.states import StateCache
from ..errors import UnsupportedCheckpoint
from ..findings import Finding
from ..format.index_models import CheckpointIndex
from ..format.index_validate import is_index
from ..format.models import Manifest
from ..location import RemotePath
from .check.recorded import check_records, recorded_manifests
from .describe import describe_tag_dir
from .embed_steps import REHASH_HINT, another_kind, check_completed, layout_agrees, write_failed
from .kinds import kind_of_dir

Given = Manifest | CheckpointIndex | dict | None

# What the files cannot know (only a live engine does: the save hook's index records it) or what records the files
# rather than the layout: not compared with an index given (tests/deepspeed/test_parallel_hook.py's ENGINE_ONLY).
_NOT_LAYOUT = {
    "": ("producer",),
    "topology": ("ranks", "degrees_source"),
    "domains": ("members",),
    "parameters": ("placement_source",),
    "layer_files": ("size", "hash"),
    "expert_files": ("size", "hash"),
}


def refuse_model_states(tag_dir: Path | RemotePath, checkpoint: str) -> UnsupportedCheckpoint:
    """CK202 for ``embed`` without ``--sidecar-only`` on a checkpoint an index describes."""
    label = kind_of_dir(tag_dir).label
    return UnsupportedCheckpoint(
        "embed writes a layout manifest into the model-states files of a ZeRO data-parallel checkpoint only; a "
        f"{label} checkpoint is described by a checkpoint index, which embed writes as the sidecar",
        f"write the checkpoint index as the sidecar: `ckptspec embed {checkpoint} --sidecar-only` (the model states "
        "keep their bytes)",
        str(tag_dir),
    )


def index_document(tag_dir: Path | RemotePath, states: StateCache, given: Given, hash_algorithm: str | None) -> dict:
    """The index to record: the one ``generate`` makes from the files (with ``hash_algorithm``: file hashes and tensor
    digests), valid (CK304 otherwise). ``given`` must describe the same layout: CK304 naming the first difference, or
    that it is a format 1.x manifest."""
    generated = describe_tag_dir(tag_dir, states, hash_algorithm=hash_algorithm, as_index=True).to_dict()
    if given is not None:
        doc = as_document(given)
        if not is_index(doc):
            label = kind_of_dir(tag_dir).label
            raise another_kind("a format 1.x manifest", f"{label} checkpoint (a checkpoint index)", tag_dir)
        layout_agrees(index_layout(generated), index_layout(doc), tag_dir)
    check_completed(generated, tag_dir)
    return generated


def index_layout(doc: dict) -> dict:
    """``doc`` without ``_NOT_LAYOUT``'s fields, and each domain's manifest without what its copies may differ in."""
    out = {k: v for k, v in doc.items() if k not in _NOT_LAYOUT[""]}
    for section, fields in _NOT_LAYOUT.items():
        value = out.get(section)
        if isinstance(value, dict):
            out[section] = {k: v for k, v in value.items() if k not in fields}
        elif isinstance(value, list):
            out[section] = [
                {k: v for k, v in e.items() if k not in fields} if isinstance(e, dict) else e for e in value
            ]
    for domain in out.get("domains") or []:
        if isinstance(domain, dict) and isinstance(domain.get("manifest"), dict):
            domain["manifest"] = layout_part(domain["manifest"])
    return out


def checked_index(
    tag_dir: Path | RemotePath, given: Given, hash_algorithm: str | None, rehash: bool
) -> tuple[dict, list[Finding]]:
    """For a URL (reads only): the index to upload, and what ``rehash`` re-recorded (``check_records``)."""
    states = StateCache()  # each file is read once, here
    doc = index_document(tag_dir, states, given, hash_algorithm)
    records = recorded_manifests(tag_dir, given)  # type: ignore[arg-type]  # a RemotePath reads as a Path
    return doc, check_records(tag_dir, records, states, rehash=rehash, hint=REHASH_HINT)


def write_index_sidecar(tag_dir: Path, given: Given, hash_algorithm: str | None, encoding, rehash: bool):
    """The local ``embed --sidecar-only`` of an index kind: (index, sidecar path, what ``rehash`` re-recorded). The
    records are checked and the sidecar committed under the tag directory's lock, as the plain embed does."""
    states = StateCache()
    doc = index_document(tag_dir, states, given, hash_algorithm)
    with exclusive(tag_dir):
        recover(tag_dir)  # a killed embed's half-finished commit: finish it first
        sweep(tag_dir)
        replaced = check_records(tag_dir, recorded_manifests(tag_dir, given), states, rehash=rehash, hint=REHASH_HINT)
        try:
            renames, removals = sidecar_commit(tag_dir, doc, encoding)
            commit(tag_dir, renames, removals)
        except OSError as exc:
            raise write_failed(exc, tag_dir) from None
    return doc, renames[0][1], replaced


def files_recorded(doc: dict) -> int:
    """How many files a manifest or an index records (an index: each domain's, the layer and expert files, once)."""
    if not is_index(doc):
        return len(doc.get("files") or [])
    paths = {f["path"] for d in doc["domains"] for f in d["manifest"].get("files", [])}
    paths.update(f["path"] for f in [*doc.get("layer_files", []), *(doc.get("expert_files") or [])])
    return len(paths)
