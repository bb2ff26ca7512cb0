"""Read the structure of torch ``.pt`` files without torch, deepspeed or unsafe unpickling.

A ``torch.save`` file is an uncompressed zip: ``<prefix>/data.pkl`` (the object tree, with
tensors as persistent references to storages) and ``<prefix>/data/<key>`` (raw storage bytes).
``read_pt_metadata`` unpickles only ``data.pkl``, with a restricted unpickler whose globals
come from a fixed allowlist and are replaced by inert local stand-ins (``TensorRef`` etc.).
No tensor bytes are read. ``zip_member_locations`` gives the byte range of each member, so a
tensor's bytes can later be read (or hashed) directly from the file.

Every way a hostile file can go wrong ends in a ``TorchFileError`` (zipfile's own exceptions
included); members are read only if stored or deflated, and never past the size they claim.
The opcodes are scanned before unpickling and the result checked after it (``pickle_scan``); the
stand-ins (``standins``) refuse the BUILD opcode, so a pickle cannot edit them after they were
checked, nor the allowlisted globals every later read in the process shares. Every storage a
tensor names must be a member of the archive holding the storage's bytes.

Standard library only (plus ckptspec's own dtype table): this module must stay importable where
torch is not installed.
"""

from __future__ import annotations

import io
import os
import pickle
import struct
import zipfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ..errors import (
    DEFAULT_MAX_PICKLE_BYTES,
    MAX_PICKLE_BYTES_VARIABLE,
    FileUnreadable,
    LegacyTorchFile,
    NotATorchFile,
    PickleOverCap,
    TorchFileError,
    TruncatedFile,
    UnsafePickleError,
)
from ..location import RemotePath, location, open_binary
from .pickle_scan import MAX_NESTING, check_tree, scan_pickle
from .prescan import PassedBytes, Streamed
from .standins import (
    ALLOWED,
    INT64,
    MAX_NDIM,
    STORAGE_TYPES,
    DType,
    DynamicLossScalerState,
    FragmentAddress,
    LossScalerState,
    StorageRef,
    StorageType,
    TensorRef,
    ZeroStage,
)

__all__ = [
    "ALLOWED",
    "STORAGE_TYPES",
    "TruncatedFile",
    "UnsafePickleError",
    "NotATorchFile",
    "MAX_NESTING",
    "MAX_NDIM",
    "TorchFileError",
    "StorageRef",
    "TensorRef",
    "ZeroStage",
    "LossScalerState",
    "DynamicLossScalerState",
    "FragmentAddress",
    "DType",
    "read_pt_metadata",
    "read_data_pkl",
    "check_decoded",
    "decode_data_pkl",
    "unpickle_data_pkl",
    "RawPickle",
    "zip_member_locations",
    "iter_tensor_refs",
    "tensor_byte_range",
]

# DEFAULT_MAX_PICKLE_BYTES and MAX_PICKLE_BYTES_VARIABLE (imported from errors, whose CK225 hint names
# them): data.pkl holds names and shapes only; the cap bounds what decoding a hostile one costs.


def pickle_cap() -> int:
    """The cap on one ``data.pkl``: ``CKPTSPEC_MAX_PICKLE_BYTES`` if set to a positive integer, else the default."""
    try:
        value = int(os.environ.get(MAX_PICKLE_BYTES_VARIABLE, DEFAULT_MAX_PICKLE_BYTES))
    except ValueError:
        return DEFAULT_MAX_PICKLE_BYTES
    return value if value > 0 else DEFAULT_MAX_PICKLE_BYTES


# torch.save(..., _use_new_zipfile_serialization=False) (DeepSpeed's checkpoint_serialization: false,
# torch < 1.6) starts with torch's magic number pickled at protocol 2 (torch/serialization.py).
LEGACY_MAGIC = b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19"
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, skip to name length + extra length
_LOCAL_HEADER_SIG = b"PK\x03\x04"


