"""The inert stand-ins the restricted reader of a DCP ``.metadata`` builds instead of torch's objects.

``torch.distributed.checkpoint`` pickles its ``Metadata`` (dataclasses built with NEWOBJ then BUILD, a
``torch.Size`` per shape, dtypes as globals, the layout and memory format by name, the save's path as a ``pathlib``
path; Megatron-core's ``torch_dist`` adds ``all_local_plans``, each rank's ``SavePlan``). Each allowlisted global
(``ALLOWED``) maps to a class or function here: a record class takes its state once, as a dict (or
``TensorProperties``' tuple); nothing here reads a file, imports a module or calls anything the pickle names.
``metadata.convert`` then reads these records field by field into plain, checked values: what a record holds is not
trusted before that.
"""

from __future__ import annotations

from typing import Any, ClassVar

from ...format.dtypes import ITEMSIZE

_METADATA = "torch.distributed.checkpoint.metadata"
_PLANNER = "torch.distributed.checkpoint.planner"
_MAX_NDIM = 64  # as the manifest schema and the .pt reader
_INT64 = 2**63


class Record:
    """A DCP dataclass as the pickle built it: NEWOBJ without arguments, then one BUILD with its state.
    ``__slots__`` and a ``__setstate__`` that runs once: the pickle cannot set attributes or build it twice."""

    __slots__ = ("state",)
    state: dict | tuple | None
    torch_name: ClassVar[str] = ""

    def __new__(cls, *args):
        if args:
            raise ValueError(f"{cls.torch_name} built with arguments {args!r}")
        self = object.__new__(cls)
        self.state = None
        return self

    def __init__(self, *args):  # REDUCE calls the class: as NEWOBJ, no arguments
        if args:
            raise ValueError(f"{self.torch_name} built with arguments {args!r}")

    def __setstate__(self, state):
        if self.state is not None:
            raise ValueError(f"{self.torch_name} built twice")
        if isinstance(state, tuple) and len(state) == 2 and state[0] is None and isinstance(state[1], dict):
            state = state[1]  # a slotted dataclass's (None, slots) form
        if not isinstance(state, (dict, tuple)):
            raise ValueError(f"{self.torch_name} state is a {type(state).__name__}")
        # What it holds is checked by metadata.convert, once the pickle has run to its end (a list it was given
        # may still grow until then).
        self.state = dict(state) if isinstance(state, dict) else tuple(state)

    def __repr__(self):
        return f"{self.torch_name}({self.state!r})"


def _record(name: str, module: str = _METADATA) -> type[Record]:
    return type(name, (Record,), {"__slots__": (), "torch_name": f"{module}.{name}"})


Metadata = _record("Metadata")
TensorStorageMetadata = _record("TensorStorageMetadata")
BytesStorageMetadata = _record("BytesStorageMetadata")
ChunkStorageMetadata = _record("ChunkStorageMetadata")
TensorProperties = _record("TensorProperties")
MetadataIndex = _record("MetadataIndex")
StorageMeta = _record("StorageMeta")
StorageInfo = _record("_StorageInfo", "torch.distributed.checkpoint.filesystem")
# Megatron-core's cache of each rank's save plan (``Metadata.all_local_plans``): kept as built, never used.
SavePlan = _record("SavePlan", _PLANNER)
WriteItem = _record("WriteItem", _PLANNER)
TensorWriteData = _record("TensorWriteData", _PLANNER)
BytesIOWriteData = _record("BytesIOWriteData", _PLANNER)


class DTypeName(str):
    """A torch dtype named by the pickle (``torch.float32``): its name, ``float32``."""

    __slots__ = ()

    def __setstate__(self, _):
        raise ValueError("the pickle sets the state of a dtype")


class Marker(str):
    """A layout or memory format by name (``torch.strided``, ``contiguous_format``)."""

    __slots__ = ()

    def __setstate__(self, _):
        raise ValueError("the pickle sets the state of a layout or memory format")


def size(seq=()):
    """``torch.Size(seq)``: a tuple of at most 64 ints in [0, 2**63)."""
    if type(seq) not in (tuple, list) or len(seq) > _MAX_NDIM:
        raise ValueError(f"torch.Size of {type(seq).__name__} {seq!r:.80}")
    if not all(type(v) is int and 0 <= v < _INT64 for v in seq):
        raise ValueError(f"torch.Size with a value that is no int64 size: {seq!r:.80}")
    return tuple(seq)


_LAYOUTS = frozenset({"torch.strided", "torch.sparse_coo", "torch.sparse_csr", "torch._mkldnn", "torch.jagged"})


def get_layout(name):
    """``torch.serialization._get_layout(name)``: the name, if it is a layout's."""
    if name not in _LAYOUTS:
        raise ValueError(f"unknown layout {name!r:.80}")
    return Marker(name)


_MEMORY_FORMATS = {0: "contiguous_format", 1: "channels_last", 2: "preserve_format"}


def memory_format(value):
    """``_MEM_FORMAT_ENCODING(value)``: the enum's member, by name."""
    if type(value) is not int or value not in _MEMORY_FORMATS:
        raise ValueError(f"unknown memory format encoding {value!r:.80}")
    return Marker(_MEMORY_FORMATS[value])


_WRITE_ITEM_TYPES = {1: "TENSOR", 2: "SHARD", 3: "BYTE_IO"}


def write_item_type(value):
    """``WriteItemType(value)``: the enum's member, by name."""
    if type(value) is not int or value not in _WRITE_ITEM_TYPES:
        raise ValueError(f"unknown WriteItemType {value!r:.80}")
    return Marker(_WRITE_ITEM_TYPES[value])


def path(*parts):
    """``pathlib.PosixPath(*parts)`` (the save's ``checkpoint_id``): the path as text, never touched."""
    if not parts or not all(type(p) is str and len(p) < 4096 for p in parts):
        raise ValueError("a path of something other than text")
    return "/".join(parts)


ALLOWED: dict[tuple[str, str], Any] = {
    **{
        (_METADATA, r.torch_name.rsplit(".", 1)[1]): r
        for r in (
            Metadata,
            TensorStorageMetadata,
            BytesStorageMetadata,
            ChunkStorageMetadata,
            TensorProperties,
            MetadataIndex,
            StorageMeta,
        )
    },  # fmt: skip
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): StorageInfo,
    **{(_PLANNER, r.torch_name.rsplit(".", 1)[1]): r for r in (SavePlan, WriteItem, TensorWriteData, BytesIOWriteData)},
    (_PLANNER, "WriteItemType"): write_item_type,
    ("torch", "Size"): size,
    ("torch.serialization", "_get_layout"): get_layout,
    (_METADATA, "_MEM_FORMAT_ENCODING"): memory_format,
    ("pathlib", "PosixPath"): path,
    ("pathlib", "PurePosixPath"): path,
    ("pathlib", "WindowsPath"): path,
    ("pathlib", "PureWindowsPath"): path,
    **{("torch", name): DTypeName(name) for name in ITEMSIZE},
}
