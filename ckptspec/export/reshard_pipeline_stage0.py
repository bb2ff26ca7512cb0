"""``ckptspec reshard --stage 0`` of a bf16 (or fp32) PipelineModule checkpoint: what a pipeline job at ZeRO stage 0
saves.

DeepSpeed's PipelineEngine at stage 0 in bf16 runs ``BF16_Optimizer`` (``engine._do_optimizer_sanity_check``). Per
stage it partitions the stage's trainable parameters like ZeRO-1 (one flat buffer per param group in the module's
order, padded to 2 x the data degree, split evenly) and saves, per data rank, ``bf16_zero_pp_rank_<d>_mp_rank_<s>_
optim_states.pt``: ``BF16_Optimizer.state_dict()`` (``reshard_files.BF16_OPTIMIZER_KEYS``; the fp32 partition and
moments whole, the tail padding kept), with the ``ds_config`` and version. The stage's ``mp_rank_<s>_model_states.pt``
is a ZeRO-1 pipeline stage's with ``optimizer`` a copy of data rank 0's state dict (ZeRO off: the engine saves
``optimizer.state_dict()`` there) and ``param_shapes``/``shared_params`` None; the layer files are as saved.

Each stage is written by the ZeRO writer (``reshard_files.write_files``) from the source stage's masters and moments:
a ZeRO-1 pipeline's partitions, or a stage-0 pipeline's BF16 partitions (``reshard_stage0_source.stage0_optimizer``
reads its entries) at another data degree. ``--pipeline-parallel Q``: moved to Q stages at ZeRO-1 first
(``reshard_pipeline``, a tensor-parallel pipeline's tensor ranks each: ``reshard_tp_pipeline_stages``; into a directory
beside the output's; a stage-0 source written as a ZeRO-1 pipeline before that), then written at stage 0 here
(``plan_restaged``). ``--tensor-parallel T`` of a tensor-parallel pipeline the same way: merged (T 1) or split at
ZeRO-1 (``reshard_tp_pipeline``, ``reshard_tp_pipeline_split``; with ``--pipeline-parallel Q`` too: then moved), then
written at stage 0. A stage-0 source asked at Q stages or tensor degree T and ``--stage 1`` is the same chain without
its last step. Each step is the command that writes it alone, so the output is what those commands write in turn.

DeepSpeed 0.19.8's ``engine.load_checkpoint`` cannot load the optimizer state of such a checkpoint, its own save
included: it hands ``BF16_Optimizer.load_state_dict`` the model states' copy (a dict) where it indexes every rank's
list (``KeyError: 0``). ``load_checkpoint(..., load_optimizer_states=False)`` then ``engine._load_zero_checkpoint``
(DeepSpeed's reader of the ``bf16_zero_pp_rank_*`` files) loads both alike.

An fp32 pipeline's stage-0 job runs the torch optimizer instead, its state in each stage's model states: each stage
written by ``reshard_pipeline_stage0_fp32`` (``Fp32StageWrite``; restaged first as above), loaded by plain
``load_checkpoint``.

A tensor-parallel pipeline (Megatron-style layers, ``PipeModelDataParallelTopology``) is written the same way per
(stage, tensor rank) domain, its files named by DeepSpeed's ``mp_rank = stage x tp + tensor``, its layer files
(``layer_XX-model_YY``) and the saved split rules (``universal_checkpoint_info``) kept as saved.

Refused by name (CK410) before anything is written: fp16 pipelines (DeepSpeed 0.19.8 saves one at stage 0 on the CPU
with FP16_UnfusedOptimizer, its fp32 masters, Adam state and dynamic loss scale in each stage's model states: not
described, CK202, nor written yet), ``round_robin_gradients`` or
``parameter_alignment`` sources (BF16_Optimizer lays out neither), what a step of the chain refuses (each step planned
first; a stage-0 source's stages planned as the ZeRO-1 pipeline it is written as). What only that written ZeRO-1
pipeline's values show (its stages' optimizer groups or hyperparameters differing, a tie's copies or, merged or split,
its tensor ranks' replicated copies differing) is refused when it is moved, beside the output, not published.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .. import split
from ..checkpoint.states import StateCache
from ..errors import ReshardUnsupported
from ..format.index_models import CheckpointIndex, Domain
from ..format.models import Manifest
from ..format.partition import ParamSpec, flat_group
from ..location import RemotePath
from .masters_state import masters_state_plan
from .model_plan import ReconstructionPlan
from .optimizer_state import OptimizerStatePlan, plan_optimizer_state
from .reshard_files import BF16_OPTIMIZER_KEYS, ModelChanges, write_files
from .reshard_layout import TargetLayout, natural_groups
from .reshard_pipeline import pipeline_target
from .reshard_pipeline_stage0_fp32 import Fp32StageWrite
from .reshard_source import SourceOptimizer, source_optimizer, with_stage
from .reshard_stage0_source import is_stage0_source, plan_stage0_source, stage0_optimizer
from .reshard_tp_pipeline import plan_tensor_pipeline_merge, refuse_tensor_pipeline_merge
from .reshard_tp_pipeline_split import plan_tensor_pipeline_split, refuse_split_and_stages, refuse_tensor_pipeline_split
from .reshard_tp_pipeline_stages import is_tensor_pipeline, plan_tensor_pipeline_stages, refuse_merge_and_stages

# model-states entries a stage-0 engine saves as None (ZeRO off); ``optimizer`` is written by ``write_files``
_ZERO_OFF = ("param_shapes", "frozen_param_shapes", "shared_params", "frozen_param_fragments")
# DeepSpeed 0.19.8's load_checkpoint hands BF16_Optimizer the model states' copy of rank 0's state and fails
# (KeyError: 0, on its own save too): the module first, then its reader of the bf16_zero_pp_rank_* files.
PIPELINE_STAGE0_RESUME = (
    "engine.load_checkpoint('{output}', load_optimizer_states=False), then "
    "engine._load_zero_checkpoint('{output}', tag, load_optimizer_states=True) (docs/reshard.md)"
)


def is_pipeline_stage0_target(index: CheckpointIndex, zero_stage: int | None) -> bool:
    """A pipeline (layer files) asked at stage 0, or a stage-0 pipeline without ``--stage`` (it keeps its stage)."""
    return bool(index.layer_files) and (zero_stage == 0 or (zero_stage is None and is_stage0_source(index)))


def changes_degrees(index: CheckpointIndex, tensor_parallel: int | None, pipeline_parallel: int | None) -> bool:
    """Another number of stages or tensor degree than ``index``'s asked: a chain of moves (``plan_restaged``)."""
    degrees = index.topology.degrees
    return pipeline_parallel not in (None, degrees.pipeline) or tensor_parallel not in (None, degrees.tensor)


