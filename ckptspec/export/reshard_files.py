"""The files of a resharded checkpoint (ZeRO stage 1/2, DeepSpeedZeroOptimizer), written with torch.save.

* ``[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt`` per target rank: the source rank 0's
  optimizer-state dict with every layout-dependent entry recomputed for the target: the fp32
  master partition (tail padding dropped, as DeepSpeed saves it), each per-element state
  (``exp_avg``...: the whole partition, padding zeros), ``group_paddings``,
  ``param_alignment_paddings``, ``partition_count``, ``zero_stage`` and ``param_slice_mappings``
  (the real positions, also under round robin). Every other entry (step, hyperparameters, loss
  scaler, clip_grad, version) is copied as saved.
* ``mp_rank_00_model_states.pt``: the source's dict with ``dp_world_size`` set to the target's and the
  trainable low-precision weights re-laid into the target's flat group buffer (order and padding
  change with the world size); frozen params, buffers, ties, LR scheduler, counters and client
  state as saved (the source's embedded manifest is dropped: the new one is embedded after).

Every file is written with ``ds_pickle.save_streamed``: each record (a partition of one state, a
group's flat low-precision buffer) is read from the source and cast in chunks of at most 16 MiB as it
is written, so peak memory grows neither with the model nor with its largest parameter.
"""

from __future__ import annotations

import collections
import functools
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..checkpoint.embedded import CLIENT_STATE_KEY
from ..checkpoint.states import StateCache
from ..errors import ReconstructMismatch
from ..format.dtypes import ITEMSIZE
from ..format.models import Group, Manifest
from ..location import RemotePath
from . import ds_pickle
from .arrays import ShardReader, _np, _np_dtype, iter_chunks, iter_zeros
from .model_plan import Segment, TensorSource
from .reshard_layout import TargetLayout, natural_groups
from .reshard_source import SourceOptimizer, source_optimizer, with_stage


def _slice(source: TensorSource, start: int, count: int) -> list[Segment]:
    """The segments of elements ``[start, start + count)`` of ``source`` (its segments concatenated)."""

    item = ITEMSIZE[source.dtype]
    lo, hi, pos, out = start * item, (start + count) * item, 0, []
    for seg in source.segments:
        a, b = max(lo, pos), min(hi, pos + seg.nbytes)
        if a < b:
            out.append(Segment(seg.path, seg.offset + a - pos, b - a))
        pos += seg.nbytes
    return out


def _pieces(group: Group, rank: int, sources: dict[str, TensorSource], dtype: str):
    """Where rank ``rank``'s flat partition of ``group`` gets its elements: ``(at, source, first, count)``
    (``count`` elements of ``source`` from its element ``first``, at partition element ``at``), in order."""
    out = []
    lo = rank * group.partition_numel
    for p in group.params:
        if group.partitioning == "flat":  # rank r holds buffer elements [r * pn, (r + 1) * pn)
            a, b = max(p.offset, lo), min(p.offset + p.numel, lo + group.partition_numel)
            first, at = a - p.offset, a - lo
        else:  # per param: rank r holds elements [r * share, ...) of each param, at its offset
            share = (p.numel + p.padding) // group.partition_count
            a, b = 0, max(0, min(share, p.numel - rank * share))
            first, at = rank * share, p.offset
        if a >= b:
            continue
        source = sources[p.name]
        if source.dtype != dtype:
            raise ReconstructMismatch(f"{p.name}: stored as {source.dtype}, the group's partitions as {dtype}")
        out.append((at, source, first, b - a))
    return sorted(out, key=lambda piece: piece[0])


def placed_chunks(size: int, pieces, dtype: str, files: ShardReader):
    """The ``size`` elements of a flat buffer of ``dtype`` (zero where nothing is placed) a chunk at a
    time: each ``(at, source, first, count)`` piece read from ``source``'s segments (cast to ``dtype``)."""
    cursor = 0
    for at, source, first, count in pieces:
        if at >= size:
            break
        count = min(count, size - at)
        if count <= 0:
            continue
        yield from iter_zeros(dtype, at - cursor)
        yield from iter_chunks(_slice(source, first, count), source.dtype, dtype, files)
        cursor = at + count
    yield from iter_zeros(dtype, size - cursor)


