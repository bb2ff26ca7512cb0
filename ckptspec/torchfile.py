"""Read the structure of torch ``.pt`` files without torch, deepspeed or unsafe unpickling.

A ``torch.save`` file is an uncompressed zip: ``<prefix>/data.pkl`` (the object tree, with
tensors as persistent references to storages) and ``<prefix>/data/<key>`` (raw storage bytes).
``read_pt_metadata`` unpickles only ``data.pkl``, with a restricted unpickler whose globals
come from a fixed allowlist and are replaced by inert local stand-ins (``TensorRef`` etc.).
No tensor bytes are read. ``zip_member_locations`` gives the byte range of each member, so a
tensor's bytes can later be read (or hashed) directly from the file.

Every way a hostile file can go wrong ends in a ``TorchFileError`` (zipfile's own exceptions
included); members are read only if stored or deflated, and never past the size they claim.
Before unpickling, a scan of the opcodes refuses memo indices that would make the C unpickler
allocate memory in proportion to them, and tuples nested deeper than ``MAX_NESTING`` (hashing one
recurses in C and can crash the interpreter); after it, the result must be a tree a recursive
walker can handle (no cycles, at most ``MAX_NESTING`` deep, not exponentially large through
shared references).
The stand-ins refuse the BUILD opcode, so a pickle cannot edit them after they were checked, nor
the allowlisted globals every later read in the process shares.
Every storage a tensor names must be a member of the archive holding the storage's bytes, and
shapes are int64 values in at most ``MAX_NDIM`` dimensions.

Standard library only: this module must stay importable where torch is not installed.
"""
from __future__ import annotations

import collections
import io
import pickle
import reprlib
import struct
import zipfile
import zlib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Iterator

__all__ = [
    "TorchFileError", "NotATorchFile", "UnsafePickleError", "TruncatedFile",
    "StorageRef", "TensorRef", "ZeroStage", "LossScalerState", "DynamicLossScalerState",
    "FragmentAddress", "DType",
    "read_pt_metadata", "zip_member_locations", "iter_tensor_refs", "tensor_byte_range",
]

DEFAULT_MAX_PICKLE_BYTES = 64 * 1024 * 1024  # data.pkl holds names/shapes only; huge means hostile
MAX_NESTING = 100  # containers in a DeepSpeed checkpoint nest about 6 deep
MAX_NDIM = 64      # as the manifest schema
_INT64 = 2**63     # torch sizes, strides, offsets and numels are int64

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

class _Sealed:
    """Refuses the pickle's BUILD opcode. BUILD calls ``__setstate__`` when an object has one
    (the class itself included), and otherwise writes into its ``__dict__`` or sets its
    attributes: that would let a pickle edit a stand-in after it was checked, or an allowlisted
    global that every later read in the process shares (``torch.FloatStorage``'s itemsize,
    ``torch.Size``'s defaults)."""

    __slots__ = ()

    def __setstate__(*_):
        raise ValueError("data.pkl sets the state of an object only the reader may build")


class _SealedRecord(_Sealed):
    __slots__ = ()

    def __reduce__(self):  # copy and pickle rebuild through the constructor, never through __setstate__
        return type(self), tuple(getattr(self, f.name) for f in fields(self))


@dataclass(frozen=True)
class StorageRef(_SealedRecord):
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
class TensorRef(_SealedRecord):
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


class ZeroStage(_Sealed, int):
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

    def __new__(cls, *args):
        self = super().__new__(cls)
        self.state = {}  # also when the pickle builds it with NEWOBJ and sets no state
        return self

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


class DType(_Sealed, str):
    """A torch dtype referenced by name (e.g. DynamicLossScaler.dtype = torch.float16)."""

    def __repr__(self):
        return f"torch.{str(self)}"


class _StorageType(_Sealed):
    """What ``torch.FloatStorage`` etc. resolve to; only usable inside a persistent id."""

    __slots__ = ("name", "dtype", "itemsize")

    def __init__(self, name, dtype, itemsize):
        self.name, self.dtype, self.itemsize = name, dtype, itemsize

    def __repr__(self):
        return f"torch.{self.name}"


