"""The inert stand-ins the restricted unpickler (``torchfile``) builds instead of torch objects.

Each allowlisted global of a torch checkpoint's ``data.pkl`` maps to a local class or function
here (``ALLOWED``): tensors become ``TensorRef`` views of ``StorageRef`` storages, DeepSpeed's
enums, loss scalers and fragment addresses become plain records. Nothing here can run code or
read bytes. The stand-ins refuse the BUILD opcode (see ``_Sealed``), and sizes are int64 values in
at most ``MAX_NDIM`` dimensions.
"""

from __future__ import annotations

import collections
import itertools
import math
import operator
import reprlib
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from ..format.dtypes import ITEMSIZE, Dtype

MAX_NDIM = 64  # as the manifest schema
INT64 = 2**63  # torch sizes, strides, offsets and numels are int64
_INT64 = INT64


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
    __dataclass_fields__: ClassVar[dict[str, Any]]  # every subclass is a dataclass (what fields() reads)

    def __reduce__(self):  # copy and pickle rebuild through the constructor, never through __setstate__
        return type(self), tuple(getattr(self, f.name) for f in fields(self))


@dataclass(frozen=True)
class StorageRef(_SealedRecord):
    member: str  # zip member holding the raw bytes: "<prefix>/data/<key>"
    key: str
    dtype: Dtype  # torch dtype name without "torch.", e.g. "bfloat16" (a storage type's: _STORAGE_DTYPES)
    itemsize: int
    numel: int  # elements in the whole storage (a view may use fewer)
    location: str  # device it was saved from, e.g. "cpu"

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


_CONTIGUOUS: dict[tuple, bool] = {}  # (shape, stride) -> TensorRef.is_contiguous


@dataclass(slots=True)
class TensorRef(_SealedRecord):
    storage: StorageRef
    storage_offset: int  # in elements
    shape: tuple
    stride: tuple
    requires_grad: bool = False
    is_parameter: bool = False
    attrs: dict = field(default_factory=dict)  # python attributes pickled with the tensor (stage-3 "ds_id")

    @property
    def dtype(self) -> Dtype:
        return self.storage.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def view(self) -> tuple:
        """What makes two pickled tensors the same tensor (a tie: one parameter under two names)."""
        return self.storage.member, self.storage_offset, tuple(self.shape), tuple(self.stride)

    def is_contiguous(self) -> bool:
        # Asked of every module tensor (CK217); a model has a few distinct (shape, stride) pairs.
        key = (self.shape, self.stride)
        try:
            return _CONTIGUOUS[key]
        except (KeyError, TypeError):  # new, or not hashable (a list): work it out
            pass
        expected, found = 1, True
        for size, stride in reversed(list(zip(self.shape, self.stride))):
            if size != 1 and stride != expected:
                found = False
                break
            expected *= size
        if len(_CONTIGUOUS) < 4096 and type(self.shape) is tuple and type(self.stride) is tuple:
            _CONTIGUOUS[key] = found
        return found


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
        # One per parameter and rank (param_slice_mappings): the checks are C calls.
        if not isinstance(state, dict) or state.keys() != _FRAGMENT_KEYS:
            raise ValueError(f"bad fragment_address state {state!r}")
        self.numel, self.start = int(state["numel"]), int(state["start"])


_FRAGMENT_KEYS = frozenset({"numel", "start"})


class DType(_Sealed, str):
    """A torch dtype referenced by name (e.g. DynamicLossScaler.dtype = torch.float16)."""

    def __repr__(self):
        return f"torch.{str(self)}"


class StorageType(_Sealed):
    """What ``torch.FloatStorage`` etc. resolve to; only usable inside a persistent id."""

    __slots__ = ("name", "dtype", "itemsize")

    def __init__(self, name: str, dtype: Dtype, itemsize: int):
        self.name, self.dtype, self.itemsize = name, dtype, itemsize

    def __repr__(self):
        return f"torch.{self.name}"


