"""``ckptspec reshard`` of a tensor- or pipeline-parallel ZeRO-1/2 checkpoint to another data-parallel degree.

A checkpoint index gives one ZeRO domain per (pipeline, tensor) coordinate, each an ordinary 1.x manifest over
that coordinate's files (``mp_rank_XX``). The data axis of each domain is resharded exactly as a plain ZeRO
checkpoint's (``reshard_files.write_files``: every layout-dependent entry recomputed, the rest copied as saved,
the file names keeping the coordinate's ``mp_rank_XX``); a pipeline's layer files, written once per stage
whatever the data degree, are copied as saved. The tensor and pipeline degrees stay as they are: the target's
world size must be a multiple of their product. The output is validated from its files (its checkpoint index
generated anew) before it is renamed into place; nothing is written when the source has an error finding or
the target cannot be expressed (CK410). At ``--stage 0`` each AutoTP tensor rank's domain is written as the model
states of its stage-0 job (``reshard_stage0``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from .. import split
from ..checkpoint.states import StateCache
from ..deepspeed.check.checkpoint_index import validate_index_checkpoint
from ..deepspeed.layout.tag_dir import resolve_tag_dir
from ..errors import CheckpointInvalid, ReshardUnsupported
from ..findings import has_errors
from ..format.index_models import CheckpointIndex
from ..location import RemotePath, location
from .arrays import CHUNK_BYTES, ShardReader
from .compose import domain_plan
from .model_plan import Segment
from .optimizer_state import plan_optimizer_state
from .output_dir import build_and_publish, held_new_output
from .reshard import ReshardResult, commit_and_validate_index, embed_and_validate
from .reshard_bf16 import (
    is_bf16_optimizer,
    refuse_bf16_model_parallel,
    refuse_grad_accum_dtype_index,
    target_config,
    zero_source,
)
from .reshard_files import write_files
from .reshard_layout import TargetLayout, target_layout
from .reshard_moe import plan_moe
from .reshard_moe_stage0 import write_moe_stage0
from .reshard_pipeline import pipeline_target, write_stages
from .reshard_pipeline_stage0 import (
    changes_degrees,
    is_pipeline_stage0_target,
    moves_stage0_source,
    pipeline_stage0_resume,
    plan_pipeline_stage0,
    plan_restaged,
)
from .reshard_stage0 import module_order, refuse_stage0, source_osd, write_stage0_files
from .reshard_stage0_source import is_stage0_source, plan_stage0_source
from .reshard_stage0_world import keeps_dense_stage0, plan_stage0_world
from .reshard_stage3 import write_stage3_files
from .reshard_tensor import all_zero3_partitions, plan_tensor_merge, refuse_unpartitioned
from .reshard_tensor_split import plan_tensor_split
from .reshard_tensor_stage0 import is_autotp_stage0, plan_autotp_stage0
from .reshard_tp_pipeline import plan_tensor_pipeline_merge
from .reshard_tp_pipeline_split import plan_tensor_pipeline_split, refuse_split_and_stages
from .reshard_tp_pipeline_stages import is_tensor_pipeline, plan_tensor_pipeline_stages, refuse_merge_and_stages


def reshard_model_parallel(
    checkpoint: str | os.PathLike,
    output: str | os.PathLike,
    world_size: int,
    *,
    zero_stage: int | None = None,
    tag: str | None = None,
    index: Any = None,
    tensor_parallel: int | None = None,
    pipeline_parallel: int | None = None,
    partition_method: str | None = None,
    expert_parallel: int | None = None,
    sub_group_size: int | None = None,
    grad_accum_dtype: str | None = None,
) -> ReshardResult:
    """Validate ``checkpoint`` (digests included), then write it for ``world_size`` ranks in all: the same
    tensor and pipeline degrees, ``world_size / (tp x pp)`` data-parallel ranks (and ``zero_stage``).
    ``index``: the checkpoint index to read it by (a model, a validated report or a file), else its files'.
    ``pipeline_parallel`` other than the source's: the stages rebuilt (``reshard_pipeline``, ``partition_method``;
    a tensor-parallel pipeline's tensor ranks each, or merged first: ``reshard_tp_pipeline_stages``).
    ``sub_group_size``: a ZeRO-3 target's (default: a ZeRO-3 source's, else DeepSpeed's). ``grad_accum_dtype``: a bf16
    ZeRO-1 pipeline's stages for the other optimizer kind (``reshard_bf16``; the data axis only)."""
    with held_new_output(output, "the resharded checkpoint") as out:
        if isinstance(index, (str, os.PathLike)):
            from ..format.index_validate import validate_index_file

            index = validate_index_file(index)
            if not index.ok:
                raise CheckpointInvalid(index.findings, str(checkpoint))
        states = StateCache()
        found, findings = validate_index_checkpoint(checkpoint, index, tag, states=states, verify_digests=True)
        if found is None or has_errors(findings):
            raise CheckpointInvalid(findings, str(checkpoint))
        src_dir = resolve_tag_dir(checkpoint, tag)
        # what is written: one data-parallel checkpoint (merge), ZeRO domains written from a plan each (writes: an
        # AutoTP split's tensor ranks, a stage-0 pipeline's stages), a MoE, another number of stages, or each
        # domain's data axis (targets)
        merge, moe, stages, targets = None, None, None, {}
        writes: list[Any] | None = None  # each with .write(states, tag_dir) and .zero_stage
        merged_layers = False  # the source's layer files are written anew (not copied)
        restage: int | None = None  # a tensor pipeline merged, then moved to this many stages
        try:  # CK410 before anything is written
            degrees = found.topology.degrees
            splitting = degrees.tensor > 1 and tensor_parallel not in (None, 1, degrees.tensor)
            refuse_degree_changes(
                found, None if tensor_parallel == 1 or splitting else tensor_parallel, pipeline_parallel
            )
            refuse_bf16_model_parallel(found, tensor_parallel, pipeline_parallel, zero_stage)
            refuse_grad_accum_dtype_index(
                found, grad_accum_dtype, tensor_parallel, pipeline_parallel, expert_parallel, zero_stage
            )
            if expert_parallel is not None and not found.expert_files:
                raise ReshardUnsupported(
                    f"--expert-parallel {expert_parallel} of a checkpoint without experts",
                    "leave --expert-parallel out: it regroups a MoE checkpoint's experts",
                )
            plans = {d.id: domain_plan(src_dir, d, states) for d in found.domains}
            if is_pipeline_stage0_target(found, zero_stage):  # a stage-0 bf16 or fp32 pipeline job's files
                writes = plan_pipeline_stage0(
                    found,
                    src_dir,
                    plans,
                    states,
                    world_size,
                    pipeline_parallel,
                    partition_method,
                    reshard_model_parallel,
                    tensor_parallel,
                )
                merged_layers = changes_degrees(found, tensor_parallel, pipeline_parallel)  # the chain writes them
            elif moves_stage0_source(found, tensor_parallel, pipeline_parallel):  # written as ZeRO-1, then moved
                restaged = (world_size, pipeline_parallel, partition_method, reshard_model_parallel, zero_stage)
                writes = [plan_restaged(found, src_dir, plans, states, *restaged, tensor_parallel)]  # type: ignore[arg-type]
                merged_layers = True  # the restage writes them
            elif is_autotp_stage0(found):  # AutoTP at stage 0: as ZeRO or stage 0, at its degree, merged or split
                stage0_args = (world_size, zero_stage, tensor_parallel, sub_group_size)
                writes = plan_autotp_stage0(found, src_dir, plans, states, *stage0_args)  # type: ignore[arg-type]
                if tensor_parallel == 1:  # merged: one data-parallel checkpoint, validated as such
                    merge, writes = writes[0], None
            elif splitting and is_tensor_pipeline(found):  # each stage's tensor ranks cut anew (then moved: restage)
                merged_layers = True
                split_world: int = world_size
                if pipeline_parallel not in (None, degrees.pipeline):  # split at the source's stages, then moved
                    refuse_split_and_stages(found, world_size, tensor_parallel, pipeline_parallel, partition_method)  # type: ignore[arg-type]
                    restage = pipeline_parallel
                    split_world = tensor_parallel * degrees.pipeline  # type: ignore[operator]  # one data rank
                args = (found, src_dir, plans, states, split_world, zero_stage, tensor_parallel)
                writes = [plan_tensor_pipeline_split(*args)]  # type: ignore[arg-type]
            elif splitting:  # another tensor degree: each tensor rank's shards cut from the whole model
                degree: int = tensor_parallel  # type: ignore[assignment]  # splitting: an int
                split_args = (world_size, zero_stage, degree, sub_group_size)
                writes = plan_tensor_split(found, src_dir, plans, states, *split_args)  # type: ignore[arg-type]
            elif tensor_parallel == 1 and is_tensor_pipeline(found):
                merged_layers = True  # a tensor-parallel pipeline: each stage merged, its layer files too
                merge_args = (world_size, zero_stage)
                if pipeline_parallel not in (None, degrees.pipeline):  # merged first, then moved (restage)
                    refuse_merge_and_stages(found, world_size, pipeline_parallel, partition_method)
                    restage = pipeline_parallel
                    merge_args = (degrees.pipeline, zero_stage)  # at the source's stages, one data rank
                writes = [plan_tensor_pipeline_merge(found, src_dir, plans, states, *merge_args)]  # type: ignore[arg-type]
            elif is_tensor_pipeline(found) and pipeline_parallel not in (None, degrees.pipeline):
                stage_args = (world_size, zero_stage, pipeline_parallel, partition_method)
                writes = plan_tensor_pipeline_stages(found, src_dir, plans, states, *stage_args)  # type: ignore[arg-type]
            elif tensor_parallel == 1 and found.topology.degrees.tensor != 1:
                merge = plan_tensor_merge(found, src_dir, plans, states, world_size, zero_stage, sub_group_size)  # type: ignore[arg-type]
            elif found.expert_files:  # MoE: the dense and expert groups, each over its own ranks
                moe = plan_moe(found, src_dir, plans, states, world_size, zero_stage, expert_parallel)  # type: ignore[arg-type]
            elif keeps_dense_stage0(found, zero_stage):  # its one file, for a stage-0 job of another world size
                writes = [plan_stage0_world(found, src_dir, world_size, sub_group_size)]
            elif is_stage0_source(found):  # written as ZeRO: the whole model (one domain), or each pipeline stage
                to_zero = (world_size, zero_stage, pipeline_parallel, sub_group_size)
                stage0 = plan_stage0_source(found, src_dir, plans, states, *to_zero)  # type: ignore[arg-type]
                if found.topology.degrees.pipeline == 1:
                    merge = next(iter(stage0.values()))
                else:
                    writes = [stage0[d.id] for d in found.domains]
            elif pipeline_parallel not in (None, found.topology.degrees.pipeline):
                stages = pipeline_target(
                    found, pipeline_parallel, world_size, zero_stage, partition_method, states, src_dir, plans
                )
            else:
                targets = target_layouts(found, world_size, zero_stage, sub_group_size, grad_accum_dtype)
                for d in found.domains:  # what a stage-0 checkpoint could not describe (ties, frozen parameters...)
                    if targets[d.id].zero_stage == 0:
                        # an AutoTP tensor rank's module names its frozen parameters' order (a pipeline's: layer files)
                        order = None if found.layer_files else module_order(d.manifest, plans[d.id], states)
                        refuse_stage0(d.manifest, source_osd(d.manifest, plans[d.id], states), order)
        except ReshardUnsupported as exc:
            raise ReshardUnsupported(exc.message, exc.hint, str(checkpoint)) from None
        state_plans = (
            {key: plan_optimizer_state(plan) for key, plan in plans.items()} if merge is writes is moe is None else {}
        )

        def build(tmp: Path) -> list[Path]:
            tag_dir = tmp / src_dir.name
            tag_dir.mkdir(exist_ok=True)  # every rank of a torchrun split
            if merge is not None:  # one data-parallel checkpoint: validated as such
                merged = merge.write(states, tag_dir)
                if merge.zero_stage == 0:  # a stage-0 checkpoint is described by a checkpoint index
                    commit_and_validate_index(tmp, tag_dir, output)
                else:
                    embed_and_validate(merge.manifest, tmp, tag_dir, output)
                return merged
            files: list[Path] = []
            if stages is not None:  # another number of stages: each target stage's files from every domain
                files += write_stages(stages, found, plans, state_plans, states, tag_dir)
            elif restage is not None:
                tag = src_dir.name
                steps = (writes[0], states, tmp, tag, world_size, zero_stage, restage, partition_method)  # type: ignore[index]
                share = split.current()  # rank 0 writes both steps alone (the merge is read back whole)
                share.first_only(lambda: files.extend(_merge_then_restage(*steps)))
                share.written.extend(str(path) for path in files)  # rank 0's, for its report
            elif writes is not None:
                for write in writes:
                    files += write.write(states, tag_dir)
            elif moe is not None:
                if moe.zero_stage == 0:  # a stage-0 MoE job's files
                    files += write_moe_stage0(moe, states, tag_dir, src_dir)  # type: ignore[arg-type]
                else:
                    files += moe.write(states, tag_dir, src_dir)  # type: ignore[arg-type]
                for expert in found.expert_files:  # one per global expert, whatever the world size
                    _copy(src_dir / expert.path, tag_dir / expert.path, expert.size)
                    files.append(tag_dir / expert.path)
            else:
                for d in found.domains:
                    if targets[d.id].zero_stage == 0:  # a tensor rank's model states, as its stage-0 job saves them
                        args = (d.manifest, plans[d.id], state_plans[d.id], targets[d.id], states, tag_dir)
                        files += write_stage0_files(*args, mp_rank=d.coordinate.tensor)
                    elif targets[d.id].zero_stage == 3:  # the coordinate's ZeRO-3 partitions, its sub-group size
                        files += write_stage3_files(
                            d.manifest, plans[d.id], state_plans[d.id], targets[d.id], states, tag_dir, sub_group_size
                        )
                    else:  # a BF16_Optimizer stage for a ZeRO job, or the reverse: its entries and ds_config so
                        kind = _kind_changed(d.manifest, plans[d.id], targets[d.id], states)
                        files += write_files(
                            d.manifest, plans[d.id], state_plans[d.id], targets[d.id], states, tag_dir, **kind
                        )
            for layer in [] if merged_layers else found.layer_files:  # a stage's layers, whatever the data degree
                _copy(src_dir / layer.path, tag_dir / layer.path, layer.size)
                files.append(tag_dir / layer.path)
            commit_and_validate_index(tmp, tag_dir, output)
            return files

        files = build_and_publish(out, build)
    written_to = location(output)
    degrees = found.topology.degrees
    return ReshardResult(
        written_to,
        src_dir.name,
        degrees.data * degrees.tensor * degrees.pipeline,
        world_size,
        # the written ZeRO stage: the plan's, whichever way it was planned
        (merge or (writes and writes[0]) or moe or stages or next(iter(targets.values()))).zero_stage,
        [written_to / src_dir.name / f.name for f in files],
        *pipeline_stage0_resume(found, zero_stage),
    )


