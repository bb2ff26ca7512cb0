"""Manifests that travel with their checkpoint: where copies live, how to read and write them.

A checkpoint can carry its manifest in three places (docs/embedding.md):

* the **sidecar** ``ckptspec.json`` (or ``ckptspec.msgpack``) in the tag directory: the
  complete manifest, ``files`` included (sizes, hashes, locators). It is written last
  and atomically, so its presence marks a complete checkpoint;
* the **client state** of DeepSpeed's model-states file(s): key ``ckptspec_manifest``,
  a JSON string holding the layout manifest (``files`` is ``[]``: a file cannot record
  its own size or hash). It survives when only the ``.pt`` files are copied, and the
  restricted unpickler reads it as a plain ``str``;
* the output of ``ckptspec reconstruct``: key ``ckptspec.manifest``, the compact canonical JSON
  text of the source checkpoint's manifest, next to ``ckptspec.manifest_sha256``, the SHA-256 of
  that text; in the single file's ``__metadata__``, or in the index's ``metadata`` of a sharded
  output (each shard then records the SHA-256 and ``ckptspec.manifest_in``, the index's name).

Copies **agree** when their layout parts are equal: everything except ``producer``,
``files`` (what the files are), ``save`` and ``optimizer`` (what this save is: counters, save
id, steps; CK223 checks them against the files), and format 1.1's tensor digests (computed
from the files after they were written: the copy inside a file cannot have them).
Disagreeing copies are ``CK301``.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from ..errors import CkptspecError, EmbedError, InputOutputError
from ..findings import Finding, finding, json_path
from ..format.codec import decode, dumps, load_document
from ..location import AnyPath, RemotePath, location, not_found, open_binary
from .sidecar import SIDECAR_NAMES
from .states import read_state

if TYPE_CHECKING:
    from ..format.index_models import CheckpointIndex
    from ..format.models import Manifest

CLIENT_STATE_KEY = "ckptspec_manifest"
SAFETENSORS_KEY = "ckptspec.manifest"
SAFETENSORS_SHA256_KEY = "ckptspec.manifest_sha256"
SAFETENSORS_WITHIN_KEY = "ckptspec.manifest_in"  # a shard of a sharded output: the index holds the manifest
NOT_LAYOUT = ("producer", "files", "save", "optimizer")  # the parts of a manifest copies may differ in
DIGEST_KEYS = ("digest", "model_digest", "state_digests")  # format 1.1's per-tensor digests
SAFETENSORS_MAX_HEADER = 100 * 1024 * 1024  # the safetensors library's own limit

Kind = Literal["sidecar", "client_state", "safetensors", "index", "manifest_file"]
_PREFERENCE = {"sidecar": 0, "manifest_file": 1, "index": 2, "safetensors": 2, "client_state": 3}
_KIND_NAMES = {
    "sidecar": "sidecar",
    "manifest_file": "manifest file",
    "safetensors": "safetensors __metadata__ copy",
    "index": "index metadata copy",
    "client_state": "client-state copy",
}


@dataclass
class EmbeddedCopy:
    """One copy of a manifest found in or next to a checkpoint."""

    source: str  # the file it was read from
    kind: Kind
    document: Any  # the decoded manifest (plain data, not validated)

    @property
    def complete(self) -> bool:
        return isinstance(self.document, dict) and bool(self.document.get("files"))


# --------------------------------------------------------------------------- the values written


def as_document(manifest: Manifest | CheckpointIndex | dict) -> dict:
    """A manifest (or checkpoint index) as a plain document (a copy: the caller may change it)."""
    return copy.deepcopy(manifest) if isinstance(manifest, dict) else manifest.to_dict()


def layout_document(manifest: Manifest | dict) -> dict:
    """The manifest without its file list (``files: []``): what a file can carry inside itself."""
    doc = as_document(manifest)
    doc["files"] = []
    return doc


def client_state_value(manifest: Manifest | dict) -> str:
    """The ``client_state[CLIENT_STATE_KEY]`` string: compact canonical JSON of the layout manifest."""
    return dumps(layout_document(manifest), "json", compact=True).decode("utf-8")


def safetensors_metadata(manifest: Manifest | dict) -> dict[str, str]:
    """``__metadata__`` (or index ``metadata``) entries that carry ``manifest``: ``ckptspec.manifest``,
    its compact canonical JSON text, and ``ckptspec.manifest_sha256``, the SHA-256 of that text,
    so either can be checked against the other."""
    data = dumps(manifest, "json", compact=True)
    return {SAFETENSORS_KEY: data.decode("utf-8"), SAFETENSORS_SHA256_KEY: hashlib.sha256(data).hexdigest()}


def pointer_metadata(carried: dict[str, str], within: str) -> dict[str, str]:
    """For a shard of a sharded output: the SHA-256 of the manifest ``carried`` by ``within`` (its index)."""
    return {SAFETENSORS_SHA256_KEY: carried[SAFETENSORS_SHA256_KEY], SAFETENSORS_WITHIN_KEY: within}


# --------------------------------------------------------------------------- agreement


def layout_part(doc: dict) -> dict:
    part = {k: v for k, v in doc.items() if k not in NOT_LAYOUT}
    for section in ("groups", "frozen", "buffers"):
        if isinstance(part.get(section), list):
            part[section] = [_without_digests(item, section) for item in part[section]]
    return part


def _without_digests(item: Any, section: str) -> Any:
    if not isinstance(item, dict):
        return item
    if section == "groups":
        params = item.get("params")
        if isinstance(params, list):
            item = {**item, "params": [_without_digests(p, "params") for p in params]}
        return item
    return {k: v for k, v in item.items() if k not in DIGEST_KEYS}


def _describe(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, ensure_ascii=False, default=repr)
    return text if len(text) <= 80 else text[:77] + "..."


def first_difference(a: Any, b: Any, where: tuple = (), *, lenient: bool = False) -> tuple[str, str, str] | None:
    """The first place two documents differ: (JSON path, value in a, value in b), or None.

    ``lenient`` ignores object keys present on one side only (optional fields one
    producer writes and another does not).
    """
    if isinstance(a, dict) and isinstance(b, dict):
        keys = sorted(a.keys() & b.keys()) if lenient else sorted(a.keys() | b.keys())
        for key in keys:
            if key not in a:
                return json_path(*where, key), "<absent>", _describe(b[key])
            if key not in b:
                return json_path(*where, key), _describe(a[key]), "<absent>"
            found = first_difference(a[key], b[key], where + (key,), lenient=lenient)
            if found:
                return found
        return None
    if isinstance(a, list) and isinstance(b, list):
        for i, (x, y) in enumerate(zip(a, b)):
            found = first_difference(x, y, where + (i,), lenient=lenient)
            if found:
                return found
        if len(a) != len(b):
            return json_path(*where), f"{len(a)} entries", f"{len(b)} entries"
        return None
    numbers = (int, float)
    if a == b and (type(a) is type(b) or (type(a) in numbers and type(b) in numbers)):
        return None  # 3 and 3.0 are the same count (JSON Schema agrees); True and 1 are not
    return json_path(*where), _describe(a), _describe(b)


def agreement_findings(copies: Iterable[EmbeddedCopy]) -> list[Finding]:
    """CK301 for every copy whose layout part differs from the reference copy's.

    The reference is the most complete copy (the sidecar when there is one).
    """
    usable = [c for c in copies if isinstance(c.document, dict)]
    if len(usable) < 2:
        return []
    reference = min(usable, key=lambda c: _PREFERENCE[c.kind])
    findings = []
    for copy_ in usable:
        if copy_ is reference:
            continue
        diff = first_difference(layout_part(reference.document), layout_part(copy_.document))
        if diff:
            path, ours, theirs = diff
            findings.append(
                finding(
                    "CK301",
                    path,
                    f"embedded copies disagree: this {_KIND_NAMES[copy_.kind]} says {theirs}, "
                    f"the {_KIND_NAMES[reference.kind]} {Path(reference.source).name} says {ours}",
                    "copies of a manifest must describe the same layout; re-embed one manifest everywhere with "
                    "`ckptspec embed CHECKPOINT --manifest M`",
                    file=copy_.source,
                )
            )
    return findings


# --------------------------------------------------------------------------- reading copies


def _decode_embedded(value: Any, source: str, what: str) -> Any:
    if not isinstance(value, str):
        raise EmbedError(
            "CK302",
            f"{what} is a {type(value).__name__}, not a JSON string",
            "the key is reserved for ckptspec's manifest; re-embed it with `ckptspec embed`",
            source,
        )
    try:
        doc = decode(value.encode("utf-8"), "json", source)
    except (CkptspecError, UnicodeEncodeError) as exc:
        detail = exc.message if isinstance(exc, CkptspecError) else "not UTF-8 text"
        raise EmbedError(
            "CK302",
            f"{what} is not a manifest document: {detail}",
            "re-embed the manifest with `ckptspec embed`",
            source,
        ) from None
    return _manifest_object(doc, source, what)


def _manifest_object(doc: Any, source: str, what: str) -> dict:
    """A decoded copy must be an object to be a manifest (or to be compared with one): CK302 otherwise."""
    if not isinstance(doc, dict):
        kind = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(doc), "a number")
        raise EmbedError(
            "CK302",
            f"{what} holds {kind}, not a JSON object",
            "re-embed the manifest with `ckptspec embed`",
            source,
        )
    return doc


def read_client_state_copy(path: AnyPath, state: Any = None) -> EmbeddedCopy | None:
    """The manifest in a model-states file's client state, or None when it holds none."""
    if state is None:
        state = read_state(path)
    if not isinstance(state, dict) or CLIENT_STATE_KEY not in state:
        return None
    doc = _decode_embedded(state[CLIENT_STATE_KEY], str(path), f"client state '{CLIENT_STATE_KEY}'")
    return EmbeddedCopy(str(path), "client_state", doc)


