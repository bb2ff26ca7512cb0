"""Manifest documents as bytes: read (JSON or msgpack, safely) and write (canonical, atomically).

Reading: every way the bytes can be unusable becomes a ``CkptspecError`` with a code: the
size is capped *before* reading, text must be UTF-8, JSON may not hold NaN/Infinity or
duplicate keys, and pathological nesting or integers become errors instead of tracebacks.

Writing: canonical forms (the same document always gives the same bytes):

* JSON: UTF-8 (no ``\\u`` escapes for non-ASCII), keys sorted at every level, two-space
  indent, a final newline, no ``NaN``/``Infinity`` (``compact=True``: no whitespace at all).
* msgpack: maps with keys sorted the same way, strings as msgpack ``str``, integers in
  their smallest msgpack type, floats as float64.

The two are lossless for every manifest: decoding either gives the same Python data,
types included (``3`` stays an int, ``3.0`` a float, ``null`` stays ``None``), so
``JSON -> msgpack -> JSON`` reproduces the canonical JSON bytes exactly. A value that
one encoding cannot hold (an integer outside [-2**63, 2**64), bytes, NaN) is refused
with ``CK907`` instead of being altered.

No pydantic here: ``ckptspec validate MANIFEST`` reads through this module without the models.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

import msgpack

from .._fs import write_atomic
from ..errors import InputOutputError, InvalidDocument, NotEncodable
from ..location import AnyPath, RemotePath, is_remote, location, not_found, upload, writable
from .json_fast import dumps_compact, dumps_indented, dumps_reference

if TYPE_CHECKING:
    from .index_models import CheckpointIndex
    from .models import Manifest

Encoding = Literal["json", "msgpack"]
DEFAULT_MAX_BYTES = 512 * 1024 * 1024
MSGPACK_SUFFIXES = {".msgpack", ".mpk"}
STDIO = "-"  # as a file name: standard input for a reader, standard output for `write_manifest`
ZIP_MAGIC = b"PK\x03\x04"  # torch.save's format since torch 1.6: never a JSON or msgpack manifest


def encoding_for(path: AnyPath, data: bytes | None = None) -> Encoding:
    """By extension first; otherwise sniff: msgpack maps start with 0x80-0x8f/0xde/0xdf."""
    suffix = Path(str(path)).suffix.lower()  # str(): a URL (location.RemotePath) has a suffix too
    if suffix in MSGPACK_SUFFIXES:
        return "msgpack"
    if suffix == ".json" or not data:
        return "json"
    first = data[0]
    return "msgpack" if (0x80 <= first <= 0x8F or first in (0xDE, 0xDF)) else "json"


def read_bytes(path: AnyPath, max_bytes: int = DEFAULT_MAX_BYTES) -> bytes:
    """The bytes of a manifest file, ``-`` being standard input (as for cat, jq and json.tool)."""
    name = str(path)
    if name == STDIO:
        data = sys.stdin.buffer.read(max_bytes + 1)
    else:
        data = _read_file(path, max_bytes)
    if len(data) > max_bytes:  # standard input, or a device, FIFO or /proc file that reports size 0
        raise InputOutputError(
            "CK902",
            f"file holds more than the {max_bytes}-byte limit",
            "raise the limit with --max-size if this file is really a manifest",
            name,
        )
    return data


def _read_file(path: AnyPath, max_bytes: int) -> bytes:
    name = str(path)
    if isinstance(path, RemotePath) or is_remote(path):
        return _read_remote(cast(RemotePath, location(path)), max_bytes)
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        raise InputOutputError("CK901", "file not found", "check the path", name) from None
    except OSError as exc:
        raise InputOutputError(
            "CK901", f"cannot read file: {exc.strerror}", "check the path and permissions", name
        ) from None
    if os.path.isdir(path):
        raise InputOutputError("CK901", "is a directory, not a manifest file", "pass the manifest file", name)
    if size > max_bytes:
        raise InputOutputError(
            "CK902",
            f"file is {size} bytes, over the {max_bytes}-byte limit",
            "raise the limit with --max-size if this file is really a manifest",
            name,
        )
    try:
        with open(path, "rb") as fh:
            return fh.read(max_bytes + 1)
    except OSError as exc:
        raise InputOutputError(
            "CK901", f"cannot read file: {exc.strerror}", "check the path and permissions", name
        ) from None


def _read_remote(path: RemotePath, max_bytes: int) -> bytes:
    """A manifest at a URL: one request for its size, one for its bytes (``RemoteError`` when it cannot be had)."""
    name = str(path)
    if path.is_dir():
        raise InputOutputError("CK901", "is a directory, not a manifest file", "pass the manifest file", name)
    if not path.is_file():
        raise not_found(name, "file not found")
    size = path.stat().st_size
    if size > max_bytes:
        raise InputOutputError(
            "CK902",
            f"file is {size} bytes, over the {max_bytes}-byte limit",
            "raise the limit with --max-size if this file is really a manifest",
            name,
        )
    return path.read_bytes()


def _no_duplicates(pairs: list[tuple[Any, Any]]) -> dict:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set = set()
        for key, _ in pairs:
            if key in seen:
                raise _Duplicate(key)
            seen.add(key)
    return obj


class _Duplicate(Exception):
    pass


# A \uD800-\uDFFF escape may leave a lone surrogate: not Unicode text, so no manifest
# string can hold it (msgpack's strict UTF-8 decoding already refuses them).
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _refuse_lone_surrogates(value: Any) -> None:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError("a string holds a lone UTF-16 surrogate escape") from None
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


@contextlib.contextmanager
def gc_paused(*, for_good: bool = False) -> Iterator[None]:
    """No cyclic garbage collection while a large document is decoded and checked.

    Decoding allocates millions of containers and none of them form cycles; without
    the pause the collector rescans them over and over (about half the decode time
    of a 100k-parameter manifest).

    ``for_good``: what was made meanwhile is kept out of every later collection (``gc.freeze``),
    for a command whose process ends after it: the first collection after the pause would
    otherwise walk all of it once more just before the process exits.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            if for_good:
                gc.freeze()
            gc.enable()


