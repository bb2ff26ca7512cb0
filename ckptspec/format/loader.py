"""Read a manifest document (JSON or msgpack) into plain Python data, safely.

Every way the bytes can be unusable becomes a ``CkptspecError`` with a code:
the size is capped *before* reading, text must be UTF-8, JSON may not hold
NaN/Infinity or duplicate keys, and pathological nesting or integers become
errors instead of tracebacks.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import re
from pathlib import Path
from typing import Any, Iterator, Literal

import msgpack

from ..errors import CkptspecError, InvalidDocument

Encoding = Literal["json", "msgpack"]
DEFAULT_MAX_BYTES = 512 * 1024 * 1024
MSGPACK_SUFFIXES = {".msgpack", ".mpk"}


def encoding_for(path: str | os.PathLike, data: bytes | None = None) -> Encoding:
    """By extension first; otherwise sniff: msgpack maps start with 0x80-0x8f/0xde/0xdf."""
    suffix = Path(path).suffix.lower()
    if suffix in MSGPACK_SUFFIXES:
        return "msgpack"
    if suffix == ".json" or not data:
        return "json"
    first = data[0]
    return "msgpack" if (0x80 <= first <= 0x8F or first in (0xDE, 0xDF)) else "json"


def read_bytes(path: str | os.PathLike, max_bytes: int = DEFAULT_MAX_BYTES) -> bytes:
    name = str(path)
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        raise CkptspecError("CK901", "file not found", "check the path", name) from None
    except OSError as exc:
        raise CkptspecError("CK901", f"cannot read file: {exc.strerror}", "check the path and permissions", name) from None
    if os.path.isdir(path):
        raise CkptspecError("CK901", "is a directory, not a manifest file", "pass the manifest file", name)
    if size > max_bytes:
        raise CkptspecError(
            "CK902",
            f"file is {size} bytes, over the {max_bytes}-byte limit",
            "raise the limit with --max-size if this file is really a manifest",
            name,
        )
    try:
        with open(path, "rb") as fh:
            data = fh.read(max_bytes + 1)
    except OSError as exc:
        raise CkptspecError("CK901", f"cannot read file: {exc.strerror}", "check the path and permissions", name) from None
    if len(data) > max_bytes:  # a device, FIFO or /proc file reports size 0
        raise CkptspecError("CK902", f"file holds more than the {max_bytes}-byte limit",
                            "raise the limit with --max-size if this file is really a manifest", name)
    return data


def _no_duplicates(pairs: list[tuple[Any, Any]]) -> dict:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise _Duplicate(dup)
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
def gc_paused() -> Iterator[None]:
    """No cyclic garbage collection while a large document is decoded and checked.

    Decoding allocates millions of containers and none of them form cycles; without
    the pause the collector rescans them over and over (about half the decode time
    of a 100k-parameter manifest).
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _refuse_constant(token: str) -> Any:
    raise ValueError(f"{token} is not allowed in a manifest")


class _FloatSpotter:
    """Decoding hooks that note whether the document holds any float.

    The semantic rules read decoded documents as they are and need plain ints; a
    float (even 3.0, which JSON Schema counts as an integer) sends the document
    through the models, which normalize it. Nothing is changed here: decoding stays
    lossless.
    """

    def __init__(self) -> None:
        self.seen = False

    def json_float(self, token: str) -> float:
        self.seen = True
        return float(token)

    def msgpack_map(self, pairs: list[tuple[Any, Any]]) -> dict:
        # msgpack has no float hook: look at map values and at arrays held by maps,
        # which is everywhere the schema has integers.
        for key, value in pairs:
            if type(key) is not str:
                raise ValueError(f"map key {key!r} is not a string")
            kind = type(value)
            if kind is float or (kind is list and float in map(type, value)):
                self.seen = True
        return _no_duplicates(pairs)


def decode_document(data: bytes, encoding: Encoding, name: str = "<input>") -> tuple[Any, bool]:
    """``decode``, also telling whether the document holds floats."""
    floats = _FloatSpotter()
    try:
        if encoding == "msgpack":
            doc = msgpack.unpackb(data, raw=False, strict_map_key=True, object_pairs_hook=floats.msgpack_map)
            return doc, floats.seen or type(doc) is float
        text = data.decode("utf-8")
        doc = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_refuse_constant,
                         parse_float=floats.json_float)
        if _SURROGATE_ESCAPE.search(text):
            _refuse_lone_surrogates(doc)
        return doc, floats.seen
    except _Duplicate as dup:
        raise InvalidDocument("CK904", f"duplicate key {dup.args[0]!r}", "every key may appear once per object", name) from None
    except UnicodeDecodeError as exc:
        raise CkptspecError("CK903", f"not UTF-8 text (byte {exc.start})", "save the manifest as UTF-8 JSON or msgpack", name) from None
    except RecursionError:
        raise CkptspecError("CK903", "nesting is too deep to be a manifest", "check that this is a ckptspec manifest", name) from None
    except (ValueError, msgpack.UnpackException, msgpack.ExtraData, TypeError, OverflowError) as exc:
        what = "msgpack" if encoding == "msgpack" else "JSON"
        detail = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        raise CkptspecError("CK903", f"not valid {what}: {detail}", f"check that this is a {what} manifest", name) from None


def decode(data: bytes, encoding: Encoding, name: str = "<input>") -> Any:
    """Decode bytes to Python data; never raises anything but ``CkptspecError``.

    The result holds no duplicate keys and no lone surrogates.
    """
    return decode_document(data, encoding, name)[0]


def load_document(
    path: str | os.PathLike,
    max_bytes: int = DEFAULT_MAX_BYTES,
    encoding: Encoding | None = None,
) -> Any:
    """Read and decode one manifest file into plain Python data (not yet validated)."""
    return read_document(path, max_bytes, encoding)[0]


def read_document(
    path: str | os.PathLike, max_bytes: int = DEFAULT_MAX_BYTES, encoding: Encoding | None = None,
) -> tuple[Any, bool]:
    """``load_document``, also telling whether the document holds floats."""
    data = read_bytes(path, max_bytes)
    return decode_document(data, encoding or encoding_for(path, data), str(path))