def read_safetensors_metadata(path: AnyPath) -> dict[str, str]:
    """The ``__metadata__`` string map of a safetensors file (only the header is read)."""
    name = str(path)
    try:
        with open_binary(path) as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise EmbedError(
                    "CK302",
                    "not a safetensors file: shorter than its 8-byte header length",
                    "pass a .safetensors file",
                    name,
                )
            (length,) = struct.unpack("<Q", head)
            if length > SAFETENSORS_MAX_HEADER or length > fh.seek(0, os.SEEK_END) - 8:
                raise EmbedError(
                    "CK302",
                    f"not a safetensors file: header length {length} is impossible",
                    "pass a .safetensors file",
                    name,
                )
            fh.seek(8)
            raw = fh.read(length)
    except OSError as exc:
        raise InputOutputError(
            "CK901", f"cannot read file: {exc.strerror}", "check the path and permissions", name
        ) from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise EmbedError(
            "CK302", "not a safetensors file: the header is not JSON", "pass a .safetensors file", name
        ) from None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if meta is None:
        return {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise EmbedError(
            "CK302", "__metadata__ is not a map of strings", "the file breaks the safetensors format", name
        )
    return meta


def _manifest_in_metadata(meta: dict, source: str, where: str, expected: str | None = None) -> Any:
    """The manifest a metadata map carries, checked against its SHA-256 (and ``expected``, the
    SHA-256 the shard that pointed here records)."""
    value = meta[SAFETENSORS_KEY]
    actual = hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()
    for want in (meta.get(SAFETENSORS_SHA256_KEY), expected):
        if want is not None and want != actual:
            raise EmbedError(
                "CK302",
                f"'{SAFETENSORS_KEY}' does not match the SHA-256 {want[:16]}... recorded for it",
                "the embedded manifest was altered after it was written; regenerate the output",
                source,
            )
    return _decode_embedded(value, source, f"{where} '{SAFETENSORS_KEY}'")


def read_safetensors_copy(path: AnyPath) -> EmbeddedCopy | None:
    """The manifest a ``reconstruct`` output file carries: in its ``__metadata__``, or (a shard) in
    the index it names."""
    meta = read_safetensors_metadata(path)
    if SAFETENSORS_KEY in meta:
        return EmbeddedCopy(str(path), "safetensors", _manifest_in_metadata(meta, str(path), "__metadata__"))
    within = meta.get(SAFETENSORS_WITHIN_KEY)
    if within is None:
        return None
    if "/" in within or within in ("", ".", ".."):
        raise EmbedError(
            "CK302",
            f"'{SAFETENSORS_WITHIN_KEY}' names {within!r}, not a file beside it",
            "the metadata was altered; regenerate the output",
            str(path),
        )
    index = read_index_copy(location(path).parent / within, expected=meta.get(SAFETENSORS_SHA256_KEY))
    if index is None:
        raise EmbedError(
            "CK302", f"the index {within} it names holds no manifest", "copy the index with its shards", str(path)
        )
    return index


def read_index_copy(path: AnyPath, expected: str | None = None) -> EmbeddedCopy | None:
    """The manifest in the ``metadata`` of a sharded output's index (``*.index.json``)."""
    name = str(path)
    where = location(path)
    try:
        if where.stat().st_size > SAFETENSORS_MAX_HEADER * 3:
            raise EmbedError(
                "CK302", "the index is too large to hold names and a manifest", "pass a ckptspec output", name
            )
        doc = json.loads(where.read_text("utf-8"))
    except FileNotFoundError:
        raise InputOutputError("CK901", "file not found", "copy the index with its shards", name) from None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        raise EmbedError("CK302", "the index is not JSON", "pass the index a ckptspec output wrote", name) from None
    meta = doc.get("metadata") if isinstance(doc, dict) else None
    if not isinstance(meta, dict) or SAFETENSORS_KEY not in meta:
        return None
    return EmbeddedCopy(name, "index", _manifest_in_metadata(meta, name, "index metadata", expected))


def _is_zip(path: Path | RemotePath) -> bool:
    try:
        with open_binary(path) as fh:
            return fh.read(2) == b"PK"
    except OSError:
        return False


def copies_in_file(path: AnyPath) -> list[EmbeddedCopy]:
    """The manifest copies one file holds: a .pt's client state, a safetensors ``__metadata__``,
    or the file itself when it is a manifest (JSON or msgpack)."""
    p = location(path)
    if not p.exists():
        if isinstance(p, RemotePath):
            raise not_found(str(p), "file not found")
        raise InputOutputError("CK901", "file not found", "check the path", str(p))
    suffix = p.suffix.lower()
    if suffix == ".safetensors":
        found = read_safetensors_copy(p)
    elif p.name.endswith(".index.json"):
        found = read_index_copy(p)
    elif suffix in (".pt", ".bin", ".pth") or _is_zip(p):
        found = read_client_state_copy(p)
    else:
        found = read_manifest_copy(p, "sidecar" if p.name in SIDECAR_NAMES.values() else "manifest_file")
    return [found] if found else []


def read_manifest_copy(path: AnyPath, kind: Kind = "manifest_file") -> EmbeddedCopy:
    """A manifest file (or a sidecar given as a file) as a copy: CK302 when it is not an object.
    Bytes that do not decode stay CK903: the file given is not a manifest at all."""
    return EmbeddedCopy(str(path), kind, _manifest_object(load_document(path), str(path), f"the {_KIND_NAMES[kind]}"))


def read_sidecar_copy(path: str | os.PathLike) -> EmbeddedCopy:
    """The sidecar of a checkpoint directory: a part of the checkpoint, so bytes that are not a
    manifest document (empty, truncated, not UTF-8, not an object) make it an unreadable copy, CK302."""
    try:
        return read_manifest_copy(path, "sidecar")
    except CkptspecError as exc:
        if exc.code != "CK903":
            raise
        raise unreadable_sidecar(exc) from None


def unreadable_sidecar(exc: CkptspecError) -> EmbedError:
    """CK302 for a sidecar whose bytes do not decode (``exc``, a CK903 naming it)."""
    return EmbedError(
        "CK302",
        f"the sidecar is not a manifest document: {exc.message}",
        "restore it, or write it again from the checkpoint's files with `ckptspec embed CHECKPOINT --sidecar-only`",
        exc.file,
    )


def best_copy(copies: list[EmbeddedCopy]) -> EmbeddedCopy:
    """The most complete copy: a sidecar, then a manifest file, a safetensors copy, a client state."""
    return min(copies, key=lambda c: (_PREFERENCE[c.kind], not c.complete))