def lazy_partition(group: Group, rank: int, sources, dtype: str, files: ShardReader, numel: int | None = None):
    """Rank ``rank``'s flat partition of ``group`` (its first ``numel`` elements; padding zero), read
    from the params' ``sources`` a chunk at a time when ``ds_pickle.save_streamed`` writes it."""
    size = group.partition_numel if numel is None else numel
    pieces = _pieces(group, rank, sources, dtype)  # dtype mismatches raise before anything is written
    return ds_pickle.Lazy(dtype, (size,), lambda: placed_chunks(size, pieces, dtype, files))


def _slice_mappings(group: Group, rank: int, natural: list[str], round_robin: bool) -> collections.OrderedDict:
    """``param_slice_mappings`` of one group and rank as DeepSpeed 0.19 writes them (checked by CK218):
    natural order; offsets counted sequentially in that order unless alignment gaps exist, so under
    round robin they do not describe the flat buffer (DeepSpeed's own defect, kept: these files are
    what DeepSpeed would have written; ckptspec never reads positions from them)."""
    by_name = {p.name: p for p in group.params}
    real = any(p.padding for p in group.params) or not round_robin
    start, end = rank * group.partition_numel, (rank + 1) * group.partition_numel
    out, cursor = collections.OrderedDict(), 0
    for name in natural:
        p = by_name[name]
        offset = p.offset if real else cursor
        if p.numel > 0 and (start <= offset < end or offset < start < offset + p.numel):
            lo, hi = max(offset, start), min(offset + p.numel, end)
            out[name] = ds_pickle.fragment_address(hi - lo, lo - start)
        cursor += p.numel
    return out


def optim_file_names(first: str, world_size: int, mp_rank: int | None = None) -> list[str]:
    """Rank 0's file name ``first`` with each target rank's: the prefix (``bf16_``) and the model-parallel rank
    kept (or ``mp_rank``'s)."""
    first = _with_mp_rank(first, mp_rank)
    prefix, rest = first.split("zero_pp_rank_0_", 1)
    return [f"{prefix}zero_pp_rank_{r}_{rest}" for r in range(world_size)]


@dataclass(frozen=True)
class ModelChanges:
    """What a change of the tensor or pipeline degrees changes in DeepSpeed's files besides the partitions."""

    module: dict[str, TensorSource]  # the module's tensors, whole (written in the model dtype)
    set_keys: dict[str, Any]  # model-states entries a job of the target layout saves otherwise
    drop_keys: tuple[str, ...]  # model-states entries it does not save
    config: Callable[[Any], Any]  # the saved ds_config, as the target job's


def _with_mp_rank(name: str, mp_rank: int | None) -> str:
    return name if mp_rank is None else re.sub(r"mp_rank_\d+", f"mp_rank_{mp_rank:02d}", name)


