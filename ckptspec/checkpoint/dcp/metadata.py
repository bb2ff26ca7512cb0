"""Read a torch Distributed Checkpoint's ``.metadata`` without torch and without running its pickle.

A DCP directory (``dcp.save``) holds ``.metadata``, a pickle of ``torch.distributed.checkpoint.metadata.Metadata``,
and the ``.distcp`` files its storage items point into. ``torch.distributed.checkpoint`` reads ``.metadata`` with
``pickle.load``: a forged one runs whatever it names. ``read_metadata`` refuses one larger than the pickle cap
before reading it (CK225), scans its opcodes (``pickle_scan``), unpickles it with an allowlist of inert stand-ins
(``standins``; any other global refused by name, CK204) and converts the stand-ins field by field into the
frozen records below (anything else: CK205, the field named). Standard library only.
"""

from __future__ import annotations

import io
import math
import os
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ...errors import FileUnreadable, PickleOverCap, TorchFileError, UnsafePickleError
from ...location import AnyPath, RemotePath, location, open_binary
from ..pickle_scan import scan_pickle
from ..torchfile import pickle_cap
from . import standins
from .standins import ALLOWED, Record

if TYPE_CHECKING:
    from .megatron import MegatronParts

METADATA_NAME = ".metadata"


@dataclass(frozen=True)
class Chunk:
    """One saved piece of a tensor: where it starts in the whole tensor and its sizes."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


@dataclass(frozen=True)
class TensorEntry:
    """A tensor of the saved state dict: its dtype, whole size and chunks (``TensorStorageMetadata``)."""

    dtype: str
    size: tuple[int, ...]
    chunks: tuple[Chunk, ...]


@dataclass(frozen=True)
class BytesEntry:
    """A value saved as bytes (``BytesStorageMetadata``): a ``torch.save`` pickle of any object. Listed, never read."""


@dataclass(frozen=True)
class Item:
    """A storage item: one chunk of a tensor (``index`` among chunks at ``offset``), or a bytes value, and where
    its bytes are (``_StorageInfo``): ``length`` bytes at ``offset`` of ``file``."""

    fqn: str
    chunk_offset: tuple[int, ...] | None
    index: int | None
    file: str
    offset: int
    length: int


@dataclass(frozen=True)
class DcpMetadata:
    entries: dict[str, TensorEntry | BytesEntry]
    items: tuple[Item, ...]
    version: str | None
    size: int  # of .metadata, in bytes
    megatron: MegatronParts | None = None  # a Megatron-core torch_dist save's metadata.json and common.pt

    @property
    def files(self) -> list[str]:
        return sorted({item.file for item in self.items})


def is_dcp(name: AnyPath) -> bool:
    """A torch DCP checkpoint: a directory, local or at a URL, that holds a ``.metadata`` file. The one test every
    command makes before it reads a directory as a DeepSpeed checkpoint."""
    where = location(name)
    return where.is_dir() and (where / METADATA_NAME).is_file()


class _Unpickler(pickle.Unpickler):
    # find_class is the only way a pickle obtains a callable: REDUCE, NEWOBJ and BUILD reach the stand-ins only.
    def __init__(self, data: bytes, path: Path | RemotePath):
        super().__init__(io.BytesIO(data))
        self._path = path

    def find_class(self, module, name):
        try:
            return ALLOWED[(module, name)]
        except KeyError:
            raise UnsafePickleError(
                self._path, f".metadata references global {module}.{name}, which is not allowlisted"
            ) from None

    def persistent_load(self, pid):
        raise TorchFileError(self._path, f".metadata holds a persistent id {pid!r:.80}, which DCP never writes")


def read_metadata(directory: Path | RemotePath) -> DcpMetadata:
    """The checked ``.metadata`` of the DCP checkpoint in ``directory`` (local or at a URL: ranged reads, the size
    refused before a byte is read); raises a ``CkptspecError``."""
    path = directory / METADATA_NAME
    cap = pickle_cap()
    try:
        with open_binary(path) as fh:
            size = fh.seek(0, os.SEEK_END)
            if size > cap:
                raise PickleOverCap(path, f".metadata holds {size} bytes, over the cap of {cap}")
            fh.seek(0)
            data = fh.read(size + 1)  # a byte past the size seen: a file that grew past the cap is refused
    except OSError as exc:
        raise FileUnreadable(path, exc) from None
    if len(data) > cap:  # grew while read
        raise PickleOverCap(path, f".metadata holds over {cap} bytes, the cap")
    try:
        scan_pickle(data)
        root = _Unpickler(data, path).load()
    except (UnsafePickleError, TorchFileError):
        raise
    except RecursionError:
        raise TorchFileError(path, ".metadata nests too deep to read") from None
    except Exception as exc:  # any way the pickle is not one DCP wrote: damaged, never run
        raise TorchFileError(path, f".metadata is not a DCP metadata pickle: {exc}") from None
    try:
        return convert(root, len(data))
    except ValueError as exc:
        raise TorchFileError(path, f".metadata is not a DCP metadata pickle: {exc}") from None


def _state(obj, kind: type[Record], what: str) -> dict:
    if type(obj) is not kind or not isinstance(obj.state, dict):
        raise ValueError(f"{what} is {'an unbuilt ' if type(obj) is kind else 'a '}{type(obj).__name__}")
    return obj.state


def _int(value, what: str, low: int = 0) -> int:
    if type(value) is not int or not low <= value < 2**63:
        raise ValueError(f"{what} is {value!r:.80}, not an int64 >= {low}")
    return value


def _shape(value, what: str, ndim: int | None = None) -> tuple[int, ...]:
    if type(value) is not tuple or (ndim is not None and len(value) != ndim):
        raise ValueError(f"{what} is {value!r:.80}, not a torch.Size" + (f" of {ndim} dimensions" if ndim else ""))
    return value  # standins.size checked its values


def _tensor(fqn: str, obj) -> TensorEntry:
    state = _state(obj, standins.TensorStorageMetadata, fqn)
    props = state.get("properties")
    if type(props) is not standins.TensorProperties or not isinstance(props.state, (tuple, dict)):
        raise ValueError(f"{fqn}: properties are {type(props).__name__}")
    dtype = props.state[0] if isinstance(props.state, tuple) and props.state else None
    if isinstance(props.state, dict):
        dtype = props.state.get("dtype")
    if type(dtype) is not standins.DTypeName:
        raise ValueError(f"{fqn}: dtype {dtype!r:.80} is no torch dtype")
    whole = _shape(state.get("size"), f"{fqn}: size")
    chunks = state.get("chunks")
    if type(chunks) is not list:
        raise ValueError(f"{fqn}: chunks are {type(chunks).__name__}, not a list")
    out = []
    for i, chunk in enumerate(chunks):
        c = _state(chunk, standins.ChunkStorageMetadata, f"{fqn}: chunk {i}")
        offsets = _shape(c.get("offsets"), f"{fqn}: chunk {i} offsets", len(whole))
        sizes = _shape(c.get("sizes"), f"{fqn}: chunk {i} sizes", len(whole))
        out.append(Chunk(offsets, sizes))
    return TensorEntry(str(dtype), whole, tuple(out))


def _item(key, info) -> Item:
    k = _state(key, standins.MetadataIndex, "a storage_data key")
    fqn = k.get("fqn")
    if type(fqn) is not str:
        raise ValueError(f"a storage_data key names {fqn!r:.80}")
    offset, index = k.get("offset"), k.get("index")
    if offset is not None:
        offset = _shape(offset, f"{fqn}: storage key offset")
    if index is not None:
        index = _int(index, f"{fqn}: storage key index")
    s = _state(info, standins.StorageInfo, f"{fqn}: storage info")
    file = s.get("relative_path")
    if type(file) is not str:
        raise ValueError(f"{fqn}: relative_path {file!r:.80}")
    if s.get("transform_descriptors") not in (None, [], ()):
        raise ValueError(f"{fqn}: transform_descriptors {s['transform_descriptors']!r:.80} (compressed items)")
    start, length = _int(s.get("offset"), f"{fqn}: offset"), _int(s.get("length"), f"{fqn}: length")
    return Item(fqn, offset, index, file, start, length)


def _plans(value) -> None:
    """Megatron-core's ``all_local_plans`` (torch_dist: each rank's ``SavePlan``, kept to reuse at the next save):
    a list of plans or absent. Not used: the storage items say where every byte is."""
    if value is None:
        return
    if type(value) is not list or not all(type(p) is standins.SavePlan for p in value):
        raise ValueError(f"all_local_plans is {type(value).__name__}, not a list of SavePlan")


def convert(root, size: int) -> DcpMetadata:
    """The stand-ins of an unpickled ``.metadata`` as checked records; ``ValueError`` names what is wrong."""
    state = _state(root, standins.Metadata, ".metadata's root")
    sdm = state.get("state_dict_metadata")
    if type(sdm) is not dict:
        raise ValueError(f"state_dict_metadata is {type(sdm).__name__}")
    entries: dict[str, TensorEntry | BytesEntry] = {}
    for fqn, value in sdm.items():
        if type(fqn) is not str:
            raise ValueError(f"a state dict key is {fqn!r:.80}")
        if type(value) is standins.BytesStorageMetadata:
            entries[fqn] = BytesEntry()
        else:
            entries[fqn] = _tensor(fqn, value)
    storage = state.get("storage_data")
    if type(storage) is not dict:
        raise ValueError(f"storage_data is {type(storage).__name__} (a DCP save's FileSystemWriter writes a dict)")
    items = tuple(_item(key, info) for key, info in storage.items())
    _plans(state.get("all_local_plans"))
    version = state.get("version")
    return DcpMetadata(entries, items, version if type(version) is str else None, size)
