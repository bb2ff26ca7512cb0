"""``ckptspec reshard --tensor-parallel T`` of an AutoTP ZeRO-1/2/3 checkpoint: its tensors split over T tensor ranks.

The source's checkpoint index says how AutoTP splits each tensor: along one axis (a column-parallel weight and bias:
axis 0, a row-parallel weight: axis 1) or not at all (replicated). The target keeps each tensor's rule at another
degree. The whole model is composed as for the merge (``reshard_tensor``), then each tensor rank's shards are cut
from it (no byte is held: a shard is the whole tensor's segments at the rank's runs). Each tensor rank is written by
the ZeRO writer (a ZeRO-3 target's: ``reshard_stage3``) as a domain of ``world_size / T`` data-parallel ranks under
its ``mp_rank_XX`` names. A ZeRO-3 source's module holds placeholders: its weights are the masters, cast.

What an AutoTP job of degree T saves besides its shards, set here: ``mp_world_size`` T,
``checkpoint_parallel_dimensions`` tp T, ``tensor_parallel.autotp_size`` T in the saved ``ds_config``, and
``universal_checkpoint_info`` with the patterns and the ``affine_map`` (version 1) DeepSpeed 0.19 records: for every
parameter, each rank's shard shape and the one piece of the whole tensor it holds.
Refused by name (CK410): a split axis T does not divide, a source other than AutoTP ZeRO at pipeline degree 1.
"""

from __future__ import annotations

import copy
import functools
import math
import re
from pathlib import Path
from typing import Any

from ..checkpoint.states import StateCache
from ..errors import ReshardUnsupported
from ..format.index_models import CheckpointIndex, PiecesPlacement, SplitPlacement
from .arrays import ShardReader
from .model_plan import ReconstructionPlan, RunSegments, TensorSource
from .optimizer_state import OptimizerStatePlan
from .reshard_files import ModelChanges, lazy_reader
from .reshard_layout import target_layout
from .reshard_tensor import DataParallelTarget, refuse_unmergeable, whole_model
from .tensor_cuts import Cut, affine_pieces, check_degree, cut_of_pieces, plain, shard_runs, shard_shape


def plan_tensor_split(
    index: CheckpointIndex,
    tag_dir: Path,
    plans: dict[str, ReconstructionPlan],
    states: StateCache,
    world_size: int,
    zero_stage: int | None,
    degree: int,
    sub_group_size: int | None = None,
) -> list[DataParallelTarget]:
    """One write per target tensor rank (a ZeRO-3 target's cut into sub-groups of ``sub_group_size``); CK410
    before anything is written."""
    refuse_unmergeable(index, world_size)
    _refuse_indivisible_world(world_size, degree)
    manifest, whole, extras, module = whole_model(index, tag_dir, plans, states)
    axes = split_axes(index, extras, degree)
    state_plan = whole.optimizer_state_plan()
    writes = split_writes(manifest, whole, state_plan, module, axes, world_size, zero_stage, degree, sub_group_size)
    return _refused_at_stage0(writes, whole, states, autotp=True)


def plan_data_parallel_split(
    found,
    plan,
    state_plan: OptimizerStatePlan,
    states: StateCache,
    world_size: int,
    zero_stage,
    degree: int,
    config,
    sub_group_size: int | None = None,
) -> list[DataParallelTarget]:
    """A data-parallel ZeRO checkpoint (its format 1.x manifest ``found``) split over ``degree`` tensor ranks by
    the target's AutoTP rules (``config``: its ``ds_config``); CK410 before anything is written."""
    _refuse_indivisible_world(world_size, degree)
    axes = axes_from_config(found, config, degree)
    if found.layout.zero_stage == 3:  # its module holds placeholders: the weights are the masters, cast
        module = {n: s for n, s in plan.sources.items() if s.role == "trainable"}
    else:
        module = _saved_module(found, plan, states)
    module.update({n: s for n, s in plan.sources.items() if s.role in ("frozen", "buffer")})
    manifest = found.model_copy(deep=True)
    writes = split_writes(manifest, plan, state_plan, module, axes, world_size, zero_stage, degree, sub_group_size)
    return _refused_at_stage0(writes, plan, states)


