"""A DeepSpeed ``BF16_Optimizer`` checkpoint (bf16 with ``data_types.grad_accum_dtype: fp32`` at ZeRO stage 1, as
BLOOM and Megatron-DeepSpeed runs train) written for a ZeRO-1/2/3 job, and a bf16 ZeRO one for a BF16_Optimizer job.

``BF16_Optimizer.state_dict()`` holds ``clip_grad``, the torch optimizer's state (one flat partition per group, as
ZeRO-1's), the fp32 partitions with their tail padding, ``group_paddings``, ``partition_count``, ``ds_version`` and
``param_slice_mappings``: no loss scaler (bf16 scales no loss) and no ``zero_stage``. A ZeRO job's file holds
``DeepSpeedZeroOptimizer.state_dict()``'s keys (``reshard_files.STAGE12_KEYS``); what BF16_Optimizer keeps none of
is what a bf16 ZeRO job saves for it: a static loss scaler of scale 1, no dynamic scale, no overflow. The rest (the
partitions, paddings, counts, stage, mappings) the ZeRO writers recompute for the target. A stage-1 target needs
none of this: it is BF16_Optimizer's again (``reshard_layout``), written from the source's own keys; so is each stage
of a pipeline's (Megatron-DeepSpeed's) moved along its data axis. Anything else of a tensor/pipeline-parallel one is
refused by name (``refuse_bf16_model_parallel``, CK410).

``--grad-accum-dtype`` (``reshard_layout.runs_bf16_optimizer``) changes the kind at stage 1: ``bf16`` writes a
BF16_Optimizer source for a plain ZeRO-1 job (``zero_source``, as for ZeRO-2), ``fp32`` a bf16 ZeRO-1/2/3 source for a
BF16_Optimizer job: its ZeRO optimizer's entries but the loss scaler, overflow, stage and alignment paddings (which
BF16_Optimizer keeps none of), the partitions re-laid in natural order and saved whole (``reshard_files``). The
saved ds_config then says what the target job runs (``target_config``).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

from ..checkpoint.standins import LossScalerState
from ..checkpoint.states import StateCache
from ..errors import ReshardUnsupported
from ..format.models import Manifest
from .reshard_files import STAGE12_KEYS
from .reshard_layout import TargetLayout
from .reshard_source import SourceOptimizer, source_optimizer


def is_bf16_optimizer(found: Manifest) -> bool:
    """A checkpoint of DeepSpeed's BF16_Optimizer (its partitions saved whole: the tail padding too)."""
    return found.layout.tail_padding_saved


def zero_source(found: Manifest, plan, states: StateCache) -> SourceOptimizer:
    """Source rank 0's BF16_Optimizer entries as a bf16 ZeRO job's optimizer saves them."""
    first = next(f.path for f in found.files if f.role == "optimizer_states" and 0 in f.ranks)
    source = source_optimizer(found, states.state(plan.tag_dir / first))
    osd: dict[str, Any] = dict.fromkeys(STAGE12_KEYS)  # DeepSpeedZeroOptimizer.state_dict()'s order
    osd.update(source.osd)
    osd.update(
        loss_scaler=LossScalerState({"cur_scale": 1.0, "dynamic": False}), dynamic_loss_scale=False, overflow=False
    )
    if "clip_grad" not in source.osd:
        del osd["clip_grad"]  # the target job's gradient_clipping applies, as DeepSpeed's loader does
    return dataclasses.replace(source, osd=osd, path=plan.tag_dir / first, file_name=first)


def target_config(found: Manifest, target: TargetLayout) -> Callable[[Any], Any] | None:
    """The saved ds_config as the target job's where ``--grad-accum-dtype`` changed its optimizer (a stage-1 target
    of the other kind): ``data_types.grad_accum_dtype`` fp32 for BF16_Optimizer (``zero_optimization.stage`` 1; its
    ``round_robin_gradients`` and ``parameter_alignment`` dropped: BF16_Optimizer runs neither, and ckptspec reads the
    layout's by them), none for a bf16 ZeRO-1 job (the default: the model dtype, as a plain bf16 job saves it).
    None (the config as saved) otherwise: at stage 2 or 3 DeepSpeed runs its ZeRO optimizer whatever it says."""
    if target.zero_stage != 1 or target.bf16_optimizer == is_bf16_optimizer(found):
        return None

    def config(value: Any) -> Any:
        if not isinstance(value, dict):
            return value
        value = copy.deepcopy(value)
        types = dict(value.get("data_types") or {})
        if target.bf16_optimizer:
            types["grad_accum_dtype"] = "fp32"
            zero = value.get("zero_optimization")
            if isinstance(zero, dict):
                zero["stage"] = 1
                zero.pop("round_robin_gradients", None)
                zero.pop("parameter_alignment", None)
        else:
            types.pop("grad_accum_dtype", None)
        value.pop("data_types", None)
        if types:
            value["data_types"] = types  # last, where a job's config that names it has it here
        return value

    return config