def moves_stage0_source(index: CheckpointIndex, tensor_parallel: int | None, pipeline_parallel: int | None) -> bool:
    """A stage-0 pipeline asked at another number of stages or tensor degree and a ZeRO stage
    (``is_pipeline_stage0_target`` otherwise): written as ZeRO-1, then moved (``plan_restaged``)."""
    return (
        bool(index.layer_files)
        and is_stage0_source(index)
        and changes_degrees(index, tensor_parallel, pipeline_parallel)
    )


def pipeline_stage0_resume(index: CheckpointIndex, zero_stage: int | None) -> list[str]:
    """The resume line of a bf16 stage-0 pipeline output (an fp32 one's is load_checkpoint's: none here)."""
    bf16 = all(d.manifest.layout.model_dtype == "bfloat16" for d in index.domains)
    return [PIPELINE_STAGE0_RESUME] if bf16 and is_pipeline_stage0_target(index, zero_stage) else []


@dataclass
class Bf16StageWrite:
    """One pipeline stage written as a stage-0 bf16 pipeline job saves it."""

    manifest: Manifest  # the source stage's domain manifest
    plan: ReconstructionPlan  # its fp32 masters
    state_plan: OptimizerStatePlan  # their moments
    target: TargetLayout  # BF16_Optimizer's partitions at the target's data degree
    source: SourceOptimizer  # the hyperparameters, steps and clip_grad, BF16_Optimizer's keys

    zero_stage = 0

    def write(self, states: StateCache, tag_dir: Path) -> list[Path]:
        changes = ModelChanges(
            module={}, set_keys=dict.fromkeys(_ZERO_OFF), drop_keys=(), config=lambda config: with_stage(config, 0)
        )
        args = (self.manifest, self.plan, self.state_plan, self.target, states, tag_dir, changes)
        return write_files(*args, source=self.source, optimizer_in_model_states=True)


