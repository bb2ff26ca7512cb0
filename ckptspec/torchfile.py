"""Read the structure of torch ``.pt`` files without torch, deepspeed or unsafe unpickling.

A ``torch.save`` file is an uncompressed zip: ``<prefix>/data.pkl`` (the object tree, with
tensors as persistent references to storages) and ``<prefix>/data/<key>`` (raw storage bytes).
``read_pt_metadata`` unpickles only ``data.pkl``, with a restricted unpickler whose globals
come from a fixed allowlist and are replaced by inert local stand-ins (``TensorRef`` etc.).
No tensor bytes are read. ``zip_member_locations`` gives the byte range of each member, so a
tensor's bytes can later be read (or hashed) directly from the file.

Every way a hostile file can go wrong ends in a ``TorchFileError`` (zipfile's own exceptions
included); members are read only if stored or deflated, and never past the size they claim.

Standard library only: this module must stay importable where torch is not installed.
"""
from __future__ import annotations

import collections
import io
import pickle
import struct
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

__all__ = [
    "TorchFileError", "NotATorchFile", "UnsafePickleError", "TruncatedFile",
    "StorageRef", "TensorRef", "ZeroStage", "LossScalerState", "DynamicLossScalerState",
    "FragmentAddress", "DType",
    "read_pt_metadata", "zip_member_locations", "iter_tensor_refs", "tensor_byte_range",
]

DEFAULT_MAX_PICKLE_BYTES = 64 * 1024 * 1024  # data.pkl holds names/shapes only; huge means hostile

_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, skip to name length + extra length
_LOCAL_HEADER_SIG = b"PK\x03\x04"


# --- errors -------------------------------------------------------------------------------

class TorchFileError(Exception):
    """Base class: the file cannot be read as a (safe) torch zip file."""


class NotATorchFile(TorchFileError):
    """Not a zip archive, or a zip without ``<prefix>/data.pkl`` (e.g. legacy torch format)."""


class UnsafePickleError(TorchFileError):
    """data.pkl refers to a global that is not on the allowlist."""


class TruncatedFile(TorchFileError):
    """The file ends before the data its zip structures promise."""


# --- stand-ins for allowlisted globals ----------------------------------------------------

@dataclass(frozen=True)
class StorageRef:
    member: str        # zip member holding the raw bytes: "<prefix>/data/<key>"
    key: str
    dtype: str         # torch dtype name without "torch.", e.g. "bfloat16"
    itemsize: int
    numel: int         # elements in the whole storage (a view may use fewer)
    location: str      # device it was saved from, e.g. "cpu"

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


@dataclass
class TensorRef:
    storage: StorageRef
    storage_offset: int            # in elements
    shape: tuple
    stride: tuple
    requires_grad: bool = False
    is_parameter: bool = False
    attrs: dict = field(default_factory=dict)  # python attributes pickled with the tensor (stage-3 "ds_id")

    @property
    def dtype(self) -> str:
        return self.storage.dtype

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def is_contiguous(self) -> bool:
        expected = 1
        for size, stride in reversed(list(zip(self.shape, self.stride))):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True


class ZeroStage(int):
    """Stand-in for deepspeed.runtime.zero.config.ZeroStageEnum (an int enum)."""
    _NAMES = {0: "disabled", 1: "optimizer_states", 2: "gradients", 3: "weights"}

    def __new__(cls, value):
        if type(value) is not int or value not in cls._NAMES:
            raise ValueError(f"unknown ZeroStageEnum value {value!r}")
        return super().__new__(cls, value)

    @property
    def name(self) -> str:
        return self._NAMES[int(self)]

    def __repr__(self):
        return f"ZeroStage.{self.name}"


class LossScalerState:
    """Stand-in for deepspeed LossScaler: keeps the pickled ``__dict__`` as ``state``."""
    kind = "LossScaler"

    def __init__(self, state=None):
        self.state = dict(state or {})

    def __setstate__(self, state):
        if not isinstance(state, dict):
            raise ValueError(f"{self.kind} state must be a dict, got {type(state).__name__}")
        self.state = dict(state)

    def __repr__(self):
        return f"{type(self).__name__}({self.state!r})"


class DynamicLossScalerState(LossScalerState):
    kind = "DynamicLossScaler"