def refuse_grad_accum_dtype_model_parallel(checkpoint, grad_accum_dtype: str | None) -> None:
    """CK410 by name for ``--grad-accum-dtype`` with a data-parallel checkpoint's ``--tensor-parallel`` split: not
    written yet."""
    if grad_accum_dtype is not None:
        raise ReshardUnsupported(
            "--grad-accum-dtype is written for a checkpoint moved along its data axis only so far, not with a "
            "--tensor-parallel split",
            "leave --grad-accum-dtype out, or reshard in two commands",
            str(checkpoint),
        )


def refuse_grad_accum_dtype_index(
    index, grad_accum_dtype: str | None, tensor_parallel, pipeline_parallel, expert_parallel, zero_stage
) -> None:
    """CK410 by name for ``--grad-accum-dtype`` asked of a checkpoint index (``index``) but a ZeRO-1/2 pipeline
    (``PipelineModule``, no tensor parallelism) moved along its data axis, each stage ZeRO-1 of either kind: a
    tensor-parallel, MoE or stage-0 checkpoint, or another degree or stage together with it, is not written yet."""
    if grad_accum_dtype is None:
        return
    moved = [
        _beyond_the_data_axis(index, tensor_parallel, pipeline_parallel, zero_stage),
        f"--expert-parallel {expert_parallel}" if expert_parallel is not None else "",
        "a stage-0 source" if any(d.masters is not None for d in index.domains) else "",
    ]
    asked = ", ".join(m for m in moved if m)
    if asked:
        raise ReshardUnsupported(
            f"--grad-accum-dtype of a checkpoint index is written for a ZeRO-1 pipeline moved along its data axis "
            f"only so far, not with {asked}",
            "leave --grad-accum-dtype out, or move the degrees first and change the optimizer kind in a second command",
        )


def refuse_bf16_model_parallel(index, tensor_parallel: int | None, pipeline_parallel: int | None, zero_stage) -> None:
    """CK410 by name for a tensor/pipeline-parallel BF16_Optimizer checkpoint (``index``: a checkpoint index) moved
    otherwise than along its data axis at stage 1 (``reshard_parallel.target_layouts``: a pipeline's stages, each
    BF16_Optimizer's again). A tensor-parallel one, another stage, a degree change or a MoE is not written yet."""
    if not any(is_bf16_optimizer(d.manifest) for d in index.domains):
        return
    asked = _beyond_the_data_axis(index, tensor_parallel, pipeline_parallel, zero_stage)
    if asked:
        raise ReshardUnsupported(
            f"a tensor/pipeline-parallel checkpoint of DeepSpeed's BF16_Optimizer (bf16 with grad_accum_dtype fp32 at "
            f"ZeRO-1) is written only along its data axis at stage 1 so far, not with {asked}",
            "reshard it with --world-size alone (a pipeline's stages stay BF16_Optimizer's)",
        )


def _beyond_the_data_axis(index, tensor_parallel: int | None, pipeline_parallel: int | None, zero_stage) -> str:
    """What moves a checkpoint index otherwise than along its data axis at stage 1, as the user asked it ("" if
    nothing): another stage or degree, or a tensor-parallel or MoE source."""
    degrees = index.topology.degrees
    moved = [
        f"--stage {zero_stage}" if zero_stage not in (None, 1) else "",
        f"--pipeline-parallel {pipeline_parallel}" if pipeline_parallel not in (None, degrees.pipeline) else "",
        f"--tensor-parallel {tensor_parallel}" if tensor_parallel not in (None, degrees.tensor) else "",
        f"tensor degree {degrees.tensor}" if degrees.tensor != 1 else "",
        "experts" if index.expert_files else "",
    ]
    return ", ".join(m for m in moved if m)
