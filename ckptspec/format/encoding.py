"""Write manifests: canonical JSON or msgpack, atomically.

Canonical forms (the same document always gives the same bytes):

* JSON: UTF-8 (no ``\\u`` escapes for non-ASCII), keys sorted at every level, two-space
  indent, a final newline, no ``NaN``/``Infinity`` (``compact=True``: no whitespace at all).
* msgpack: maps with keys sorted the same way, strings as msgpack ``str``, integers in
  their smallest msgpack type, floats as float64.

The two are lossless for every manifest: decoding either gives the same Python data,
types included (``3`` stays an int, ``3.0`` a float, ``null`` stays ``None``), so
``JSON -> msgpack -> JSON`` reproduces the canonical JSON bytes exactly. A value that
one encoding cannot hold (an integer outside [-2**63, 2**64), bytes, NaN) is refused
with ``CK907`` instead of being altered.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, BinaryIO, Iterator

import msgpack

from ..errors import CkptspecError, NotEncodable
from .loader import MSGPACK_SUFFIXES, Encoding, decode
from .models import Manifest

ENCODINGS: tuple[Encoding, ...] = ("json", "msgpack")


def _sorted_maps(value: Any) -> Any:
    """The same data with every map's keys in sorted order (msgpack keeps insertion order)."""
    if isinstance(value, dict):
        return {k: _sorted_maps(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [_sorted_maps(v) for v in value]
    return value


def dumps(manifest: Manifest | dict, encoding: Encoding = "json", *, compact: bool = False) -> bytes:
    """Canonical bytes of a manifest (a model, or a plain decoded document)."""
    doc = manifest.to_dict() if isinstance(manifest, Manifest) else manifest
    if encoding == "msgpack":
        try:
            return msgpack.packb(_sorted_maps(doc), use_bin_type=True)
        except (OverflowError, TypeError, ValueError) as exc:
            raise NotEncodable(f"cannot be written as msgpack: {exc}") from None
    if encoding != "json":
        raise ValueError(f"unknown encoding {encoding!r}; use one of {', '.join(ENCODINGS)}")
    try:
        if compact:
            text = json.dumps(doc, separators=(",", ":"), sort_keys=True, ensure_ascii=False, allow_nan=False)
        else:
            text = json.dumps(doc, indent=2, sort_keys=True, ensure_ascii=False, allow_nan=False) + "\n"
        return text.encode("utf-8")
    except (TypeError, ValueError) as exc:
        raise NotEncodable(f"cannot be written as JSON: {exc}") from None
    except UnicodeEncodeError:
        raise NotEncodable("cannot be written as UTF-8: a string holds a lone surrogate") from None


def loads(data: bytes, encoding: Encoding, name: str = "<input>") -> Any:
    """Decode manifest bytes (the reader's checks: UTF-8, no NaN, no duplicate keys)."""
    return decode(data, encoding, name)


def encoding_for_output(path: str | os.PathLike, override: Encoding | None = None) -> Encoding:
    """``override``, else by extension: ``.msgpack``/``.mpk`` is msgpack, anything else JSON."""
    if override:
        return override
    if str(path) == "-":
        return "json"
    return "msgpack" if Path(path).suffix.lower() in MSGPACK_SUFFIXES else "json"


def convert_bytes(data: bytes, source: Encoding, target: Encoding, name: str = "<input>") -> bytes:
    """Re-encode a document losslessly (both sides canonical)."""
    return dumps(loads(data, source, name), target)


def fsync_dir(directory: Path) -> None:
    # Makes the rename itself durable; not every platform/file system can open a directory.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _final_mode(target: Path) -> int:
    try:
        return target.stat().st_mode & 0o7777
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """A binary file that replaces ``path`` only when the ``with`` block succeeds.

    Writes a temporary file in the same directory, fsyncs it, renames it over ``path``
    and fsyncs the directory. On any error the temporary file is removed and ``path``
    is untouched: readers see the old file or the complete new one, never a part.
    """
    target = Path(path)
    directory = target.parent if str(target.parent) else Path(".")
    mode = _final_mode(target)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=directory)
    os.close(fd)
    try:
        with open(tmp, "w+b") as fh:  # by name, so ``fh.name`` is the temporary path
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(directory)


def write_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (temporary file, fsync, rename, directory fsync)."""
    with atomic_output(path) as fh:
        fh.write(data)


def write_manifest(manifest: Manifest | dict, output: str, encoding: Encoding | None = None) -> None:
    """``output`` '-' is stdout (JSON unless ``encoding`` says msgpack)."""
    try:
        data = dumps(manifest, encoding_for_output(output, encoding))
    except NotEncodable as exc:
        exc.file = output
        raise
    if output == "-":
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
        return
    try:
        write_atomic(output, data)
    except OSError as exc:
        raise CkptspecError("CK906", f"cannot write: {exc.strerror}", "check the output directory exists and is writable", output) from None
