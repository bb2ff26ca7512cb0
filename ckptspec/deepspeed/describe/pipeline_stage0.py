"""The checkpoint index of a pipeline trained with ``BF16_Optimizer`` at ZeRO stage 0 (issue #17).

DeepSpeed's pipeline engine uses ``BF16_Optimizer`` for bf16 at stage 0. It partitions the fp32
masters of each stage over the stage's data-parallel group like stage 1, and writes
``bf16_zero_pp_rank_<d>_mp_rank_<m>_optim_states.pt`` plus a copy of rank 0's optimizer state in
``mp_rank_<m>_model_states.pt`` (``optimizer``); it records no ``param_shapes`` and no module (a
pipeline's weights are in its layer files). What names the masters: ``param_slice_mappings[g]``,
each parameter's fragment (``start``, ``numel``) in the rank's flat partition, in the flat buffer's
order; a parameter's fragments on the ranks in rank order are the parameter. Its shape is the one
of its weight in the layer file (``<layer>.<key>``).

One domain per stage (``pp<p>-tp0``, size = the data-parallel degree) with ``masters`` in the
optimizer files and the model states' copy as ``replicas``; the whole-model view is the pipeline one
(``model_parallel.pipeline_view``). Metadata only, no pickle code.

An fp32 pipeline at stage 0 runs the torch optimizer itself: no optimizer files, its state per parameter in each
stage's model states, the layer files' fp32 weights its masters (``stored_in: module``), named by
``layout.pipeline_torch_optimizer``; each stage's domain lists its model states (the moments' file). An fp16 pipeline
at stage 0 (FP16_UnfusedOptimizer) is named the same way, its masters the fp32 tensors ``optimizer/fp32_groups[g][i]``
of the stage's model states (``stored_in: model_states``), its dynamic loss scale beside them.
"""

from __future__ import annotations

import math
from pathlib import Path

from ...checkpoint.standins import FragmentAddress
from ...checkpoint.states import StateCache
from ...checkpoint.torchfile import TensorRef, tensor_byte_range
from ...errors import UnsupportedCheckpoint
from ...format.dtypes import ITEMSIZE, Dtype
from ...format.index_models import Coordinate
from ...location import RemotePath
from ..layout.masters import MasterTensor
from ..layout.parallel_files import (
    degrees_of,
    layer_file_name,
    missing_layer_files,
    scan_parallel,
    tensor_rank_files,
)
from ..layout.pipeline_torch_optimizer import StageParam, is_torch_optimizer_state, is_unfused_state, stage_params
from .index_builder import IndexBuilder

_HINT = "the masters of this stage-0 pipeline cannot be named from its files; it is not described"
_KEY = ("optimizer_state_dict", "single_partition_of_fp32_groups")


def _layer_tensors(files, states: StateCache) -> dict[str, TensorRef]:
    """``<layer>.<key>`` -> its (low-precision) weight in the layer file: the parameter's shape and dtype."""
    out = {}
    for layer, path in files.layer_files.items():
        state = states.state(path)
        for key, ref in state.items() if isinstance(state, dict) else []:
            if isinstance(ref, TensorRef):
                out[f"{layer}.{key}"] = ref
    return out


def _stage_masters(
    folder: Path, by_rank: dict[int, Path | RemotePath], shapes, states: StateCache, copy_of=None, tensor=None
):
    """Every master of one stage: each parameter's fragments over the data-parallel ranks, in rank order.
    ``tensor``: the stage's tensor rank in a tensor-parallel pipeline (whose layer files hold the shapes)."""
    pieces: dict[str, list] = {}
    dtype: Dtype = "float32"
    for _, path in sorted(by_rank.items()):  # rank order: the flat buffer's
        state = states.state(path)
        osd = state.get("optimizer_state_dict") if copy_of is None else state.get("optimizer")
        rel = path.relative_to(folder).as_posix()  # type: ignore[arg-type]  # folder's own file, of its kind
        if not isinstance(osd, dict) or not isinstance(osd.get("param_slice_mappings"), list):
            raise UnsupportedCheckpoint("no param_slice_mappings", _HINT, rel)
        members = states.members(path)
        for g, mapping in enumerate(osd["param_slice_mappings"]):
            ref = (osd.get("single_partition_of_fp32_groups") or [None] * (g + 1))[g]
            if not isinstance(ref, TensorRef):
                raise UnsupportedCheckpoint(f"no flat fp32 partition of group {g}", _HINT, rel)
            base = members[ref.storage.member][0] + ref.storage_offset * ref.storage.itemsize
            dtype = ref.dtype
            item = ref.storage.itemsize
            for name, fragment in mapping.items():
                if not isinstance(fragment, FragmentAddress):
                    raise UnsupportedCheckpoint(f"param_slice_mappings of {name!r} is no FragmentAddress", _HINT, rel)
                start, numel = int(fragment.start), int(fragment.numel)
                if start + numel > ref.numel:
                    raise UnsupportedCheckpoint(f"fragment of {name!r} beyond the partition", _HINT, rel)
                pieces.setdefault(name, []).append((rel, base + start * item, numel * item, g))
    missing: dict[str, list[str]] = {}  # a master without a weight in a layer file: its shape is unknown
    for name in pieces:
        if name not in shapes:
            missing.setdefault(layer_file_name(name, tensor), []).append(name)
    if missing:
        raise missing_layer_files(missing, folder)
    out = []
    for name, segments in pieces.items():
        key = (*(_KEY if copy_of is None else ("optimizer", "single_partition_of_fp32_groups")), segments[0][3])
        master = MasterTensor(name, shapes[name], dtype, tuple(s[:3] for s in segments), key)
        if sum(s[2] for s in segments) != ITEMSIZE[dtype] * math.prod(master.shape):
            if copy_of is not None:  # data rank 0's copy holds its own partition: a master it holds in part is no copy
                continue
            raise UnsupportedCheckpoint(f"the fragments of {name!r} do not make its shape {list(master.shape)}", _HINT)
        out.append(master)
    return out


