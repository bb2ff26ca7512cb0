"""``ckptspec export-universal`` of a ZeRO stage-0 checkpoint: data-parallel, or a bf16 pipeline (BF16_Optimizer).

DeepSpeed's ``ds_to_universal`` refuses stage 0. The folder is the one ``universal.py`` describes: for every
parameter, ``zero/<param>/`` holds the fp32 master, its moments and the step. ``zero/optimizer_state.pt`` holds
the optimizer's global state and param groups. Every ``mp_rank_XX_model_states.pt`` is copied (a pipeline's
stages each have one, as ``ds_to_universal`` copies them). The values are those ``reshard --stage 1`` moves
(``reshard_stage0_source``): the masters and moments as the checkpoint index locates them, and the param groups,
step, ``clip_grad`` and a static loss scaler from the stage-0 optimizer's entries. A pipeline's parameters keep
their ``PipelineModule`` names (``<layer>.<attr>``), which are unique across its stages. An AutoTP checkpoint at
stage 0 (one model-states file per tensor rank) gets its whole parameters, as ``reshard --tensor-parallel 1 --stage 1``
composes them (``reshard_tensor_stage0``), and every tensor rank's model states, as ``ds_to_universal`` writes an AutoTP
ZeRO checkpoint's folder (``universal_parallel``).
"""

from __future__ import annotations

from pathlib import Path

from ..checkpoint.states import StateCache
from ..format.index_models import CheckpointIndex
from .compose import domain_plan
from .reshard_stage0_source import plan_stage0_source
from .reshard_tensor_stage0 import plan_autotp_stage0


def stage0_parts(found: CheckpointIndex, src_dir: Path, states: StateCache) -> list[tuple]:
    """``universal.write_folder``'s parts of the stage-0 checkpoint ``found``: the whole model, or each pipeline
    stage, as the ZeRO-1 job of the same layout this folder is read as (one data-parallel rank per stage) holds
    it; CK410 for what is not written."""
    plans = {d.id: domain_plan(src_dir, d, states) for d in found.domains}
    writes = plan_stage0_source(found, src_dir, plans, states, found.topology.degrees.pipeline, 1)
    return [(w.manifest, w.plan, w.state_plan, w.source) for w in (writes[d.id] for d in found.domains)]


def autotp_stage0_parts(found: CheckpointIndex, src_dir: Path, states: StateCache) -> tuple[list[tuple], list[Path]]:
    """``universal.write_folder``'s part of the AutoTP stage-0 checkpoint ``found`` (the whole model, as a ZeRO-1 job
    without tensor parallelism holds it) and the model-states files it copies (every tensor rank's, in order)."""
    plans = {d.id: domain_plan(src_dir, d, states) for d in found.domains}
    (write,) = plan_autotp_stage0(found, src_dir, plans, states, 1, 1, 1)
    domains = sorted(found.domains, key=lambda d: d.coordinate.tensor)
    copies = [src_dir / next(f.path for f in d.manifest.files if f.role == "model_states") for d in domains]
    return [(write.manifest, write.plan, write.state_plan, write.source)], copies
