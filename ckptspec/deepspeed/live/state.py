"""The parts of a live DeepSpeed engine's manifest besides its groups: frozen parameters, aliases,
buffers, and format 1.1's ``optimizer`` and ``save`` objects.

The optimizer and save values are those DeepSpeed saves (``scalars.py`` reads them back from the files): the
wrapped torch optimizer's param groups and ``step``, the loss scaler's attributes, the gradient
clipping (saved at stages 1 and 2 only), the engine's training counters; plus what only the
live engine knows, the optimizer's class. Reads attributes only: no collective call, no torch
import (tensors are read with ``.item()``).
"""

from __future__ import annotations

from itertools import compress, repeat
from operator import itemgetter, not_
from typing import Any, Literal

from ...format.dtypes import Dtype, dtype_name
from ...format.models import Alias, Buffer, FrozenParam, LossScaler, Optimizer, OptimizerGroup, Save
from ...format.partition import frozen_params
from ..describe.scalars import plain_values
from ..layout.ties import repeated
from .groups import columns_of, param_shape
from .walk import ModuleWalk


def frozen_of_engine(walk: ModuleWalk, trainable: set[str], stage: int, excluded: bool) -> list[FrozenParam]:
    if excluded:
        return []
    by_stage: dict[int, Literal["module", "fragments", "partitioned_fragments"]] = {
        0: "module",
        1: "module",
        2: "fragments",
        3: "partitioned_fragments",
    }
    stored_in = by_stage[stage]
    # The params no group holds, picked in C (100k params, a tenth of them frozen), then read in bulk.
    frozen = list(compress(walk.params, map(not_, map(trainable.__contains__, walk.names.values()))))
    if not frozen:
        return []
    return frozen_params(*columns_of(frozen, walk.names), stored_in)


def aliases_of_engine(walk: ModuleWalk) -> list[Alias]:
    """Tied parameters by object identity (``ds_id`` under stage 3), each with its owner's shape.

    DeepSpeed uses ``data_ptr()`` outside stage 3, which ties every zero-element
    param together (they all report 0); identity does not.
    """
    return [Alias(name=full, owner=owner, shape=list(param_shape(p))) for full, owner, p in _ties(walk)]


def _ties(walk: ModuleWalk) -> list[tuple[str, str, Any]]:
    """(name, owner's name, param) of each tied param, in the walk's order."""
    if not any(map(hasattr, walk.params, repeat("ds_id"))):  # identity: the pairs the walk met again
        names = walk.names
        return [(full, names[id(param)], param) for full, param in walk.tied]
    fulls = list(map(itemgetter(0), walk.local_params))
    params = list(map(itemgetter(1), walk.local_params))
    keys = list(map(getattr, params, repeat("ds_id"), map(id, params)))  # in C: 100k params
    owner_of: dict[Any, str] = {}
    ties = []
    for full, param, key in repeated(zip(fulls, params, keys), keys):
        if key in owner_of:
            ties.append((full, owner_of[key], param))
        else:
            owner_of[key] = full
    return ties


def buffers_of_engine(engine, walk: ModuleWalk) -> list[Buffer]:
    persistent = walk.persistent if walk.persistent is not None else set(engine._get_buffer_names())
    return [
        Buffer(name=name, shape=list(buf.shape), dtype=dtype_name(buf.dtype))
        for name, buf in walk.buffers
        if name in persistent
    ]


def optimizer_class(engine) -> str:
    """The client optimizer's class as an import path (``torch.optim.adamw.AdamW``)."""
    cls = type(getattr(engine, "basic_optimizer", None) or engine.optimizer)
    return f"{cls.__module__}.{cls.__qualname__}"


def _number(value: Any) -> Any:
    return value.item() if hasattr(value, "item") and not isinstance(value, (int, float)) else value


def _plain_attributes(obj) -> dict[str, Any]:
    # A torch.dtype attribute (DynamicLossScaler.dtype) is saved pickled as torch.float16; the
    # files' reader names it "float16".
    out = {}
    for key, value in vars(obj).items():
        if type(value).__module__ == "torch" and type(value).__name__ == "dtype":
            value = str(value).removeprefix("torch.")
        out[key] = value
    return plain_values(out)


def _flat_partitions(wrapper, stage: int) -> list[tuple[int, Any]]:
    """(optimizer group, the rank's flat fp32 partition) of each group (stage 3: sub-group), in order:
    the "parameters" the wrapped optimizer steps, whose state holds ``step``."""
    if stage == 3:
        return [(int(g), flat) for g, flat in zip(wrapper.sub_group_to_group_id, wrapper.fp32_partitioned_groups_flat)]
    flats = getattr(wrapper, "single_partition_of_fp32_groups", None)
    if flats is None:
        flats = getattr(wrapper, "fp32_groups_flat_partition", [])  # BF16_Optimizer
    return list(enumerate(flats))


def optimizer_of_engine(engine, stage: int) -> Optimizer | None:
    """Class, hyperparameters and step of each param group, loss scaler, clipping; None if unreadable.

    Each torch param group's step is that of its first flat partition (stage 3: its first
    sub-group): DeepSpeed steps the wrapped optimizer on them, one group at a time.
    """
    wrapper = engine.optimizer
    inner = getattr(wrapper, "optimizer", None)
    if inner is None or not hasattr(inner, "param_groups"):
        return None
    steps: dict[int, Any] = {}
    for g, flat in _flat_partitions(wrapper, stage):
        step = inner.state.get(flat, {}).get("step")
        if step is not None:
            steps.setdefault(g, _number(step))
    # No step for a group: the optimizer has not stepped it yet (a fresh engine), or counts no steps (SGD): 0.
    groups = [
        OptimizerGroup(optimizer_group=g, hyperparameters=plain_values(group, skip=("params",)), step=steps.get(g, 0))
        for g, group in enumerate(inner.param_groups)
    ]
    optimizer = Optimizer(class_=optimizer_class(engine), groups=groups)
    scaler = getattr(wrapper, "loss_scaler", None)
    if scaler is not None and type(wrapper).__name__ != "BF16_Optimizer":  # BF16_Optimizer saves none
        optimizer.loss_scaler = LossScaler(kind=type(scaler).__name__, state=_plain_attributes(scaler))
    clip = getattr(wrapper, "clip_grad", None)
    if stage in (1, 2) and isinstance(clip, (int, float)) and not isinstance(clip, bool) and clip >= 0:
        optimizer.clip_grad = clip
    return optimizer


def save_of_engine(engine) -> Save:
    """The training counters as ``engine.save_checkpoint`` writes them now."""
    return Save(
        global_steps=int(engine.global_steps),
        global_samples=int(engine.global_samples),
        skipped_steps=int(engine.skipped_steps),
    )


def master_dtype_of_engine(engine, stage: int) -> Dtype:
    opt = engine.optimizer
    if stage == 3:
        return dtype_name(opt.fp32_partitioned_groups_flat[0].dtype)
    return (
        dtype_name(opt.single_partition_of_fp32_groups[0].dtype)
        if hasattr(opt, "single_partition_of_fp32_groups")
        else dtype_name(opt.fp32_groups_flat_partition[0].dtype)
    )
