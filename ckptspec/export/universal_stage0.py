"""``ckptspec export-universal`` of a ZeRO stage-0 checkpoint: data-parallel, or a bf16 pipeline (BF16_Optimizer).

DeepSpeed's ``ds_to_universal`` refuses stage 0. The folder is the one ``universal.py`` describes: for every
parameter, ``zero/<param>/`` holds the fp32 master, its moments and the step. ``zero/optimizer_state.pt`` holds
the optimizer's global state and param groups. Every ``mp_rank_XX_model_states.pt`` is copied (a pipeline's
stages each have one, as ``ds_to_universal`` copies them). The values are those ``reshard --stage 1`` moves
(``reshard_stage0_source``): the masters and moments as the checkpoint index locates them, and the param groups,
step, ``clip_grad`` and a static loss scaler from the stage-0 optimizer's entries. A pipeline's parameters keep
their ``PipelineModule`` names (``<layer>.<attr>``), which are unique across its stages.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..checkpoint.states import StateCache
from ..deepspeed.check.checkpoint_index import validate_index_checkpoint
from ..deepspeed.layout.tag_dir import resolve_tag_dir
from ..errors import CheckpointInvalid, ReshardUnsupported
from ..findings import has_errors
from .compose import domain_plan
from .output_dir import build_and_publish, held_new_output
from .reshard_stage0_source import plan_stage0_source


def export_universal_stage0(
    checkpoint: str | os.PathLike, output: str | os.PathLike, *, tag: str | None = None, index=None
):
    """Validate the stage-0 ``checkpoint`` (digests included), then write its universal folder as ``output``."""
    from .universal import UniversalResult, write_folder

    with held_new_output(output, "the universal checkpoint") as out:
        states = StateCache()
        found, findings = validate_index_checkpoint(checkpoint, index, tag, states=states, verify_digests=True)
        if found is None or has_errors(findings):
            raise CheckpointInvalid(findings, str(checkpoint))
        src_dir = resolve_tag_dir(checkpoint, tag)
        plans = {d.id: domain_plan(src_dir, d, states) for d in found.domains}
        try:  # the ZeRO-1 job of the same layout this folder is read as (one data-parallel rank per stage)
            degrees = found.topology.degrees
            writes = plan_stage0_source(found, src_dir, plans, states, degrees.pipeline, 1)  # type: ignore[arg-type]
        except ReshardUnsupported as exc:
            raise ReshardUnsupported(exc.message, exc.hint, str(checkpoint)) from None
        domains = [(w.manifest, w.plan, w.state_plan, w.source) for w in (writes[d.id] for d in found.domains)]
        count = build_and_publish(out, lambda tmp: write_folder(domains, states, tmp))
    return UniversalResult(Path(output), src_dir.name, count)
