"""Add one item to the top-level dict of a torch zip file without unpickling it.

Used to embed a manifest in DeepSpeed's model-states files (``client_state``). The new
``data.pkl`` is the old one with ``dict[key] = value`` appended before STOP; every other
record is copied byte for byte, stored and 64-byte aligned as torch.save writes them.
The result is read back with the restricted unpickler before it replaces the file.
"""

from __future__ import annotations

import os
import struct
import zipfile
from pathlib import Path
from typing import Any

from .._fs import fsync, fsync_dir, io_point, replace, temp_file
from ..errors import EmbedError, InputOutputError, InvalidCheckpoint
from .states import StateCache, read_state

ZIP_ALIGNMENT = 64  # torch.save aligns every record's data to 64 bytes


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
        raise EmbedError(
            "CK305",
            f"data.pkl is not a protocol-2/3 pickle ending in STOP (starts {data[:2].hex()})",
            "ckptspec embeds only into files written by torch.save with its default protocol",
            source,
        )
    if len(value.encode("utf-8")) >= 2**32:
        raise EmbedError("CK305", "the manifest is too large for a pickle string", "embed the sidecar only", source)
    return data[:-1] + _binunicode(key) + _binunicode(value) + _SETITEM + _STOP


def pickles_before(data: bytes, key: str) -> list[bytes]:
    """``data`` (a ``data.pkl``) as it was before each ``_pickle_with_item`` of ``key`` that made it,
    the latest first: the inverse of the append, exact byte for byte. Empty when ``data`` does not
    end with such an item (a pickle torch wrote memoizes its strings, so it never matches)."""
    marker = _binunicode(key) + _BINUNICODE
    earlier = []
    while data.endswith(_SETITEM + _STOP):
        at = data.rfind(marker)  # the value is JSON text: it holds no raw control byte of a length
        start = at + len(marker)
        if at < 2 or start + 4 > len(data):
            break
        (length,) = struct.unpack_from("<I", data, start)
        if start + 4 + length + len(_SETITEM + _STOP) != len(data):
            break
        data = data[:at] + _STOP
        earlier.append(data)
    return earlier


def _padding_extra(offset_of_header: int, name: bytes, zip64: bool) -> bytes:
    """An 'FB' extra field (as torch.save writes it) that puts the member's data at a
    multiple of ZIP_ALIGNMENT."""
    start = offset_of_header + 30 + len(name) + 4 + (20 if zip64 else 0)
    pad = -start % ZIP_ALIGNMENT
    return b"FB" + struct.pack("<H", pad) + b"Z" * pad


def rewrite_pt_with_item(path: str | os.PathLike, key: str, value: str, *, state: Any = None) -> None:
    """Add ``key: value`` to the top-level dict of a torch zip file, atomically (see ``rewritten_pt``)."""
    tmp = rewritten_pt(path, key, value, state=state)
    if tmp is not None:
        replace(tmp, path)
        fsync_dir(Path(path).parent)


def rewritten_pt(
    path: str | os.PathLike, key: str, value: str, *, state: Any = None, read_back: StateCache | None = None
) -> Path | None:
    """``path`` with ``key: value`` added to its top-level dict, as a finished temporary file beside
    it (fsynced, not yet renamed: the caller commits it), or None when the file holds it already.

    Every other record is copied byte for byte (stored, 64-byte aligned like torch.save
    writes them), in its order and with its archive name; only ``data.pkl`` changes.
    The result is read back with the restricted unpickler before it is handed over (into
    ``read_back`` when given, so that a caller describing the temporary reads it only once).
    """
    path = Path(path)
    source = str(path)
    if state is None:
        state = read_state(path)
    if not isinstance(state, dict):
        raise EmbedError(
            "CK305",
            f"the file holds a {type(state).__name__}, not a dict",
            "only DeepSpeed model states can carry a manifest",
            source,
        )
    if state.get(key) == value:
        return None  # already there
    with zipfile.ZipFile(path) as zin:
        infos = zin.infolist()
        prefix = infos[0].filename.split("/", 1)[0]
        pkl_name = f"{prefix}/data.pkl"
        for info in infos:
            if info.compress_type != zipfile.ZIP_STORED:
                raise EmbedError(
                    "CK305", f"record {info.filename} is compressed", "torch.save writes stored records only", source
                )
        new_pkl = _pickle_with_item(zin.read(pkl_name), key, value, source)
        fd, tmp = temp_file(path)
        try:
            os.fchmod(fd, path.stat().st_mode & 0o7777)  # the file it replaces keeps its mode
            with os.fdopen(fd, "w+b") as fh:
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
                                io_point("write")
                                writer.write(new_pkl)
                            else:
                                with zin.open(info) as reader:
                                    while chunk := reader.read(1 << 20):
                                        io_point("write")
                                        writer.write(chunk)
                fh.flush()
                fsync(fh.fileno())
            _check_rewritten(tmp, state, key, value, source, read_back or StateCache())
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise InputOutputError(
                "CK906", f"cannot write: {exc.strerror}", "check free space and permissions", source
            ) from None
        except zipfile.BadZipFile as exc:  # a record's bytes no longer match their CRC-32
            tmp.unlink(missing_ok=True)
            raise InvalidCheckpoint(
                "CK205", f"the file is damaged: {exc}", "restore it; the file was left untouched", source
            ) from None
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    return tmp


def _check_rewritten(path: Path, before: dict, key: str, value: str, source: str, read_back: StateCache) -> None:
    try:
        after, locations = read_back.state(path), read_back.members(path)
    except InvalidCheckpoint:
        after = locations = None
    expected_keys = list(before) + ([key] if key not in before else [])
    if not isinstance(after, dict) or locations is None or list(after) != expected_keys or after.get(key) != value:
        raise EmbedError(
            "CK305",
            "the rewritten file does not read back as the original plus the manifest",
            "please report this ckptspec bug; the original file was left untouched",
            source,
        )
    misaligned = [m for m, (offset, _) in locations.items() if "/data/" in m and offset % ZIP_ALIGNMENT]
    if misaligned:
        raise EmbedError(
            "CK305",
            f"record {misaligned[0]} is not {ZIP_ALIGNMENT}-byte aligned after rewriting",
            "please report this ckptspec bug; the original file was left untouched",
            source,
        )