class _TensorClass(_Sealed):
    """What ``torch.Tensor`` resolves to; only usable as _rebuild_from_type_v2's new_type."""


class _Callable(_Sealed):
    """An allowlisted function as the pickle sees it: callable, but sealed (see _Sealed).
    ``_Callable(f)`` is an instance of a subclass whose ``__call__`` is ``f`` itself, so a call
    from the pickle runs ``f`` with no frame in between (two per tensor otherwise)."""

    __slots__ = ()

    def __new__(cls, function):
        own = type(f"_Callable_{function.__name__}", (cls,), {"__slots__": (), "__call__": staticmethod(function)})
        return object.__new__(own)

    @property
    def function(self):
        return type(self).__call__

    def __repr__(self):
        return f"<allowlisted {self.function.__name__}>"


# torch's typed storage classes (what protocol-2 pickles name) and the dtype each holds.
_STORAGE_DTYPES: dict[str, Dtype] = {
    "DoubleStorage": "float64", "FloatStorage": "float32", "HalfStorage": "float16", "BFloat16Storage": "bfloat16",
    "LongStorage": "int64", "IntStorage": "int32", "ShortStorage": "int16", "CharStorage": "int8",
    "ByteStorage": "uint8", "BoolStorage": "bool", "ComplexFloatStorage": "complex64",
    "ComplexDoubleStorage": "complex128",
}  # fmt: skip
STORAGE_TYPES = {name: StorageType(name, dtype, ITEMSIZE[dtype]) for name, dtype in _STORAGE_DTYPES.items()}
_DTYPES = {t.dtype for t in STORAGE_TYPES.values()}


_INT_ONLY = frozenset({int})
_ONES = itertools.repeat(1)  # (s - 1) for each dimension s, in C


def _as_int_tuple(value, what, minimum=0):
    # Bounded like torch's int64 sizes and the schema's 64 dimensions: products and sums of
    # these stay small (a million-digit or million-dimension "shape" makes numel quadratic).
    # The checks in C (set, min, max): two per tensor, 100k tensors in a mixture-of-experts model.
    if (
        not isinstance(value, tuple)
        or len(value) > MAX_NDIM
        or (value and (_INT_ONLY.issuperset(map(type, value)) is False or min(value) < minimum or max(value) >= INT64))
    ):
        raise ValueError(
            f"{what} must be a tuple of at most {MAX_NDIM} ints in [{minimum}, 2**63), got {reprlib.repr(value)}"
        )
    return value


# (size, stride) -> the offset of the view's last element from its first, or None when it has no
# elements: what the checks below found of a pair already met. A model has a few distinct pairs,
# and the checks were most of a tensor's cost. A pair is looked up only once
# its members are known to be exact ints: True == 1 and 1.0 == 1, so a bool or a float would
# otherwise pass as the int it equals.
_SPANS: dict[tuple, int | None] = {}
_MAX_SPANS = 4096
_UNSEEN = object()


