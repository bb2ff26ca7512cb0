"""The files of a checkpoint resharded to ZeRO stage 3, from a stage 1/2 source (the change DeepSpeed's
universal path cannot make), as DeepSpeed 0.19's ``DeepSpeedZeroOptimizer_Stage3`` saves them.

* ``[bf16_]zero_pp_rank_R_mp_rank_XX_optim_states.pt`` per rank: ``fp32_flat_groups`` (one flat
  partition per sub-group: each param's ``ceil(numel / ws)`` share at its offset, padding zero), the
  torch optimizer's state per sub-group (``exp_avg``... laid out like the masters, ``step`` as saved)
  with each param group listing its sub-groups, ``partition_count``, ``zero_stage`` 3 and the loss
  scaler, ``dynamic_loss_scale`` and ``overflow`` as saved.
* ``zero_pp_rank_R_mp_rank_XX_model_states.pt`` per rank (``XX``: the source's, or the target tensor rank's):
  the source's model states with every parameter (trainable, frozen, tied) as the empty placeholder stage 3 saves (a tie
  shares its owner's), each frozen parameter's rank share in ``frozen_param_fragments``, ``param_shapes`` per
  sub-group, ``shared_params`` on rank 0 only (as DeepSpeed writes them at stage 3), ``dp_world_size`` and
  ``ds_config``'s stage set; buffers, counters, LR scheduler and client state as saved. DeepSpeed rebuilds the
  low-precision weights from the masters on load, so none are written.

Sub-groups follow DeepSpeed's ``_create_fp16_sub_groups`` for the target's ``sub_group_size``
(``reshard_layout.sub_groups``); the target job must use the same value.
"""

from __future__ import annotations

import collections
import functools
from pathlib import Path
from typing import Any

from ..checkpoint.embedded import CLIENT_STATE_KEY
from ..checkpoint.states import StateCache
from ..format.models import Manifest
from . import ds_pickle
from .arrays import ShardReader, iter_chunks
from .model_plan import TensorSource
from .reshard_files import ModelChanges, lazy_partition, lazy_reader, optim_file_names, placed_chunks, tensor_reader
from .reshard_layout import TargetLayout, target_sub_group_size
from .reshard_source import SourceOptimizer, source_optimizer, with_stage


def write_stage3_files(
    found: Manifest,
    plan,
    state_plan,
    target: TargetLayout,
    states: StateCache,
    tag_dir: Path,
    sub_group_size,
    changes: ModelChanges | None = None,
    mp_rank: int | None = None,
    source: SourceOptimizer | None = None,
) -> list[Path]:
    """``changes``: the target's tensor degree differs (an AutoTP ZeRO-3 merge, ``reshard_tensor``, or split,
    ``reshard_tensor_split``); ``found`` then is the whole model's manifest, or a target tensor rank's, whose files
    are named for tensor rank ``mp_rank``. ``source``: the optimizer entries of a source without ZeRO optimizer
    files (an FSDP checkpoint's, ``reshard_dcp``), whose made model states hold no tensor (each one whole in
    ``changes.module``)."""
    config = changes.config if changes is not None else (lambda value: value)
    src_dir = plan.tag_dir
    model = src_dir / next(f.path for f in found.files if f.role == "model_states" and 0 in (f.ranks or [0]))
    if source is None:
        first = src_dir / next(f.path for f in found.files if f.role == "optimizer_states" and 0 in f.ranks)
        source, first_name = source_optimizer(found, states.state(first)), first.name
    else:
        assert source.path is not None and source.file_name is not None
        first, first_name = source.path, source.file_name
    model_state = states.state(model)
    masters = {name: s for name, s in plan.sources.items() if s.role == "trainable"}
    sub_group_size = target_sub_group_size(found, sub_group_size)
    written = []
    with ShardReader() as files:
        read_optim = tensor_reader(first, states, files)
        read_model = lazy_reader(model, states, files)  # nothing read until written
        dtype = found.layout.model_dtype
        lp = {
            name: read_model(ref) if ref is not None else _whole(changes.module[name], dtype, files)  # type: ignore[union-attr]
            for name, ref in model_state["module"].items()
        }
        frozen = _frozen(found, plan)
        for rank, name in enumerate(optim_file_names(first_name, target.world_size, mp_rank)):
            osd = _optimizer_state_dict(source, read_optim, target, rank, masters, state_plan, files)
            doc = {
                k: osd
                if k == "optimizer_state_dict"
                else config(with_stage(v, 3, sub_group_size))
                if k == "ds_config"
                else ds_pickle.from_standins(v, read_optim)
                for k, v in source.top.items()
            }
            ds_pickle.save_streamed(doc, tag_dir / name)  # one partition in memory at a time
            written.append(tag_dir / name)
        # zero_pp_rank_R_mp_rank_XX_model_states.pt: a tensor-parallel coordinate keeps its mp_rank_XX (a stage
        # 1/2 source's model states are mp_rank_XX_model_states.pt)
        first_model = model.name if model.name.startswith("zero_pp_rank_0_") else f"zero_pp_rank_0_{model.name}"
        for rank, name in enumerate(optim_file_names(first_model, target.world_size, mp_rank)):
            path = tag_dir / name
            doc = _model_states(
                model_state, found, target, rank, lp, frozen, read_model, sub_group_size, files, changes is not None
            )
            if changes is not None:
                doc = {k: changes.set_keys.get(k, v) for k, v in doc.items() if k not in changes.drop_keys}
                doc.update({k: v for k, v in changes.set_keys.items() if k not in doc})  # last, as DeepSpeed does
                doc["ds_config"] = config(doc["ds_config"])
            ds_pickle.save_streamed(doc, path, shapes_as_tuples=True)  # torch.save's bytes, a chunk at a time
            written.append(path)
    return written


