"""The target layout of a reshard: every group's flat partitions at another data-parallel world size.

Pure arithmetic on the source manifest (no files): DeepSpeed's ZeRO stage 1/2 optimizer lays each
optimizer group out as one flat buffer in *natural* parameter order, reordered round robin over the
ranks when ``round_robin_gradients`` is on (``_round_robin_reorder``: bucket k % ws, buckets
concatenated), with a gap after every param but the last when ``parameter_alignment`` is on
(16 bytes: ``16 // gcd(16, itemsize)`` elements), padded to 2 x ws and split evenly. The order and
the gaps both depend on the world size, so they are recomputed from the natural order here
(deepspeed ``runtime/zero/stage_1_and_2.py`` ``__init__`` and ``_round_robin_reorder``).
DeepSpeed's ``BF16_Optimizer`` (bf16 with fp32 gradient accumulation at stage 1) lays its groups out as ZeRO-1
does (natural order, no alignment gaps, padded to 2 x ws) and saves every partition whole, the tail padding
included (``tail_padding_saved``): a stage-1 target of such a source is one again (what the same job config
runs at any world size); ``--stage 2|3`` gives DeepSpeed's ZeRO optimizer's layout (``reshard_bf16``).
``--grad-accum-dtype`` (the target job's ``data_types.grad_accum_dtype``) changes the kind at stage 1: ``fp32`` writes
a bf16 ZeRO-1/2/3 checkpoint for a BF16_Optimizer job, ``bf16`` a BF16_Optimizer one for a plain ZeRO-1 job.
What reshard cannot write is refused here, before anything is read: ``ReshardUnsupported`` (CK410).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import ReshardUnsupported
from ..format.dtypes import ITEMSIZE
from ..format.models import Group, Manifest, Optimizer
from ..format.partition import ParamSpec, flat_group, natural_order, per_param_group

STAGES = (1, 2, 3)  # the sources reshard reads
TARGET_STAGES = (0, 1, 2, 3)  # 0: reshard_stage0
DEFAULT_SUB_GROUP_SIZE = 1_000_000_000  # DeepSpeed's zero_optimization.sub_group_size default


@dataclass(frozen=True)
class TargetLayout:
    world_size: int
    zero_stage: int
    groups: list[Group]  # stage 1/2: one per source group; stage 3: its sub-groups, in order
    bf16_optimizer: bool = False  # DeepSpeed's BF16_Optimizer's files (its keys, every partition whole)


def round_robin_order(params: list, partition_count: int) -> list:
    """DeepSpeed's ``_round_robin_reorder``: param k goes to bucket k % ws; buckets concatenated."""
    return [p for b in range(partition_count) for p in params[b::partition_count]]


def alignment_paddings(numels: list[int], itemsize: int) -> list[int]:
    """``parameter_alignment``'s gap after each param (none after the last), in flat order."""
    align = 16 // math.gcd(16, itemsize)
    out, offset = [], 0
    for i, numel in enumerate(numels):
        offset += numel
        pad = 0 if i == len(numels) - 1 else (-offset) % align
        out.append(pad)
        offset += pad
    return out


def natural_groups(manifest: Manifest) -> list[tuple[int, list]]:
    """Each optimizer group's params in natural (model) order: a stage 1/2 group with round robin undone,
    or the concatenation of a stage-3 checkpoint's sub-groups (cut from that order, in order)."""
    out: dict[int, list] = {}
    for grp in manifest.groups:
        params = list(grp.params)
        if manifest.layout.round_robin and grp.partitioning == "flat":
            params = natural_order(params, grp.partition_count)
        out.setdefault(grp.optimizer_group, []).extend(params)
    return sorted(out.items())


