"""``ckptspec reshard [--stage 0|1|2|3]`` of an AutoTP checkpoint saved at ZeRO stage 0: at its degree, merged or split.

An AutoTP job at stage 0 saves one ``mp_rank_XX_model_states.pt`` per tensor rank: its shards' fp32 masters in the
wrapper's ``fp32_groups`` and their Adam moments in the wrapped torch optimizer's state (every data rank the same).
The checkpoint index has one stage-0 domain per tensor rank, placed by the ``affine_map`` the files record.
The parts already written for other moves compose:
- at the source's tensor degree, each tensor rank's domain is written as a dense stage-0 source's
  (``reshard_stage0_source.stage0_domain_write``): its files keep their ``mp_rank_XX``, its module (its own copy of
  the buffers) is its file's;
- ``--tensor-parallel 1`` or another degree: the whole model composed as for an AutoTP ZeRO merge
  (``reshard_tensor.whole_model``: replicated copies, buffers too, compared first: CK401), then written as the
  merge or cut as the split (``reshard_tensor_split.split_writes``) writes it.
Either way the optimizer files' param groups, steps and loss scale come from the stage-0 optimizer's entries
(``stage0_optimizer``), and the model states change as for a dense stage-0 source (``optimizer`` None,
``zero_optimization.stage``) besides the merge's or split's entries.

For an AutoTP stage-0 job (``--stage 0``, or no ``--stage``: the checkpoint's own):
- at the source's tensor degree, each tensor rank's file as saved with ``dp_world_size`` the target's
  (``reshard_stage0_world.Stage0WorldWrite``, as for a dense stage-0 source: DeepSpeed's stage-0 job records the
  data-parallel size and never compares it), frozen parameters included;
- merged or split, the whole model written by the stage-0 writer (``reshard_stage0.write_stage0_files``) from the
  stage-0 optimizer's entries, the wrapper's loss scale and ``cur_iter`` as saved, the buffers each tensor rank's
  copy (compared first: CK401), frozen parameters merged or cut by the source's AutoTP rules into the module and out
  of the optimizer groups.

Frozen parameters (``layout/stage0_names.frozen_apart`` names them, the index places them by the ``affine_map``) go as a
ZeRO job of the target's degree saves them (the module; at ZeRO-2 ``frozen_param_shapes``/``frozen_param_fragments``,
``reshard_files``; at ZeRO-3 each rank's share), or as a stage-0 job saves them (the module): as saved at the source's
degree, merged or split at another. A written stage-0 file's reader names its masters by their shapes in module order
(``frozen_apart``), so each file (a split's shards at their shapes) is checked to name the trainable parameters alone
(``reshard_stage0.refuse_untold_frozen``, in tensor rank 0's module order: the written one).

Refused by name (CK410) before anything is written: frozen parameters a written stage-0 file could not tell from the
trainable ones, a world size the target's tensor degree does not divide, ``--sub-group-size`` for a target not at
ZeRO-3.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from ..checkpoint.standins import LossScalerState
from ..checkpoint.states import StateCache
from ..errors import ReshardUnsupported
from ..format.index_models import CheckpointIndex
from .masters_state import masters_state_plan
from .model_plan import ReconstructionPlan
from .reshard_files import ModelChanges
from .reshard_layout import located_target_layout
from .reshard_source import SourceOptimizer, with_stage
from .reshard_stage0 import module_order, refuse_stage0
from .reshard_stage0_source import at_stage3, stage0_domain_write, stage0_optimizer
from .reshard_stage0_world import Stage0WorldWrite
from .reshard_tensor import AUTOTP_ONLY_KEYS, DataParallelTarget, whole_model, without_tensor_parallel
from .reshard_tensor_split import split_axes, split_writes


def is_autotp_stage0(index: CheckpointIndex) -> bool:
    """An AutoTP checkpoint of a stage-0 job: tensor degree above 1, every domain a stage-0 one, no pipeline."""
    degrees = index.topology.degrees
    stage0 = all(d.configured_zero_stage == 0 for d in index.domains)
    return stage0 and degrees.tensor > 1 and degrees.pipeline == 1 and not index.expert_files


def plan_autotp_stage0(
    index: CheckpointIndex,
    tag_dir: Path,
    plans: dict[str, ReconstructionPlan],
    states: StateCache,
    world_size: int,
    zero_stage: int | None,
    tensor_parallel: int | None,
    sub_group_size: int | None = None,
) -> list[DataParallelTarget]:
    """One write per target tensor rank of ``tensor_parallel`` (default: the source's degree), each a ZeRO
    ``zero_stage`` domain of ``world_size / tensor_parallel`` data-parallel ranks (ZeRO-3: cut into sub-groups of
    ``sub_group_size``, default DeepSpeed's); CK410 before anything is written."""
    held = index.topology.degrees.tensor
    degree = held if tensor_parallel is None else tensor_parallel
    stage = _refused_or_stage(index, world_size, zero_stage, degree, sub_group_size)
    data = world_size // degree
    if stage == 0 and degree == held:  # each tensor rank's file as saved, dp_world_size the target's
        domains = sorted(index.domains, key=lambda d: d.coordinate.tensor)
        files = [next(f.path for f in d.manifest.files if f.role == "model_states") for d in domains]
        return [Stage0WorldWrite(tag_dir / f, data) for f in files]  # type: ignore[misc]
    if degree == held:  # each tensor rank's domain as a dense stage-0 source's, its files keeping their mp_rank
        domains = sorted(index.domains, key=lambda d: d.coordinate.tensor)
        writes = [
            stage0_domain_write(d, tag_dir, plans[d.id], masters_state_plan(tag_dir, d, states), states, data, stage)
            for d in domains
        ]
        return _as_saved_at(writes, stage, sub_group_size)
    manifest, whole, extras, module = whole_model(index, tag_dir, plans, states)
    if stage == 0:  # a stage-0 module holds the buffers too: the whole plan's (each tensor rank's copy compared)
        module = {**module, **{n: s for n, s in whole.sources.items() if s.role == "buffer" and n not in module}}
    state_plan = whole.optimizer_state_plan()
    first = next(d for d in index.domains if d.coordinate.tensor == 0)
    moments = sorted({key for names in state_plan.states.values() for key in names})
    source = stage0_optimizer(tag_dir, first, states, moments, stage)
    # the whole manifest read at the target stage (a merge's target; a split's shards are laid out from it)
    target = located_target_layout(manifest, state_plan.metadata["ckptspec.optimizer"], data, stage, stage == 0)
    order = None
    if stage == 0:  # FP16_UnfusedOptimizer's loss-scale entries as the source's wrapper saved them (reshard_stage0)
        source = _with_wrapper_scale(source, states.state(source.path)["optimizer"])  # type: ignore[arg-type]
        order = module_order(manifest, whole, states)  # tensor rank 0's module: the written file's order
    stage0_keys: dict[str, Any] = {
        "optimizer": None,
        "shared_params": {},
    }  # no ties: an AutoTP stage-0 checkpoint's are read but refused here (_refused_or_stage)
    if degree == 1:  # merged: what a job without tensor parallelism saves (reshard_tensor)
        if order is not None:  # frozen parameters: told from the masters by their whole shapes (refuse_untold_frozen)
            refuse_stage0(manifest, source.osd, order)
        merge = {"mp_world_size": 1, "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1}}
        changes = ModelChanges(
            module=module,
            set_keys={**merge, **stage0_keys},
            drop_keys=AUTOTP_ONLY_KEYS,
            config=lambda config: without_tensor_parallel(with_stage(config, stage)),
        )
        return _as_saved_at(
            [DataParallelTarget(manifest, whole, state_plan, target, changes, source)], stage, sub_group_size
        )
    axes = split_axes(index, extras, degree)
    writes = split_writes(manifest, whole, state_plan, module, axes, world_size, stage, degree, sub_group_size)
    out = []
    for write in writes:  # the split's entries, and a stage-0 source's
        config = write.changes.config
        changes = replace(
            write.changes,
            set_keys={**write.changes.set_keys, **stage0_keys},
            config=lambda saved, config=config: config(with_stage(saved, stage)),  # type: ignore[misc]
        )
        if order is not None:  # each tensor rank's file: its masters told from its frozen shards by their shapes
            refuse_stage0(write.manifest, source.osd, order)
        out.append(replace(write, changes=changes, source=source))
    return _as_saved_at(out, stage, sub_group_size)


def _with_wrapper_scale(source: SourceOptimizer, wrapper: dict) -> SourceOptimizer:
    """``source`` with the stage-0 wrapper's static loss scale and its iteration count (``cur_iter``), which a
    stage-0 target's wrapper saves as they were (``stage0_optimizer`` refused a dynamic one)."""
    kept = {k: wrapper[k] for k in ("cur_scale", "cur_iter") if k in wrapper}
    return replace(source, osd={**source.osd, "loss_scaler": LossScalerState({**kept, "dynamic": False})})


def _as_saved_at(writes: list[DataParallelTarget], stage: int, sub_group_size: int | None) -> list[DataParallelTarget]:
    """``writes`` as a ZeRO ``stage`` job saves them. ZeRO-2: with the two entries a stage-0 one saves None (DeepSpeed
    0.19.8 records the frozen parameters' shapes and fragments when it partitions gradients: empty without frozen
    parameters; with them the ZeRO writer writes both, ``reshard_files``). ZeRO-3: cut into sub-groups of
    ``sub_group_size`` (the ZeRO-3 writer's model states have their own entries), the size recorded in the saved
    ``ds_config`` when given."""
    if stage == 3:
        return [at_stage3(w, sub_group_size) for w in writes]
    if stage != 2:
        return writes
    keys: dict[str, Any] = {"frozen_param_shapes": {}, "frozen_param_fragments": {}}
    return [
        w if w.manifest.frozen else replace(w, changes=replace(w.changes, set_keys={**w.changes.set_keys, **keys}))
        for w in writes
    ]


def _refused_or_stage(
    index: CheckpointIndex, world_size: int, zero_stage: int | None, degree: int, sub_group_size: int | None
) -> int:
    """The target's ZeRO stage; CK410, by name, for what is not written."""
    held = index.topology.degrees.tensor
    zero_stage = 0 if zero_stage is None else zero_stage  # the checkpoint's own stage
    if zero_stage not in (0, 1, 2, 3):
        raise ReshardUnsupported(
            f"--stage {zero_stage} for an AutoTP stage-0 checkpoint (tensor degree {held})", "give --stage 0, 1, 2 or 3"
        )
    if sub_group_size is not None and zero_stage != 3:
        raise ReshardUnsupported(
            f"--sub-group-size {sub_group_size} with --stage {zero_stage}: a ZeRO-3 target's", "leave it out"
        )
    if degree < 1 or world_size < 1 or world_size % degree:
        raise ReshardUnsupported(
            f"--world-size {world_size} is not a multiple of the target's tensor degree ({degree})",
            f"give a multiple of {degree}: each data-parallel rank holds one copy of the {degree} tensor ranks",
        )
    tied = sorted({f"{a.name} of {a.owner}" for d in index.domains for a in d.manifest.aliases})
    if tied:  # read since the ties of a stage-0 module are (layout/stage0_names), moved by no job yet
        raise ReshardUnsupported(
            f"tied parameters ({', '.join(tied)}) of an AutoTP stage-0 checkpoint are not resharded yet",
            "reconstruct reads it; resume it at the same layout",
        )
    for d in index.domains:
        if d.masters is None or d.masters.stored_in not in ("module", "model_states"):
            raise ReshardUnsupported(
                f"domain {d.id}: stage-0 masters in {d.masters.stored_in if d.masters else 'ZeRO partitions'} are "
                "not written as ZeRO yet",
                "resume at the same layout",
            )
    return zero_stage