def _whole(source: TensorSource, model_dtype: str, files: ShardReader) -> ds_pickle.View:
    """A tensor of the module as its own storage, read when written: a parameter (master or frozen) in the model
    dtype, a buffer in its own."""
    dtype = model_dtype if source.role in ("trainable", "frozen") else source.dtype
    chunks = functools.partial(iter_chunks, source.segments, source.dtype, dtype, files, source)
    return ds_pickle.View(ds_pickle.Lazy(dtype, (source.numel,), chunks), tuple(source.shape))


def _frozen(found: Manifest, plan) -> dict[str, TensorSource]:
    """Where every frozen parameter's bytes are (a stage-3 source holds them as rank fragments)."""
    out = {}
    for f in found.frozen:
        source = plan.sources.get(f.name)
        if source is not None and source.role == "frozen":
            out[f.name] = source
    return out


def _share(source: TensorSource, dtype: str, rank: int, world_size: int, files: ShardReader) -> ds_pickle.Lazy:
    """Rank ``rank``'s ``ceil(numel / ws)`` share of a frozen parameter (flat, the tail zero) in ``dtype`` (the
    model's), read when written."""
    size = -(-source.numel // world_size)
    count = max(0, min(size, source.numel - rank * size))
    pieces = [(0, source, rank * size, count)] if count else []
    return ds_pickle.Lazy(dtype, (size,), lambda: placed_chunks(size, pieces, dtype, files))


def _optimizer_state_dict(source, read, target, rank, masters, state_plan, files) -> dict:
    flats, state = [], {}
    for j, group in enumerate(target.groups):
        g = group.optimizer_group
        flats.append(lazy_partition(group, rank, masters, "float32", files))
        entry = {}
        for key in source.state_keys.get(g, ()):
            sources = {p.name: state_plan.sources[state_plan.states[p.name][key]] for p in group.params}
            dtype = next(iter(sources.values())).dtype if sources else "float32"
            entry[key] = lazy_partition(group, rank, sources, dtype, files)
        for key, value in source.group_scalars.get(g, {}).items():
            # step: as saved (equal on every rank and group); a copy per sub-group, since the optimizer
            # increments it in place and sub-groups sharing one storage would count thrice
            entry[key] = ds_pickle.copied(ds_pickle.from_standins(value, read))
        state[j] = entry
    param_groups = ds_pickle.from_standins(source.param_groups, read)
    for g, pg in enumerate(param_groups):
        pg["params"] = [j for j, group in enumerate(target.groups) if group.optimizer_group == g]
    osd = source.osd
    return {
        "zero_stage": ds_pickle.zero_stage(3),
        "loss_scaler": ds_pickle.from_standins(osd["loss_scaler"], read),
        "dynamic_loss_scale": osd.get("dynamic_loss_scale", False),
        "overflow": osd.get("overflow", False),
        "partition_count": target.world_size,
        "optimizer_state_dict": {"state": state, "param_groups": param_groups},
        "fp32_flat_groups": flats,
    }


def _model_states(
    state: dict, found: Manifest, target: TargetLayout, rank, lp, frozen, read, sub_group_size, files, reshaped: bool
) -> dict:
    """``reshaped``: the tensor degree changes, so the frozen parameters' saved shapes (the source's shards) are not
    the target's."""
    aliases = {a.name: a.owner for a in found.aliases}
    params = {p.name for g in found.groups for p in g.params} | {f.name for f in found.frozen}
    placeholders = {}
    module = collections.OrderedDict()
    for name in state["module"]:
        owner = aliases.get(name, name)
        if owner in params:
            if owner not in placeholders:
                placeholders[owner] = ds_pickle.placeholder(lp[name].base.dtype)
            module[name] = placeholders[owner]
        else:
            module[name] = lp[name]
    # Stage 1 records no frozen shapes or fragments (the module holds them); stage 3 needs both.
    frozen_shapes = (None if reshaped else state.get("frozen_param_shapes")) or collections.OrderedDict(
        (f.name, tuple(f.shape)) for f in found.frozen if f.name in frozen
    )
    dtype = found.layout.model_dtype
    fragments = collections.OrderedDict(
        (n, _share(s, dtype, rank, target.world_size, files)) for n, s in frozen.items()
    )
    out: dict[str, Any] = {}
    for key, value in state.items():
        if key == CLIENT_STATE_KEY:
            continue
        if key == "module":
            out[key] = module
        elif key == "param_shapes":
            out[key] = ds_pickle.sizes(
                [collections.OrderedDict((p.name, tuple(p.shape)) for p in g.params) for g in target.groups]
            )
        elif key in ("frozen_param_shapes", "frozen_param_fragments") and found.layout.exclude_frozen_parameters:
            out[key] = None  # as DeepSpeed saves them then: its loader reads every frozen param's fragment otherwise
        elif key == "frozen_param_shapes":
            out[key] = ds_pickle.sizes(frozen_shapes)
        elif key == "frozen_param_fragments":
            out[key] = fragments
        elif key == "shared_params":  # as DeepSpeed 0.19 writes them at stage 3: on rank 0 only
            out[key] = dict(value or {}) if rank == 0 else {}
        elif key == "dp_world_size":
            out[key] = target.world_size
        elif key == "ds_config":
            out[key] = with_stage(value, 3, sub_group_size)
        else:
            out[key] = ds_pickle.from_standins(value, read)
    return out
