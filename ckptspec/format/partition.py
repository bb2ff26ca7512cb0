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
from collections.abc import Sequence
from itertools import accumulate, chain
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from .models import Group

# DeepSpeed pads each stage 1/2 flat group to nccl_start_alignment_factor (2) x world size.
NCCL_START_ALIGNMENT_FACTOR = 2


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class ParamSpec(NamedTuple):
    """One parameter as a producer sees it, before layout (a tuple: 100k of them are built per manifest)."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class ParamColumns(NamedTuple):
    """Many params as a producer sees them, a column each: what the group builders read, given
    without a ``ParamSpec`` per param (100k tensors: each made, then taken apart again)."""

    names: list[str]
    shapes: list[tuple[int, ...]]
    dtypes: list[str]


_INT64_MAX = 2**63 - 1
_MAX_NDIM = 64  # the schema's maxItems of a shape
_DTYPES: frozenset[str] = frozenset()  # models.Dtype's values, filled on first use (no pydantic at import)


_INT_ONLY = frozenset({int})


_FIELDS = ("name", "shape", "numel", "dtype", "offset", "padding")
# The fields a producer sets on a Param (format/manifest_dict.py dumps such params without pydantic).
PLAIN_FIELDS = frozenset(_FIELDS)
_construct = None  # (the Param class, its unset fields' defaults, construct.fill) once checked


def _constructor():
    """What ``Param.model_construct`` does for these six fields, without its per-field loop (a
    Python call per field), checked once against it (``construct.template``), else None."""
    from .construct import fill, template
    from .models import Param

    found = template(Param, dict(zip(_FIELDS, ("w", [2], 2, "float32", 0, 0))))
    return None if found is None else (Param, found[1], fill)


def make_param(name: str, shape: tuple[int, ...], numel: int, dtype: str, offset: int, padding: int):
    """A ``Param``, built without validation when its values plainly meet the model's types
    (what every producer gives): a validated ``Param`` runs Python validators. Anything
    else goes through validation, which raises what it always raised. The same object either way
    (fields, fields set, dumped bytes: ``tests/format/test_partition_fast.py``)."""
    global _DTYPES, _construct
    if not _DTYPES:
        from typing import get_args

        from .models import Dtype

        _DTYPES = frozenset(get_args(Dtype))
        _construct = _constructor()
    plain = (
        type(name) is str
        and 0 < len(name) <= 1024
        and type(shape) in (tuple, list)
        and len(shape) <= _MAX_NDIM
        and type(numel) is int
        and type(offset) is int
        and type(padding) is int
        and _INT_ONLY.issuperset(map(type, shape))
        and min(numel, offset, padding, *shape) >= 0  # every count and dimension a non-negative int64, in C
        and max(numel, offset, padding, *shape) <= _INT64_MAX
        and type(dtype) is str
        and dtype in _DTYPES
    )
    if plain and _construct is not None:
        cls, defaults, fill = _construct
        obj = cls.__new__(cls)
        fill(
            obj,
            {"name": name, "shape": list(shape), "numel": numel, "dtype": dtype, "offset": offset, "padding": padding},
            defaults,
        )
        return obj
    from .models import Param  # not on the path above: an import per call adds up at 100k tensors

    values = {"name": name, "shape": list(shape), "numel": numel, "dtype": dtype, "offset": offset, "padding": padding}
    return Param.model_construct(**values) if plain else Param(**values)


def make_params(
    names: Sequence[str],
    shapes: Sequence[tuple[int, ...]],
    numels: Sequence[int],
    dtypes: Sequence[str],
    offsets: Sequence[int],
    paddings: Sequence[int],
) -> list:
    """``make_param`` of each row of these columns, in bulk: when every value plainly fits, the
    checks and the objects are made by C loops (``map``), without a Python call per param (100k
    tensors: a mixture-of-experts model). Anything else: ``make_param`` row by row, which
    validates and raises what it always raised. ``tests/format/test_partition_fast.py``."""
    if not _DTYPES:
        make_param("w", (1,), 1, "float32", 0, 0)  # fills _DTYPES and _construct
    columns = (names, shapes, numels, dtypes, offsets, paddings)
    n = len(names)
    if any(len(c) != n for c in columns):
        raise ValueError(f"columns of {sorted({len(c) for c in columns})} rows")
    if not n:
        return []
    dims = list(chain.from_iterable(shapes)) if _plain_types(shapes, {tuple, list}) else None
    counts = list(chain(numels, offsets, paddings, dims or ()))
    plain = (
        _construct is not None
        and dims is not None
        and _plain_types(names, {str})
        and _plain_types(dtypes, {str})
        and _plain_types(counts, {int})
        and min(map(len, names)) > 0
        and max(map(len, names)) <= 1024
        and max(map(len, shapes)) <= _MAX_NDIM
        and min(counts) >= 0
        and max(counts) <= _INT64_MAX
        and _DTYPES.issuperset(dtypes)
    )
    if not plain:
        return [make_param(*row) for row in zip(*columns)]
    cls, defaults, _ = _construct
    from .construct import constructed

    return constructed(
        cls, dict(zip(_FIELDS, (names, map(list, shapes), numels, dtypes, offsets, paddings))), defaults, n
    )


def _plain_types(values, types: set) -> bool:
    return set(map(type, values)) <= types


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
    entries = make_params(names, shapes, numels, dtypes, [0, *ends[:-1]], paddings)
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
    entries = make_params(names, shapes, numels, dtypes, [0, *ends[:-1]], paddings)
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
