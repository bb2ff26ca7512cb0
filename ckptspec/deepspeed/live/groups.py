"""The flat groups (stage 1/2, BF16_Optimizer) and stage-3 sub-groups of a live engine's manifest,
read from the optimizer objects themselves and cross-checked with the optimizer's own numbers."""

from __future__ import annotations

from itertools import repeat
from operator import attrgetter
from typing import Any

from ...errors import EngineLayoutMismatch
from ...format.dtypes import Dtype, dtype_name
from ...format.models import Group
from ...format.partition import ParamColumns, flat_group, per_param_group


def param_shape(param) -> tuple[int, ...]:
    """A param's shape; a ZeRO-3 param's before partitioning (``ds_shape``)."""
    return tuple(param.ds_shape if hasattr(param, "ds_shape") else param.shape)


_DTYPE_NAMES: dict[Any, Dtype] = {}  # torch dtype -> its name (dtype_name's str() per param added up at 100k)
_DTYPE = attrgetter("dtype")
_DS_SHAPE = attrgetter("ds_shape")  # a ZeRO-3 param's shape before partitioning
_SHAPE = attrgetter("shape")
_OFFSET = attrgetter("offset")


def columns_of(params: list, names: dict[int, str], shape_of=None) -> ParamColumns:
    """The params' names, shapes and dtypes, in C loops where the params are plain (100k of them:
    a mixture-of-experts model). ``shape_of``: how every param gives its shape (stage 3:
    ``ds_shape``, the shape before partitioning), else each param's own (``param_shape``)."""
    dtypes = list(map(_DTYPE, params))
    for dtype in set(dtypes) - _DTYPE_NAMES.keys():
        _DTYPE_NAMES[dtype] = dtype_name(dtype)
    if shape_of is None and not any(map(hasattr, params, repeat("ds_shape"))):
        shape_of = _SHAPE  # (asked in C: hasattr's misses cost less than a Python call per param)
    shapes = list(map(tuple, map(shape_of, params))) if shape_of is not None else list(map(param_shape, params))
    return ParamColumns(
        list(map(names.__getitem__, map(id, params))), shapes, list(map(_DTYPE_NAMES.__getitem__, dtypes))
    )


def _live_paddings(params, flat) -> list[int]:
    """Alignment padding after each param, from where the params really sit in the flat buffer.

    DeepSpeed before 0.19.6 keeps no ``round_robin_bit16_padding``; its params are views
    into ``bit16_groups_flat``, so their storage positions give the layout.
    """
    size = flat.element_size()
    offsets = [(p.data_ptr() - flat.data_ptr()) // size for p in params]
    ends = [o + p.numel() for o, p in zip(offsets, params)]
    return [nxt - end for end, nxt in zip(ends, offsets[1:])] + [0]


def _check_padded_numel(group: Group, i: int, flat) -> None:
    """Cross-check with the optimizer's own numbers: the computed group fills its live flat buffer."""
    if group.padded_numel != flat.numel():
        raise EngineLayoutMismatch(
            f"group {i}: computed padded numel {group.padded_numel}, live flat buffer has {flat.numel()}"
        )


def flat_groups_stage12(engine, names) -> list[Group]:
    opt = engine.optimizer
    groups = []
    for i, params in enumerate(opt.round_robin_bit16_groups):
        count = opt.partition_count[i]
        paddings = (
            opt.round_robin_bit16_padding[i]
            if hasattr(opt, "round_robin_bit16_padding")
            else _live_paddings(params, opt.bit16_groups_flat[i])
        )
        group = flat_group(
            columns_of(params, names),
            optimizer_group=i,
            partition_count=count,
            zero_stage=engine.zero_optimization_stage(),
            paddings=paddings,
        )
        _check_padded_numel(group, i, opt.bit16_groups_flat[i])
        if hasattr(opt, "round_robin_bit16_offsets") and list(map(_OFFSET, group.params)) != list(
            opt.round_robin_bit16_offsets[i]
        ):
            raise EngineLayoutMismatch(f"group {i}: computed offsets differ from the live optimizer's")
        groups.append(group)
    return groups


def flat_groups_bf16_optimizer(engine, names) -> list[Group]:
    # BF16_Optimizer saves each rank's fp32 partition *with* its tail padding.
    opt = engine.optimizer
    groups = []
    for i, params in enumerate(opt.bf16_groups):
        group = flat_group(
            columns_of(params, names),
            optimizer_group=i,
            partition_count=opt.partition_count[i],
            zero_stage=1,
            tail_padding_saved=True,
        )
        _check_padded_numel(group, i, opt.bf16_groups_flat[i])
        groups.append(group)
    return groups


def per_param_groups_stage3(engine, names) -> list[Group]:
    opt = engine.optimizer
    groups = []
    for j, sub_group in enumerate(opt.fp16_groups):
        group = per_param_group(
            columns_of(sub_group, names, _DS_SHAPE if all(map(hasattr, sub_group, repeat("ds_shape"))) else None),
            optimizer_group=int(opt.sub_group_to_group_id[j]),
            partition_count=opt.sub_group_partition_counts[j]
            if hasattr(opt, "sub_group_partition_counts")
            else engine.dp_world_size,
        )
        if group.partition_numel != int(opt.fp16_partitioned_groups_flat_numel[j]):
            raise EngineLayoutMismatch(
                f"sub-group {j}: computed partition numel {group.partition_numel}, "
                f"live optimizer has {opt.fp16_partitioned_groups_flat_numel[j]}"
            )
        groups.append(group)
    return groups


def is_bf16_optimizer(opt) -> bool:
    return type(opt).__name__ == "BF16_Optimizer"