@dataclass
class FragmentAddress:
    """Stand-in for deepspeed.utils.tensor_fragment.fragment_address (a dataclass)."""
    numel: int = 0
    start: int = 0

    def __setstate__(self, state):
        if not isinstance(state, dict) or set(state) != {"numel", "start"}:
            raise ValueError(f"bad fragment_address state {state!r}")
        self.numel, self.start = int(state["numel"]), int(state["start"])


class DType(str):
    """A torch dtype referenced by name (e.g. DynamicLossScaler.dtype = torch.float16)."""

    def __repr__(self):
        return f"torch.{str(self)}"


class _StorageType:
    """What ``torch.FloatStorage`` etc. resolve to; only usable inside a persistent id."""

    def __init__(self, name, dtype, itemsize):
        self.name, self.dtype, self.itemsize = name, dtype, itemsize

    def __repr__(self):
        return f"torch.{self.name}"


class _TensorClass:
    """What ``torch.Tensor`` resolves to; only usable as _rebuild_from_type_v2's new_type."""


_STORAGE_TYPES = {
    name: _StorageType(name, dtype, itemsize) for name, dtype, itemsize in [
        ("DoubleStorage", "float64", 8), ("FloatStorage", "float32", 4), ("HalfStorage", "float16", 2),
        ("BFloat16Storage", "bfloat16", 2), ("LongStorage", "int64", 8), ("IntStorage", "int32", 4),
        ("ShortStorage", "int16", 2), ("CharStorage", "int8", 1), ("ByteStorage", "uint8", 1),
        ("BoolStorage", "bool", 1), ("ComplexFloatStorage", "complex64", 8),
        ("ComplexDoubleStorage", "complex128", 16),
    ]
}
_DTYPES = {t.dtype for t in _STORAGE_TYPES.values()}


def _as_int_tuple(value, what):
    if not isinstance(value, tuple) or not all(type(v) is int for v in value):
        raise ValueError(f"{what} must be a tuple of ints, got {value!r}")
    return value


def _rebuild_tensor(storage, storage_offset, size, stride, requires_grad=False):
    if not isinstance(storage, StorageRef) or type(storage_offset) is not int or storage_offset < 0:
        raise ValueError("tensor must reference a storage at a non-negative offset")
    ref = TensorRef(storage, storage_offset, _as_int_tuple(size, "size"), _as_int_tuple(stride, "stride"),
                    bool(requires_grad))
    if len(ref.shape) != len(ref.stride) or any(s < 0 for s in ref.shape + ref.stride):
        raise ValueError(f"bad size/stride {ref.shape}/{ref.stride}")
    # Bounds check, so byte offsets computed from this ref always stay inside the storage.
    if ref.numel:
        last = storage_offset + sum((s - 1) * st for s, st in zip(ref.shape, ref.stride))
        if last >= storage.numel:
            raise ValueError(f"tensor view {ref.shape}@{storage_offset} exceeds storage of {storage.numel}")
    return ref


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad, backward_hooks, metadata=None):
    return _rebuild_tensor(storage, storage_offset, size, stride, requires_grad)


def _rebuild_parameter(data, requires_grad, backward_hooks):
    if not isinstance(data, TensorRef):
        raise ValueError("parameter must wrap a tensor")
    data.requires_grad, data.is_parameter = bool(requires_grad), True
    return data


def _rebuild_from_type_v2(func, new_type, args, state):
    # torch uses this for tensors that carry python attributes (ZeRO-3 flat groups carry ds_id).
    if func is not _rebuild_tensor_v2 or new_type is not _TensorClass or not isinstance(args, tuple):
        raise ValueError("_rebuild_from_type_v2 is only allowed for plain tensors")
    ref = func(*args)
    # state is a __dict__ or (__dict__, slots) as in torch._utils._set_obj_state.
    parts = state if isinstance(state, tuple) else (state,)
    for part in parts:
        if part is not None and not isinstance(part, dict):
            raise ValueError(f"bad tensor state {state!r}")
        ref.attrs.update(part or {})
    return ref


def _size(seq=()):
    return _as_int_tuple(tuple(seq), "torch.Size")