def _weight(folder: Path, rel: str, name: str, key: str, ref: TensorRef, states: StateCache) -> MasterTensor:
    """A layer file's fp32 weight taken for its master (a pipeline without mixed precision)."""
    offset, nbytes = tensor_byte_range(ref, states.members(folder / rel))
    return MasterTensor(name, tuple(ref.shape), ref.dtype, ((rel, offset, nbytes),), (key,))


def _stage_master(folder: Path, param: StageParam, states: StateCache) -> MasterTensor:
    """A stage parameter's master: FP16_UnfusedOptimizer's fp32 tensor in the model states, else the layer weight."""
    if param.master is None:
        return _weight(folder, param.layer_file, param.name, param.key, param.ref, states)
    offset, nbytes = tensor_byte_range(param.master, states.members(folder / param.model_file))
    segments = ((param.model_file, offset, nbytes),)
    return MasterTensor(param.name, tuple(param.master.shape), param.master.dtype, segments, param.master_key)


def describe(folder: Path, states: StateCache, hash_algorithm: str | None = None, live=None):
    """``live``: the live engine's masters and copies of each model-parallel rank (live/masters.py)."""
    from .model_parallel import pipeline_view
    from .tp_pipeline import tensor_pipeline_view

    files = scan_parallel(folder)
    degrees = degrees_of(files, states)
    # Each tensor rank's stages and layer files are a pipeline of their own (its shards' names and shapes)
    views = {t: tensor_rank_files(files, degrees, t) for t in range(degrees.tensor)}
    tensor_of = {mp: degrees.coordinate(mp)[1] for mp in files.by_mp_rank}
    b = IndexBuilder(folder, states, hash_algorithm)
    weights = {t: _layer_tensors(view, states) for t, view in views.items()}
    shapes = {t: {n: tuple(r.shape) for n, r in w.items()} for t, w in weights.items()}
    b.model_dtypes.update({n: r.dtype for w in weights.values() for n, r in w.items()})
    if live is not None:
        b.model_dtypes.update(live.dtypes)
    fp32 = None  # the torch optimizer's own state in the model states (FP16_UnfusedOptimizer's: its fp32 masters too)
    unfused = is_unfused_state(b.model.get("optimizer"))
    if live is None and (is_torch_optimizer_state(b.model.get("optimizer")) or unfused):
        fp32 = stage_params(files, states)
    domains = []
    for mp, shards in sorted(files.by_mp_rank.items()):
        model = shards.model_files[min(shards.model_files)]
        own, tensor = shapes[tensor_of[mp]], (tensor_of[mp] if degrees.tensor > 1 else None)
        if live is not None:
            masters, copies = live.by_mp_rank[mp]
        elif fp32 is not None:
            masters, copies = [_stage_master(folder, p, states) for p in fp32[mp]], []
        else:
            masters = _stage_masters(folder, shards.optim_files, own, states, tensor=tensor)
            copies = (
                _stage_masters(folder, {0: model}, own, states, copy_of=0, tensor=tensor)
                if shards.optim_files.get(0)
                else []
            )
        by_name = {m.name: m for m in masters}
        replicas = [(by_name[c.name], c) for c in copies if c.name in by_name]
        ranks = {p.name: r for r, p in shards.optim_files.items()}
        listed = [b.file(model.name, "model_states", [0])]
        listed += [b.file(p.name, "optimizer_states", [ranks[p.name]]) for p in shards.optim_files.values()]
        pipeline, tensor = degrees.coordinate(mp)
        domain = b.domain(
            f"pp{pipeline}-tp{tensor}",
            Coordinate(pipeline=pipeline, tensor=tensor),
            "data_parallel",
            masters,
            "optimizer_states" if fp32 is None else ("model_states" if unfused else "module"),
            listed,
            size=len(shards.optim_files) if fp32 is None else degrees.data,
            replicas=replicas,
            add_parameters=False,
        )
        domain.manifest.layout.pipeline_parallel_size = degrees.pipeline
        domain.manifest.layout.tensor_parallel_size = degrees.tensor
        domains.append(domain)
    if degrees.tensor > 1:  # each tensor rank's shards placed in the whole tensors by the recorded split rules
        layer_files, parameters = tensor_pipeline_view(files, states, domains, degrees.tensor, hash_algorithm)
    else:
        layer_files, parameters = pipeline_view(files, states, domains, hash_algorithm)
    b.parameters = parameters
    index = b.index("zero", domains)
    index.layer_files = layer_files
    index.topology.degrees.pipeline = degrees.pipeline
    index.topology.degrees.tensor = degrees.tensor
    index.topology.model_parallel_size = degrees.model_parallel
    index.topology.degrees_source = degrees.source
    return index