@dataclass
class RestagedStage0Write:
    """A ZeRO-1 pipeline moved to ``stages`` stages and/or merged or split to ``tensor_parallel`` tensor ranks
    (``restage``: ``reshard_model_parallel`` at ZeRO-1, the command that moves a ZeRO-1 pipeline so) in a directory
    beside the output's, then written at stage 0 (``restage`` again; ``zero_stage`` 1: the moved ZeRO-1 pipeline is
    the output); the files moved into the output's tag. A stage-0 source (``source_ranks``: its stages x tensor
    degree) is written as a ZeRO-1 pipeline of one data rank per (stage, tensor rank) first. Each step was planned,
    and what it refuses refused, before anything is written (``plan_restaged``); a refusal left to a step (CK410) names
    the source, and the output is not published."""

    checkpoint: Path | RemotePath
    tag: str
    world_size: int
    stages: int | None  # None: the source's
    partition_method: str | None
    restage: Callable[..., object]
    source_ranks: int | None = None  # a stage-0 source's pp x tp
    zero_stage: int = 0  # the output's: 0, or 1 (a stage-0 source's ZeRO-1 pipeline, moved)
    tensor_parallel: int | None = None  # the target's tensor degree (None: the source's)

    def write(self, states: StateCache, tag_dir: Path) -> list[Path]:
        out: list[Path] = []
        share = split.current()  # rank 0 writes every step alone (each step is read back whole)
        share.first_only(lambda: out.extend(self._both_steps(tag_dir)))
        share.written.extend(str(path) for path in out)
        return out

    def _both_steps(self, tag_dir: Path) -> list[Path]:
        try:
            return self._steps(tag_dir)
        except ReshardUnsupported as exc:  # a step's refusal, of a temporary directory: the source's
            raise ReshardUnsupported(exc.message, exc.hint, str(self.checkpoint)) from None

    def _steps(self, tag_dir: Path) -> list[Path]:
        with tempfile.TemporaryDirectory(prefix=".pp-restaged-", dir=tag_dir.parent) as mid:
            moved, written, source = Path(mid) / "moved", Path(mid) / "stage0", self.checkpoint
            if self.source_ranks is not None:  # the stage-0 optimizer's masters and moments as ZeRO-1's
                source = Path(mid) / "zero1"
                self.restage(self.checkpoint, source, self.source_ranks, zero_stage=1, tag=self.tag)
            options = {"tag": self.tag, "pipeline_parallel": self.stages, "partition_method": self.partition_method}
            options["tensor_parallel"] = self.tensor_parallel  # merged or split (reshard_tp_pipeline, _split)
            self.restage(source, moved, self.world_size, zero_stage=1, **options)
            if self.zero_stage == 0:
                self.restage(moved, written, self.world_size, zero_stage=0, tag=self.tag)
            out = []
            for path in sorted(((written if self.zero_stage == 0 else moved) / self.tag).iterdir()):
                shutil.move(path, tag_dir / path.name)
                out.append(tag_dir / path.name)
            return out


def plan_restaged(
    index: CheckpointIndex,
    src_dir: Path | RemotePath,
    plans: dict[str, ReconstructionPlan],
    states: StateCache,
    world_size: int,
    stages: int | None,
    partition_method: str | None,
    restage: Callable[..., object],
    zero_stage: int,
    tensor_parallel: int | None = None,
) -> RestagedStage0Write:
    """``index``'s pipeline (a tensor-parallel one's tensor ranks each) at ``stages`` stages and/or (a tensor-parallel
    one) merged or split to ``tensor_parallel`` tensor ranks, at ``zero_stage`` 0 (a ZeRO-1 or stage-0 source), or at
    ZeRO-1 (a stage-0 source): the steps of ``RestagedStage0Write``, each planned here first, so that what one refuses
    (CK410) is refused before anything is written: a stage-0 source written as ZeRO-1 (``plan_stage0_source``), its
    stages moved (``reshard_pipeline.pipeline_target``, or each tensor rank's: ``reshard_tp_pipeline_stages``; a
    stage-0 source's planned as the ZeRO-1 pipeline it is written as), its tensor degree changed
    (``_plan_tensor_degree``). The stages' optimizer groups and hyperparameters, and a tie's copies (and, for another
    tensor degree, the tensor ranks' replicated copies), of a stage-0 source are compared when its ZeRO-1 pipeline is
    moved (CK410/CK401 then, the output not published)."""
    degrees = index.topology.degrees
    stage0 = is_stage0_source(index)
    ranks = degrees.pipeline * degrees.tensor
    planned = index
    if stage0:  # what writing it as ZeRO-1 at its own stages refuses (a stage the target cannot run too); its domains
        zero1 = plan_stage0_source(index, src_dir, plans, states, ranks, zero_stage or 1)  # type: ignore[arg-type]
        domains = [d.model_copy(update={"manifest": zero1[d.id].manifest}) for d in index.domains]
        planned = index.model_copy(update={"domains": domains})  # as that ZeRO-1 pipeline's manifests lay them out
    if tensor_parallel not in (None, degrees.tensor):
        args = (world_size, tensor_parallel, stages, partition_method, stage0)
        _plan_tensor_degree(planned, src_dir, plans, states, *args)
    elif is_tensor_pipeline(index):  # the stages moved only (``stages`` given)
        args = (world_size, 1, stages or degrees.pipeline, partition_method, stage0)
        plan_tensor_pipeline_stages(planned, src_dir, plans, states, *args)  # type: ignore[arg-type]
    else:
        moved = stages or degrees.pipeline
        pipeline_target(planned, moved, world_size, 1, partition_method, states, src_dir, plans, stage0)
    restaged = (src_dir.parent, src_dir.name, world_size, stages, partition_method, restage)
    source_ranks = ranks if stage0 else None
    return RestagedStage0Write(*restaged, source_ranks, zero_stage, tensor_parallel)