class _TensorClass(_Sealed):
    """What ``torch.Tensor`` resolves to; only usable as _rebuild_from_type_v2's new_type."""


class _Callable(_Sealed):
    """An allowlisted function as the pickle sees it: callable, but sealed (see _Sealed)."""

    __slots__ = ("function",)

    def __init__(self, function):
        self.function = function

    def __call__(self, *args):
        return self.function(*args)

    def __repr__(self):
        return f"<allowlisted {self.function.__name__}>"


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


def _as_int_tuple(value, what, minimum=0):
    # Bounded like torch's int64 sizes and the schema's 64 dimensions: products and sums of
    # these stay small (a million-digit or million-dimension "shape" makes numel quadratic).
    if (not isinstance(value, tuple) or len(value) > MAX_NDIM
            or not all(type(v) is int and minimum <= v < _INT64 for v in value)):
        raise ValueError(f"{what} must be a tuple of at most {MAX_NDIM} ints in [{minimum}, 2**63), "
                         f"got {reprlib.repr(value)}")
    return value


def _rebuild_tensor(storage, storage_offset, size, stride, requires_grad=False):
    if (not isinstance(storage, StorageRef) or type(storage_offset) is not int
            or not 0 <= storage_offset < _INT64):
        raise ValueError("tensor must reference a storage at a non-negative offset")
    ref = TensorRef(storage, storage_offset, _as_int_tuple(size, "size"), _as_int_tuple(stride, "stride"),
                    bool(requires_grad))
    if len(ref.shape) != len(ref.stride):
        raise ValueError(f"bad size/stride {ref.shape}/{ref.stride}")
    # Bounds check, so byte offsets computed from this ref always stay inside the storage.
    if ref.numel:
        last = storage_offset + sum((s - 1) * st for s, st in zip(ref.shape, ref.stride))
        if last >= storage.numel:
            raise ValueError(f"tensor view {ref.shape}@{storage_offset} exceeds storage of {storage.numel}")
    elif storage_offset > storage.numel:  # an empty view may sit at the storage's end, not past it
        raise ValueError(f"empty tensor view @{storage_offset} is past the end of its storage of {storage.numel}")
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
    if (func is not _ALLOWED[("torch._utils", "_rebuild_tensor_v2")] or new_type is not _TensorClass
            or not isinstance(args, tuple)):
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
    return _as_int_tuple(tuple(seq), "torch.Size", -_INT64)


def _codecs_encode(text, encoding):
    # How protocol 2 pickles a non-empty bytes object: _codecs.encode(text, "latin1").
    if type(text) is not str or encoding != "latin1":
        raise ValueError("_codecs.encode is only allowed as protocol 2 writes bytes")
    return text.encode("latin1")


def _empty_bytes():  # how protocol 2 pickles b""
    return b""