def sub_groups(params: list, world_size: int, sub_group_size: int) -> list[list]:
    """DeepSpeed's ``_create_fp16_sub_groups``: cut a param group where the partition numels reach
    ``sub_group_size`` (one sub-group when the whole group fits)."""
    shares = [-(-p.numel // world_size) for p in params]
    if sub_group_size >= sum(shares):
        return [params]
    out, current, size = [], [], 0
    for i, (p, share) in enumerate(zip(params, shares)):
        current.append(p)
        size += share
        if size >= sub_group_size or i == len(params) - 1:
            out.append(current)
            current, size = [], 0
    return out


def target_layout(
    manifest: Manifest,
    world_size: int,
    zero_stage: int | None = None,
    sub_group_size: int | None = None,
    *,
    domain: bool = False,
    writes_stage0: bool = False,
    grad_accum_dtype: str | None = None,
) -> TargetLayout:
    """The groups of ``manifest``'s checkpoint re-laid out for ``world_size`` (and ``zero_stage``).
    ``domain``: the manifest is one domain of a tensor/pipeline-parallel checkpoint (its data axis);
    ``writes_stage0``: the caller writes that domain at stage 0 (``reshard_stage0``: an AutoTP merge, or each tensor
    rank of an AutoTP checkpoint). ``grad_accum_dtype``: the target job's ``data_types.grad_accum_dtype`` ("float32"
    or "bfloat16"; None: the source's kind kept), which decides at stage 1 whether it runs BF16_Optimizer."""
    layout = manifest.layout
    stage = layout.zero_stage if zero_stage is None else zero_stage
    _refuse(manifest, world_size, stage, domain, writes_stage0)
    refuse_grad_accum_dtype(manifest, stage, grad_accum_dtype)
    bf16_optimizer = runs_bf16_optimizer(manifest, stage, grad_accum_dtype)
    if stage == 0:  # one file, every parameter whole: nothing to lay out (reshard_stage0)
        return TargetLayout(world_size, 0, [])
    if stage == 3:
        groups = []
        size = target_sub_group_size(manifest, sub_group_size)
        for g, natural in natural_groups(manifest):
            for sub in sub_groups(natural, world_size, size):
                specs = [ParamSpec(p.name, tuple(p.shape), p.dtype) for p in sub]
                groups.append(per_param_group(specs, optimizer_group=g, partition_count=world_size))
        return TargetLayout(world_size, stage, groups)
    groups = []
    for g, natural in natural_groups(manifest):
        # BF16_Optimizer: natural order, no alignment gaps, its partitions whole (it runs neither option)
        ordered = round_robin_order(natural, world_size) if layout.round_robin and not bf16_optimizer else natural
        paddings = (
            alignment_paddings([p.numel for p in ordered], ITEMSIZE[layout.model_dtype])
            if layout.parameter_alignment and not bf16_optimizer
            else None
        )
        specs = [ParamSpec(p.name, tuple(p.shape), p.dtype) for p in ordered]
        target = flat_group(
            specs,
            optimizer_group=g,
            partition_count=world_size,
            zero_stage=stage,
            paddings=paddings,
            tail_padding_saved=bf16_optimizer,
        )
        end = target.params[-1].offset + target.params[-1].numel if target.params else 0
        if target.padded_numel - end > target.partition_numel:
            # DeepSpeed records the tail padding on the last rank only (groups_padding); a tail longer
            # than one partition would give it a negative saved length.
            raise ReshardUnsupported(
                f"group {g} has {end} elements: too few for {world_size} ranks "
                f"(its padding would span more than one rank's partition)",
                "reshard to fewer ranks",
            )
        groups.append(target)
    return TargetLayout(world_size, stage, groups, bf16_optimizer)


def runs_bf16_optimizer(manifest: Manifest, stage: int, grad_accum_dtype: str | None) -> bool:
    """Whether the target job runs DeepSpeed's BF16_Optimizer: bf16 with fp32 gradient accumulation at stage 1
    (DeepSpeed 0.19.8's ``_do_optimizer_sanity_check``). Without ``grad_accum_dtype``: a stage-1 target of a
    BF16_Optimizer source, as the same job config runs at any world size."""
    if grad_accum_dtype is None:
        return manifest.layout.tail_padding_saved and stage == 1
    return stage == 1 and manifest.layout.model_dtype == "bfloat16" and grad_accum_dtype == "float32"


def located_target_layout(
    manifest: Manifest, optimizer_json: str, world_size: int, stage: int, writes_stage0: bool = False
) -> TargetLayout:
    """``target_layout`` of a domain whose masters and moments the checkpoint index locates apart from ZeRO
    partitions (stage 0, MoE): ``manifest`` (a copy, changed here) is read at the target ``stage`` for its order,
    dtypes and groups, with the optimizer the moments' state plan found (``optimizer_json``); ``writes_stage0`` as
    ``target_layout``'s (an AutoTP stage-0 source merged or split for a stage-0 job)."""
    manifest.layout.zero_stage = stage
    manifest.optimizer = Optimizer.model_validate_json(optimizer_json)
    return target_layout(manifest, world_size, stage, domain=True, writes_stage0=writes_stage0)


def target_sub_group_size(manifest: Manifest, sub_group_size: int | None) -> int:
    """The stage-3 target's ``sub_group_size``: the one given, else a stage-3 source's, else DeepSpeed's default."""
    if sub_group_size is not None:
        return sub_group_size
    if manifest.layout.zero_stage == 3 and manifest.layout.sub_group_size:
        return manifest.layout.sub_group_size
    return DEFAULT_SUB_GROUP_SIZE


GRAD_ACCUM_DTYPES = {"float32": "fp32", "bfloat16": "bf16"}  # what --grad-accum-dtype takes (DeepSpeed's names)


def refuse_grad_accum_dtype(manifest: Manifest, stage: int, grad_accum_dtype: str | None) -> None:
    """CK410 for a ``--grad-accum-dtype`` the target cannot express: one of a checkpoint not in bf16 (only a bf16
    job's gradient accumulation dtype picks its optimizer: BF16_Optimizer or DeepSpeed's ZeRO optimizer), or fp32
    at stage 0 (DeepSpeed 0.19.8 runs no dense stage-0 job with it). At stage 2 or 3 fp32 is taken: DeepSpeed runs
    its ZeRO optimizer whatever it says."""
    if grad_accum_dtype is None:
        return
    named = GRAD_ACCUM_DTYPES.get(grad_accum_dtype, grad_accum_dtype)
    if grad_accum_dtype not in GRAD_ACCUM_DTYPES:
        raise ReshardUnsupported(
            f"--grad-accum-dtype {named}: not a gradient accumulation dtype reshard writes for",
            "give fp32 (BF16_Optimizer at stage 1) or bf16 (DeepSpeed's ZeRO optimizer)",
        )
    if manifest.layout.model_dtype != "bfloat16":
        raise ReshardUnsupported(
            f"--grad-accum-dtype {named} of a {manifest.layout.model_dtype} checkpoint: only a bf16 job's "
            "data_types.grad_accum_dtype decides its optimizer (fp32: BF16_Optimizer at stage 1)",
            "leave --grad-accum-dtype out (the target job accumulates in its model dtype)",
        )
    if stage == 0 and grad_accum_dtype == "float32":
        raise ReshardUnsupported(
            "--grad-accum-dtype fp32 with a stage-0 target: DeepSpeed 0.19.8 runs no dense stage-0 job with fp32 "
            "gradient accumulation (NotImplementedError: unsupported mix of model_dtype and grad_accum_dtype)",
            "reshard it to --stage 1 (BF16_Optimizer), 2 or 3, or give --grad-accum-dtype bf16",
        )


def _refuse(manifest: Manifest, world_size: int, stage: int, domain: bool, writes_stage0: bool = False) -> None:
    layout = manifest.layout
    if world_size < 1:
        raise ReshardUnsupported(f"--world-size must be at least 1, not {world_size}", "give a positive world size")
    # an AutoTP stage-0 domain (its masters located apart) merged or split for a stage-0 job: reshard_tensor_stage0
    read = layout.zero_stage in STAGES or (writes_stage0 and layout.zero_stage == 0 == stage)
    if not read or stage not in TARGET_STAGES:
        raise ReshardUnsupported(
            f"resharding ZeRO stage {layout.zero_stage} to stage {stage} is not supported yet "
            "(stage 1, 2 and 3 sources, to stage 0, 1, 2 or 3, are)",
            "reshard a stage 1, 2 or 3 checkpoint",
        )
    if stage == 0 and domain and not writes_stage0:  # reshard_stage0 writes AutoTP's tensor ranks, no pipeline stage
        raise ReshardUnsupported(
            "a stage-0 target of a pipeline-parallel checkpoint is not written yet",
            "reshard it to stage 1 or 2 (AutoTP checkpoints are written at stage 0)",
        )
    if not domain and (layout.tensor_parallel_size != 1 or layout.pipeline_parallel_size != 1):
        raise ReshardUnsupported(
            f"the checkpoint is tensor- or pipeline-parallel (tp {layout.tensor_parallel_size}, "
            f"pp {layout.pipeline_parallel_size}); reshard changes data parallelism only",
            "use DeepSpeed's ds_to_universal for tensor- or pipeline-parallel checkpoints",
        )
    if layout.tail_padding_saved and stage == 0:
        raise ReshardUnsupported(
            "a stage-0 target of a BF16_Optimizer checkpoint (bf16 with grad_accum_dtype fp32 at stage 1) is not "
            "written yet: DeepSpeed 0.19.8 runs no dense stage-0 job with fp32 gradient accumulation",
            "reshard it to --stage 1 (BF16_Optimizer again), 2 or 3",
        )
    # a domain's moments may be located apart from its manifest's files (a stage-0 source's: masters_state_plan)
    if manifest.optimizer is None or not (domain or any(f.state_partitions for f in manifest.files)):
        raise ReshardUnsupported(
            "the manifest locates no optimizer state (format 1.0)",
            "use a format 1.1 manifest: `ckptspec generate CHECKPOINT` describes the files anew",
        )
    if not all(isinstance(g.step, (int, float)) for g in manifest.optimizer.groups):
        raise ReshardUnsupported("an optimizer group has no step", "regenerate the manifest from the files")
