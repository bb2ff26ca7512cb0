"""Partition arithmetic shared by every producer: params in, manifest groups out.

The producers (live engine, saved directory, plain module) differ in where they
find the ordered params and paddings; the arithmetic that turns those into
offsets, padded totals and per-rank numels is the one written here, and
``ckptspec.format.rules`` checks the same arithmetic from the other side (it uses
the constants here, without the models: the group builders import them when called).
"""

from __future__ import annotations

import math
import operator
from collections import deque
from collections.abc import Sequence
from itertools import accumulate, repeat
from operator import setitem
from types import GenericAlias
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

if TYPE_CHECKING:
    from pydantic import TypeAdapter

    from .dtypes import Dtype
    from .models import Group, Param

# DeepSpeed pads each stage 1/2 flat group to nccl_start_alignment_factor (2) x world size.
NCCL_START_ALIGNMENT_FACTOR = 2


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class ParamSpec(NamedTuple):
    """One parameter as a producer sees it, before layout (a tuple: 100k of them are built per manifest)."""

    name: str
    shape: tuple[int, ...]
    dtype: Dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class ParamColumns(NamedTuple):
    """Many params as a producer sees them, a column each: what the group builders read, given
    without a ``ParamSpec`` per param (100k tensors: each made, then taken apart again)."""

    names: list[str]
    shapes: list[tuple[int, ...]]
    dtypes: list[Dtype]


_FIELDS = ("name", "shape", "numel", "dtype", "offset", "padding")
# (Param, its columns' validators) once made; False where the made objects would differ
_bulk: tuple[type[Param], dict[str, TypeAdapter[Any]]] | Literal[False] | None = None


def _params(
    names: Sequence[str],
    shapes: Sequence[tuple[int, ...]],
    numels: Sequence[int],
    dtypes: Sequence[str],
    offsets: Sequence[int],
    paddings: Sequence[int],
) -> list:
    """The ``Param`` of each row of these columns: each column validated whole by its field's own
    type (``Param.model_fields``, one call into pydantic-core each), then the objects made as
    validation makes them, by C loops: validating a ``Param`` per row is measurably slower
    (docs/performance.md). A column that does not validate: row by row, raising what ``Param`` raises."""
    columns = dict(zip(_FIELDS, (names, list(map(list, shapes)), numels, dtypes, offsets, paddings)))
    if any(len(c) != len(names) for c in columns.values()):
        raise ValueError(f"columns of {sorted({len(c) for c in columns.values()})} rows")
    bulk = _bulk if _bulk is not None else _bulk_validators()
    if bulk:
        cls, validators = bulk
        try:
            for key, column in columns.items():
                validators[key].validate_python(column)
        except ValueError:  # a pydantic ValidationError: the row's own error, below
            pass
        else:
            return _made(cls, columns, len(names))
    from .models import Param

    return [Param(**dict(zip(columns, row))) for row in zip(*columns.values())]


def _bulk_validators() -> tuple[type[Param], dict[str, TypeAdapter[Any]]] | Literal[False]:
    """``(Param, a validator of each column)``, or False when the objects ``_made`` makes are not
    what validation makes (checked once: another pydantic)."""
    global _bulk
    from pydantic import ConfigDict, TypeAdapter

    from .models import Param

    strict = ConfigDict(strict=True)
    # list[the field's type], a type known only at run time (GenericAlias is what list[...] makes)
    columns: dict[str, Any] = {k: GenericAlias(list, (Param.model_fields[k].rebuild_annotation(),)) for k in _FIELDS}
    validators = {k: TypeAdapter(columns[k], config=strict) for k in _FIELDS}
    row = dict(zip(_FIELDS, ("w", [2], 2, "float32", 0, 0)))
    made, validated = _made(Param, {k: [v] for k, v in row.items()}, 1)[0], Param.model_validate(row)
    same = all(getattr(made, a) == getattr(validated, a) for a in _STATE) and made == validated
    _bulk = (Param, validators) if same else False
    return _bulk


_STATE = ("__dict__", "__pydantic_fields_set__", "__pydantic_extra__", "__pydantic_private__")


def _made(cls: type[Param], columns: dict[str, Sequence[Any]], rows: int) -> list:
    """``rows`` objects of ``cls`` holding these (validated) columns, as ``model_validate`` leaves them."""
    # Each __dict__ a copy of one with every field (a dict's table is copied whole), one column at a time
    # written in, then the objects' state set: no Python call per object.
    values = list(map(dict.copy, repeat(dict.fromkeys(cls.model_fields), rows)))
    for key, column in columns.items():
        deque(map(setitem, values, repeat(key), column), 0)
    made: list[Param] = list(map(cls.__new__, repeat(cls, rows)))
    set_ = object.__setattr__
    deque(map(set_, made, repeat("__dict__"), values), 0)
    deque(map(set_, made, repeat("__pydantic_fields_set__"), map(set.copy, repeat(set(columns), rows))), 0)
    deque(map(set_, made, repeat("__pydantic_extra__"), repeat(None, rows)), 0)
    deque(map(set_, made, repeat("__pydantic_private__"), repeat(None, rows)), 0)
    return made


