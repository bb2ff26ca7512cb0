"""``ckptspec reshard --stage 1|2`` of a ZeRO stage-0 checkpoint: written as a ZeRO-1/2 data-parallel checkpoint.

A stage-0 job keeps no ZeRO partitions. Everything is in ``mp_rank_00_model_states.pt``:
- the fp32 masters are the module's weights (fp32) or the mixed-precision wrapper's ``fp32_groups`` (bf16);
- the Adam moments are the torch optimizer's per-parameter state, under ``optimizer``.

The checkpoint index locates them (``Domain.masters``; ``masters_state_plan`` for the moments). The target is what a
ZeRO-1/2 job of the same model saves. Its optimizer-state files are written by the ZeRO writer
(``reshard_files.write_files``) from a ``SourceOptimizer`` built here from the stage-0 optimizer's entries: the param
groups, each group's step and the loss scaler. Its model states are the source's, changed where a ZeRO job saves
otherwise: ``optimizer`` None, ``param_shapes`` and ``shared_params`` as ZeRO saves them, and
``zero_optimization.stage`` set in the saved ``ds_config``.

Refused by name (CK410) before anything is written:
- fp16 with a dynamic loss scale: FP16_Optimizer does not save the hysteresis state that ZeRO's DynamicLossScaler
  pickles;
- a tensor- or pipeline-parallel or MoE stage-0 checkpoint;
- DeepSpeed's BF16_Optimizer files (masters in ``bf16_zero_pp_rank`` files).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..checkpoint.standins import LossScalerState
from ..checkpoint.states import StateCache
from ..errors import ReshardUnsupported
from ..format.index_models import CheckpointIndex
from ..format.models import Optimizer
from .compose_extras import extras_of
from .compose_plan import whole_plan
from .model_plan import ReconstructionPlan
from .reshard_files import STAGE12_KEYS, ModelChanges
from .reshard_layout import target_layout
from .reshard_source import SourceOptimizer, with_stage
from .reshard_tensor import DataParallelTarget

# Where a stage-0 domain's masters are (``Masters.stored_in``): the module (fp32), the mixed-precision wrapper
# in the model states (bf16, fp16). BF16_Optimizer's ("optimizer_states") are refused.
STAGE0_MASTERS = ("module", "model_states")


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
) -> DataParallelTarget:
    """The stage-0 checkpoint ``index`` as a ZeRO ``zero_stage`` (1 or 2) checkpoint of ``world_size`` ranks;
    CK410 for what is not written, before anything is."""
    domain = _refuse_unwritten(index, zero_stage)
    assert zero_stage is not None
    model_file = next(f.path for f in domain.manifest.files if f.role == "model_states")
    saved = states.state(tag_dir / model_file)
    wrapper = saved["optimizer"]
    optimizer = wrapper.get("optimizer_state_dict", wrapper)  # the torch optimizer's, inside a wrapper or not
    if wrapper.get("dynamic_loss_scale"):
        raise ReshardUnsupported(
            f"{model_file}: an fp16 stage-0 checkpoint with a dynamic loss scale: its FP16_Optimizer does not save "
            "the hysteresis state a ZeRO job's loss scaler holds",
            "resume at stage 0, or train with a static loss scale",
        )
    extras, ties = extras_of(index, tag_dir, plans, states)
    whole = whole_plan(index, tag_dir, plans, extras, ties)
    whole.states = states
    state_plan = whole.optimizer_state_plan()
    manifest = domain.manifest.model_copy(deep=True)
    manifest.layout.zero_stage = zero_stage  # read for the order, dtypes and groups only (``target_layout``)
    manifest.optimizer = Optimizer.model_validate_json(state_plan.metadata["ckptspec.optimizer"])
    target = target_layout(manifest, world_size, zero_stage, domain=True)
    moments = sorted({key for names in state_plan.states.values() for key in names})
    source = _zero_optimizer(saved, wrapper, optimizer, moments, zero_stage, tag_dir / model_file, manifest)
    changes = ModelChanges(
        module={n: s for n, s in whole.sources.items() if s.role == "frozen"},  # DeepSpeed saves them at stage 2
        set_keys={"optimizer": None, "shared_params": {a.name: a.owner for a in manifest.aliases}},
        drop_keys=(),
        config=lambda config: with_stage(config, zero_stage),
    )
    return DataParallelTarget(manifest, whole, state_plan, target, changes, source)


def _refuse_unwritten(index: CheckpointIndex, zero_stage: int | None):
    """The one stage-0 domain this writes; CK410 for anything else, by name."""
    degrees = index.topology.degrees
    if degrees.tensor != 1 or degrees.pipeline != 1 or index.expert_files or len(index.domains) != 1:
        raise ReshardUnsupported(
            f"a stage-0 checkpoint of tensor {degrees.tensor} x pipeline {degrees.pipeline} degrees"
            f"{' with experts' if index.expert_files else ''} is not written as ZeRO-1/2 yet",
            "stage-0 data-parallel checkpoints (one domain) are",
        )
    domain = index.domains[0]
    if domain.masters is None or domain.masters.stored_in not in STAGE0_MASTERS:
        where = domain.masters.stored_in if domain.masters is not None else "ZeRO partitions"
        raise ReshardUnsupported(
            f"domain {domain.id}: stage-0 masters in {where} (DeepSpeed's BF16_Optimizer) are not written as "
            "ZeRO-1/2 yet",
            "resume at the same layout",
        )
    if zero_stage not in (1, 2):
        raise ReshardUnsupported(
            f"--stage {zero_stage} for a stage-0 checkpoint: stage 1 and 2 targets are written",
            "give --stage 1 or --stage 2",
        )
    return domain


def _zero_optimizer(
    saved: dict, wrapper: dict, optimizer: dict, moments: list[str], stage: int, path: Path, manifest
) -> SourceOptimizer:
    """What a ZeRO-1/2 job's optimizer-state file holds besides the partitions, from the stage-0 optimizer's
    entries: the torch param groups, each group's scalar state (``step``: its first parameter's, as every
    parameter of a group steps together), a static loss scaler at the wrapper's scale."""
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
    prefix = "bf16_" if manifest.layout.model_dtype == "bfloat16" else ""
    return SourceOptimizer(
        top,
        osd,
        param_groups,
        scalars,
        dict.fromkeys(range(len(param_groups)), moments),
        stage,
        path=path,
        file_name=f"{prefix}zero_pp_rank_0_mp_rank_00_optim_states.pt",
    )