# Nothing here may return a tuple holding tuples: _scan_pickle counts a call's result as one
# tuple level when it bounds how deep tuples nest.
_ALLOWED = {
    ("torch._utils", "_rebuild_tensor"): _Callable(_rebuild_tensor),
    ("torch._utils", "_rebuild_tensor_v2"): _Callable(_rebuild_tensor_v2),
    ("torch._utils", "_rebuild_parameter"): _Callable(_rebuild_parameter),
    ("torch._tensor", "_rebuild_from_type_v2"): _Callable(_rebuild_from_type_v2),
    ("torch", "Tensor"): _TensorClass,
    ("torch", "Size"): _Callable(_size),
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("_codecs", "encode"): _Callable(_codecs_encode),
    # Plain containers; protocol-2 pickles (torch.save) name builtins "__builtin__". Older
    # DeepSpeed (0.15) pickles a set in the model states.
    **{(module, name): container for module in ("builtins", "__builtin__")
       for name, container in (("set", set), ("frozenset", frozenset), ("bytes", _Callable(_empty_bytes)))},
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

    def __init__(self, data: bytes, prefix: str, path: Path, member_sizes: dict[str, int]):
        super().__init__(io.BytesIO(data))
        self._prefix, self._path, self._storages, self._member_sizes = prefix, path, {}, member_sizes

    def find_class(self, module, name):
        try:
            return _ALLOWED[(module, name)]
        except KeyError:
            raise UnsafePickleError(
                f"{self._path}: data.pkl references global {module}.{name}, which is not allowlisted") from None

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], _StorageType) and isinstance(pid[2], str)
                and isinstance(pid[3], str) and type(pid[4]) is int and 0 <= pid[4] < _INT64):
            raise UnsafePickleError(f"{self._path}: unsupported persistent id {pid!r}")
        _, stype, key, location, numel = pid
        # Views of one flat buffer (ZeRO stage 1/2 modules) name the same storage once per
        # tensor: reuse the first StorageRef rather than build and compare a new one each time.
        known = self._storages.get(key)
        if known is not None:
            if (known.dtype, known.numel, known.location) != (stype.dtype, numel, location):
                raise TorchFileError(f"{self._path}: storage {key} referenced with conflicting types")
            return known
        ref = StorageRef(f"{self._prefix}/data/{key}", key, stype.dtype, stype.itemsize, numel, location)
        # Every storage is a member holding its bytes, so offsets computed from a ref stay inside it.
        size = self._member_sizes.get(ref.member)
        if size is None:
            raise TorchFileError(f"{self._path}: data.pkl names storage {key!r}, which is not in the archive")
        if size < ref.nbytes:
            raise TruncatedFile(f"{self._path}: storage {key!r} holds {size} bytes, data.pkl says "
                                f"{numel} x {stype.itemsize}")
        self._storages[key] = ref
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
        _scan_pickle(data)
        obj = _RestrictedUnpickler(data, prefix, path, {n: i.file_size for n, i in infos.items()}).load()
        _check_tree(obj, 2 * len(data) + 1_000_000)
        return obj
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


# --- checks around the unpickler ------------------------------------------------------------

# Opcode argument layouts (pickletools' table, by opcode byte) and, for _scan_pickle's general
# path, their effect on the stack.
_FIXED = {**dict.fromkeys(b"KhqCU\x80\x82\x8c\x8a", 1), **dict.fromkeys(b"M\x83", 2),
          **dict.fromkeys(b"Jjr\x84TBX\x8b", 4), **dict.fromkeys(b"G\x95\x8d\x8e\x96", 8)}
_COUNTED = frozenset(b"CU\x8c\x8aTBX\x8b\x8d\x8e\x96")  # the argument is a byte count; the bytes follow
_LINES = {**dict.fromkeys(b"ILFSVgpP", 1), **dict.fromkeys(b"ci", 2)}
_NO_ARG = frozenset(b"(.012NRabd}elo]st)uQ\x81\x85\x86\x87\x88\x89\x8f\x90\x91\x92\x93\x94\x97\x98")
_PUSH = frozenset(b"N\x88\x89KMJGILFSVUC\x8c\x8aTBX\x8b\x8d\x8e\x96]}\x8fc\x82\x83\x84P\x97")  # push one non-tuple