def _merge_then_restage(
    merge, states, tmp: Path, tag: str, world_size: int, zero_stage, stages: int, partition_method
) -> list[Path]:
    """A tensor pipeline's merge or split (at its stages) written to a temporary directory in ``tmp`` (the output's
    staging directory: its file system), then resharded to ``stages`` stages there (``reshard_tp_pipeline_stages``'s
    module docstring); the result's files moved into ``tmp / tag``, the temporary directory removed before the
    commit."""
    tag_dir = tmp / tag
    with tempfile.TemporaryDirectory(prefix=".tp-merged-", dir=tmp) as mid:
        merged, moved = Path(mid) / "merged", Path(mid) / "moved"
        (merged / tag).mkdir(parents=True)
        merge.write(states, merged / tag)
        reshard_model_parallel(
            merged,
            moved,
            world_size,
            zero_stage=zero_stage,
            tag=tag,
            pipeline_parallel=stages,
            partition_method=partition_method,
        )
        out = []
        for path in sorted((moved / tag).iterdir()):
            shutil.move(path, tag_dir / path.name)
            out.append(tag_dir / path.name)
        return out


def refuse_degree_changes(index: CheckpointIndex, tensor_parallel: int | None, pipeline_parallel: int | None) -> None:
    """CK410 for a tensor degree other than the source's that the caller does not write (it passes None for an
    AutoTP merge or split: ``reshard_tensor``, ``reshard_tensor_split``), e.g. above 1 for a pipeline, MoE or
    stage-0 checkpoint; and for a pipeline degree change together with one (``reshard_pipeline`` changes the
    pipeline degree at the same tensor degree)."""
    degrees = index.topology.degrees
    for flag, wanted, held in (
        ("--tensor-parallel", tensor_parallel, degrees.tensor),
        (
            "--pipeline-parallel",
            pipeline_parallel if tensor_parallel not in (None, degrees.tensor) else None,
            degrees.pipeline,
        ),
    ):
        if wanted is not None and wanted != held:
            raise ReshardUnsupported(
                f"{flag} {wanted}: changing the checkpoint's degree ({held}) is not supported yet",
                f"give {flag} {held} (or leave it out): the data axis is what reshard moves so far",
            )