def _plan_tensor_degree(
    index: CheckpointIndex,
    src_dir: Path | RemotePath,
    plans: dict[str, ReconstructionPlan],
    states: StateCache,
    world_size: int,
    degree: int,
    stages: int | None,
    partition_method: str | None,
    stage0: bool,
) -> None:
    """The ZeRO-1 move of a tensor-parallel pipeline to ``degree`` tensor ranks (1: merged, ``reshard_tp_pipeline``;
    else split, ``reshard_tp_pipeline_split``) at its stages, or at ``stages`` (moved after, at one data rank there,
    as ``reshard_model_parallel`` does it), planned: CK410/CK401 before anything is written. A stage-0 source
    (``stage0``: ``index`` as the ZeRO-1 pipeline it is written as, whose masters and moments are not written yet)
    is asked what the index and its layer files decide only."""
    degrees = index.topology.degrees  # tp > 1 (``refuse_degree_changes``): DeepSpeed's layer files are per tensor rank
    world = world_size
    if stages not in (None, degrees.pipeline):  # merged or split at the source's stages, then moved
        if degree == 1:
            refuse_merge_and_stages(index, world_size, stages, partition_method)
        else:
            refuse_split_and_stages(index, world_size, degree, stages, partition_method)
        world = degree * degrees.pipeline
    if stage0:  # the ZeRO-1 pipeline it is written as: its partitions (no masters located apart)
        domains = [d.model_copy(update={"masters": None}) for d in index.domains]
        zero1 = index.model_copy(update={"domains": domains})
        if degree == 1:
            refuse_tensor_pipeline_merge(zero1, world, 1)
        else:
            refuse_tensor_pipeline_split(zero1, src_dir, states, world, 1, degree)  # type: ignore[arg-type]
    elif degree == 1:
        plan_tensor_pipeline_merge(index, src_dir, plans, states, world, 1)  # type: ignore[arg-type]
    else:
        plan_tensor_pipeline_split(index, src_dir, plans, states, world, 1, degree)  # type: ignore[arg-type]


def plan_pipeline_stage0(
    index: CheckpointIndex,
    src_dir: Path | RemotePath,
    plans: dict[str, ReconstructionPlan],
    states: StateCache,
    world_size: int,
    pipeline_parallel: int | None,
    partition_method: str | None,
    restage: Callable[..., object],
    tensor_parallel: int | None = None,
) -> list[Bf16StageWrite] | list[RestagedStage0Write] | list[Fp32StageWrite]:
    """``index``'s pipeline written for a stage-0 bf16 pipeline job of ``world_size`` ranks: one write per stage,
    or the restage then stage 0 (``pipeline_parallel`` other than the source's). CK410 before anything is written."""
    degrees = index.topology.degrees
    _refuse(index, world_size, pipeline_parallel, tensor_parallel)
    if changes_degrees(index, tensor_parallel, pipeline_parallel):  # moved at ZeRO-1 first (a stage-0 source: so)
        args = (world_size, pipeline_parallel, partition_method, restage, 0, tensor_parallel)
        return [plan_restaged(index, src_dir, plans, states, *args)]
    data = world_size // (degrees.pipeline * degrees.tensor)  # a tensor-parallel one: each (stage, tensor rank)
    return [_stage_write(d, src_dir, plans[d.id], states, data, degrees.tensor) for d in index.domains]


