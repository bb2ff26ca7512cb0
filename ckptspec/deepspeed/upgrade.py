"""Fill format 1.1's fields of a manifest from the checkpoint it describes (``ckptspec migrate --checkpoint``).

A 1.0 manifest migrated to 1.1 is a valid 1.1 document without any of 1.1's fields: the
locators, optimizer scalars, counters and digests are in the checkpoint's files. This reads
them there (``describe.manifest_from_states``, the directory producer), after checking that the
manifest describes these very files (CK304 otherwise), and adds them to the document: its own
fields are kept (its producer, its excluded names, a file's hash).
"""

from __future__ import annotations

import copy
import os

from ..checkpoint.embedded import NOT_LAYOUT, first_difference
from ..checkpoint.states import StateCache
from ..errors import EmbedError
from ..format.models import Manifest
from ..format.tolerant import from_document
from .check.recorded import check_records
from .describe.digests import add_digests
from .describe.zero import manifest_from_states
from .layout.tag_dir import resolve_tag_dir, scan_tag_dir

_CHANGED_HINT = "restore the files the manifest records, or migrate without --checkpoint (no 1.1 field is filled)"

# A file entry as the document and the directory must both see it.
_FILE_IDENTITY = ("path", "role", "ranks", "size", "partitions")


def fill_from_checkpoint(doc: dict, checkpoint: str | os.PathLike, tag: str | None = None) -> dict:
    """A copy of the (valid, format 1.1) ``doc`` with every 1.1 field the checkpoint's files give.

    Digests are added when ``doc`` records file hashes (it was made with ``--hash``: reading every
    byte was wanted). Raises ``EmbedError`` (CK304) when ``doc`` does not describe the checkpoint.
    """
    tag_dir = resolve_tag_dir(checkpoint, tag)
    states = StateCache()
    found = manifest_from_states(scan_tag_dir(tag_dir), states)
    derived = found.to_dict()
    ignore = NOT_LAYOUT + ("excluded",)
    diff = first_difference(
        {k: v for k, v in derived.items() if k not in ignore},
        {k: v for k, v in doc.items() if k not in ignore},
        lenient=True,
    )
    if diff is None and doc.get("files"):
        files_here = [{k: f.get(k) for k in _FILE_IDENTITY} for f in derived["files"]]
        files_doc = [{k: f.get(k) for k in _FILE_IDENTITY} for f in doc["files"]]
        diff = first_difference(files_here, files_doc)
        diff = diff and (f"$.files{diff[0][1:]}", diff[1], diff[2])
    if diff:
        path, here, given = diff
        raise EmbedError(
            "CK304",
            f"the manifest does not describe this checkpoint: at {path} the files say {here}, the manifest {given}",
            "migrate the manifest of this checkpoint, or omit --checkpoint (the result then has no 1.1 field)",
            str(tag_dir),
        )
    if any("hash" in f for f in doc.get("files", [])):
        # Digests read from files that no longer match the recorded hashes would vouch for the change.
        recorded = from_document(Manifest, doc)
        check_records(tag_dir, [("the manifest", recorded)], states, rehash=False, hint=_CHANGED_HINT)
        add_digests(found, tag_dir)
        derived = found.to_dict()
    out = copy.deepcopy(doc)
    out["layout"]["byte_order"] = derived["layout"]["byte_order"]
    for key in ("optimizer", "save"):
        if key in derived:
            out[key] = derived[key]
    for section in ("groups", "frozen", "buffers"):
        for mine, theirs in _pairs(out[section], derived[section], section):
            for key in ("digest", "model_digest", "state_digests"):
                if key in theirs:
                    mine[key] = theirs[key]
    by_path = {f["path"]: f for f in derived["files"]}
    files = out["files"] or [
        {k: v for k, v in f.items() if k not in ("tensors", "model_weights", "state_partitions")}
        for f in derived["files"]
    ]
    for f in files:
        for key in ("tensors", "model_weights", "state_partitions"):
            if key in by_path.get(f["path"], {}):
                f[key] = by_path[f["path"]][key]
    out["files"] = files
    return out


def _pairs(mine: list, theirs: list, section: str):
    """Matching entries of a section (the layouts agreed, so they pair up in order)."""
    if section == "groups":
        for a, b in zip(mine, theirs):
            yield from zip(a["params"], b["params"])
    else:
        yield from zip(mine, theirs)
