"""Write DeepSpeed's pickled checkpoint files with torch.save, without importing DeepSpeed.

DeepSpeed's optimizer-state files hold a few DeepSpeed objects (the loss scaler, ``ZeroStageEnum``,
``fragment_address``). The restricted reader turns them into inert stand-ins
(``checkpoint/standins.py``); here they become proxies that pickle under DeepSpeed's own global
names (a ``GLOBAL`` opcode naming ``deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler``...), so
``torch.load`` in the job builds the real objects, exactly as DeepSpeed pickles them (NEWOBJ +
BUILD for the scaler and the dataclass, a call for the enum). Tensors are real torch tensors made
from numpy arrays (``torch.from_numpy``: no copy).
"""

from __future__ import annotations

import collections
import copyreg
import math
import pickle
import types
from pathlib import Path
from typing import Any

from ..checkpoint.standins import DType, FragmentAddress, LossScalerState, TensorRef, ZeroStage
from ..format.dtypes import ITEMSIZE

LOSS_SCALER_MODULE = "deepspeed.runtime.fp16.loss_scaler"
ZERO_STAGE = ("deepspeed.runtime.zero.config", "ZeroStageEnum")
FRAGMENT_ADDRESS = ("deepspeed.utils.tensor_fragment", "fragment_address")

_CLASSES: dict[tuple[str, str], type] = {}


def _global(module: str, name: str) -> type:
    """A placeholder class that pickles as the global ``module.name`` (see ``_Pickler.save_global``)."""
    key = (module, name)
    if key not in _CLASSES:
        _CLASSES[key] = type(name, (), {"__module__": module, "__qualname__": name, "_ckptspec_global": key})
    return _CLASSES[key]


def _object(module: str, name: str, state: dict):
    """An instance of a DeepSpeed class, pickled as ``cls.__new__(cls)`` + ``__dict__`` update (BUILD)."""
    obj: Any = object.__new__(_global(module, name))  # a made class: its attributes are set here
    obj._ckptspec_state = state
    return obj


class _Enum:
    """A DeepSpeed enum member, pickled as ``cls(value)``."""

    def __init__(self, module: str, name: str, value: Any):
        self.cls, self.value = _global(module, name), value


def loss_scaler(kind: str, state: dict) -> Any:
    return _object(LOSS_SCALER_MODULE, kind, state)


def zero_stage(stage: int) -> _Enum:
    return _Enum(*ZERO_STAGE, int(stage))


def fragment_address(numel: int, start: int) -> Any:
    return _object(*FRAGMENT_ADDRESS, {"numel": int(numel), "start": int(start)})


# The type: ignores below: CPython's pure-Python pickler (save_global, write, memoize) and copyreg.__newobj__
# are implementation details typeshed does not describe; this module relies on them on purpose.
class _Pickler(pickle._Pickler):  # the Python pickler: its save_global can be extended
    def reducer_override(self, obj):
        if not isinstance(obj, type) and hasattr(type(obj), "_ckptspec_global"):
            return copyreg.__newobj__, (type(obj),), obj._ckptspec_state  # type: ignore[attr-defined]
        if isinstance(obj, _Enum):
            return obj.cls, (obj.value,)
        return NotImplemented

    def save_global(self, obj, name=None):
        key = getattr(obj, "_ckptspec_global", None) if isinstance(obj, type) else None
        if key is None:
            return super().save_global(obj, name)  # type: ignore[misc]
        module, qualname = key
        self.write(pickle.GLOBAL + module.encode("utf-8") + b"\n" + qualname.encode("utf-8") + b"\n")  # type: ignore[attr-defined]
        self.memoize(obj)  # type: ignore[attr-defined]


PICKLE_MODULE = types.SimpleNamespace(Pickler=_Pickler, __name__="ckptspec_pickle")


def save(obj: Any, path: Path) -> None:
    """``torch.save(obj, path)`` through the pickler above (protocol 2, torch's zip format)."""
    import torch

    from .. import split

    if not split.current().claims(path):  # another rank of a torchrun split writes this file
        return
    torch.save(obj, path, pickle_module=PICKLE_MODULE)


def tensor(array, dtype: str | None = None) -> Any:
    """A torch tensor sharing ``array``'s memory; ``dtype`` "bfloat16" reinterprets uint16 bits."""
    import torch

    out = torch.from_numpy(array)
    return out.view(torch.bfloat16) if dtype == "bfloat16" else out


