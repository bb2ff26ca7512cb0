"""Manifests that travel with their checkpoint: where copies live, how to read and write them.

A checkpoint can carry its manifest in three places (docs/embedding.md):

* the **sidecar** ``ckptspec.json`` (or ``ckptspec.msgpack``) in the tag directory: the
  complete manifest, ``files`` included (sizes, hashes, locators). It is written last
  and atomically, so its presence marks a complete checkpoint;
* the **client state** of DeepSpeed's model-states file(s): key ``ckptspec_manifest``,
  a JSON string holding the layout manifest (``files`` is ``[]``: a file cannot record
  its own size or hash). It survives when only the ``.pt`` files are copied, and the
  restricted unpickler reads it as a plain ``str``;
* the ``__metadata__`` of safetensors files written by ``ckptspec reconstruct``: key
  ``ckptspec.manifest``, the canonical JSON text of the source checkpoint's manifest
  (the exact bytes of its ``ckptspec.json``), next to ``ckptspec.manifest_sha256``,
  the SHA-256 of those bytes.

Copies **agree** when their layout parts are equal: everything except ``producer``
and ``files``. Disagreeing copies are ``CK301``.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Literal

from .states import StateCache, read_state
from .._fs import atomic_output, write_atomic
from ..format.codec import Encoding, dumps
from ..errors import CkptspecError, EmbedError, InvalidCheckpoint
from ..findings import Finding, finding, json_path
from ..format.codec import decode, load_document
from ..format.models import Manifest

SIDECAR_NAMES: dict[str, str] = {"json": "ckptspec.json", "msgpack": "ckptspec.msgpack"}
CLIENT_STATE_KEY = "ckptspec_manifest"
SAFETENSORS_KEY = "ckptspec.manifest"
SAFETENSORS_SHA256_KEY = "ckptspec.manifest_sha256"
NOT_LAYOUT = ("producer", "files")  # the parts of a manifest copies may differ in
SAFETENSORS_MAX_HEADER = 100 * 1024 * 1024  # the safetensors library's own limit
ZIP_ALIGNMENT = 64  # torch.save aligns every record's data to 64 bytes

Kind = Literal["sidecar", "client_state", "safetensors", "manifest_file"]
_PREFERENCE = {"sidecar": 0, "manifest_file": 1, "safetensors": 2, "client_state": 3}
_KIND_NAMES = {"sidecar": "sidecar", "manifest_file": "manifest file", "safetensors": "safetensors __metadata__ copy",
               "client_state": "client-state copy"}


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


def _as_doc(manifest: Manifest | dict) -> dict:
    return manifest.to_dict() if isinstance(manifest, Manifest) else copy.deepcopy(manifest)


def layout_document(manifest: Manifest | dict) -> dict:
    """The manifest without its file list (``files: []``): what a file can carry inside itself."""
    doc = _as_doc(manifest)
    doc["files"] = []
    return doc


def client_state_value(manifest: Manifest | dict) -> str:
    """The ``client_state[CLIENT_STATE_KEY]`` string: compact canonical JSON of the layout manifest."""
    return dumps(layout_document(manifest), "json", compact=True).decode("utf-8")


def safetensors_metadata(manifest: Manifest | dict) -> dict[str, str]:
    """``__metadata__`` entries that embed ``manifest`` in a safetensors file.

    ``ckptspec.manifest`` is the canonical JSON text (``ckptspec generate``'s bytes) and
    ``ckptspec.manifest_sha256`` its SHA-256, so either can be checked against the other.
    """
    data = dumps(manifest, "json")
    return {SAFETENSORS_KEY: data.decode("utf-8"), SAFETENSORS_SHA256_KEY: hashlib.sha256(data).hexdigest()}


# --------------------------------------------------------------------------- agreement


def layout_part(doc: dict) -> dict:
    return {k: v for k, v in doc.items() if k not in NOT_LAYOUT}


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
            findings.append(finding(
                "CK301", path,
                f"embedded copies disagree: this {_KIND_NAMES[copy_.kind]} says {theirs}, "
                f"the {_KIND_NAMES[reference.kind]} {Path(reference.source).name} says {ours}",
                "copies of a manifest must describe the same layout; re-embed one manifest everywhere with "
                "`ckptspec embed CHECKPOINT --manifest M`",
                file=copy_.source,
            ))
    return findings


# --------------------------------------------------------------------------- reading copies


def _decode_embedded(value: Any, source: str, what: str) -> Any:
    if not isinstance(value, str):
        raise EmbedError("CK302", f"{what} is a {type(value).__name__}, not a JSON string",
                         "the key is reserved for ckptspec's manifest; re-embed it with `ckptspec embed`", source)
    try:
        doc = decode(value.encode("utf-8"), "json", source)
    except (CkptspecError, UnicodeEncodeError) as exc:
        detail = exc.message if isinstance(exc, CkptspecError) else "not UTF-8 text"
        raise EmbedError("CK302", f"{what} is not a manifest document: {detail}",
                         "re-embed the manifest with `ckptspec embed`", source) from None
    if not isinstance(doc, dict):
        raise EmbedError("CK302", f"{what} holds a JSON {type(doc).__name__}, not an object",
                         "re-embed the manifest with `ckptspec embed`", source)
    return doc


def read_client_state_copy(path: str | os.PathLike, state: Any = None) -> EmbeddedCopy | None:
    """The manifest in a model-states file's client state, or None when it holds none."""
    if state is None:
        state = read_state(path)
    if not isinstance(state, dict) or CLIENT_STATE_KEY not in state:
        return None
    doc = _decode_embedded(state[CLIENT_STATE_KEY], str(path), f"client state '{CLIENT_STATE_KEY}'")
    return EmbeddedCopy(str(path), "client_state", doc)


def read_safetensors_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The ``__metadata__`` string map of a safetensors file (only the header is read)."""
    name = str(path)
    try:
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise EmbedError("CK302", "not a safetensors file: shorter than its 8-byte header length",
                                 "pass a .safetensors file", name)
            (length,) = struct.unpack("<Q", head)
            if length > SAFETENSORS_MAX_HEADER or length > os.fstat(fh.fileno()).st_size - 8:
                raise EmbedError("CK302", f"not a safetensors file: header length {length} is impossible",
                                 "pass a .safetensors file", name)
            raw = fh.read(length)
    except OSError as exc:
        raise CkptspecError("CK901", f"cannot read file: {exc.strerror}", "check the path and permissions", name) from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise EmbedError("CK302", "not a safetensors file: the header is not JSON", "pass a .safetensors file", name) from None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if meta is None:
        return {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise EmbedError("CK302", "__metadata__ is not a map of strings", "the file breaks the safetensors format", name)
    return meta


def read_safetensors_copy(path: str | os.PathLike) -> EmbeddedCopy | None:
    meta = read_safetensors_metadata(path)
    if SAFETENSORS_KEY not in meta:
        return None
    value = meta[SAFETENSORS_KEY]
    expected = meta.get(SAFETENSORS_SHA256_KEY)
    if expected is not None and hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest() != expected:
        raise EmbedError("CK302", f"'{SAFETENSORS_KEY}' does not match its '{SAFETENSORS_SHA256_KEY}'",
                         "the embedded manifest was altered after it was written; regenerate the file", str(path))
    return EmbeddedCopy(str(path), "safetensors", _decode_embedded(value, str(path), f"__metadata__ '{SAFETENSORS_KEY}'"))


def _is_zip(path: Path) -> bool:
    try:
        with open(path, "rb") as fh:
            return fh.read(2) == b"PK"
    except OSError:
        return False


def copies_in_file(path: str | os.PathLike) -> list[EmbeddedCopy]:
    """The manifest copies one file holds: a .pt's client state, a safetensors ``__metadata__``,
    or the file itself when it is a manifest (JSON or msgpack)."""
    p = Path(path)
    if not p.exists():
        raise CkptspecError("CK901", "file not found", "check the path", str(p))
    suffix = p.suffix.lower()
    if suffix == ".safetensors":
        found = read_safetensors_copy(p)
    elif suffix in (".pt", ".bin", ".pth") or _is_zip(p):
        found = read_client_state_copy(p)
    else:
        kind: Kind = "sidecar" if p.name in SIDECAR_NAMES.values() else "manifest_file"
        found = EmbeddedCopy(str(p), kind, load_document(p))
    return [found] if found else []


def find_sidecars(tag_dir: Path) -> list[Path]:
    return [tag_dir / name for name in SIDECAR_NAMES.values() if (tag_dir / name).is_file()]


def copies_in_dir(directory: str | os.PathLike, tag: str | None = None,
                  errors: list[CkptspecError] | None = None, states: StateCache | None = None) -> list[EmbeddedCopy]:
    """Every manifest copy of a checkpoint directory (or of a directory of safetensors files).

    A DeepSpeed save or tag directory: its sidecar(s) and each model-states file's client
    state. Any other directory: its sidecar(s) and the ``__metadata__`` of its ``*.safetensors``.
    With ``errors``, a file that cannot be read is appended there and skipped instead of raising.
    ``states``: model states already read (and where the ones read here are kept).
    """
    from ..deepspeed.describe import MODEL_RE, resolve_tag_dir

    root = Path(directory)
    try:
        tag_dir = resolve_tag_dir(root, tag)
    except InvalidCheckpoint:
        if tag is not None or not root.is_dir():
            raise
        tag_dir = None
    where = tag_dir or root
    candidates: list[tuple[Path, Any]] = [(p, lambda p: [EmbeddedCopy(str(p), "sidecar", load_document(p))])
                                          for p in find_sidecars(where)]
    if tag_dir is not None:
        models = sorted((p for p in tag_dir.iterdir() if p.is_file() and MODEL_RE.match(p.name)), key=lambda p: _rank_order(p.name))
        cache = states if states is not None else StateCache()
        candidates += [(p, lambda p: [c for c in [read_client_state_copy(p, cache.state(p))] if c]) for p in models]
    else:
        candidates += [(p, lambda p: [c for c in [read_safetensors_copy(p)] if c]) for p in sorted(root.glob("*.safetensors"))]
    copies: list[EmbeddedCopy] = []
    for path, read in candidates:
        try:
            copies += read(path)
        except CkptspecError as exc:
            if errors is None:
                raise
            errors.append(exc)
    return copies


def _rank_order(name: str) -> tuple:
    from ..deepspeed.describe import MODEL_RE

    m = MODEL_RE.match(name)
    return (0, int(m.group(1) or 0)) if m else (1, name)


def find_copies(target: str | os.PathLike, tag: str | None = None) -> list[EmbeddedCopy]:
    p = Path(target)
    if not p.exists():
        raise CkptspecError("CK901", "file or directory not found", "check the path", str(p))
    return copies_in_dir(p, tag) if p.is_dir() else copies_in_file(p)


def best_copy(copies: list[EmbeddedCopy]) -> EmbeddedCopy:
    """The most complete copy: a sidecar, then a manifest file, a safetensors copy, a client state."""
    return min(copies, key=lambda c: (_PREFERENCE[c.kind], not c.complete))


def embedded_findings(checkpoint: str | os.PathLike, tag: str | None = None,
                      states: StateCache | None = None) -> list[Finding]:
    """For validation: CK302 for an embedded copy that cannot be read, CK301 for copies that disagree.

    Files that cannot be read at all (CK204, CK205, CK9xx) are skipped: the shard checks
    report them. ``states`` as for ``copies_in_dir``.
    """
    errors: list[CkptspecError] = []
    copies = copies_in_dir(checkpoint, tag, errors, states) if Path(checkpoint).is_dir() else find_copies(checkpoint, tag)
    findings = [finding(e.code, "$", e.message, e.hint, file=e.file)
                for e in errors if e.code == "CK302"]
    return findings + agreement_findings(copies)


# --------------------------------------------------------------------------- writing copies


def write_sidecar(tag_dir: str | os.PathLike, manifest: Manifest | dict, encoding: Encoding = "json") -> Path:
    """Write the complete manifest next to the shards, atomically; remove a sidecar of the
    other encoding first so that no stale copy remains."""
    tag_dir = Path(tag_dir)
    target = tag_dir / SIDECAR_NAMES[encoding]
    data = dumps(manifest, encoding)
    try:
        for other in SIDECAR_NAMES.values():
            if other != target.name:
                (tag_dir / other).unlink(missing_ok=True)
        write_atomic(target, data)
    except OSError as exc:
        raise CkptspecError("CK906", f"cannot write the sidecar: {exc.strerror}",
                            "check that the tag directory is writable and the sidecar name is free", str(target)) from None
    return target


# A torch.save pickle (protocol 2) of a dict ends with the dict on the stack and STOP.
_PROTO, _STOP, _SETITEM, _BINUNICODE = 0x80, b".", b"s", b"X"


def _binunicode(text: str) -> bytes:
    data = text.encode("utf-8")
    return _BINUNICODE + struct.pack("<I", len(data)) + data


def _pickle_with_item(data: bytes, key: str, value: str, source: str) -> bytes:
    """``data`` (a pickled dict) with ``dict[key] = value`` appended before STOP.

    Nothing is unpickled or re-pickled: the original bytes stay as they are, so objects
    ckptspec does not know are preserved exactly. Protocols 4+ use framing, which this
    simple append would break; torch.save writes protocol 2.
    """
    if len(data) < 3 or data[0] != _PROTO or data[1] not in (2, 3) or data[-1:] != _STOP:
        raise EmbedError("CK305", f"data.pkl is not a protocol-2/3 pickle ending in STOP (starts {data[:2].hex()})",
                         "ckptspec embeds only into files written by torch.save with its default protocol", source)
    if len(value.encode("utf-8")) >= 2**32:
        raise EmbedError("CK305", "the manifest is too large for a pickle string", "embed the sidecar only", source)
    return data[:-1] + _binunicode(key) + _binunicode(value) + _SETITEM + _STOP


def _padding_extra(offset_of_header: int, name: bytes, zip64: bool) -> bytes:
    """An 'FB' extra field (as torch.save writes it) that puts the member's data at a
    multiple of ZIP_ALIGNMENT."""
    start = offset_of_header + 30 + len(name) + 4 + (20 if zip64 else 0)
    pad = -start % ZIP_ALIGNMENT
    return b"FB" + struct.pack("<H", pad) + b"Z" * pad


def rewrite_pt_with_item(path: str | os.PathLike, key: str, value: str) -> None:
    """Add ``key: value`` to the top-level dict of a torch zip file, atomically.

    Every other record is copied byte for byte (stored, 64-byte aligned like torch.save
    writes them), in its order and with its archive name; only ``data.pkl`` changes.
    The result is read back with the restricted unpickler before it replaces ``path``.
    """
    path = Path(path)
    source = str(path)
    state = read_state(path)
    if not isinstance(state, dict):
        raise EmbedError("CK305", f"the file holds a {type(state).__name__}, not a dict", "only DeepSpeed model states can carry a manifest", source)
    if state.get(key) == value:
        return  # already there
    with zipfile.ZipFile(path) as zin:
        infos = zin.infolist()
        prefix = infos[0].filename.split("/", 1)[0]
        pkl_name = f"{prefix}/data.pkl"
        for info in infos:
            if info.compress_type != zipfile.ZIP_STORED:
                raise EmbedError("CK305", f"record {info.filename} is compressed", "torch.save writes stored records only", source)
        new_pkl = _pickle_with_item(zin.read(pkl_name), key, value, source)
        try:
            with atomic_output(path) as fh:
                with zipfile.ZipFile(fh, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zout:
                    for info in infos:
                        size = len(new_pkl) if info.filename == pkl_name else info.file_size
                        out = zipfile.ZipInfo(info.filename, date_time=info.date_time)
                        out.compress_type = zipfile.ZIP_STORED
                        out.file_size = size
                        out.external_attr = info.external_attr
                        zip64 = size * 1.05 > zipfile.ZIP64_LIMIT  # zipfile's own rule when the size is known
                        out.extra = _padding_extra(fh.tell(), out.filename.encode("utf-8"), zip64)
                        with zout.open(out, "w", force_zip64=zip64) as writer:
                            if info.filename == pkl_name:
                                writer.write(new_pkl)
                            else:
                                with zin.open(info) as reader:
                                    while chunk := reader.read(1 << 20):
                                        writer.write(chunk)
                fh.flush()
                _check_rewritten(fh, state, key, value, source)
        except OSError as exc:
            raise CkptspecError("CK906", f"cannot write: {exc.strerror}", "check free space and permissions", source) from None


def _check_rewritten(fh, before: dict, key: str, value: str, source: str) -> None:
    path = Path(fh.name)
    read_back = StateCache()
    try:
        after, locations = read_back.state(path), read_back.members(path)
    except InvalidCheckpoint:
        after = locations = None
    expected_keys = list(before) + ([key] if key not in before else [])
    if not isinstance(after, dict) or list(after) != expected_keys or after.get(key) != value:
        raise EmbedError("CK305", "the rewritten file does not read back as the original plus the manifest",
                         "please report this ckptspec bug; the original file was left untouched", source)
    misaligned = [m for m, (offset, _) in locations.items() if "/data/" in m and offset % ZIP_ALIGNMENT]
    if misaligned:
        raise EmbedError("CK305", f"record {misaligned[0]} is not {ZIP_ALIGNMENT}-byte aligned after rewriting",
                         "please report this ckptspec bug; the original file was left untouched", source)


# --------------------------------------------------------------------------- embedding into a checkpoint


@dataclass
class EmbedResult:
    manifest: dict  # the complete manifest written as the sidecar
    sidecar: Path
    model_states: list[Path]  # files whose client state now holds the layout manifest


def embed_checkpoint(checkpoint: str | os.PathLike, manifest: Manifest | dict | None = None, *, tag: str | None = None,
                     hash_algorithm: str | None = "sha256", encoding: Encoding = "json",
                     model_states: bool = True) -> EmbedResult:
    """Add a manifest to an existing DeepSpeed checkpoint: model-states client state, then the sidecar.

    ``manifest`` (valid, already checked by the caller) is used when given; it must describe
    this checkpoint's layout (CK304 otherwise). Without it the manifest is generated from the
    directory. The old sidecar is removed first and the new one written last, so the
    checkpoint is marked complete only once every file is final.
    """
    from ..deepspeed.describe import manifest_from_checkpoint, resolve_tag_dir, scan_tag_dir

    tag_dir = resolve_tag_dir(checkpoint, tag)
    shards = scan_tag_dir(tag_dir)
    derived = manifest_from_checkpoint(tag_dir).to_dict()
    if manifest is None:
        # A layout the live engine embedded (save_checkpoint) is more exact than what the
        # directory tells (it knows the excluded names): keep it, e.g. to restore a sidecar
        # lost when only the .pt files were copied.
        embedded = [read_client_state_copy(path) for _, path in sorted(shards.model_files.items())]
        embedded = [c for c in embedded if c is not None]
        disagree = agreement_findings(embedded)
        if disagree:
            first = disagree[0]
            raise EmbedError("CK301", f"{Path(first.file).name}: {first.path}: {first.message}", first.hint, str(tag_dir))
        if embedded:
            manifest = embedded[0].document
    if manifest is None:
        doc = derived
    else:
        doc = _as_doc(manifest)
        # The directory cannot know the names exclude_frozen_parameters dropped, nor who produced it.
        ignore = NOT_LAYOUT + ("excluded",)
        diff = first_difference({k: v for k, v in derived.items() if k not in ignore},
                                {k: v for k, v in doc.items() if k not in ignore}, lenient=True)
        if diff:
            path, on_disk, given = diff
            raise EmbedError("CK304", f"the manifest does not describe this checkpoint: at {path} the files say {on_disk}, "
                             f"the manifest {given}", "embed the manifest of this checkpoint, or omit --manifest to generate it",
                             str(tag_dir))
    written = []
    for sidecar in find_sidecars(tag_dir):
        try:
            sidecar.unlink()
        except OSError as exc:
            raise CkptspecError("CK906", f"cannot replace the sidecar: {exc.strerror}",
                                "check that the tag directory is writable", str(sidecar)) from None
    if model_states:
        value = client_state_value(doc)
        for _, path in sorted(shards.model_files.items()):
            rewrite_pt_with_item(path, CLIENT_STATE_KEY, value)
            written.append(path)
    complete = dict(doc)
    complete["files"] = [f.model_dump(mode="json", exclude_unset=True) for f in manifest_from_checkpoint(tag_dir, hash_algorithm=hash_algorithm).files]
    from ..format.validate import validate_document

    report = validate_document(complete)
    if not report.ok:
        first = next(f for f in report.findings if f.severity == "error")
        raise EmbedError("CK304", f"the completed manifest is not valid: {first.path}: {first.code} {first.message}",
                         "check the manifest with `ckptspec validate`", str(tag_dir))
    sidecar = write_sidecar(tag_dir, complete, encoding)
    return EmbedResult(complete, sidecar, written)


__all__ = [
    "CLIENT_STATE_KEY", "SAFETENSORS_KEY", "SAFETENSORS_SHA256_KEY", "SIDECAR_NAMES", "EmbeddedCopy", "EmbedError",
    "EmbedResult", "agreement_findings", "best_copy", "client_state_value", "copies_in_dir", "copies_in_file",
    "embed_checkpoint", "embedded_findings", "find_copies", "first_difference", "layout_document", "layout_part",
    "read_client_state_copy", "read_safetensors_metadata", "rewrite_pt_with_item", "safetensors_metadata",
    "write_sidecar",
]
