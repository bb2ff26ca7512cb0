"""``ckptspec reshard --stage 1|2|3`` of a ZeRO stage-0 checkpoint: written as a ZeRO-1/2/3 checkpoint.

A stage-0 job keeps no ZeRO partitions. A data-parallel one keeps everything in ``mp_rank_00_model_states.pt``:
- the fp32 masters are the module's weights (fp32) or the mixed-precision wrapper's ``fp32_groups`` (bf16);
- the Adam moments are the torch optimizer's per-parameter state, under ``optimizer``.
A bf16 pipeline at stage 0 runs DeepSpeed's BF16_Optimizer instead: each stage's masters and moments are flat
partitions in its ``bf16_zero_pp_rank`` files, laid out by BF16_Optimizer's own rules.

The checkpoint index locates them (``Domain.masters``; ``masters_state_plan`` for the moments). The target is what a
ZeRO-1/2 job of the same model saves (a pipeline: ZeRO-1, each stage a domain), or a data-parallel one's ZeRO-3 job
(``at_stage3``: cut into the sub-groups of ``--sub-group-size``). Its optimizer-state files are written by the ZeRO
writer (``reshard_files.write_files``; ZeRO-3: ``reshard_stage3.write_stage3_files``) from a ``SourceOptimizer`` built
here from the stage-0
optimizer's entries (``stage0_optimizer``, which the MoE writer ``reshard_moe`` reads a stage-0 MoE by too): the
param groups, each group's step, ``clip_grad`` where saved, and a static loss scaler.
Its model states are the source's, changed where a ZeRO job saves otherwise: ``optimizer`` None,
``param_shapes`` and ``shared_params`` as ZeRO saves them, and ``zero_optimization.stage`` set in the saved
``ds_config``.

A data-parallel stage-0 checkpoint for a stage-0 job (``--stage 0``, or none) is ``reshard_stage0_world``'s.

Frozen parameters of a data-parallel stage-0 checkpoint (``stage0_names.frozen_apart`` names them from the masters'
shapes) go as a ZeRO job saves them: in the module, at ZeRO-2 also ``frozen_param_shapes``/``frozen_param_fragments``
(``reshard_files``), at ZeRO-3 each rank's share (``reshard_stage3``).

Refused by name (CK410) before anything is written:
- a stage the target cannot run (2 or 3 for a pipeline), ``--sub-group-size`` for a target not at ZeRO-3;
- fp16 with a dynamic loss scale: FP16_UnfusedOptimizer (FP16_Optimizer of DeepSpeed's FusedAdam) does not save
  the hysteresis state that ZeRO's DynamicLossScaler pickles;
- a pipeline's number of stages changed with the stage.
A tensor-parallel pipeline's (stage, tensor rank) domains are each written so, at ``world_size / (pp x tp)`` data
ranks; its layer files are kept as saved.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from ..checkpoint.standins import LossScalerState
from ..checkpoint.states import StateCache
from ..errors import ReshardUnsupported
from ..format.index_models import CheckpointIndex, Domain
from .compose_extras import extras_of
from .compose_plan import whole_plan
from .masters_state import masters_state_plan
from .model_plan import ReconstructionPlan
from .optimizer_state import OptimizerStatePlan
from .reshard_files import STAGE12_KEYS, ModelChanges
from .reshard_layout import located_target_layout, target_layout
from .reshard_source import SourceOptimizer, with_stage
from .reshard_tensor import DataParallelTarget

# Where a stage-0 domain's masters are (``Masters.stored_in``): the module (fp32), the mixed-precision wrapper
# in the model states (bf16, fp16), BF16_Optimizer's flat partitions ("optimizer_states": a bf16 pipeline's).
STAGE0_MASTERS = ("module", "model_states", "optimizer_states")


def is_stage0_source(index: CheckpointIndex) -> bool:
    """A checkpoint of a stage-0 job (every domain configured at stage 0)."""
    return all(d.configured_zero_stage == 0 for d in index.domains)


def plan_stage0_source(
    index: CheckpointIndex,
    tag_dir: Path,
    plans: dict[str, ReconstructionPlan],
    states: StateCache,
    world_size: int,
    zero_stage: int | None,
    pipeline_parallel: int | None = None,
    sub_group_size: int | None = None,
) -> dict[str, DataParallelTarget]:
    """The stage-0 checkpoint ``index`` as a ZeRO ``zero_stage`` checkpoint of ``world_size`` ranks in all, one
    write per domain (a pipeline's: one per stage, at ``world_size / stages`` data-parallel ranks; ZeRO-3: cut into
    sub-groups of ``sub_group_size``, default DeepSpeed's); CK410 for what is not written, before anything is."""
    degrees = index.topology.degrees
    _refuse_unwritten(index, zero_stage, world_size, pipeline_parallel, sub_group_size)
    if degrees.pipeline == degrees.tensor == 1:  # the whole model: ties, buffers and frozen parameters too
        extras, ties = extras_of(index, tag_dir, plans, states)
        whole = whole_plan(index, tag_dir, plans, extras, ties)
        whole.states = states
        domain = index.domains[0]
        state_plan = whole.optimizer_state_plan()
        write = stage0_domain_write(domain, tag_dir, whole, state_plan, states, world_size, zero_stage)
        return {domain.id: at_stage3(write, sub_group_size) if zero_stage == 3 else write}
    data = world_size // (degrees.pipeline * degrees.tensor)  # each (stage, tensor rank) its own ZeRO domain
    return {
        d.id: stage0_domain_write(
            d, tag_dir, plans[d.id], masters_state_plan(tag_dir, d, states), states, data, zero_stage
        )
        for d in index.domains
    }


def stage0_domain_write(
    domain: Domain, tag_dir: Path, plan, state_plan: OptimizerStatePlan, states: StateCache, data: int, zero_stage
) -> DataParallelTarget:
    """One stage-0 domain written as a ZeRO domain of ``data`` data-parallel ranks."""
    manifest = domain.manifest.model_copy(deep=True)
    target = located_target_layout(manifest, state_plan.metadata["ckptspec.optimizer"], data, zero_stage)
    moments = sorted({key for names in state_plan.states.values() for key in names})
    source = stage0_optimizer(tag_dir, domain, states, moments, zero_stage)
    changes = ModelChanges(
        module={n: s for n, s in plan.sources.items() if s.role == "frozen"},  # DeepSpeed saves them at stage 2
        set_keys={"optimizer": None, "shared_params": {a.name: a.owner for a in manifest.aliases}},
        drop_keys=(),
        config=lambda config: with_stage(config, zero_stage),
    )
    return DataParallelTarget(manifest, plan, state_plan, target, changes, source)


def stage0_optimizer(
    tag_dir: Path, domain: Domain, states: StateCache, moments: list[str], zero_stage: int, keep_scale: bool = False
) -> SourceOptimizer:
    """What the ZeRO ``zero_stage`` optimizer-state files of ``domain`` hold besides the partitions, from the
    stage-0 optimizer its model states save (a MoE's dense domain: expert-parallel rank 0's, whose param groups
    are the dense and the expert group); ``moments``: the per-element states the masters' state plans locate.
    CK410 for an fp16 dynamic loss scale, unless ``keep_scale`` (a writer that keeps FP16_UnfusedOptimizer's own
    loss-scale entries: an fp16 stage-0 pipeline written at stage 0)."""
    model_file = next(f.path for f in domain.manifest.files if f.role == "model_states")
    saved = states.state(tag_dir / model_file)
    wrapper = saved["optimizer"]
    if wrapper.get("dynamic_loss_scale") and not keep_scale:
        # the wrapper that saved it, told by where its masters are (DeepSpeed's FusedAdam: flat ones)
        name = "FP16_Optimizer" if "fp32_groups_flat" in wrapper else "FP16_UnfusedOptimizer"
        raise ReshardUnsupported(
            f"{model_file}: an fp16 stage-0 checkpoint with a dynamic loss scale: its {name} does not save "
            "the hysteresis state a ZeRO job's loss scaler holds",
            "resume at stage 0, or train with a static loss scale",
        )
    return _zero_optimizer(saved, wrapper, moments, zero_stage, tag_dir / model_file, domain.manifest)


def at_stage3(write: DataParallelTarget, sub_group_size: int | None) -> DataParallelTarget:
    """``write`` (a stage-0 domain's, at stage 3) as a ZeRO-3 job of ``sub_group_size`` saves it: cut into its
    sub-groups (the ZeRO-3 writer's model states have their own entries), the size recorded in the saved
    ``ds_config`` when given (else DeepSpeed's default is the job's)."""
    target = target_layout(write.manifest, write.target.world_size, 3, sub_group_size, domain=True)
    config = write.changes.config
    changes = replace(write.changes, config=lambda saved: with_stage(config(saved), 3, sub_group_size))
    return replace(write, target=target, changes=changes, sub_group_size=sub_group_size)


def _refuse_unwritten(
    index: CheckpointIndex, zero_stage: int | None, world_size: int, pipeline_parallel, sub_group_size: int | None
) -> None:
    """CK410 for what is not written, by name."""
    degrees = index.topology.degrees
    if degrees.tensor != 1 and not index.layer_files:  # a MoE's experts: reshard_moe's; AutoTP: reshard_tensor_stage0
        raise ReshardUnsupported(
            f"a stage-0 checkpoint of tensor degree {degrees.tensor} is not written as ZeRO yet",
            "stage-0 data-parallel, pipeline, tensor-parallel pipeline, AutoTP and MoE checkpoints are",
        )
    for d in index.domains:
        if d.masters is None or d.masters.stored_in not in STAGE0_MASTERS:
            raise ReshardUnsupported(
                f"domain {d.id}: stage-0 masters in {d.masters.stored_in if d.masters else 'ZeRO partitions'} "
                "are not written as ZeRO yet",
                "resume at the same layout",
            )
    # DeepSpeed's PipelineEngine runs ZeRO-1 at most; a stage-0 target is reshard_stage0_world's (data-parallel) or
    # reshard_pipeline_stage0's (a pipeline)
    stages = (1,) if degrees.pipeline > 1 else (1, 2, 3)
    if zero_stage not in stages:
        kind = "pipeline " if degrees.pipeline > 1 else ""
        asked = "no --stage" if zero_stage is None else f"--stage {zero_stage}"
        raise ReshardUnsupported(
            f"{asked} for a stage-0 {kind}checkpoint: ZeRO stage {', '.join(map(str, stages))} and stage-0 targets "
            "are written",
            f"give --stage {' or --stage '.join(map(str, (*stages, 0)))}",
        )
    if sub_group_size is not None and zero_stage != 3:
        raise ReshardUnsupported(
            f"--sub-group-size {sub_group_size} with --stage {zero_stage}: a ZeRO-3 target's", "leave it out"
        )
    if pipeline_parallel not in (None, degrees.pipeline):
        raise ReshardUnsupported(
            f"--pipeline-parallel {pipeline_parallel} of a stage-0 pipeline ({degrees.pipeline} stages) is not "
            "supported yet",
            f"give --pipeline-parallel {degrees.pipeline} (or leave it out), then reshard the ZeRO-1 pipeline",
        )
    kept = degrees.pipeline * degrees.tensor
    if world_size < 1 or world_size % kept:
        which = f"pipeline degree ({kept})" if degrees.tensor == 1 else f"pipeline x tensor degrees ({kept})"
        raise ReshardUnsupported(
            f"--world-size {world_size} is not a multiple of the {which}, which is kept", f"give a multiple of {kept}"
        )


def _zero_optimizer(
    saved: dict, wrapper: dict, moments: list[str], stage: int, path: Path, manifest
) -> SourceOptimizer:
    """What a ZeRO-1/2 job's optimizer-state file holds besides the partitions, from the stage-0 optimizer's
    entries: the torch param groups, each group's scalar state (``step``: its first parameter's, as every
    parameter of a group steps together), a static loss scaler at the wrapper's scale."""
    # the torch optimizer's state: inside FP16_Optimizer's wrapper, BF16_Optimizer's (one state per group, its flat
    # partition), or the optimizer itself (fp32)
    optimizer = wrapper.get("optimizer_state_dict") or wrapper.get("base_optimizer_state") or wrapper
    param_groups = optimizer["param_groups"]
    scalars = {}
    for g, group in enumerate(param_groups):
        first = optimizer["state"][group["params"][0]]
        scalars[g] = {k: v for k, v in first.items() if k not in moments}
    osd: dict[str, Any] = dict.fromkeys(STAGE12_KEYS)  # DeepSpeedZeroOptimizer.state_dict()'s order
    osd.update(
        loss_scaler=LossScalerState({"cur_scale": wrapper.get("cur_scale", 1.0), "dynamic": False}),
        dynamic_loss_scale=False,
        overflow=False,
        ds_version=saved.get("ds_version"),
    )
    if "clip_grad" in wrapper:  # else the target job's gradient_clipping applies, as DeepSpeed's loader does
        osd["clip_grad"] = wrapper["clip_grad"]
    else:
        del osd["clip_grad"]
    top = {"optimizer_state_dict": None, "ds_config": saved.get("ds_config"), "ds_version": saved.get("ds_version")}
    prefix = "bf16_" if manifest.layout.model_dtype == "bfloat16" else ""  # mp_rank_XX_model_states -> its optimizer's
    return SourceOptimizer(
        top,
        osd,
        param_groups,
        scalars,
        dict.fromkeys(range(len(param_groups)), moments),
        stage,
        path=path,
        file_name=f"{prefix}zero_pp_rank_0_{path.name.replace('_model_states', '_optim_states')}",
    )