def _scan_pickle(data: bytes) -> None:
    """Walk the opcodes of ``data`` as the unpickler will, before it runs, and refuse what
    would harm the process: a memo index past the pickle's length (the C unpickler grows its
    memo array to twice the index: a 9-byte pickle could claim 32 GB), and tuples nested more
    than MAX_NESTING deep (hashing one, as a dict key or set element, recurses in C without a
    limit and crashes the interpreter). Tracks the tuple depth of every stack slot and memo
    entry; anything but a tuple counts 0 (other containers are unhashable or, for frozenset,
    hash without recursing), and a call's result counts 1 (see _ALLOWED). Anything the
    unpickler would fail on (an unknown opcode, a cut argument, a missing MARK) fails here.
    """
    n = len(data)
    pos, stack, marks, memo = 0, [], [], {}
    push, pop, from_bytes = stack.append, stack.pop, int.from_bytes

    def to_mark():
        if not marks:
            raise ValueError(f"no MARK before byte {pos}")
        items = stack[marks[-1]:]
        del stack[marks.pop():]
        return items

    def tuple_of(items):
        depth = 1 + max(items, default=0)
        if depth > MAX_NESTING:
            raise ValueError(f"tuples nest deeper than {MAX_NESTING} levels at byte {pos}")
        return depth

    def put(index):
        if not 0 <= index < n:
            raise ValueError(f"memo index {index} at byte {pos} is beyond the pickle's {n} bytes")
        memo[index] = stack[-1]

    try:
        while True:
            op = data[pos]
            # The opcodes torch.save writes most, argument and stack effect in one go.
            if op == 0x72:  # LONG_BINPUT (put() inlined: this is a quarter of all opcodes)
                index = from_bytes(data[pos + 1:pos + 5], "little")
                if index >= n:
                    put(index)
                memo[index] = stack[-1]
                pos += 5
            elif op == 0x4B:  # BININT1
                push(0)
                pos += 2
            elif op == 0x68:  # BINGET
                push(memo[data[pos + 1]])
                pos += 2
            elif op == 0x52:  # REDUCE
                pop()
                stack[-1] = 1
                pos += 1
            elif op == 0x86:  # TUPLE2
                b = pop()
                a = stack[-1]
                if a or b:
                    stack[-1] = tuple_of((a, b))
                else:
                    stack[-1] = 1
                pos += 1
            elif op == 0x28:  # MARK
                marks.append(len(stack))
                pos += 1
            elif op == 0x74:  # TUPLE
                push(tuple_of(to_mark()))
                pos += 1
            elif op == 0x6A:  # LONG_BINGET
                push(memo[from_bytes(data[pos + 1:pos + 5], "little")])
                pos += 5
            elif op == 0x4A:  # BININT
                push(0)
                pos += 5
            elif op == 0x58:  # BINUNICODE
                pos += 5 + from_bytes(data[pos + 1:pos + 5], "little")
                push(0)
            elif op == 0x29:  # EMPTY_TUPLE
                push(1)
                pos += 1
            elif op == 0x51:  # BINPERSID
                stack[-1] = 0
                pos += 1
            elif op == 0x89 or op == 0x88 or op == 0x4E:  # NEWFALSE, NEWTRUE, NONE
                push(0)
                pos += 1
            elif op == 0x85:  # TUPLE1
                stack[-1] = tuple_of((stack[-1],))
                pos += 1
            elif op == 0x71:  # BINPUT
                put(data[pos + 1])
                pos += 2
            elif op == 0x2E:  # STOP
                return
            else:
                pos = _scan_rare(op, data, pos, stack, marks, memo, to_mark, tuple_of, put)
    except IndexError:
        raise ValueError("pickle data was truncated, or an opcode finds too few values on the stack") from None
    except KeyError as e:
        raise ValueError(f"memo value not found at index {e}") from None


def _scan_rare(op, data, pos, stack, marks, memo, to_mark, tuple_of, put):
    """_scan_pickle for every other opcode: returns the position of the next one."""
    start = pos
    pos += 1
    width = _FIXED.get(op)
    if width is not None:
        if pos + width > len(data):
            raise IndexError
        arg = int.from_bytes(data[pos:pos + width], "little")
        pos += width + (arg if op in _COUNTED else 0)
    elif op in _LINES:
        line_start = pos
        for _ in range(_LINES[op]):
            end = data.find(b"\n", pos)
            if end < 0:
                raise IndexError
            pos = end + 1
        if op == 0x70:  # PUT
            put(int(data[line_start:pos]))
            return pos
        if op == 0x67:  # GET
            stack.append(memo[int(data[line_start:pos])])
            return pos
    elif op not in _NO_ARG:
        raise ValueError(f"unknown opcode {op:#04x} at byte {start}")
    if op in _PUSH:
        stack.append(0)
    elif op == 0x68 or op == 0x6A:  # BINGET, LONG_BINGET
        stack.append(memo[arg])
    elif op == 0x71 or op == 0x72:  # BINPUT, LONG_BINPUT
        put(arg)
    elif op == 0x94:  # MEMOIZE: the next free index, like the unpickler's
        memo[len(memo)] = stack[-1]
    elif op == 0x87:  # TUPLE3
        items = stack[-3:]
        if len(items) < 3:
            raise IndexError
        del stack[-3:]
        stack.append(tuple_of(items))
    elif op in b"ld\x91":  # LIST, DICT, FROZENSET: the items since MARK become one value
        to_mark()
        stack.append(0)
    elif op in b"io":  # INST, OBJ: a call on the items since MARK
        to_mark()
        stack.append(1)
    elif op in b"eu\x901":  # APPENDS, SETITEMS, ADDITEMS, POP_MARK
        to_mark()
    elif op == 0x30:  # POP: an item, or the MARK on top
        if marks and marks[-1] == len(stack):
            marks.pop()
        else:
            stack.pop()
    elif op == 0x32:  # DUP
        stack.append(stack[-1])
    elif op in b"ab":  # APPEND, BUILD
        stack.pop()
    elif op == 0x73:  # SETITEM
        stack.pop(), stack.pop()
    elif op in b"\x81\x93":  # NEWOBJ, STACK_GLOBAL: two values -> one
        stack.pop()
        stack[-1] = 1
    elif op == 0x92:  # NEWOBJ_EX
        stack.pop(), stack.pop()
        stack[-1] = 1
    elif op == 0x98:  # READONLY_BUFFER
        stack[-1]
    # Everything else (PROTO, FRAME, and the opcodes _scan_pickle handles itself) only has its argument.
    return pos


