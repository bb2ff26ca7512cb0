"""``ckptspec export-universal`` of an AutoTP, ``PipelineModule`` or MoE ZeRO-1/2 checkpoint.

The folder is the one ``universal.py`` describes, as DeepSpeed 0.19's ``ds_to_universal`` writes it for these
sources: ``zero/<param>/`` per parameter (the whole tensor in fp32, its moments, the step),
``zero/optimizer_state.pt`` from the first domain's (pipeline stage 0, tensor rank 0) optimizer file, and every
domain's ``mp_rank_XX_model_states.pt`` copied (a pipeline's layer files are not: DeepSpeed's universal load
never reads the module, the weights come from ``zero/``).

* A pipeline: each stage's parameters from its own domain (their ``PipelineModule`` names are unique across
  stages). A ``TiedLayerSpec``'s module is built and trained on every stage running one of its layers, under the same
  name there (``tied_modules.<key>.<param>``): its folder is written once, and DeepSpeed's loader gives it to each
  such stage (``ds_to_universal`` writes each stage's copy to the same files: whichever it extracts last is kept).
  The copies of its master and moments must be equal (CK401, ``reshard_pipeline_layers.check_tied_copies``): either
  would be a guess. Frozen parameters and buffers live in the layer files, which the folder does not hold (nor does
  ``ds_to_universal``'s): DeepSpeed's universal load never reads the module, the job keeps its own values.
* AutoTP: every parameter whole, its shards put together as the checkpoint index places them (the merge
  ``reshard --tensor-parallel 1`` writes: ``reshard_tensor.whole_model``; replicated copies compared first, CK401).
  DeepSpeed's loader cuts each tensor rank's slice back out of the whole tensor by the target job's own AutoTP
  metadata (``universal_checkpoint.py`` ``_resolve_autotp_partition``), or copies it whole without AutoTP.
* A tensor-parallel pipeline (Megatron-style layers): each stage's parameters whole, as ``reshard --tensor-parallel
  1`` merges them (``reshard_tp_pipeline.whole_stages``), its first tensor rank's optimizer file for the scalars; a
  split tensor's files say its split dim (``cat_dim``: 1 for a row-parallel weight), a replicated one's none, as
  ``ds_to_universal`` writes them from the same ``universal_checkpoint_info`` patterns: DeepSpeed's loader cuts a
  tensor-parallel target's slice along ``cat_dim``.

A MoE checkpoint (ZeRO stage 0, 1 or 2): its dense group as any, its experts as ``universal_moe`` stacks them
(DeepSpeed's loader names a native expert by its local name).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from ..checkpoint.states import StateCache
from ..deepspeed.check.checkpoint_index import validate_index_checkpoint
from ..deepspeed.layout.tag_dir import resolve_tag_dir
from ..errors import CheckpointInvalid, ReshardUnsupported
from ..findings import has_errors
from ..format.index_models import CheckpointIndex, Domain
from ..location import location
from .compose import domain_plan
from .optimizer_state import plan_optimizer_state
from .output_dir import build_and_publish, held_new_output
from .reshard_pipeline_layers import check_tied_copies
from .reshard_source import source_optimizer
from .reshard_stage0_source import is_stage0_source
from .reshard_tensor import whole_model
from .reshard_tensor_stage0 import is_autotp_stage0
from .reshard_tp_pipeline import universal_entries, whole_stages
from .universal_moe import moe_parts
from .universal_stage0 import autotp_stage0_parts, stage0_parts
from .universal_tp_stage3 import is_tp_stage3, tp_stage3_part, write_tp_stage3


def export_universal_index(
    checkpoint: str | os.PathLike, output: str | os.PathLike, *, tag: str | None = None, index=None
):
    """Validate ``checkpoint``, a kind a checkpoint index describes (digests included), then write its universal
    folder as ``output``: stage 0 (``universal_stage0``), AutoTP at ZeRO-1/2 (here) or 3 (``universal_tp_stage3``),
    a pipeline (here) or a MoE (``universal_moe``); CK410 for what is not written."""
    from .universal import UniversalResult

    with held_new_output(output, "the universal checkpoint") as out:
        states = StateCache()
        found, findings = validate_index_checkpoint(checkpoint, index, tag, states=states, verify_digests=True)
        if found is None or has_errors(findings):
            raise CheckpointInvalid(findings, str(checkpoint))
        src_dir = resolve_tag_dir(checkpoint, tag)
        try:  # CK410 before anything is written
            write = _writer(found, src_dir, states)  # type: ignore[arg-type]
        except ReshardUnsupported as exc:
            raise ReshardUnsupported(exc.message, exc.hint, str(checkpoint)) from None
        count = build_and_publish(out, write)
    return UniversalResult(location(output), src_dir.name, count)


def _writer(index: CheckpointIndex, src_dir: Path, states: StateCache):
    """The folder's writer (its temporary directory -> the number of parameters written), planned; CK410 for what is
    not written."""
    from .universal import model_file, write_folder

    if is_tp_stage3(index):
        part = tp_stage3_part(index, src_dir, states)
        return functools.partial(write_tp_stage3, part, states)
    if is_autotp_stage0(index):  # the whole model, every tensor rank's model states
        parts, copies = autotp_stage0_parts(index, src_dir, states)
        return lambda tmp: write_folder(parts, states, tmp, copies)
    if is_stage0_source(index) and not index.expert_files:  # each part's model-states file
        return functools.partial(write_folder, stage0_parts(index, src_dir, states), states)
    parts, entries = _parts(index, src_dir, states)
    # every stage's and tensor rank's (a MoE's dense domain: rank 0's, the one it has)
    copies = [src_dir / model_file(d.manifest) for d in index.domains if d.coordinate.expert is None]
    return lambda tmp: write_folder(parts, states, tmp, copies, entries)


def _refuse(index: CheckpointIndex) -> None:
    for d in index.domains:
        if d.masters is not None or d.manifest.layout.zero_stage not in (1, 2):
            raise ReshardUnsupported(
                f"domain {d.id} is not a ZeRO stage 1 or 2 partition (stage {d.manifest.layout.zero_stage}): the "
                "universal folder of a tensor/pipeline-parallel checkpoint is written from ZeRO-1/2 files so far",
                "use DeepSpeed's ds_to_universal",
            )


def _parts(index: CheckpointIndex, src_dir: Path, states: StateCache) -> tuple[list[tuple], dict | None]:
    """``write_folder``'s parts (one per pipeline stage, the whole AutoTP model as one, a MoE's dense group and
    experts) and the entries of a MoE's expert files; CK410 for what is not written."""
    plans = {d.id: domain_plan(src_dir, d, states) for d in index.domains}
    if index.expert_files:
        return moe_parts(index, src_dir, plans, states)
    _refuse(index)
    if index.topology.degrees.tensor == 1:
        check_tied_copies(index, plans)  # a tie's folder is written once, from its first stage
        parts = [
            (d.manifest, plans[d.id], plan_optimizer_state(plans[d.id]), _source(d, src_dir, states))
            for d in index.domains
        ]
        return parts, None
    if index.topology.degrees.pipeline > 1:  # a tensor-parallel pipeline: each stage's tensors whole
        whole, state_plan, stages = whole_stages(index, src_dir, plans, states)
        parts = [(manifest, plan, state_plan, _source(first, src_dir, states)) for manifest, first, plan in stages]
        return parts, universal_entries(index)
    manifest, whole, _, _ = whole_model(index, src_dir, plans, states)
    first = next(d for d in index.domains if d.coordinate.tensor == 0)
    return [(manifest, whole, whole.optimizer_state_plan(), _source(first, src_dir, states))], None


def _source(domain: Domain, src_dir: Path, states: StateCache):
    """The domain's rank-0 optimizer file as ``write_folder`` reads it (its entries, param groups, step)."""
    path = src_dir / next(f.path for f in domain.manifest.files if f.role == "optimizer_states" and 0 in f.ranks)
    source = source_optimizer(domain.manifest, states.state(path))
    source.path = path
    return source