def from_standins(obj: Any, read_tensor) -> Any:
    """The stand-in tree of a decoded ``data.pkl`` as objects torch.save writes as DeepSpeed did.

    ``read_tensor(ref)`` returns the torch tensor of a ``TensorRef``.
    """
    if isinstance(obj, TensorRef):
        return read_tensor(obj)
    if isinstance(obj, ZeroStage):
        return zero_stage(int(obj))
    if isinstance(obj, LossScalerState):
        return loss_scaler(obj.kind, from_standins(obj.state, read_tensor))
    if isinstance(obj, FragmentAddress):
        return fragment_address(obj.numel, obj.start)
    if isinstance(obj, DType):
        import torch

        return getattr(torch, str(obj))
    if isinstance(obj, collections.OrderedDict):
        return collections.OrderedDict((k, from_standins(v, read_tensor)) for k, v in obj.items())
    if isinstance(obj, dict):
        return {k: from_standins(v, read_tensor) for k, v in obj.items()}
    if isinstance(obj, list):
        return [from_standins(v, read_tensor) for v in obj]
    if isinstance(obj, tuple):
        return tuple(from_standins(v, read_tensor) for v in obj)
    return obj


def copied(value: Any) -> Any:
    """A tensor with a storage of its own (other values unchanged): a scalar state such as ``step`` is
    incremented in place by the optimizer, so two entries must never share one."""
    return value.clone() if hasattr(value, "clone") else value


def storage_reader(read_storage):
    """``read_tensor`` for ``from_standins`` that keeps torch's storage sharing: each storage is read
    once (``read_storage(StorageRef)`` -> a flat torch tensor) and every tensor is a view into it."""
    cache: dict[str, Any] = {}

    def read(ref: TensorRef):
        storage = ref.storage
        if storage.member not in cache:
            cache[storage.member] = read_storage(storage)
        return cache[storage.member].as_strided(ref.shape, ref.stride, ref.storage_offset)

    return read


def sizes(shapes: Any) -> Any:
    """``param_shapes`` / ``frozen_param_shapes`` values back as ``torch.Size`` (the reader makes tuples)."""
    import torch

    if isinstance(shapes, list):
        return [sizes(s) for s in shapes]
    return collections.OrderedDict((k, torch.Size(v)) for k, v in shapes.items())


def placeholder(dtype: str) -> Any:
    """The empty tensor ZeRO-3 saves in ``module`` for a partitioned parameter."""
    import torch

    return torch.empty(0, dtype=getattr(torch, dtype))


class Lazy:
    """A tensor (over a storage of its own) that ``save_streamed`` writes from ``produce()`` when it
    reaches its record: a flat little-endian numpy array of ``dtype`` (bfloat16 as uint16 bits), or an
    iterable of such arrays, the record's bytes in order. Its bytes exist only while written, a chunk
    at a time when ``produce`` yields chunks."""

    def __init__(self, dtype: str, shape: tuple[int, ...], produce):
        self.dtype, self.shape, self.produce = dtype, tuple(shape), produce

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class View:
    """A tensor over part of a ``Lazy``'s storage (``offset`` and ``stride`` in elements), as a module
    parameter is a view into DeepSpeed's flat group buffer: the storage is written once."""

    def __init__(self, base: Lazy, shape: tuple[int, ...], offset: int = 0, stride: tuple[int, ...] | None = None):
        self.base, self.shape, self.offset = base, tuple(shape), int(offset)
        self.stride = tuple(stride) if stride is not None else contiguous(self.shape)


def contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    """torch's strides of a contiguous tensor of ``shape`` (a size 0 counts as 1)."""
    stride: list[int] = []
    acc = 1
    for size in reversed(shape):
        stride.insert(0, acc)
        acc *= max(size, 1)
    return tuple(stride)


_STORAGES = {
    "float32": "FloatStorage",
    "float16": "HalfStorage",
    "bfloat16": "BFloat16Storage",
    "float64": "DoubleStorage",
    "int64": "LongStorage",
    "int32": "IntStorage",
    "int16": "ShortStorage",
    "int8": "CharStorage",
    "uint8": "ByteStorage",
    "bool": "BoolStorage",
}


def _torch_view(tensor, storages: dict) -> View:
    """A torch tensor as a ``View`` of a ``Lazy`` over its whole storage (one per storage: sharing kept)."""
    storage = tensor.untyped_storage()
    dtype = str(tensor.dtype).removeprefix("torch.")
    if storage._cdata not in storages:
        import torch

        numel = storage.nbytes() // tensor.element_size()
        flat = torch.empty(0, dtype=tensor.dtype).set_(storage, 0, (numel,), (1,))
        bits = flat.view(torch.int16) if dtype == "bfloat16" else flat  # numpy has no bfloat16
        storages[storage._cdata] = Lazy(dtype, (numel,), lambda: bits)
    return View(storages[storage._cdata], tuple(tensor.shape), tensor.storage_offset(), tuple(tensor.stride()))