def _refused_at_stage0(
    writes: list[DataParallelTarget], plan, states: StateCache, autotp: bool = False
) -> list[DataParallelTarget]:
    """``writes``, after CK410 for a stage-0 target that a stage-0 checkpoint could not describe (ties, frozen
    parameters...: ``reshard_stage0.refuse_stage0``, from the source's rank-0 optimizer file). ``autotp``: an AutoTP
    source's split, whose frozen parameters are written (each tensor rank's file checked at its shard shapes, in
    tensor rank 0's module order: the written one)."""
    if writes[0].zero_stage == 0:
        from .reshard_stage0 import module_order, refuse_stage0, source_osd

        osd = source_osd(writes[0].manifest, plan, states)
        order = module_order(writes[0].manifest, plan, states) if autotp else None
        for write in writes if autotp else writes[:1]:
            refuse_stage0(write.manifest, osd, order)
    return writes


def _saved_module(found, plan, states: StateCache) -> dict[str, TensorSource]:
    """A ZeRO-1/2 checkpoint's module tensors as saved (its low-precision weights)."""
    model = next(f.path for f in found.files if f.role == "model_states" and 0 in (f.ranks or [0]))
    with ShardReader() as files:
        read = lazy_reader(plan.tag_dir / model, states, files)
        saved = states.state(plan.tag_dir / model)["module"] or {}
        module = {n: read.located(n, ref) for n, ref in saved.items()}
    if any(source is None for source in module.values()):
        raise ReshardUnsupported(f"{model}: a module tensor is not contiguous", "resume at the same layout")
    return module


def _refuse_indivisible_world(world_size: int, degree: int) -> None:
    if world_size % degree:
        raise ReshardUnsupported(
            f"--world-size {world_size} is not a multiple of --tensor-parallel {degree}",
            f"give a multiple of {degree}: each data-parallel rank holds one copy of the {degree} tensor ranks",
        )


def axes_from_config(found, config, degree: int) -> dict[str, Cut]:
    """name -> the axis AutoTP of ``degree`` splits it along, by the target ``ds_config``'s explicit
    ``tensor_parallel.partition_config.layer_specs`` (DeepSpeed's ``find_matching_spec`` of a layer's
    ``<module>.weight``, the first spec that matches): a column-parallel layer's weight and bias along axis 0, a
    row-parallel layer's weight along axis 1 (its bias is replicated), any other tensor replicated."""
    tp = (config or {}).get("tensor_parallel") or {}
    partition = tp.get("partition_config") or {}
    specs = partition.get("layer_specs")
    if partition.get("use_default_specs", True) is not False or not specs:
        raise ReshardUnsupported(
            "--tensor-parallel of a data-parallel checkpoint needs the target's AutoTP rules: "
            "tensor_parallel.partition_config.layer_specs with use_default_specs false in --ds-config",
            "give the target job's ds_config with its layer_specs (DeepSpeed's preset rules are not read)",
        )
    for spec in specs:
        extra = sorted(set(spec) - {"patterns", "partition_type"})
        if extra or spec.get("partition_type", "column") not in ("column", "row", "skip"):
            raise ReshardUnsupported(
                f"a layer spec with {extra or spec.get('partition_type')} is not read yet", "give patterns and a type"
            )
    shapes = {p.name: list(p.shape) for g in found.groups for p in g.params}
    shapes.update({f.name: list(f.shape) for f in found.frozen})
    out = {}
    for name, shape in shapes.items():
        layer, _, attr = name.rpartition(".")
        spec = next((s for s in specs if any(re.match(p, f"{layer}.weight") for p in s["patterns"])), None)
        kind = None if spec is None else spec.get("partition_type", "column")
        if attr not in ("weight", "bias") or kind in (None, "skip") or (kind == "row" and attr == "bias"):
            continue
        if len(shapes.get(f"{layer}.weight", [])) != 2:
            raise ReshardUnsupported(
                f"{layer}: matched by a {kind} layer spec, but its weight is not 2-D (not a Linear layer)",
                "narrow the layer_specs patterns to Linear layers",
            )
        axis = 0 if kind == "column" else 1
        if shape[axis] % degree:
            raise ReshardUnsupported(
                f"{name} has {shape[axis]} elements along axis {axis}: not a multiple of --tensor-parallel {degree}",
                "give a degree that divides every split axis",
            )
        out[name] = plain(shape, axis)
    return out