def write_files(
    found,
    plan,
    state_plan,
    target: TargetLayout,
    states: StateCache,
    tag_dir: Path,
    changes: ModelChanges | None = None,
    *,
    mp_rank: int | None = None,
    model_changes: dict | None = None,
    source: SourceOptimizer | None = None,
    optimizer_in_model_states: bool = False,
    config: Callable[[Any], Any] | None = None,
) -> list[Path]:
    """``changes``: the target's tensor degree differs (``reshard_tensor``); ``found`` then is the target's
    whole-model manifest. ``mp_rank``: the model-parallel rank of the written files' names (another pipeline
    stage's, issue #40), ``model_changes``: model-states entries replaced (``mp_world_size``...). ``source``:
    the optimizer entries of a source without ZeRO-1/2 optimizer files (``reshard_stage0_source``).
    ``optimizer_in_model_states``: the model states' ``optimizer`` is a copy of rank 0's optimizer state dict, as
    a stage-0 bf16 pipeline saves it (``reshard_pipeline_stage0``). ``config``: the saved ds_config as the target
    job's (``reshard_bf16.target_config``), in every file, when the degrees stay."""
    src_dir = plan.tag_dir
    config = changes.config if changes is not None else config or (lambda value: value)
    if source is None:
        first = next(f.path for f in found.files if f.role == "optimizer_states" and 0 in f.ranks)
        source = source_optimizer(found, states.state(src_dir / first))
        source.path, source.file_name = src_dir / first, first
    assert source.path is not None and source.file_name is not None
    masters = {name: s for name, s in plan.sources.items() if s.role == "trainable"}
    master_dtype = found.layout.master_dtype
    written = []
    with ShardReader() as files:
        read = tensor_reader(source.path, states, files)
        for rank, name in enumerate(optim_file_names(source.file_name, target.world_size, mp_rank)):
            osd = _optimizer_state_dict(found, source, read, target, rank, masters, state_plan, master_dtype, files)
            doc = {
                k: osd
                if k == "optimizer_state_dict"
                else config(with_stage(v, target.zero_stage) if source.zero_stage == 3 else v)
                if k == "ds_config"
                else ds_pickle.from_standins(v, read)
                for k, v in source.top.items()
            }
            ds_pickle.save_streamed(doc, tag_dir / name)  # one partition in memory at a time
            written.append(tag_dir / name)
        model = src_dir / next(f.path for f in found.files if f.role == "model_states" and 0 in (f.ranks or [0]))
        full = _full_weights(found, plan) if found.layout.zero_stage == 3 else {}
        full = changes.module if changes is not None else full
        lazy = lazy_reader(model, states, files)
        doc = _model_states(states.state(model), found, target, lazy, full, files)
        if changes is not None:
            doc = {k: changes.set_keys.get(k, v) for k, v in doc.items() if k not in changes.drop_keys}
            doc.update({k: v for k, v in changes.set_keys.items() if k not in doc})  # saved last, as DeepSpeed does
        if "ds_config" in doc:
            doc["ds_config"] = config(doc["ds_config"])
        doc = {**doc, **(model_changes or {})}
        if optimizer_in_model_states:
            doc["optimizer"] = _optimizer_state_dict(
                found, source, read, target, 0, masters, state_plan, master_dtype, files
            )
        # the low-precision group buffers a chunk at a time; torch.save's bytes (shapes as tuples)
        # mp_rank_XX_model_states.pt (a stage-3 source's name has a zero_pp_rank_R_ prefix)
        name = _with_mp_rank(model.name[model.name.index("mp_rank_") :], mp_rank)
        ds_pickle.save_streamed(doc, tag_dir / name, shapes_as_tuples=True)
    return [*written, tag_dir / name]


def _full_weights(found: Manifest, plan) -> dict[str, TensorSource]:
    """A stage-3 source's parameters whole, as a stage 1/2 module holds them: each trainable one its
    master (cast to the model dtype when written: what DeepSpeed's step writes into the low-precision
    weights, and what stage 1/2 rebuilds them from on load), each frozen one gathered from its rank
    fragments."""
    return {name: s for name, s in plan.sources.items() if s.role in ("trainable", "frozen")}


def tensor_reader(path: Path | RemotePath, states: StateCache, files: ShardReader):
    """Tensors of ``path`` as torch views of their storages, each storage read once (sharing kept)."""
    members = states.members(path)

    def read_storage(storage):
        np = _np()
        offset, _ = members[storage.member]
        array = np.empty(storage.numel, dtype=_np_dtype(storage.dtype))
        files.read_into(Segment(path, offset, storage.nbytes), memoryview(array).cast("B"))
        return ds_pickle.tensor(array, storage.dtype)

    return ds_pickle.storage_reader(read_storage)


def lazy_reader(path: Path | RemotePath, states: StateCache, files: ShardReader):
    """Tensors of ``path`` as ``ds_pickle.View``s of lazy storages (one per storage: sharing kept), read
    a chunk at a time when ``save_streamed`` writes them; ``.located(ref)``: a contiguous tensor's bytes
    as a ``TensorSource``."""
    members = states.members(path)
    cache: dict[str, ds_pickle.Lazy] = {}

    def segment(ref) -> Segment:
        offset, _ = members[ref.storage.member]
        item = ref.storage.itemsize
        return Segment(path, offset + ref.storage_offset * item, math.prod(ref.shape) * item)

    def read(ref):
        storage = ref.storage
        if storage.member not in cache:
            seg = Segment(path, members[storage.member][0], storage.nbytes)
            chunks = functools.partial(iter_chunks, [seg], storage.dtype, storage.dtype, files)
            cache[storage.member] = ds_pickle.Lazy(storage.dtype, (storage.numel,), chunks)
        return ds_pickle.View(cache[storage.member], ref.shape, ref.storage_offset, ref.stride)

    def located(name: str, ref) -> TensorSource | None:
        if tuple(ref.stride) != ds_pickle.contiguous(tuple(ref.shape)) and math.prod(ref.shape) > 1:
            return None
        return TensorSource(name, tuple(ref.shape), ref.dtype, [segment(ref)], "lp")

    read.located = located  # type: ignore[attr-defined]  # a function attribute: read and read.located travel together
    return read