def _stage_write(
    domain: Domain, src_dir: Path | RemotePath, plan: ReconstructionPlan, states: StateCache, data: int, tp: int
):
    """One stage (of a tensor-parallel pipeline: one tensor rank's; ``tp`` its tensor degree): its masters and moments
    (a ZeRO-1 stage's partitions, or a stage-0 one's BF16 partitions)."""
    manifest = domain.manifest
    if domain.masters is not None:  # a stage-0 (BF16_Optimizer) stage: the index locates them
        state_plan = masters_state_plan(src_dir, domain, states)
        moments = sorted({key for names in state_plan.states.values() for key in names})
        source = stage0_optimizer(src_dir, domain, states, moments, 0)  # type: ignore[arg-type]  # joined, read
    else:
        state_plan = plan_optimizer_state(plan)
        first = next(f.path for f in manifest.files if f.role == "optimizer_states" and 0 in f.ranks)
        source = source_optimizer(manifest, states.state(src_dir / first))
        source.path, source.file_name = src_dir / first, first
    if manifest.layout.model_dtype == "float32":  # the torch optimizer's state in the model states, no optimizer files
        model = src_dir / next(f.path for f in manifest.files if f.role == "model_states")
        mp_rank = domain.coordinate.pipeline * tp + domain.coordinate.tensor  # DeepSpeed's numbering of (stage, tensor)
        return Fp32StageWrite(manifest, plan, state_plan, source, model, data, mp_rank)  # type: ignore[arg-type]
    # BF16_Optimizer's keys: those write_files recomputes for the target, the rest (clip_grad) as saved
    osd = {key: source.osd.get(key) for key in BF16_OPTIMIZER_KEYS}
    return Bf16StageWrite(
        manifest, plan, state_plan, _bf16_layout(manifest, data), dataclasses.replace(source, osd=osd)
    )


def _bf16_layout(manifest: Manifest, data: int) -> TargetLayout:
    """BF16_Optimizer's flat partitions of each param group at ``data`` ranks: ZeRO-1's, the tail padding saved."""
    groups = []
    for g, natural in natural_groups(manifest):
        specs = [ParamSpec(p.name, tuple(p.shape), p.dtype) for p in natural]
        groups.append(flat_group(specs, optimizer_group=g, partition_count=data, zero_stage=1, tail_padding_saved=True))
    return TargetLayout(data, 0, groups)


def _refuse(
    index: CheckpointIndex, world_size: int, pipeline_parallel: int | None, tensor_parallel: int | None
) -> None:
    """CK410 for what is not written, by name (a move's steps: ``plan_restaged``)."""
    degrees = index.topology.degrees
    stage0 = is_stage0_source(index)
    for d in index.domains:
        layout = d.manifest.layout
        if layout.model_dtype not in ("bfloat16", "float32"):
            raise ReshardUnsupported(
                f"--stage 0 of a {layout.model_dtype} pipeline (stage {d.id}): DeepSpeed's stage-0 pipeline runs "
                "FP16_UnfusedOptimizer there (FP16_Optimizer with a FusedAdam), its masters and dynamic loss scale in "
                "each stage's model states, which are not written yet",
                "bf16 (BF16_Optimizer) and fp32 (the torch optimizer) pipelines are written at stage 0; keep this one "
                "at ZeRO-1",
            )
        if not stage0 and (d.masters is not None or layout.zero_stage != 1):
            raise ReshardUnsupported(
                f"--stage 0 of stage {d.id} at ZeRO stage {layout.zero_stage}: ZeRO-1 and stage-0 pipelines are "
                "written at stage 0",
                "reshard a ZeRO-1 or stage-0 pipeline",
            )
        if layout.round_robin or layout.parameter_alignment:
            raise ReshardUnsupported(
                f"--stage 0 of stage {d.id}, saved with round_robin_gradients or parameter_alignment: "
                "BF16_Optimizer lays out neither",
                "reshard it without --stage 0",
            )
    kept = degrees.pipeline * degrees.tensor
    if not changes_degrees(index, tensor_parallel, pipeline_parallel) and (world_size < 1 or world_size % kept):
        which = f"pipeline degree ({kept})" if degrees.tensor == 1 else f"pipeline x tensor degrees ({kept})"
        raise ReshardUnsupported(
            f"--world-size {world_size} is not a multiple of the {which}, which is kept", f"give a multiple of {kept}"
        )