class _RestrictedUnpickler(pickle.Unpickler):
    # find_class is the only way a pickle can obtain a callable (GLOBAL, STACK_GLOBAL, INST,
    # OBJ and EXT* all go through it), so REDUCE/NEWOBJ can only ever call the stand-ins above.

    def __init__(self, source, prefix: str, path: Path | RemotePath, member_sizes: dict[str, int]):
        super().__init__(PassedBytes(source) if isinstance(source, bytes) else source)
        self._storages: dict[str, StorageRef] = {}
        self._prefix, self._path, self._member_sizes = prefix, path, member_sizes

    def find_class(self, module, name):
        try:
            return ALLOWED[(module, name)]
        except KeyError:
            raise UnsafePickleError(
                self._path, f"data.pkl references global {module}.{name}, which is not allowlisted"
            ) from None

    def persistent_load(self, pid):
        if not (
            isinstance(pid, tuple)
            and len(pid) == 5
            and pid[0] == "storage"
            and isinstance(pid[1], StorageType)
            and isinstance(pid[2], str)
            and isinstance(pid[3], str)
            and type(pid[4]) is int
            and 0 <= pid[4] < INT64
        ):
            raise UnsafePickleError(self._path, f"unsupported persistent id {pid!r}")
        _, stype, key, location, numel = pid
        # Views of one flat buffer (ZeRO stage 1/2 modules) name the same storage once per
        # tensor: reuse the first StorageRef rather than build and compare a new one each time.
        known = self._storages.get(key)
        if known is not None:
            if (known.dtype, known.numel, known.location) != (stype.dtype, numel, location):
                raise TorchFileError(self._path, f"storage {key} referenced with conflicting types")
            return known
        ref = StorageRef(f"{self._prefix}/data/{key}", key, stype.dtype, stype.itemsize, numel, location)
        # Every storage is a member holding its bytes, so offsets computed from a ref stay inside it.
        size = self._member_sizes.get(ref.member)
        if size is None:
            raise TorchFileError(self._path, f"data.pkl names storage {key!r}, which is not in the archive")
        if size < ref.nbytes:
            raise TruncatedFile(
                self._path, f"storage {key!r} holds {size} bytes, data.pkl says {numel} x {stype.itemsize}"
            )
        self._storages[key] = ref
        return ref


# --- zip handling ------------------------------------------------------------------------

# What zipfile raises on a hostile archive besides BadZipFile: OSError and ValueError for
# offsets outside the file or past 2**63, UnicodeDecodeError (a ValueError) for a name flagged
# UTF-8 that is not, NotImplementedError for a "version needed to extract" above 6.3 (or an
# unknown method), RuntimeError for encryption, EOFError and zlib.error for a cut or corrupt
# deflate stream.
_ZIP_ERRORS = (
    zipfile.BadZipFile,
    OSError,
    EOFError,
    ValueError,
    OverflowError,
    struct.error,
    zlib.error,
    NotImplementedError,
    RuntimeError,
)


def _open_zip(path: Path | RemotePath) -> zipfile.ZipFile:
    try:
        size = path.stat().st_size
        with open_binary(path) as f:
            magic = f.read(len(LEGACY_MAGIC))
    except OSError as e:  # permissions, an I/O error: the file's bytes were never seen (not damage)
        raise FileUnreadable(path, e) from None
    if size == 0:
        raise TruncatedFile(path, "file is empty")
    if magic == LEGACY_MAGIC:
        raise LegacyTorchFile(path, "legacy (non-zip) torch serialization")
    if not magic.startswith(b"PK"):
        raise NotATorchFile(path, "not a zip archive")
    try:
        # A remote file is read in ranges: the end record and central directory, then what is asked for.
        zf = zipfile.ZipFile(path if isinstance(path, Path) else open_binary(path))
    except _ZIP_ERRORS as e:
        # A zip's directory is at its end: a cut-off file starts like a zip but has none.
        raise TruncatedFile(path, f"zip directory unreadable, file truncated or corrupt ({e})") from e
    names = zf.namelist()
    if len(set(names)) != len(names):
        # zipfile takes the last record of a name, other readers the first: which data.pkl
        # would torch.load unpickle? Not necessarily the one checked here.
        zf.close()
        twice = next(n for n in names if names.count(n) > 1)
        raise TorchFileError(path, f"zip lists member {twice} more than once")
    return zf