def _model_states(state: dict, found: Manifest, target: TargetLayout, read, full: dict, files) -> dict:
    """The model-states dict for the target: flat lp group buffers re-laid, ``dp_world_size`` changed.
    ``full``: whole tensors replacing the module's (a stage-3 source's, whose module holds placeholders).
    Every tensor is lazy (``save_streamed``): a group buffer is written a chunk at a time."""
    module = state["module"] or {}  # None in a pipeline stage's: its weights are in the layer files
    dtype = found.layout.model_dtype
    lp: dict = {}
    for name, ref in module.items():
        if name in full:
            source = full[name]
            # a master or frozen parameter is in the model dtype (DeepSpeed casts the module's parameters; a source's
            # frozen ones already are, an FSDP checkpoint's are fp32); a buffer or weight keeps its own
            out_dtype = dtype if source.role in ("trainable", "frozen") else source.dtype
            chunks = functools.partial(iter_chunks, source.segments, source.dtype, out_dtype, files, source)
            lp[name] = ds_pickle.Lazy(out_dtype, tuple(source.shape), chunks)
        else:
            lp[name] = read(ref)
    aliases = {a.name: a.owner for a in found.aliases}
    for group in target.groups:
        lp.update(_flat_group(group, module, full, read, dtype, files))
    for alias, owner in aliases.items():
        if alias in lp and owner in lp:
            lp[alias] = lp[owner]
    frozen = [f.name for f in found.frozen if f.name in lp]
    # DeepSpeed saves frozen shapes and (whole) fragments at stage 2 unless they are excluded
    save_frozen = target.zero_stage == 2 and bool(frozen)
    out: dict[str, Any] = {}
    for key, value in state.items():
        if key == CLIENT_STATE_KEY:
            continue  # the source's manifest; the new checkpoint's is embedded after writing
        if key == "module":
            out[key] = None if value is None else collections.OrderedDict((n, lp[n]) for n in module)
        elif key == "param_shapes":  # the flat order, which round robin changes with the world size
            out[key] = ds_pickle.sizes(
                [collections.OrderedDict((p.name, tuple(p.shape)) for p in g.params) for g in target.groups]
            )
        elif key == "dp_world_size":
            out[key] = target.world_size
        elif full and key in ("frozen_param_shapes", "frozen_param_fragments"):
            shapes = collections.OrderedDict((f.name, tuple(f.shape)) for f in found.frozen if f.name in lp)
            fragments = collections.OrderedDict((n, lp[n]) for n in frozen)
            out[key] = (ds_pickle.sizes(shapes) if key == "frozen_param_shapes" else fragments) if save_frozen else None
        elif key == "frozen_param_shapes" and value is not None:
            out[key] = ds_pickle.sizes(value)
        elif key == "frozen_param_fragments" and value is not None:
            # the module's frozen tensors, as DeepSpeed saves them (the same storage)
            out[key] = collections.OrderedDict((n, lp[n] if n in lp else read(ref)) for n, ref in value.items())
        elif key == "ds_config" and full:
            out[key] = with_stage(value, target.zero_stage)
        else:
            out[key] = ds_pickle.from_standins(value, read)
    return out