def frozen_params(
    names: list[str],
    shapes: list[tuple[int, ...]],
    dtypes: list[Dtype],
    stored_in: Literal["module", "fragments", "partitioned_fragments"],
) -> list:
    """The ``FrozenParam`` of each (name, shape, dtype), all ``stored_in`` one place."""
    from .models import FrozenParam  # on use: the rules import this module without pydantic

    return [
        FrozenParam(name=name, shape=list(shape), numel=math.prod(shape), dtype=dtype, stored_in=stored_in)
        for name, shape, dtype in zip(names, shapes, dtypes)
    ]


def flat_group(
    params: Sequence[ParamSpec] | ParamColumns,
    *,
    optimizer_group: int,
    partition_count: int,
    zero_stage: int,
    paddings: Sequence[int] | None = None,
    tail_padding_saved: bool = False,
) -> Group:
    """Stage 0/1/2: params back to back (plus alignment paddings) in one flat buffer.

    Stage 1/2 pad the buffer to 2 x partition_count (DeepSpeed's
    nccl_start_alignment_factor) and split it evenly; the last rank(s) drop the
    tail padding when saving unless ``tail_padding_saved``.
    """
    from .models import Group  # on use: the rules import this module without pydantic

    names, shapes, dtypes = _columns(params)
    paddings = list(paddings) if paddings is not None else [0] * len(names)
    if len(paddings) != len(names):
        raise ValueError(f"{len(paddings)} paddings for {len(names)} params")
    numels = list(map(math.prod, shapes))
    ends = list(accumulate(map(operator.add, numels, paddings)))
    offset = ends[-1] if ends else 0
    entries = _params(names, shapes, numels, dtypes, [0, *ends[:-1]], paddings)
    alignment = NCCL_START_ALIGNMENT_FACTOR * partition_count if zero_stage in (1, 2) else 1
    padded = round_up(offset, alignment)
    partition = padded // partition_count
    if tail_padding_saved:
        saved = [partition] * partition_count
    else:
        saved = [min(partition, max(0, offset - r * partition)) for r in range(partition_count)]
    return Group(
        optimizer_group=optimizer_group,
        partitioning="flat",
        partition_count=partition_count,
        alignment=alignment,
        padded_numel=padded,
        partition_numel=partition,
        saved_numels=saved,
        params=entries,
    )


def per_param_group(params: Sequence[ParamSpec] | ParamColumns, *, optimizer_group: int, partition_count: int) -> Group:
    """Stage 3 (one sub-group): each param split on its own into ceil(numel / ws) per rank."""
    from .models import Group  # on use: the rules import this module without pydantic

    names, shapes, dtypes = _columns(params)
    numels = list(map(math.prod, shapes))
    shares = [-(-numel // partition_count) for numel in numels]
    paddings = [share * partition_count - numel for share, numel in zip(shares, numels)]
    ends = list(accumulate(shares))
    offset = ends[-1] if ends else 0
    entries = _params(names, shapes, numels, dtypes, [0, *ends[:-1]], paddings)
    return Group(
        optimizer_group=optimizer_group,
        partitioning="per_param",
        partition_count=partition_count,
        alignment=1,
        padded_numel=offset * partition_count,
        partition_numel=offset,
        saved_numels=[offset] * partition_count,
        params=entries,
    )


def _columns(params: Sequence[ParamSpec] | ParamColumns) -> tuple[list, list, list]:
    """Names, shapes and dtypes of ``params`` (each a list)."""
    if isinstance(params, ParamColumns):
        return params
    if not params:
        return [], [], []
    names, shapes, dtypes = map(list, zip(*params))
    return names, shapes, dtypes


def natural_order(params: list, partition_count: int) -> list:
    """Undo DeepSpeed's ``round_robin_gradients`` reorder (param k went to bucket k % dp, buckets concatenated)."""
    n = len(params)
    sizes = [len(range(b, n, partition_count)) for b in range(partition_count)]
    buckets, start = [], 0
    for size in sizes:
        buckets.append(params[start : start + size])
        start += size
    return [buckets[k % partition_count][k // partition_count] for k in range(n)]


def param_pieces(
    partitioning: str, partition_count: int, partition_numel: int, offset: int, numel: int, padding: int
) -> list[tuple[int, int, int]]:
    """Where a trainable param's elements lie in its group's rank partitions: ``(rank, start,
    count)`` in order, ``start`` an element index into that rank's partition (docs/spec.md#reconstruction).

    The same positions hold the param's optimizer state in each rank's state partition. Flat:
    rank r holds buffer elements ``[r * partition_numel, (r + 1) * partition_numel)``; only
    padding is ever missing from a saved partition, never a param's element. Per-param: every
    rank holds a ``share`` at ``offset``; the last shares end in padding, which is left out.
    """
    pieces = []
    if partitioning == "flat":
        end = offset + numel
        for r in range(partition_count):
            lo = r * partition_numel
            a, b = max(offset, lo), min(end, lo + partition_numel)
            if a < b:
                pieces.append((r, a - lo, b - a))
    else:
        share = (numel + padding) // partition_count
        for r in range(partition_count):
            take = max(0, min(share, numel - r * share))
            if take:
                pieces.append((r, offset, take))
    return pieces