def split_writes(
    manifest,
    whole,
    state_plan: OptimizerStatePlan,
    module: dict,
    axes,
    world_size: int,
    zero_stage,
    degree: int,
    sub_group_size: int | None = None,
) -> list[DataParallelTarget]:
    """One write per tensor rank of ``degree``: every tensor of the whole model (``whole``'s masters, frozen
    parameters and buffers, ``state_plan``'s moments, ``module``'s saved weights) cut by ``axes``; a ZeRO-3
    target's written by the ZeRO-3 writer (``DataParallelTarget.write``), cut into sub-groups of
    ``sub_group_size``."""
    tag_dir = whole.tag_dir
    config = _with_degree(degree)
    info = universal_info(manifest, axes, degree)
    writes = []
    for rank in range(degree):
        cut = {n: _shard(s, axes.get(n), rank, degree) for n, s in whole.sources.items()}
        shard_manifest = _shard_manifest(manifest, cut, degree)
        shard_plan = ReconstructionPlan(tag_dir, cut, dict(whole.aliases), list(whole.order), manifest=shard_manifest)
        moments = {k: _shard(s, axes.get(k.rsplit(".", 1)[0]), rank, degree) for k, s in state_plan.sources.items()}
        shard_states = OptimizerStatePlan(moments, state_plan.states, state_plan.metadata)
        changes = ModelChanges(
            module={n: _shard(s, axes.get(n), rank, degree) for n, s in module.items()},
            set_keys={
                "mp_world_size": degree,
                "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": degree},
                "universal_checkpoint_info": info,
            },
            drop_keys=(),
            config=config,
        )
        target = target_layout(
            shard_manifest, world_size // degree, zero_stage, sub_group_size, domain=True, writes_stage0=True
        )
        writes.append(
            DataParallelTarget(
                shard_manifest, shard_plan, shard_states, target, changes, mp_rank=rank, sub_group_size=sub_group_size
            )
        )
    return writes


def split_axes(index: CheckpointIndex, extras, degree: int) -> dict[str, Cut]:
    """name -> how AutoTP cuts it (absent: replicated), from the source's placements: the parameters', and the frozen
    parameters' and buffers' (``extras``: name -> (shape, shards)). A split is one block along its axis; affine
    pieces are read as sub-parameter blocks (``tensor_cuts.cut_of_pieces``: a fused weight)."""
    placed = [(p.name, list(p.shape), [s for s in p.shards]) for p in index.parameters]
    placed += [(name, shape, [s for s, _ in shards]) for name, (shape, shards) in extras.items()]
    tensor = {d.id: d.coordinate.tensor for d in index.domains}
    out = {}
    for name, shape, shards in placed:
        axes = {s.placement.split.axis for s in shards if isinstance(s.placement, SplitPlacement)}
        pieces = {tensor[s.domain]: s.placement.pieces for s in shards if isinstance(s.placement, PiecesPlacement)}
        if pieces:
            cut = cut_of_pieces(name, shape, [pieces[r] for r in sorted(pieces)])
        elif axes:
            (axis,) = axes
            cut = plain(shape, axis)
        else:
            continue
        check_degree(name, cut, degree)
        out[name] = cut
    return out


