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

Bytes are read per target partition, one parameter slice at a time: peak memory is a partition per
state, not the model.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from pathlib import Path

from ..checkpoint.embedded import CLIENT_STATE_KEY
from ..checkpoint.states import StateCache
from ..errors import ReconstructMismatch
from ..format.dtypes import ITEMSIZE
from ..format.models import Group, Manifest
from ..format.partition import natural_order
from . import ds_pickle
from .arrays import ShardReader, _np, _np_dtype
from .plan import Segment, TensorSource
from .reshard_layout import TargetLayout

MODEL_STATES = "mp_rank_00_model_states.pt"


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


def _partition(group: Group, rank: int, sources: dict[str, TensorSource], dtype: str, files: ShardReader):
    """Rank ``rank``'s flat partition of ``group`` (padding zero) from the params' ``sources``."""
    np = _np()
    out = np.zeros(group.partition_numel, dtype=_np_dtype(dtype))
    view = memoryview(out).cast("B")
    lo, item = rank * group.partition_numel, out.itemsize
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
        pos = at * item
        for seg in _slice(source, first, b - a):
            files.read_into(seg, view[pos : pos + seg.nbytes])
            pos += seg.nbytes
    return out


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


def _optim_file_names(found: Manifest, world_size: int) -> list[str]:
    first = next(f.path for f in found.files if f.role == "optimizer_states" and 0 in f.ranks)
    prefix = first[: first.index("zero_pp_rank_")]
    return [f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(world_size)]


def write_files(found, plan, state_plan, target: TargetLayout, states: StateCache, tag_dir: Path) -> list[Path]:
    src_dir = plan.tag_dir
    first = next(f.path for f in found.files if f.role == "optimizer_states" and 0 in f.ranks)
    template = _Template(states.state(src_dir / first), None)
    masters = {name: s for name, s in plan.sources.items() if s.role == "trainable"}
    keys = {g: sorted(names) for g, names in _state_keys(found).items()}
    master_dtype = found.layout.master_dtype
    written = []
    with ShardReader() as files:
        template.reader = _storage_reader(src_dir / first, states, files)
        for rank, name in enumerate(_optim_file_names(found, target.world_size)):
            osd = _optimizer_state_dict(found, template, target, rank, masters, state_plan, keys, master_dtype, files)
            doc = {
                k: osd if k == "optimizer_state_dict" else ds_pickle.from_standins(v, template.reader)
                for k, v in template.state.items()
            }
            ds_pickle.save(doc, tag_dir / name)
            written.append(tag_dir / name)
        model = src_dir / next(f.path for f in found.files if f.role == "model_states")
        doc = _model_states(states.state(model), found, target, _storage_reader(model, states, files))
        ds_pickle.save(doc, tag_dir / MODEL_STATES)
    return [*written, tag_dir / MODEL_STATES]


@dataclass
class _Template:
    """Source rank 0's decoded optimizer-state file: every entry the target does not recompute comes from it."""

    state: dict
    reader: object


def _storage_reader(path: Path, states: StateCache, files: ShardReader):
    """Tensors of ``path`` as torch views of their storages, each storage read once (sharing kept)."""
    members = states.members(path)

    def read_storage(storage):
        np = _np()
        offset, _ = members[storage.member]
        array = np.empty(storage.numel, dtype=_np_dtype(storage.dtype))
        files.read_into(Segment(path, offset, storage.nbytes), memoryview(array).cast("B"))
        return ds_pickle.tensor(array, storage.dtype)

    return ds_pickle.storage_reader(read_storage)