def _archive_prefix(zf: zipfile.ZipFile, path: Path) -> str:
    # Like torch's reader: the archive name is the directory of the first record.
    names = zf.namelist()
    prefix = names[0].split("/", 1)[0] if names and "/" in names[0] else None
    if prefix is None or f"{prefix}/data.pkl" not in names:
        raise NotATorchFile(path, "zip has no <prefix>/data.pkl record")
    return prefix


def _read_member(zf: zipfile.ZipFile, info: zipfile.ZipInfo, limit: int, path: Path) -> bytes:
    """At most ``limit + 1`` bytes of a member. Like torch's reader, only stored or deflated
    members without encryption (bzip2 and lzma inflate without bound, chunk by chunk)."""
    if info.flag_bits & 0x1:
        raise TorchFileError(path, f"member {info.filename} is encrypted")
    if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
        raise TorchFileError(
            path, f"member {info.filename} uses compression method {info.compress_type}, which torch does not read"
        )
    try:
        with zf.open(info) as f:
            # Inflating allocates what is asked for: ask for no more than the member claims.
            return f.read(min(limit, info.file_size) + 1)
    except EOFError as e:
        raise TruncatedFile(path, f"{info.filename} is cut off ({e})") from e
    except _ZIP_ERRORS as e:
        raise TorchFileError(path, f"cannot read {info.filename} ({e})") from e


@dataclass(frozen=True)
class RawPickle:
    """A torch file's ``data.pkl``, read and capped but not yet decoded."""

    path: Path | RemotePath
    data: bytes
    prefix: str  # the archive's name: its members are "<prefix>/..."
    member_sizes: dict[str, int]


def read_pt_metadata(path, max_pickle_bytes: int | None = None) -> Any:
    """Unpickle ``data.pkl`` of a torch zip file safely; tensors become ``TensorRef``.
    ``max_pickle_bytes``: the cap on data.pkl (default: ``pickle_cap()``)."""
    return decode_data_pkl(read_data_pkl(path, max_pickle_bytes))


def read_data_pkl(path, max_pickle_bytes: int | None = None) -> RawPickle:
    """The bytes of ``data.pkl`` (the archive checked, the cap kept), for ``decode_data_pkl``."""
    path = location(path)
    if max_pickle_bytes is None:
        max_pickle_bytes = pickle_cap()
    with _open_zip(path) as zf:
        prefix = _archive_prefix(zf, path)
        infos = {info.filename: info for info in zf.infolist()}
        info = infos[f"{prefix}/data.pkl"]
        if info.file_size > max_pickle_bytes:
            raise PickleOverCap(path, f"data.pkl is {info.file_size} bytes, over the {max_pickle_bytes} byte cap")
        byteorder = infos.get(f"{prefix}/byteorder")
        if byteorder is not None and _read_member(zf, byteorder, 16, path) != b"little":
            raise TorchFileError(path, "only little-endian archives are supported")
        data = _read_member(zf, info, max_pickle_bytes, path)
    if len(data) > max_pickle_bytes:
        raise PickleOverCap(path, f"data.pkl exceeds the {max_pickle_bytes} byte cap")
    return RawPickle(path, data, prefix, {n: i.file_size for n, i in infos.items()})


def decode_data_pkl(raw: RawPickle, scan_error: ValueError | None | Literal[True] | Streamed = True) -> Any:
    """Unpickle ``raw`` with the restricted unpickler, after ``scan_pickle``, and check the tree it
    gives (``unpickle_data_pkl``, then ``check_decoded``)."""
    obj = unpickle_data_pkl(raw, scan_error)
    check_decoded(raw, obj)
    return obj


def unpickle_data_pkl(raw: RawPickle, scan_error: ValueError | None | Literal[True] | Streamed = True) -> Any:
    """Unpickle ``raw`` with the restricted unpickler, after ``scan_pickle``: a tree nothing may
    walk before ``check_decoded`` has passed it. ``scan_error``: what ``scan_pickle(raw.data)``
    raised (None: it passed) when it already ran, elsewhere; a ``prescan.Streamed`` when another
    process is walking it (the unpickler reads only what the walk has passed); True (the default):
    run it here."""
    try:
        if isinstance(scan_error, Streamed):
            return _unpickle_streamed(raw, scan_error)
        if scan_error is True:
            scan_pickle(raw.data)
        elif scan_error is not None:
            raise scan_error
        return _RestrictedUnpickler(raw.data, raw.prefix, raw.path, raw.member_sizes).load()
    except TorchFileError:
        raise
    except Exception as e:  # malformed or hostile pickle: stand-ins raise ValueError/TypeError
        raise TorchFileError(raw.path, f"malformed data.pkl: {type(e).__name__}: {e}") from e