_ALLOWED = {
    ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type_v2,
    ("torch", "Tensor"): _TensorClass,
    ("torch", "Size"): _size,
    ("collections", "OrderedDict"): collections.OrderedDict,
    # Plain containers; protocol-2 pickles (torch.save) name builtins "__builtin__". Older
    # DeepSpeed (0.15) pickles a set in the model states.
    **{(module, name): container for module in ("builtins", "__builtin__")
       for name, container in (("set", set), ("frozenset", frozenset))},
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"): ZeroStage,
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"): LossScalerState,
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"): DynamicLossScalerState,
    ("deepspeed.utils.tensor_fragment", "fragment_address"): FragmentAddress,
    **{("torch", name): st for name, st in _STORAGE_TYPES.items()},
    **{("torch", name): DType(name) for name in _DTYPES},
}


class _RestrictedUnpickler(pickle.Unpickler):
    # find_class is the only way a pickle can obtain a callable (GLOBAL, STACK_GLOBAL, INST,
    # OBJ and EXT* all go through it), so REDUCE/NEWOBJ can only ever call the stand-ins above.

    def __init__(self, data: bytes, prefix: str, path: Path):
        super().__init__(io.BytesIO(data))
        self._prefix, self._path, self._storages = prefix, path, {}

    def find_class(self, module, name):
        try:
            return _ALLOWED[(module, name)]
        except KeyError:
            raise UnsafePickleError(
                f"{self._path}: data.pkl references global {module}.{name}, which is not allowlisted") from None

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], _StorageType) and isinstance(pid[2], str)
                and isinstance(pid[3], str) and type(pid[4]) is int and pid[4] >= 0):
            raise UnsafePickleError(f"{self._path}: unsupported persistent id {pid!r}")
        _, stype, key, location, numel = pid
        # Views of one flat buffer (ZeRO stage 1/2 modules) name the same storage once per
        # tensor: reuse the first StorageRef rather than build and compare a new one each time.
        known = self._storages.get(key)
        if known is not None:
            if (known.dtype, known.numel, known.location) != (stype.dtype, numel, location):
                raise TorchFileError(f"{self._path}: storage {key} referenced with conflicting types")
            return known
        ref = self._storages[key] = StorageRef(f"{self._prefix}/data/{key}", key, stype.dtype, stype.itemsize, numel, location)
        return ref


# --- zip handling ------------------------------------------------------------------------

# What zipfile raises on a hostile archive besides BadZipFile: OSError and ValueError for
# offsets outside the file or past 2**63, UnicodeDecodeError (a ValueError) for a name flagged
# UTF-8 that is not, NotImplementedError for a "version needed to extract" above 6.3 (or an
# unknown method), RuntimeError for encryption, EOFError and zlib.error for a cut or corrupt
# deflate stream.
_ZIP_ERRORS = (zipfile.BadZipFile, OSError, EOFError, ValueError, OverflowError, struct.error, zlib.error,
               NotImplementedError, RuntimeError)


def _open_zip(path: Path) -> zipfile.ZipFile:
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise TorchFileError(f"{path}: cannot read: {e}") from e
    if size == 0:
        raise TruncatedFile(f"{path}: file is empty")
    if not magic.startswith(b"PK"):
        hint = " (legacy non-zip torch format?)" if magic[:1] == b"\x80" else ""
        raise NotATorchFile(f"{path}: not a zip archive{hint}")
    try:
        zf = zipfile.ZipFile(path)
    except _ZIP_ERRORS as e:
        # A zip's directory is at its end: a cut-off file starts like a zip but has none.
        raise TruncatedFile(f"{path}: zip directory unreadable, file truncated or corrupt ({e})") from e
    names = zf.namelist()
    if len(set(names)) != len(names):
        # zipfile takes the last record of a name, other readers the first: which data.pkl
        # would torch.load unpickle? Not necessarily the one checked here.
        zf.close()
        twice = next(n for n in names if names.count(n) > 1)
        raise TorchFileError(f"{path}: zip lists member {twice} more than once")
    return zf


def _archive_prefix(zf: zipfile.ZipFile, path: Path) -> str:
    # Like torch's reader: the archive name is the directory of the first record.
    names = zf.namelist()
    prefix = names[0].split("/", 1)[0] if names and "/" in names[0] else None
    if prefix is None or f"{prefix}/data.pkl" not in names:
        raise NotATorchFile(f"{path}: zip has no <prefix>/data.pkl record")
    return prefix


