"""Partition arithmetic shared by every producer: params in, manifest groups out.

The producers (live engine, saved directory, plain module) differ in where they
find the ordered params and paddings; the arithmetic that turns those into
offsets, padded totals and per-rank numels is the one written here, and
``ckptspec.format.rules`` checks the same arithmetic from the other side (it uses
the constants here, without the models: the group builders import them when called).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
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


_INT64_MAX = 2**63 - 1
_MAX_NDIM = 64  # the schema's maxItems of a shape
_DTYPES: frozenset[str] = frozenset()  # models.Dtype's values, filled on first use (no pydantic at import)


_INT_ONLY = frozenset({int})


_FIELDS = ("name", "shape", "numel", "dtype", "offset", "padding")
_construct = None  # (the Param class, its unset fields' defaults) once checked against model_construct


def _constructor():
    """What ``Param.model_construct`` does for these six fields, without its per-field loop (it
    costs ~25 us a call): the attributes it sets, checked once against it, else None."""
    from .models import Param

    sample = dict(zip(_FIELDS, ("w", [2], 2, "float32", 0, 0)))
    defaults = {k: f.get_default() for k, f in Param.model_fields.items() if k not in sample}
    if any(v is not None for v in defaults.values()):
        return None
    made = Param.__new__(Param)
    _fill(made, dict(sample), defaults)
    reference = Param.model_construct(**sample)
    attrs = ("__dict__", "__pydantic_fields_set__", "__pydantic_extra__", "__pydantic_private__")
    if any(getattr(made, a) != getattr(reference, a) for a in attrs):
        return None
    return Param, defaults


def _fill(obj, values: dict, defaults: dict) -> None:
    """Give ``obj`` what model_construct would; ``values`` becomes its ``__dict__``."""
    setattr_ = object.__setattr__
    values.update(defaults)
    setattr_(obj, "__dict__", values)
    setattr_(obj, "__pydantic_fields_set__", set(_FIELDS))  # one each: assigning a field later adds to it
    setattr_(obj, "__pydantic_extra__", {})
    setattr_(obj, "__pydantic_private__", None)


def make_param(name: str, shape: tuple[int, ...], numel: int, dtype: str, offset: int, padding: int):
    """A ``Param``, built without validation when its values plainly meet the model's types
    (what every producer gives): a validated ``Param`` costs ~20 us, 2 s at 100k tensors. Anything
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
        cls, defaults = _construct
        obj = cls.__new__(cls)
        _fill(
            obj,
            {"name": name, "shape": list(shape), "numel": numel, "dtype": dtype, "offset": offset, "padding": padding},
            defaults,
        )
        return obj
    from .models import Param  # not on the path above: an import per call costs ~1 us, 0.1 s at 100k tensors

    values = {"name": name, "shape": list(shape), "numel": numel, "dtype": dtype, "offset": offset, "padding": padding}
    return Param.model_construct(**values) if plain else Param(**values)


def flat_group(
    params: Sequence[ParamSpec],
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

    paddings = list(paddings) if paddings is not None else [0] * len(params)
    if len(paddings) != len(params):
        raise ValueError(f"{len(paddings)} paddings for {len(params)} params")
    entries, offset = [], 0
    for spec, pad in zip(params, paddings):
        numel = spec.numel
        entries.append(make_param(spec.name, spec.shape, numel, spec.dtype, offset, pad))
        offset += numel + pad
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


def per_param_group(params: Sequence[ParamSpec], *, optimizer_group: int, partition_count: int) -> Group:
    """Stage 3 (one sub-group): each param split on its own into ceil(numel / ws) per rank."""
    from .models import Group  # on use: the rules import this module without pydantic

    entries, offset = [], 0
    for spec in params:
        numel = spec.numel
        share = -(-numel // partition_count)
        pad = share * partition_count - numel
        entries.append(make_param(spec.name, spec.shape, numel, spec.dtype, offset, pad))
        offset += share
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
