"""``ckptspec reshard --stage 0`` of a bf16 (or fp32) PipelineModule checkpoint: what a pipeline job at ZeRO stage 0
saves.

DeepSpeed's PipelineEngine at stage 0 in bf16 runs ``BF16_Optimizer`` (``engine._do_optimizer_sanity_check``). Per
stage it partitions the stage's trainable parameters like ZeRO-1 (one flat buffer per param group in the module's
order, padded to 2 x the data degree, split evenly) and saves, per data rank, ``bf16_zero_pp_rank_<d>_mp_rank_<s>_
optim_states.pt``: ``BF16_Optimizer.state_dict()`` (``BF16_KEYS``; the fp32 partition and moments whole, the tail
padding kept), with the ``ds_config`` and version. The stage's ``mp_rank_<s>_model_states.pt`` is a ZeRO-1 pipeline
stage's with ``optimizer`` a copy of data rank 0's state dict (ZeRO off: the engine saves ``optimizer.state_dict()``
there) and ``param_shapes``/``shared_params`` None; the layer files are as saved.

Each stage is written by the ZeRO writer (``reshard_files.write_files``) from the source stage's masters and moments:
a ZeRO-1 pipeline's partitions, or a stage-0 pipeline's BF16 partitions (``reshard_stage0_source.stage0_optimizer``
reads its entries) at another data degree. ``--pipeline-parallel Q``: moved to Q stages at ZeRO-1 first
(``reshard_pipeline``, into a directory beside the output's; a stage-0 source written as a ZeRO-1 pipeline before
that), then written at stage 0 here.

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

Refused by name (CK410) before anything is written: fp16 pipelines (their stage-0 optimizer is FP16_Optimizer, which
keeps its state in the model states: not written yet), a tensor-parallel pipeline at another number of stages,
``round_robin_gradients`` or
``parameter_alignment`` sources (BF16_Optimizer lays out neither), what the ZeRO-1 restage refuses (a stage-0
source's: once its ZeRO-1 pipeline is written, beside the output, not published).
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
from .reshard_files import ModelChanges, write_files
from .reshard_layout import TargetLayout, natural_groups
from .reshard_pipeline import pipeline_target
from .reshard_pipeline_stage0_fp32 import Fp32StageWrite
from .reshard_source import SourceOptimizer, source_optimizer, with_stage
from .reshard_stage0_source import is_stage0_source, stage0_optimizer

# BF16_Optimizer.state_dict()'s keys, in its order
BF16_KEYS = (
    "clip_grad",
    "base_optimizer_state",
    "single_partition_of_fp32_groups",
    "group_paddings",
    "partition_count",
    "ds_version",
    "param_slice_mappings",
)
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
    """A ZeRO-1 pipeline moved to ``stages`` stages (``restage``: ``reshard_model_parallel`` at ZeRO-1) in a directory
    beside the output's, then written at stage 0 (``restage`` again); the files moved into the output's tag. A
    stage-0 source (``source_stages``: its number of stages) is written as a ZeRO-1 pipeline of one data rank per
    stage first. What a step refuses (CK410) names the source; the output is not published."""

    checkpoint: Path | RemotePath
    tag: str
    world_size: int
    stages: int
    partition_method: str | None
    restage: Callable[..., object]
    source_stages: int | None = None  # a stage-0 source's

    zero_stage = 0

    def write(self, states: StateCache, tag_dir: Path) -> list[Path]:
        out: list[Path] = []
        share = split.current()  # rank 0 writes both steps alone (the restage is read back whole)
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
            if self.source_stages is not None:  # BF16_Optimizer's partitions as ZeRO-1's (reshard_stage0_source)
                source = Path(mid) / "zero1"
                self.restage(self.checkpoint, source, self.source_stages, zero_stage=1, tag=self.tag)
            options = {"tag": self.tag, "pipeline_parallel": self.stages, "partition_method": self.partition_method}
            self.restage(source, moved, self.world_size, zero_stage=1, **options)
            self.restage(moved, written, self.world_size, zero_stage=0, tag=self.tag)
            out = []
            for path in sorted((written / self.tag).iterdir()):
                shutil.move(path, tag_dir / path.name)
                out.append(tag_dir / path.name)
            return out


def plan_pipeline_stage0(
    index: CheckpointIndex,
    src_dir: Path | RemotePath,
    plans: dict[str, ReconstructionPlan],
    states: StateCache,
    world_size: int,
    pipeline_parallel: int | None,
    partition_method: str | None,
    restage: Callable[..., object],
) -> list[Bf16StageWrite] | list[RestagedStage0Write] | list[Fp32StageWrite]:
    """``index``'s pipeline written for a stage-0 bf16 pipeline job of ``world_size`` ranks: one write per stage,
    or the restage then stage 0 (``pipeline_parallel`` other than the source's). CK410 before anything is written."""
    degrees = index.topology.degrees
    _refuse(index, world_size, pipeline_parallel)
    if pipeline_parallel not in (None, degrees.pipeline):
        restaged = (src_dir.parent, src_dir.name, world_size, pipeline_parallel, partition_method, restage)
        if is_stage0_source(index):  # its ZeRO-1 pipeline, written first, is what the restage plans and refuses
            if world_size < 1 or world_size % pipeline_parallel:
                raise ReshardUnsupported(
                    f"--world-size {world_size} is not a multiple of --pipeline-parallel {pipeline_parallel}",
                    f"give a multiple of {pipeline_parallel}: each data-parallel rank holds one copy of the stages",
                )
            return [RestagedStage0Write(*restaged, source_stages=degrees.pipeline)]
        # what the ZeRO-1 restage refuses, before anything is written (its target is planned again when written)
        pipeline_target(index, pipeline_parallel, world_size, 1, partition_method, states, src_dir, plans)
        return [RestagedStage0Write(*restaged)]
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
    osd = {key: source.osd.get(key) for key in BF16_KEYS}
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


def _refuse(index: CheckpointIndex, world_size: int, pipeline_parallel: int | None) -> None:
    """CK410 for what is not written, by name."""
    degrees = index.topology.degrees
    if degrees.tensor != 1 and pipeline_parallel not in (None, degrees.pipeline):
        raise ReshardUnsupported(
            f"--stage 0 with --pipeline-parallel {pipeline_parallel} of a tensor-parallel pipeline (tensor degree "
            f"{degrees.tensor}) is not written yet",
            "write it at ZeRO-1 with --pipeline-parallel first, then reshard that to --stage 0 at its stages",
        )
    stage0 = is_stage0_source(index)
    for d in index.domains:
        layout = d.manifest.layout
        if layout.model_dtype not in ("bfloat16", "float32"):
            raise ReshardUnsupported(
                f"--stage 0 of a {layout.model_dtype} pipeline (stage {d.id}): DeepSpeed's stage-0 pipeline runs "
                "FP16_Optimizer there, whose files are not written yet",
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
    if pipeline_parallel in (None, degrees.pipeline) and (world_size < 1 or world_size % kept):
        which = f"pipeline degree ({kept})" if degrees.tensor == 1 else f"pipeline x tensor degrees ({kept})"
        raise ReshardUnsupported(
            f"--world-size {world_size} is not a multiple of the {which}, which is kept", f"give a multiple of {kept}"
        )
