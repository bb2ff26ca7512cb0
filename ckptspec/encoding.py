"""Write manifests: canonical JSON or msgpack, atomically."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import msgpack

from .errors import CkptspecError
from .loader import MSGPACK_SUFFIXES
from .models import Manifest


def dumps(manifest: Manifest, encoding: str = "json") -> bytes:
    """Canonical bytes: JSON with sorted keys, UTF-8, no NaN; or msgpack."""
    doc = manifest.to_dict()
    if encoding == "msgpack":
        return msgpack.packb(doc, use_bin_type=True)
    return (json.dumps(doc, indent=2, sort_keys=True, ensure_ascii=False, allow_nan=False) + "\n").encode("utf-8")


def write_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Write to a temporary file in the same directory, fsync, then rename over ``path``."""
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent or ".")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_manifest(manifest: Manifest, output: str, encoding: str | None = None) -> None:
    """``output`` '-' is stdout (JSON unless ``encoding`` says msgpack)."""
    if output == "-":
        sys.stdout.buffer.write(dumps(manifest, encoding or "json"))
        sys.stdout.flush()
        return
    encoding = encoding or ("msgpack" if Path(output).suffix.lower() in MSGPACK_SUFFIXES else "json")
    try:
        write_atomic(output, dumps(manifest, encoding))
    except OSError as exc:
        raise CkptspecError("CK906", f"cannot write: {exc.strerror}", "check the output directory exists and is writable", output) from None