_LEAVES = frozenset({str, int, float, bool, type(None), bytes, StorageRef, ZeroStage, DType, FragmentAddress})


def _children(obj):
    if isinstance(obj, (list, tuple, set, frozenset)):
        return obj
    if isinstance(obj, dict):
        extra = getattr(obj, "__dict__", None)  # an OrderedDict's attributes (BUILD)
        return (*obj.keys(), *obj.values(), *([extra] if extra else []))
    if isinstance(obj, TensorRef):
        return (obj.attrs,) if obj.attrs else None
    if isinstance(obj, LossScalerState):
        return (obj.state,)
    return None


def _check_tree(root, max_nodes: int) -> None:
    """The unpickled object must be a tree as a recursive walker sees it: no cycles, at most
    MAX_NESTING deep, at most ``max_nodes`` nodes when a shared object counts once per place
    it appears (the memo can share one list at every level: 2**64 paths from 700 bytes).
    Iterative, and each shared object is measured once."""
    done: dict[int, tuple[int, int]] = {}  # id -> (nodes, height) of a finished container
    if _children(root) is None:
        return
    path = {id(root)}
    stack = [[root, iter(_children(root)), 1, 0]]  # object, its children, nodes so far, tallest child
    leaves = _LEAVES
    while stack:
        frame = stack[-1]
        for child in frame[1]:
            if type(child) in leaves:
                frame[2] += 1
                continue
            kids = _children(child)
            if kids is None:
                frame[2] += 1
                continue
            known = done.get(id(child))
            if known is not None:
                if len(stack) + known[1] > MAX_NESTING:
                    raise ValueError(f"data.pkl nests deeper than {MAX_NESTING} levels")
                frame[2] += known[0]
                frame[3] = max(frame[3], known[1])
                continue
            if id(child) in path:
                raise ValueError("data.pkl holds a reference cycle")
            if len(stack) >= MAX_NESTING:
                raise ValueError(f"data.pkl nests deeper than {MAX_NESTING} levels")
            path.add(id(child))
            stack.append([child, iter(kids), 1, 0])
            break
        else:
            stack.pop()
            obj, nodes, height = frame[0], frame[2], frame[3] + 1
            if nodes > max_nodes:
                raise ValueError(f"data.pkl's objects, counted once per place they appear, exceed {max_nodes}")
            done[id(obj)] = (nodes, height)
            path.discard(id(obj))
            if stack:
                stack[-1][2] += nodes
                stack[-1][3] = max(stack[-1][3], height)


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
        raise TorchFileError(f"storage {ref.storage.member} is not in the archive")
    base, size = locations[ref.storage.member]
    if size < ref.storage.nbytes:
        raise TruncatedFile(f"storage {ref.storage.member} has {size} bytes, expected {ref.storage.nbytes}")
    return base + ref.storage_offset * ref.storage.itemsize, ref.numel * ref.storage.itemsize