def _model_states(state: dict, found: Manifest, target: TargetLayout, read) -> dict:
    """The model-states dict for the target: flat lp group buffers re-laid, ``dp_world_size`` changed."""
    module = state["module"]
    lp = {name: read(ref) for name, ref in module.items()}
    aliases = {a.name: a.owner for a in found.aliases}
    for group in target.groups:
        placed = [(p.name, lp[p.name], p.offset) for p in group.params if p.name in lp]
        views = ds_pickle.flat_views(group.padded_numel, placed)
        lp.update(views)
    for alias, owner in aliases.items():
        if alias in lp and owner in lp:
            lp[alias] = lp[owner]
    out = {}
    for key, value in state.items():
        if key == CLIENT_STATE_KEY:
            continue  # the source's manifest; the new checkpoint's is embedded after writing
        if key == "module":
            out[key] = collections.OrderedDict((n, lp[n]) for n in module)
        elif key == "param_shapes":  # the flat order, which round robin changes with the world size
            out[key] = ds_pickle.sizes(
                [collections.OrderedDict((p.name, tuple(p.shape)) for p in g.params) for g in target.groups]
            )
        elif key == "frozen_param_shapes" and value is not None:
            out[key] = ds_pickle.sizes(value)
        elif key == "dp_world_size":
            out[key] = target.world_size
        elif key == "frozen_param_fragments" and value is not None:
            # the module's frozen tensors, as DeepSpeed saves them (the same storage)
            out[key] = collections.OrderedDict((n, lp[n] if n in lp else read(ref)) for n, ref in value.items())
        else:
            out[key] = ds_pickle.from_standins(value, read)
    return out


def _state_keys(found: Manifest) -> dict[int, set[str]]:
    out: dict[int, set[str]] = {}
    for f in found.files:
        for loc in f.state_partitions or ():
            out.setdefault(loc.group, set()).add(loc.state)
    return out


def _no_tensor(ref):
    raise ReconstructMismatch("an unexpected tensor outside the optimizer state")


def _optimizer_state_dict(found, template, target, rank, masters, state_plan, keys, master_dtype, files) -> dict:
    src, read_template = template.state["optimizer_state_dict"], template.reader
    template = template.state
    base = src["base_optimizer_state"]
    states = {}
    for g, group in enumerate(target.groups):
        saved = base["state"][g]
        entry = {}
        for key, value in saved.items():
            if key in keys.get(g, ()):
                sources = {p.name: state_plan.sources[state_plan.states[p.name][key]] for p in group.params}
                dtype = next(iter(sources.values())).dtype if sources else "float32"
                entry[key] = ds_pickle.tensor(_partition(group, rank, sources, dtype, files))
            else:  # step and other per-group scalars: as saved (equal on every rank)
                entry[key] = ds_pickle.copied(ds_pickle.from_standins(value, read_template))
        states[g] = entry
    masters_out = []
    for group in target.groups:
        full = _partition(group, rank, masters, master_dtype, files)
        masters_out.append(ds_pickle.tensor(full[: group.saved_numels[rank]].copy()))
    natural = [
        [p.name for p in src_group.params] if not found.layout.round_robin else _natural(src_group)
        for src_group in found.groups
    ]
    replaced = {
        "base_optimizer_state": {
            "state": states,
            "param_groups": ds_pickle.from_standins(base["param_groups"], _no_tensor),
        },
        "single_partition_of_fp32_groups": masters_out,
        "zero_stage": ds_pickle.zero_stage(target.zero_stage),
        "group_paddings": [(g.padded_numel - _end(g)) if rank == target.world_size - 1 else 0 for g in target.groups],
        "param_alignment_paddings": [[p.padding for p in g.params] for g in target.groups],
        "partition_count": [target.world_size] * len(target.groups),
        "param_slice_mappings": [
            _slice_mappings(g, rank, natural[i], found.layout.round_robin) for i, g in enumerate(target.groups)
        ],
    }
    return {k: replaced[k] if k in replaced else ds_pickle.from_standins(v, _no_tensor) for k, v in src.items()}


def _natural(group: Group) -> list[str]:
    return [p.name for p in natural_order(list(group.params), group.partition_count)]


def _end(group: Group) -> int:
    return group.params[-1].offset + group.params[-1].numel if group.params else 0