def _flat_group(group: Group, module: dict, full: dict, read, dtype: str, files: ShardReader) -> dict:
    """DeepSpeed's flat low-precision buffer of a target group (zero where no param is) as one lazy
    storage, and each param's view into it; a param's bytes from the source module (or ``full``)."""
    placed = [p for p in group.params if p.name in module]
    if not placed:  # no view refers to the buffer: it is not saved
        return {}
    pieces = []
    for p in placed:
        source = full.get(p.name) or read.located(p.name, module[p.name])
        if source is None:  # a strided source tensor: not expected from DeepSpeed
            raise ReconstructMismatch(f"{p.name}: the saved low-precision weight is not contiguous")
        pieces.append((p.offset, source, 0, p.numel))
    pieces.sort(key=lambda piece: piece[0])
    size = group.padded_numel
    flat = ds_pickle.Lazy(dtype, (size,), lambda: placed_chunks(size, pieces, dtype, files))
    return {p.name: ds_pickle.View(flat, tuple(p.shape), p.offset) for p in placed}


def _no_tensor(ref):
    raise ReconstructMismatch("an unexpected tensor outside the optimizer state")


# DeepSpeedZeroOptimizer.state_dict()'s keys, in its order (a stage-3 source has no clip_grad: the
# target job's gradient_clipping then applies, as DeepSpeed's loader does for a missing one)
STAGE12_KEYS = (
    "loss_scaler",
    "dynamic_loss_scale",
    "overflow",
    "clip_grad",
    "base_optimizer_state",
    "single_partition_of_fp32_groups",
    "zero_stage",
    "group_paddings",
    "param_alignment_paddings",
    "partition_count",
    "ds_version",
    "param_slice_mappings",
)
# BF16_Optimizer.state_dict()'s keys, in its order (a ZeRO-3 source has no clip_grad: as above)
BF16_OPTIMIZER_KEYS = (
    "clip_grad",
    "base_optimizer_state",
    "single_partition_of_fp32_groups",
    "group_paddings",
    "partition_count",
    "ds_version",
    "param_slice_mappings",
)


def _optimizer_state_dict(found, source, read, target, rank, masters, state_plan, master_dtype, files) -> dict:
    states = {}
    for g, group in enumerate(target.groups):
        entry = {}
        for key, value in source.group_scalars.get(g, {}).items():  # step...: as saved (equal on every rank)
            entry[key] = ds_pickle.copied(ds_pickle.from_standins(value, read))
        for key in source.state_keys.get(g, ()):  # after step, in torch's order (Adam makes step first)
            sources = {p.name: state_plan.sources[state_plan.states[p.name][key]] for p in group.params}
            dtype = next(iter(sources.values())).dtype if sources else "float32"
            entry[key] = lazy_partition(group, rank, sources, dtype, files)
        states[g] = entry
    masters_out = [  # tail padding dropped, as DeepSpeed saves the masters
        lazy_partition(group, rank, masters, master_dtype, files, group.saved_numels[rank]) for group in target.groups
    ]
    natural = [[p.name for p in params] for _, params in natural_groups(found)]
    param_groups = ds_pickle.from_standins(source.param_groups, _no_tensor)
    for g, pg in enumerate(param_groups):
        pg["params"] = [g]
    replaced = {
        "base_optimizer_state": {"state": states, "param_groups": param_groups},
        "single_partition_of_fp32_groups": masters_out,
        "zero_stage": ds_pickle.zero_stage(target.zero_stage),
        "group_paddings": [(g.padded_numel - _end(g)) if rank == target.world_size - 1 else 0 for g in target.groups],
        "param_alignment_paddings": [[p.padding for p in g.params] for g in target.groups],
        "partition_count": [target.world_size] * len(target.groups),
        "param_slice_mappings": [
            _slice_mappings(g, rank, natural[i], found.layout.round_robin) for i, g in enumerate(target.groups)
        ],
        "ds_version": source.ds_version,
    }
    if target.bf16_optimizer:  # a ZeRO source's entries as BF16_Optimizer saves them (no loss scaler, no stage)
        keys = [k for k in BF16_OPTIMIZER_KEYS if k in replaced or k in source.osd]
    elif source.zero_stage == 3:
        keys = [k for k in STAGE12_KEYS if k in replaced or k in source.osd]
    else:
        keys = list(source.osd)
    return {k: replaced[k] if k in replaced else ds_pickle.from_standins(source.osd[k], _no_tensor) for k in keys}


def _end(group: Group) -> int:
    return group.params[-1].offset + group.params[-1].numel if group.params else 0