def _refuse_constant(token: str) -> Any:
    raise ValueError(f"{token} is not allowed in a manifest")


class _FloatSpotter:
    """Decoding hooks that count the document's floats.

    The semantic rules read decoded documents as they are and need plain ints; a
    float (even 3.0, which JSON Schema counts as an integer) where the schema has an
    integer sends the document through the models, which normalize it. Nothing is
    changed here: decoding stays lossless.
    """

    def __init__(self) -> None:
        self.count = 0

    def json_float(self, token: str) -> float:
        self.count += 1
        return float(token)

    def msgpack_map(self, pairs: list[tuple[Any, Any]]) -> dict:
        # msgpack has no float hook: count map values and the items of arrays held by maps,
        # which is everywhere the schema has integers.
        for key, value in pairs:
            if type(key) is not str:
                raise ValueError(f"map key {key!r} is not a string")
            kind = type(value)
            if kind is float:
                self.count += 1
            elif kind is list:
                self.count += list(map(type, value)).count(float)
        return _no_duplicates(pairs)


def _floats_in(value: Any) -> int:
    """Floats in one optimizer setting, as _FloatSpotter counts them: the value, or an array's items."""
    if type(value) is float:
        return 1
    return list(map(type, value)).count(float) if type(value) is list else 0


def _floats_where_numbers_belong(doc: Any) -> int:
    """Floats at the only places the schema takes any number, not only integers: format 1.1's
    optimizer settings (each group's hyperparameters and step, clip_grad, the loss scaler's
    state). A real manifest's learning rate is one; only a float elsewhere needs the models."""
    optimizer = doc.get("optimizer") if type(doc) is dict else None
    if type(optimizer) is not dict:
        return 0
    found = _floats_in(optimizer.get("clip_grad"))
    scaler = optimizer.get("loss_scaler")
    settings = [scaler.get("state")] if type(scaler) is dict else []
    groups = optimizer.get("groups")
    for group in groups if type(groups) is list else ():
        if type(group) is dict:
            found += _floats_in(group.get("step"))
            settings.append(group.get("hyperparameters"))
    for values in settings:
        if type(values) is dict:
            found += sum(map(_floats_in, values.values()))
    return found


def decode_document(data: bytes, encoding: Encoding, name: str = "<input>") -> tuple[Any, bool]:
    """``decode``, also telling whether the document holds floats other than optimizer settings."""
    floats = _FloatSpotter()
    try:
        if encoding == "msgpack":
            doc = msgpack.unpackb(data, raw=False, strict_map_key=True, object_pairs_hook=floats.msgpack_map)
            return doc, floats.count > _floats_where_numbers_belong(doc) or type(doc) is float
        text = data.decode("utf-8")
        doc = json.loads(
            text, object_pairs_hook=_no_duplicates, parse_constant=_refuse_constant, parse_float=floats.json_float
        )
        if _SURROGATE_ESCAPE.search(text):
            _refuse_lone_surrogates(doc)
        return doc, floats.count > _floats_where_numbers_belong(doc)
    except _Duplicate as dup:
        raise InvalidDocument(
            "CK904", f"duplicate key {dup.args[0]!r}", "every key may appear once per object", name
        ) from None
    except UnicodeDecodeError as exc:
        raise InputOutputError(
            "CK903", f"not UTF-8 text (byte {exc.start})", "save the manifest as UTF-8 JSON or msgpack", name
        ) from None
    except RecursionError:
        raise InputOutputError(
            "CK903", "nesting is too deep to be a manifest", "check that this is a ckptspec manifest", name
        ) from None
    except (ValueError, msgpack.UnpackException, msgpack.ExtraData, TypeError, OverflowError) as exc:
        what = "msgpack" if encoding == "msgpack" else "JSON"
        detail = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        raise InputOutputError(
            "CK903", f"not valid {what}: {detail}", f"check that this is a {what} manifest", name
        ) from None


