"""Manifest models built without validation where their values plainly fit (what producers give).

Validating a model is slow: its before-validators run in Python. A 100k-tensor checkpoint's
manifest holds thousands of frozen parameters and tensor locators beside its params
(``partition.make_params``). ``build(cls, **values)`` tests each value against its field's type
with a plain check (an exact type and its bounds) and, when all pass, gives the object
``model_construct`` would, without validating; anything else is validated and raises what validation raises.
``build_all(cls, columns)`` does it for many objects at once, by C loops (no Python call per object);
``digests(hexes)`` the same for format 1.1's per-tensor digests (388k of them at 100k tensors).
``tests/format/test_construct.py`` holds both ways equal on values that fit and values that do not.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from itertools import repeat
from operator import attrgetter, setitem
from typing import Any, get_args

from .models import (
    INT64_MAX,
    Alias,
    Buffer,
    Digest,
    Dtype,
    ExcludedParam,
    FrozenParam,
    Locator,
    ModelWeightsLocator,
    StateLocator,
    TensorLocator,
)

_DTYPES = frozenset(get_args(Dtype))


def _text(max_length: int):
    return lambda v: type(v) is str and 0 < len(v) <= max_length


def _count(v: Any) -> bool:
    return type(v) is int and 0 <= v <= INT64_MAX


def _shape(v: Any) -> bool:
    return (
        type(v) is list
        and len(v) <= 64
        and (not v or (set(map(type, v)) == {int} and min(v) >= 0 and max(v) <= INT64_MAX))
    )


def _dtype(v: Any) -> bool:
    return type(v) is str and v in _DTYPES


def _one_of(*options: str):
    return lambda v: type(v) is str and v in options


_NAME = _text(1024)
_MEMBER = _text(4096)
_RANGE = {
    "member": _MEMBER,
    "data_offset": _count,
    "member_size": _count,
    "dtype": _dtype,
    "element_offset": _count,
    "numel": _count,
}
# Each model's required fields and the plain check of each: exactly the types of models.py.
CHECKS: dict[type, dict[str, Any]] = {
    FrozenParam: {
        "name": _NAME,
        "shape": _shape,
        "numel": _count,
        "dtype": _dtype,
        "stored_in": _one_of("module", "fragments", "partitioned_fragments"),
    },
    Buffer: {"name": _NAME, "shape": _shape, "dtype": _dtype},
    Alias: {"name": _NAME, "owner": _NAME, "shape": _shape},
    ExcludedParam: {"name": _NAME, "reason": _text(1024)},
    Locator: {"group": _count, "rank": _count, **_RANGE},
    TensorLocator: {"name": _NAME, **_RANGE},
    ModelWeightsLocator: {"group": _count, **_RANGE},
    StateLocator: {"group": _count, "rank": _count, "state": _text(256), **_RANGE},
}
_TEMPLATES: dict[type, tuple[frozenset[str], dict[str, Any]] | None] = {}


def template(cls: type, sample: dict[str, Any]) -> tuple[frozenset[str], dict[str, Any]] | None:
    """(the required fields, the unset fields' defaults) of ``cls``, once ``fill`` is seen to give
    what ``model_construct`` gives for ``sample``; None (always validate) if it does not."""
    if cls in _TEMPLATES:
        return _TEMPLATES[cls]
    required = frozenset(k for k, f in cls.model_fields.items() if f.is_required())
    defaults = {k: f.get_default() for k, f in cls.model_fields.items() if k not in required}
    made = cls.__new__(cls)
    fill(made, dict(sample), defaults)
    reference = cls.model_construct(**sample)
    attrs = ("__dict__", "__pydantic_fields_set__", "__pydantic_extra__", "__pydantic_private__")
    same = set(sample) == required and all(getattr(made, a) == getattr(reference, a) for a in attrs)
    _TEMPLATES[cls] = (required, defaults) if same and all(v is None for v in defaults.values()) else None
    return _TEMPLATES[cls]


def fill(obj: Any, values: dict[str, Any], defaults: dict[str, Any]) -> None:
    """Give ``obj`` what model_construct would; ``values`` becomes its ``__dict__``."""
    setattr_ = object.__setattr__
    fields_set = set(values)
    values.update(defaults)
    setattr_(obj, "__dict__", values)
    setattr_(obj, "__pydantic_fields_set__", fields_set)
    setattr_(obj, "__pydantic_extra__", {})
    setattr_(obj, "__pydantic_private__", None)


def _sample(checks: dict[str, Any]) -> dict[str, Any]:
    plain = {_count: 0, _shape: [1], _dtype: "float32"}
    out = {}
    for key, check in checks.items():
        out[key] = plain.get(check)
        if out[key] is None:  # a text or one of some options: the first that fits
            out[key] = next(v for v in ("x", "module") if check(v))
    return out


def build(cls: type, **values: Any) -> Any:
    """``cls(**values)``: built without validation when every value plainly fits (the same object)."""
    checks = CHECKS.get(cls)
    shape = None
    if checks is not None:
        shape = _TEMPLATES[cls] if cls in _TEMPLATES else template(cls, _sample(checks))
    if shape is None or values.keys() != shape[0] or not all(check(values[k]) for k, check in checks.items()):
        return cls(**values)
    obj = cls.__new__(cls)
    fill(obj, values, shape[1])
    return obj


def build_all(cls: type, columns: dict[str, Sequence[Any]]) -> list:
    """``[build(cls, **row) for each row of columns]``: when every value of every column plainly
    fits, the objects are made by C loops (1M tensors: 80k frozen params and tensor locators);
    otherwise row by row, which validates and raises what it always raised."""
    checks = CHECKS.get(cls)
    shape = None if checks is None else _TEMPLATES[cls] if cls in _TEMPLATES else template(cls, _sample(checks))
    rows = len(next(iter(columns.values()), ()))
    plain = (
        shape is not None
        and columns.keys() == shape[0]
        and all(len(column) == rows for column in columns.values())
        and all(all(map(check, columns[key])) for key, check in checks.items())
    )
    if not plain:
        return [build(cls, **dict(zip(columns, row))) for row in zip(*columns.values())]
    return constructed(cls, columns, shape[1], rows)


def frozen_params(names: list[str], shapes: list[tuple[int, ...]], dtypes: list[str], stored_in: str) -> list:
    """The ``FrozenParam`` of each (name, shape, dtype), all ``stored_in`` one place, by ``build_all``."""
    columns = {"name": names, "shape": list(map(list, shapes)), "numel": list(map(math.prod, shapes))}
    return build_all(FrozenParam, {**columns, "dtype": dtypes, "stored_in": [stored_in] * len(names)})


_HEX_DIGITS = b"0123456789abcdef"
_FIELDS_SET = attrgetter("__pydantic_fields_set__")


def digests(hexes: list[str]) -> list:
    """``[Digest(sha256=h) for h in hexes]``: made by C loops when every value is 64 lowercase hex
    digits (what hashlib's ``hexdigest`` gives and the field's pattern asks), else each validated."""
    plain = (
        {str}.issuperset(map(type, hexes))
        and {64}.issuperset(map(len, hexes))
        and not "".join(hexes).encode("ascii", "replace").translate(None, _HEX_DIGITS)
    )
    if not plain:
        return [Digest(sha256=h) for h in hexes]
    return constructed(Digest, {"sha256": hexes}, {}, len(hexes))


def set_fields(models: list, name: str, values: Iterable[Any]) -> None:
    """``setattr(model, name, value)`` for each pair, by C loops: what ``BaseModel.__setattr__`` does
    for a declared field (the models do not validate assignment)."""
    deque(map(dict.__setitem__, map(vars, models), repeat(name), values), 0)
    deque(map(set.add, map(_FIELDS_SET, models), repeat(name)), 0)


def constructed(cls: type, columns: dict[str, Iterable[Any]], defaults: dict[str, Any], rows: int) -> list:
    """``rows`` new ``cls`` given what ``fill`` gives, row by row of ``columns`` (all of them the
    fields set, ``defaults`` the rest), by C loops: no Python call per object."""
    # Each __dict__ a copy of one with every key (copying a dict copies its table whole), then
    # one column at a time written in: cheaper than a dict built from each row.
    values = list(map(dict.copy, repeat({**dict.fromkeys(columns), **defaults}, rows)))
    for key, column in columns.items():
        deque(map(setitem, values, repeat(key), column), 0)
    made = list(map(cls.__new__, repeat(cls, rows)))
    setattr_ = object.__setattr__
    deque(map(setattr_, made, repeat("__dict__"), values), 0)
    deque(map(setattr_, made, repeat("__pydantic_fields_set__"), map(set.copy, repeat(set(columns), rows))), 0)
    deque(map(setattr_, made, repeat("__pydantic_extra__"), map(dict.copy, repeat({}, rows))), 0)
    deque(map(setattr_, made, repeat("__pydantic_private__"), repeat(None, rows)), 0)
    return made