def refuse_degrees_of_plain_zero(
    checkpoint, tensor_parallel: int | None, pipeline_parallel: int | None, expert_parallel: int | None = None
) -> None:
    """CK410 for a tensor, pipeline or expert degree above 1 asked of a plain ZeRO (tp 1, pp 1) checkpoint."""
    flags = (
        ("--tensor-parallel", tensor_parallel),
        ("--pipeline-parallel", pipeline_parallel),
        ("--expert-parallel", expert_parallel),
    )
    for flag, wanted in flags:
        if wanted not in (None, 1):
            raise ReshardUnsupported(
                f"{flag} {wanted} of a data-parallel checkpoint (degree 1) is not supported yet",
                f"give {flag} 1 (or leave it out)",
                str(checkpoint),
            )


def _kind_changed(found, plan, target: TargetLayout, states: StateCache) -> dict:
    """``write_files``' ``source`` and ``config`` for a domain written for the other optimizer kind (a pipeline
    stage's, ``--grad-accum-dtype``); none where the kind stays."""
    zero = zero_source(found, plan, states) if is_bf16_optimizer(found) and not target.bf16_optimizer else None
    return {"source": zero, "config": target_config(found, target)}


def target_layouts(
    index: CheckpointIndex,
    world_size: int,
    zero_stage: int | None,
    sub_group_size: int | None = None,
    grad_accum_dtype: str | None = None,
) -> dict[str, TargetLayout]:
    """Each domain's target: its data axis at ``world_size / (tp x pp)`` ranks (CK410 where it cannot be); a
    ZeRO-3 domain's at stage 3, cut into sub-groups of ``sub_group_size`` (default: the source's), or at the stage
    1 or 2 given; an AutoTP domain's at stage 0 when given."""
    degrees = index.topology.degrees
    model_parallel = degrees.tensor * degrees.pipeline
    if world_size < 1 or world_size % model_parallel:
        raise ReshardUnsupported(
            f"--world-size {world_size} is not a multiple of the tensor x pipeline degrees "
            f"({degrees.tensor} x {degrees.pipeline} = {model_parallel}), which reshard keeps",
            f"give a multiple of {model_parallel}: each data-parallel rank holds one copy of the model's "
            f"{model_parallel} parts",
        )
    data = world_size // model_parallel
    if zero_stage == 0 and degrees.pipeline == 1 and not index.layer_files:
        # AutoTP: each tensor rank's model states as an AutoTP stage-0 job saves them (reshard_stage0), from its ZeRO
        # partitions (ZeRO-3 ones too: the plain ZeRO-3 source's reading)
        if not all_zero3_partitions(index):
            refuse_unpartitioned(index, "AutoTP ZeRO-1/2/3 checkpoints are written at stage 0")
        return {d.id: target_layout(d.manifest, data, 0, domain=True, writes_stage0=True) for d in index.domains}
    if all_zero3_partitions(index):
        # each coordinate as a plain ZeRO-3 checkpoint: at stage 3 (reshard_stage3) or at stage 1/2 (write_files
        # reads a stage-3 source); a pipeline's stage 0 is refused by target_layout (a domain's)
        stage = 3 if zero_stage is None else zero_stage
        return {d.id: target_layout(d.manifest, data, stage, sub_group_size, domain=True) for d in index.domains}
    refuse_unpartitioned(index, "the data axis of tensor/pipeline-parallel ZeRO-1/2 checkpoints is what is moved")
    out: dict[str, TargetLayout] = {}
    for d in index.domains:
        if zero_stage not in (None, 1, 2):
            raise ReshardUnsupported(
                f"--stage {zero_stage} for a tensor/pipeline-parallel ZeRO-1/2 checkpoint: stage 1 and 2 targets "
                "are written",
                "give --stage 1 or 2",
            )
        out[d.id] = target_layout(d.manifest, data, zero_stage, domain=True, grad_accum_dtype=grad_accum_dtype)
    return out


def _copy(source: Path | RemotePath, target: Path, size: int) -> None:
    """A file copied as saved, at most ``CHUNK_BYTES`` at a time (from a URL too: ranged reads); by one rank of a
    torchrun split."""
    if not split.current().claims(target):
        return
    with ShardReader() as files, open(target, "wb") as out:
        for start in range(0, size, CHUNK_BYTES):
            piece = bytearray(min(CHUNK_BYTES, size - start))
            files.read_into(Segment(source, start, len(piece)), memoryview(piece))
            out.write(piece)