def decode(data: bytes, encoding: Encoding, name: str = "<input>") -> Any:
    """Decode bytes to Python data; never raises anything but ``CkptspecError``.

    The result holds no duplicate keys and no lone surrogates.
    """
    return decode_document(data, encoding, name)[0]


def load_document(
    path: AnyPath,
    max_bytes: int = DEFAULT_MAX_BYTES,
    encoding: Encoding | None = None,
) -> Any:
    """Read and decode one manifest file into plain Python data (not yet validated)."""
    return read_document(path, max_bytes, encoding)[0]


def read_document(
    path: AnyPath,
    max_bytes: int = DEFAULT_MAX_BYTES,
    encoding: Encoding | None = None,
) -> tuple[Any, bool]:
    """``load_document``, also telling whether the document holds floats."""
    data = read_bytes(path, max_bytes)
    if data.startswith(ZIP_MAGIC):
        raise InputOutputError(
            "CK903",
            "a zip archive such as a torch checkpoint file (*_model_states.pt), not a manifest",
            "pass the checkpoint directory instead: `ckptspec validate DIR` checks a checkpoint against its own "
            "manifest (`ckptspec extract FILE` prints the manifest a file embeds)",
            str(path),
        )
    if is_safetensors(data):
        raise InputOutputError(
            "CK903",
            "a safetensors file (weights, such as a `ckptspec reconstruct` output), not a manifest",
            "`ckptspec extract FILE` prints the manifest it embeds; `ckptspec validate` takes a manifest or a "
            "checkpoint directory",
            str(path),
        )
    return decode_document(data, encoding or encoding_for(path, data), str(path))


def is_safetensors(data: bytes) -> bool:
    """safetensors' layout: an 8-byte little-endian header length, then that many bytes of a JSON object."""
    length = int.from_bytes(data[:8], "little") if len(data) >= 10 else 0
    return 2 <= length <= len(data) - 8 and data[8:9] == b"{"


# --------------------------------------------------------------------------- writing


def _sorted_maps(value: Any) -> Any:
    """The same data with every map's keys in sorted order (msgpack keeps insertion order)."""
    if isinstance(value, dict):
        return {k: _sorted_maps(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [_sorted_maps(v) for v in value]
    return value


def dumps(
    manifest: Manifest | CheckpointIndex | dict,
    encoding: Encoding = "json",
    *,
    compact: bool = False,
    reference: bool = False,
) -> bytes:
    """Canonical bytes of a manifest (a model, or a plain decoded document).

    ``reference``: JSON written by the standard library alone (the same bytes, slower).
    """
    doc = manifest if isinstance(manifest, dict) else manifest.to_dict()
    if encoding == "msgpack":
        try:
            return msgpack.packb(_sorted_maps(doc), use_bin_type=True)
        except (OverflowError, TypeError, ValueError) as exc:
            raise NotEncodable(f"cannot be written as msgpack: {exc}") from None
    if encoding != "json":
        raise ValueError(f"unknown encoding {encoding!r}; use json or msgpack")
    try:
        if reference:
            return dumps_reference(doc, compact)
        # The same bytes, most of them written by orjson.
        return dumps_compact(doc) if compact else dumps_indented(doc)
    except (TypeError, ValueError) as exc:
        raise NotEncodable(f"cannot be written as JSON: {exc}") from None
    except UnicodeEncodeError:
        raise NotEncodable("cannot be written as UTF-8: a string holds a lone surrogate") from None


def encoding_for_output(path: str | os.PathLike, override: Encoding | None = None) -> Encoding:
    """``override``, else by extension: ``.msgpack``/``.mpk`` is msgpack, anything else JSON."""
    if override:
        return override
    if str(path) == STDIO:
        return "json"
    return "msgpack" if Path(path).suffix.lower() in MSGPACK_SUFFIXES else "json"


def write_manifest(manifest: Manifest | CheckpointIndex | dict, output: str, encoding: Encoding | None = None) -> None:
    """``output`` '-' is stdout (JSON unless ``encoding`` says msgpack)."""
    try:
        data = dumps(manifest, encoding_for_output(output, encoding))
    except NotEncodable as exc:
        exc.file = output
        raise
    if output == STDIO:
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
        return
    if is_remote(output):
        writable(output, "a manifest")  # CK916 for HTTP, CK917
        upload.put(output, data)
        return
    try:
        write_atomic(output, data)
    except OSError as exc:
        raise InputOutputError(
            "CK906", f"cannot write: {exc.strerror}", "check the output directory exists and is writable", output
        ) from None