def _read_member(zf: zipfile.ZipFile, info: zipfile.ZipInfo, limit: int, path: Path) -> bytes:
    """At most ``limit + 1`` bytes of a member. Like torch's reader, only stored or deflated
    members without encryption (bzip2 and lzma inflate without bound, chunk by chunk)."""
    if info.flag_bits & 0x1:
        raise TorchFileError(f"{path}: member {info.filename} is encrypted")
    if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
        raise TorchFileError(f"{path}: member {info.filename} uses compression method {info.compress_type}, "
                             "which torch does not read")
    try:
        with zf.open(info) as f:
            # Inflating allocates what is asked for: ask for no more than the member claims.
            return f.read(min(limit, info.file_size) + 1)
    except EOFError as e:
        raise TruncatedFile(f"{path}: {info.filename} is cut off ({e})") from e
    except _ZIP_ERRORS as e:
        raise TorchFileError(f"{path}: cannot read {info.filename} ({e})") from e


def read_pt_metadata(path, max_pickle_bytes: int = DEFAULT_MAX_PICKLE_BYTES) -> Any:
    """Unpickle ``data.pkl`` of a torch zip file safely; tensors become ``TensorRef``."""
    path = Path(path)
    with _open_zip(path) as zf:
        prefix = _archive_prefix(zf, path)
        infos = {info.filename: info for info in zf.infolist()}
        info = infos[f"{prefix}/data.pkl"]
        if info.file_size > max_pickle_bytes:
            raise TorchFileError(f"{path}: data.pkl is {info.file_size} bytes, over the {max_pickle_bytes} cap")
        byteorder = infos.get(f"{prefix}/byteorder")
        if byteorder is not None and _read_member(zf, byteorder, 16, path) != b"little":
            raise TorchFileError(f"{path}: only little-endian archives are supported")
        data = _read_member(zf, info, max_pickle_bytes, path)
    if len(data) > max_pickle_bytes:
        raise TorchFileError(f"{path}: data.pkl exceeds the {max_pickle_bytes} byte cap")
    try:
        return _RestrictedUnpickler(data, prefix, path).load()
    except TorchFileError:
        raise
    except Exception as e:  # malformed or hostile pickle: stand-ins raise ValueError/TypeError
        raise TorchFileError(f"{path}: malformed data.pkl: {type(e).__name__}: {e}") from e


def zip_member_locations(path) -> dict[str, tuple[int, int]]:
    """member name -> (absolute byte offset of its data, size in bytes); members must be stored."""
    path = Path(path)
    out = {}
    with _open_zip(path) as zf, open(path, "rb") as f:
        file_size = f.seek(0, io.SEEK_END)
        for info in zf.infolist():
            if info.compress_type != zipfile.ZIP_STORED:
                raise TorchFileError(f"{path}: member {info.filename} is compressed "
                                     f"(method {info.compress_type}); torch writes stored members")
            if info.flag_bits & 0x1:
                raise TorchFileError(f"{path}: member {info.filename} is encrypted")
            if info.compress_size != info.file_size:
                raise TorchFileError(f"{path}: stored member {info.filename} has two sizes, "
                                     f"{info.compress_size} and {info.file_size}")
            if not 0 <= info.header_offset <= file_size - _LOCAL_HEADER.size:
                raise TruncatedFile(f"{path}: local header of {info.filename} at byte {info.header_offset} "
                                    f"is outside the file ({file_size} bytes)")
            f.seek(info.header_offset)
            sig, name_len, extra_len = _LOCAL_HEADER.unpack(f.read(_LOCAL_HEADER.size))
            if sig != _LOCAL_HEADER_SIG:
                raise TorchFileError(f"{path}: bad local header signature for {info.filename}")
            offset = info.header_offset + _LOCAL_HEADER.size + name_len + extra_len
            if offset + info.file_size > file_size:
                raise TruncatedFile(f"{path}: member {info.filename} ends at byte "
                                    f"{offset + info.file_size}, file has {file_size}")
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
    base, size = locations[ref.storage.member]
    if size < ref.storage.nbytes:
        raise TruncatedFile(f"storage {ref.storage.member} has {size} bytes, expected {ref.storage.nbytes}")
    return base + ref.storage_offset * ref.storage.itemsize, ref.numel * ref.storage.itemsize