def _span(size, stride):
    """The checks of a view's size and stride (raising what names what is wrong) and its span."""
    # What _as_int_tuple checks of both, in one go; anything else takes the checks one by one,
    # which raise the message that names what is wrong.
    if not (
        type(size) is tuple
        and type(stride) is tuple
        and len(size) == len(stride) <= MAX_NDIM
        and _INT_ONLY.issuperset(map(type, size + stride))
        and (not size or (min(size) >= 0 and min(stride) >= 0 and max(size + stride) < _INT64))
    ):
        size, stride = _as_int_tuple(size, "size"), _as_int_tuple(stride, "stride")
        if len(size) != len(stride):
            raise ValueError(f"bad size/stride {size}/{stride}")
    span = sum(map(operator.mul, map(operator.sub, size, _ONES), stride)) if math.prod(size) else None
    if len(_SPANS) < _MAX_SPANS:
        _SPANS[size, stride] = span
    return span


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad, backward_hooks, metadata=None):
    # backward_hooks (an empty OrderedDict when torch saves) and metadata are not kept.
    if not isinstance(storage, StorageRef) or type(storage_offset) is not int or not 0 <= storage_offset < INT64:
        raise ValueError("tensor must reference a storage at a non-negative offset")
    span: Any = (  # int | None, or _UNSEEN (a sentinel mypy cannot narrow by identity)
        _SPANS.get((size, stride), _UNSEEN)
        if type(size) is tuple and type(stride) is tuple and _INT_ONLY.issuperset(map(type, size + stride))
        else _UNSEEN
    )
    if span is _UNSEEN:
        span = _span(size, stride)
    # Bounds check, so byte offsets computed from this ref always stay inside the storage.
    if span is not None:
        if storage_offset + span >= storage.numel:
            raise ValueError(f"tensor view {size}@{storage_offset} exceeds storage of {storage.numel}")
    elif storage_offset > storage.numel:  # an empty view may sit at the storage's end, not past it
        raise ValueError(f"empty tensor view @{storage_offset} is past the end of its storage of {storage.numel}")
    return TensorRef(storage, storage_offset, size, stride, bool(requires_grad))


def _rebuild_tensor(storage, storage_offset, size, stride, requires_grad=False):
    return _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad, None)


def _rebuild_parameter(data, requires_grad, backward_hooks):
    if not isinstance(data, TensorRef):
        raise ValueError("parameter must wrap a tensor")
    data.requires_grad, data.is_parameter = bool(requires_grad), True
    return data


def _rebuild_from_type_v2(func, new_type, args, state):
    # torch uses this for tensors that carry python attributes (ZeRO-3 flat groups carry ds_id).
    if (
        func is not ALLOWED[("torch._utils", "_rebuild_tensor_v2")]
        or new_type is not _TensorClass
        or not isinstance(args, tuple)
    ):
        raise ValueError("_rebuild_from_type_v2 is only allowed for plain tensors")
    ref = func(*args)
    # state is a __dict__ or (__dict__, slots) as in torch._utils._set_obj_state.
    parts = state if isinstance(state, tuple) else (state,)
    for part in parts:
        if part is not None and not isinstance(part, dict):
            raise ValueError(f"bad tensor state {state!r}")
        ref.attrs.update(part or {})
    return ref


_SIZES: set[tuple] = set()  # torch.Size values already checked (as _SPANS: exact ints first)


def _size(seq=()):
    size = tuple(seq)
    if _INT_ONLY.issuperset(map(type, size)) and size in _SIZES:
        return size
    size = _as_int_tuple(size, "torch.Size", -INT64)
    if len(_SIZES) < _MAX_SPANS:
        _SIZES.add(size)
    return size


def _codecs_encode(text, encoding):
    # How protocol 2 pickles a non-empty bytes object: _codecs.encode(text, "latin1").
    if type(text) is not str or encoding != "latin1":
        raise ValueError("_codecs.encode is only allowed as protocol 2 writes bytes")
    return text.encode("latin1")


def _empty_bytes():  # how protocol 2 pickles b""
    return b""


# Nothing here may return a tuple holding tuples: scan_pickle counts a call's result as one
# tuple level when it bounds how deep tuples nest.
# Any: a class, an allowlisted callable or a plain value, whatever the global stands for.
ALLOWED: dict[tuple[str, str], Any] = {
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
    **{
        (module, name): container
        for module in ("builtins", "__builtin__")
        for name, container in (("set", set), ("frozenset", frozenset), ("bytes", _Callable(_empty_bytes)))
    },
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"): ZeroStage,
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"): LossScalerState,
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"): DynamicLossScalerState,
    ("deepspeed.utils.tensor_fragment", "fragment_address"): FragmentAddress,
    **{("torch", name): st for name, st in STORAGE_TYPES.items()},
    **{("torch", name): DType(name) for name in _DTYPES},
}