def check_decoded(raw: RawPickle, obj: Any) -> None:
    """Raise TorchFileError unless ``obj``, unpickled from ``raw``, is a tree a recursive walker can
    handle (``check_tree``: no cycle, not too deep, not too many nodes for the pickle's size)."""
    try:
        check_tree(obj, 2 * len(raw.data) + 1_000_000)
    except Exception as e:
        raise TorchFileError(raw.path, f"malformed data.pkl: {type(e).__name__}: {e}") from e


def _unpickle_streamed(raw: RawPickle, streamed: Streamed) -> Any:
    """Unpickle behind the other process's walk. The walk's refusal comes first, whatever the
    unpickler did meanwhile: as if the walk had run before it."""
    try:
        obj = _RestrictedUnpickler(streamed.reader(), raw.prefix, raw.path, raw.member_sizes).load()
    except Exception:
        refusal = streamed.refusal()
        if refusal is not None:
            raise refusal from None
        raise
    refusal = streamed.refusal()
    if refusal is not None:
        raise refusal
    return obj


def zip_member_locations(path) -> dict[str, tuple[int, int]]:
    """member name -> (absolute byte offset of its data, size in bytes); members must be stored."""
    path = location(path)
    out = {}
    with _open_zip(path) as zf, open_binary(path) as f:
        file_size = f.seek(0, io.SEEK_END)
        for info in zf.infolist():
            if info.compress_type != zipfile.ZIP_STORED:
                raise TorchFileError(
                    path,
                    f"member {info.filename} is compressed (method {info.compress_type}); torch writes stored members",
                )
            if info.flag_bits & 0x1:
                raise TorchFileError(path, f"member {info.filename} is encrypted")
            if info.compress_size != info.file_size:
                raise TorchFileError(
                    path, f"stored member {info.filename} has two sizes, {info.compress_size} and {info.file_size}"
                )
            if not 0 <= info.header_offset <= file_size - _LOCAL_HEADER.size:
                raise TruncatedFile(
                    path,
                    f"local header of {info.filename} at byte {info.header_offset} "
                    f"is outside the file ({file_size} bytes)",
                )
            f.seek(info.header_offset)
            sig, name_len, extra_len = _LOCAL_HEADER.unpack(f.read(_LOCAL_HEADER.size))
            if sig != _LOCAL_HEADER_SIG:
                raise TorchFileError(path, f"bad local header signature for {info.filename}")
            offset = info.header_offset + _LOCAL_HEADER.size + name_len + extra_len
            if offset + info.file_size > file_size:
                raise TruncatedFile(
                    path, f"member {info.filename} ends at byte {offset + info.file_size}, file has {file_size}"
                )
            out[info.filename] = (offset, info.file_size)
    return out


# --- helpers -----------------------------------------------------------------------------


def iter_tensor_refs(obj, path=()) -> Iterator[tuple[tuple, TensorRef]]:
    """Yield (key path, TensorRef) for every tensor in dicts/lists/tuples, depth first."""
    if isinstance(obj, TensorRef):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from iter_tensor_refs(v, path + (k,))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from iter_tensor_refs(v, path + (i,))


def tensor_byte_range(ref: TensorRef, locations: dict[str, tuple[int, int]]) -> tuple[int, int]:
    """(absolute file offset, byte length) of a contiguous tensor's data."""
    if not ref.is_contiguous():
        raise ValueError("tensor is not contiguous; its bytes are not one range")
    if ref.storage.member not in locations:
        raise TorchFileError(None, f"storage {ref.storage.member} is not in the archive")
    base, size = locations[ref.storage.member]
    if size < ref.storage.nbytes:
        raise TruncatedFile(None, f"storage {ref.storage.member} has {size} bytes, expected {ref.storage.nbytes}")
    return base + ref.storage_offset * ref.storage.itemsize, ref.numel * ref.storage.itemsize