def _shard(source: TensorSource, cut: Cut | None, rank: int, degree: int) -> TensorSource:
    """Tensor rank ``rank``'s shard of the whole ``source``: the segments of its runs (replicated: the whole)."""
    if cut is None:
        return source
    whole = list(source.shape)
    runs = functools.partial(shard_runs, whole, cut, rank, degree)
    segments = RunSegments(source, runs)  # one run per row and block: made when read, never held
    local = tuple(shard_shape(whole, cut, degree))
    return TensorSource(source.name, local, source.dtype, segments, source.role, None, source.origin)


def _shard_manifest(manifest, cut: dict[str, TensorSource], degree: int):
    """``manifest`` at each parameter's shard shape, tensor degree ``degree``."""
    out = manifest.model_copy(deep=True)
    for group in out.groups:
        for p in group.params:
            p.shape, p.numel = list(cut[p.name].shape), math.prod(cut[p.name].shape)
    for f in out.frozen:
        if f.name in cut:
            f.shape, f.numel = list(cut[f.name].shape), math.prod(cut[f.name].shape)
    out.layout.tensor_parallel_size = degree
    return out


def universal_info(manifest, axes: dict[str, Cut], degree: int) -> dict[str, Any]:
    """DeepSpeed 0.19's ``universal_checkpoint_info`` of an AutoTP job of ``degree``: the row-parallel and
    replicated patterns, the fused weights' sub-parameters (as its SubParamColumnParallel layers record them) and,
    for every parameter, the pieces of the whole tensor each rank holds (``affine_map``: one per block)."""
    names = [p.name for g in manifest.groups for p in g.params] + [f.name for f in manifest.frozen]
    shapes = {p.name: list(p.shape) for g in manifest.groups for p in g.params}
    shapes.update({f.name: list(f.shape) for f in manifest.frozen})
    params, sub_params, widths = {}, [], {}
    for name in names:
        whole, pattern = shapes[name], f"^{re.escape(name)}$"
        cut = axes.get(name) or Cut(0, (whole[0],) if whole else ())
        ranks = {}
        for rank in range(degree):
            if name in axes:
                pieces = affine_pieces(whole, cut, rank, degree)
                local = shard_shape(whole, cut, degree)
            else:  # replicated: the whole tensor, on this rank
                local, strides = whole, [math.prod(whole[i + 1 :]) for i in range(len(whole))]
                pieces = [{"shape": whole, "source": [0, strides], "dest": [0, strides], "locations": [rank]}]
            ranks[rank] = {"shard_shape": local, "pieces": pieces}
        params[pattern] = {"logical_shape": whole, "ranks": ranks}
        if name in axes and len(cut.blocks) > 1:
            shape = [*whole[: cut.axis], list(cut.blocks), *whole[cut.axis + 1 :]]
            sub_params.append({"patterns": [pattern], "shape": shape, "partition_dim": cut.axis})
            widths[pattern] = [[b // degree] * degree for b in cut.blocks]
    # a row-parallel weight (split along axis 1), fused or not: DeepSpeed lists its SubParamLinearAllreduce's too
    row = {n for n, c in axes.items() if c.axis == 1}
    return {
        "universal_checkpoint_version": 0.4,
        "parameter_with_row_parallelism_patterns": [f"^{re.escape(n)}$" for n in names if n in row],
        "tp_replicated_parameter_patterns": [f"^{re.escape(n)}$" for n in names if n not in axes],
        "vocabulary_parameter_patterns": [],
        "parameter_with_sub_params": sub_params,
        "autotp_unsupported_parameter_patterns": {},
        **({"sub_param_shard_widths": widths} if widths else {}),
        "affine_map": {"version": 1, "params": params},
    }


def _with_degree(degree: int):
    def config(saved: Any) -> Any:
        """The saved ``ds_config`` with ``tensor_parallel.autotp_size`` the target's."""
        if not isinstance(saved, dict):
            return saved
        out = copy.deepcopy(saved)
        out.setdefault("tensor_parallel", {})["autotp_size"] = degree
        return out

    return config
