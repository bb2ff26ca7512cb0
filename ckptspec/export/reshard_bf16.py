"""A DeepSpeed ``BF16_Optimizer`` checkpoint (bf16 with ``data_types.grad_accum_dtype: fp32`` at ZeRO stage 1, as
BLOOM and Megatron-DeepSpeed runs train) written for a ZeRO-2 or ZeRO-3 job.

``BF16_Optimizer.state_dict()`` holds ``clip_grad``, the torch optimizer's state (one flat partition per group, as
ZeRO-1's), the fp32 partitions with their tail padding, ``group_paddings``, ``partition_count``, ``ds_version`` and
``param_slice_mappings``: no loss scaler (bf16 scales no loss) and no ``zero_stage``. A ZeRO job's file holds
``DeepSpeedZeroOptimizer.state_dict()``'s keys (``reshard_files.STAGE12_KEYS``); what BF16_Optimizer keeps none of
is what a bf16 ZeRO job saves for it: a static loss scaler of scale 1, no dynamic scale, no overflow. The rest (the
partitions, paddings, counts, stage, mappings) the ZeRO writers recompute for the target. A stage-1 target needs
none of this: it is BF16_Optimizer's again (``reshard_layout``), written from the source's own keys; so is each stage
of a pipeline's (Megatron-DeepSpeed's) moved along its data axis. Anything else of a tensor/pipeline-parallel one is
refused by name (``refuse_bf16_model_parallel``, CK410).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..checkpoint.standins import LossScalerState
from ..checkpoint.states import StateCache
from ..errors import ReshardUnsupported
from ..format.models import Manifest
from .reshard_files import STAGE12_KEYS
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


def refuse_bf16_model_parallel(index, tensor_parallel: int | None, pipeline_parallel: int | None, zero_stage) -> None:
    """CK410 by name for a tensor/pipeline-parallel BF16_Optimizer checkpoint (``index``: a checkpoint index) moved
    otherwise than along its data axis at stage 1 (``reshard_parallel.target_layouts``: a pipeline's stages, each
    BF16_Optimizer's again). A tensor-parallel one, another stage, a degree change or a MoE is not written yet."""
    if not any(is_bf16_optimizer(d.manifest) for d in index.domains):
        return
    degrees = index.topology.degrees
    moved = [
        f"--stage {zero_stage}" if zero_stage not in (None, 1) else "",
        f"--pipeline-parallel {pipeline_parallel}" if pipeline_parallel not in (None, degrees.pipeline) else "",
        f"--tensor-parallel {tensor_parallel}" if tensor_parallel not in (None, degrees.tensor) else "",
        f"tensor degree {degrees.tensor}" if degrees.tensor != 1 else "",
        "experts" if index.expert_files else "",
    ]
    asked = ", ".join(m for m in moved if m)
    if asked:
        raise ReshardUnsupported(
            f"a tensor/pipeline-parallel checkpoint of DeepSpeed's BF16_Optimizer (bf16 with grad_accum_dtype fp32 at "
            f"ZeRO-1) is written only along its data axis at stage 1 so far, not with {asked}",
            "reshard it with --world-size alone (a pipeline's stages stay BF16_Optimizer's)",
        )