def save_streamed(obj: Any, path: Path, *, shapes_as_tuples: bool = False) -> None:
    """``torch.save(obj, path)`` with each storage's bytes produced only when its record is written.

    ``obj`` holds ``Lazy`` and ``View`` tensors, and torch tensors (storage sharing kept, as torch.save
    keeps it). The records are written a chunk at a time (``torch_zip``), so peak memory is the
    largest chunk a ``produce`` yields, not the file. ``shapes_as_tuples``: pickle shapes as
    ``torch.save`` does (a tuple), so the file equals torch.save's byte for byte; without it a shape is a
    ``torch.Size``, as the optimizer-state files reshard has always written (torch loads both alike).
    """
    import io

    import torch

    from .. import split
    from ..checkpoint.torch_zip import TorchZipWriter

    if not split.current().claims(path):  # another rank of a torchrun split writes this file
        return

    keys: dict[int, str] = {}  # id(Lazy) -> its storage key (the same str object: pickled once, as torch does)
    order: list[Lazy] = []
    torch_storages: dict[int, Lazy] = {}

    class Pickler(_Pickler):
        def reducer_override(self, value):
            if isinstance(value, torch.Tensor):
                value = _torch_view(value, torch_storages)
            if isinstance(value, Lazy):
                value = View(value, value.shape)
            if isinstance(value, View):
                base = value.base
                if id(base) not in keys:
                    keys[id(base)] = str(len(order))
                    order.append(base)
                shape = tuple(list(value.shape)) if shapes_as_tuples else torch.Size(value.shape)
                return torch._utils._rebuild_tensor_v2, (
                    _StorageKey(keys[id(base)], base),
                    value.offset,
                    shape,
                    tuple(list(value.stride)),
                    False,
                    collections.OrderedDict(),
                )
            return super().reducer_override(value)

        def persistent_id(self, value):
            if isinstance(value, _StorageKey):
                return ("storage", getattr(torch, _STORAGES[value.lazy.dtype]), value.key, "cpu", value.lazy.numel)
            return None

    buffer = io.BytesIO()
    Pickler(buffer, protocol=2).dump(obj)
    data = buffer.getvalue()
    writer = TorchZipWriter(path)
    try:
        writer.write_record("data.pkl", data, len(data))
        writer.write_record(".format_version", b"1", 1)
        writer.write_record(".storage_alignment", b"64", 2)
        writer.write_record("byteorder", b"little", 6)
        for key, lazy in enumerate(order):
            nbytes = lazy.numel * ITEMSIZE[lazy.dtype]
            writer.write_record(f"data/{key}", _produced(lazy, nbytes), nbytes)
        writer.close(torch_trailer)
    except BaseException:
        writer.abort()
        raise


class _StorageKey:
    def __init__(self, key: str, lazy: Lazy):
        self.key, self.lazy = key, lazy


def _produced(lazy: Lazy, nbytes: int):
    """The bytes ``lazy.produce()`` gives, chunk by chunk, checked to add up to ``nbytes``."""
    out = lazy.produce()
    chunks = [out] if hasattr(out, "dtype") else out  # one array, or an iterable of them
    done = 0
    for chunk in chunks:
        if hasattr(chunk, "numpy"):  # a torch tensor
            chunk = chunk.numpy()
        view = memoryview(chunk).cast("B") if chunk.size else b""
        done += len(view)
        if done > nbytes:
            break
        yield view
    if done != nbytes:
        raise ValueError(f"a tensor of {lazy.shape} {lazy.dtype} produced {done} bytes")


def torch_trailer(names: list[str]) -> tuple[str, bytes]:
    """torch's writer on the same record names (no data): the name half of its serialization id and
    its ``version`` record."""
    import io
    import zipfile

    import torch

    buffer = io.BytesIO()
    writer = torch._C.PyTorchFileWriter(buffer)
    for name in names:
        writer.write_record(name, b"", 0)
    writer.write_end_of_file()
    serial = writer.serialization_id()
    with zipfile.ZipFile(io.BytesIO(buffer.getvalue())) as z:
        prefix = z.namelist()[0].split("/", 1)[0]
        version = z.read(f"{prefix}/version")
    return serial[:20], version
