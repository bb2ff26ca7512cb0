"""``ckptspec reshard --pipeline-parallel N``: a PipelineModule's ZeRO-1/2 checkpoint for another number of stages.

A pipeline checkpoint is one ZeRO domain per stage (``mp_rank_XX``: the stage's optimizer files and its model
states, whose module is None) and one file per layer (``layer_XX-model_states.pt``, named by the global layer
index whatever the stage). The target's stages take the layers DeepSpeed's ``PipelineModule`` gives them
(``_partition_layers``: ``partition_method`` "uniform", or "parameters", its default: layers balanced by their
trainable parameter counts); each stage's ZeRO groups are laid out anew from the whole model's tensors in the
stage's parameter order (``reshard_pipeline_layers``: its tied modules, then its layers in order), at
``world_size / N`` data-parallel ranks, and written by ``reshard_files.write_files`` (masters and moments moved,
a tied module's to every stage that runs it; step, hyperparameters and loss scaler copied from the source's first
stage: every stage's must agree; ``buffer_names`` the stage's layers', its tied modules' first). The layer files
carry over as saved: their names and keys do not depend on the stage; a tied module's copies (its frozen parameters
and buffers too: each stage's own), frozen parameters and buffers are in them.

A tensor-parallel pipeline's tensor ranks are each given here as a pipeline of tensor degree 1
(``reshard_tp_pipeline_stages``); given whole, it is refused. A stage-0 source is written as a ZeRO-1 pipeline first
(``reshard_pipeline_stage0.plan_restaged``, which plans it here as that pipeline: ``stage0_source``). Refused by
name (CK410) before anything is written: a stage-0 (BF16_Optimizer) source given as it is, a ZeRO-3 source, a
ZeRO-2/3 target (DeepSpeed's PipelineEngine asserts "ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism"),
frozen parameters or buffers outside the layer files, a source stage whose optimizer order or ``buffer_names`` are
not its module's, partition method "parameters" where a frozen parameter decides the stages, a layer index without a
file (a function layer: the layer count cannot be known), a target stage without trainable parameters, more stages
than layers, stages whose optimizer groups or hyperparameters differ.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from ..checkpoint.states import StateCache
from ..errors import ReshardUnsupported
from ..format.index_models import CheckpointIndex, Domain
from ..format.models import Manifest
from ..format.partition import ParamSpec, flat_group
from .optimizer_state import OptimizerStatePlan
from .reshard_files import write_files
from .reshard_layout import TargetLayout, natural_groups, target_layout
from .reshard_pipeline_layers import PipelineLayers, check_source_stages, check_tied_copies, pipeline_layers
from .reshard_source import source_optimizer

PARTITION_METHODS = ("parameters", "uniform")  # DeepSpeed's default first


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """DeepSpeed's ``partition_uniform``: part p starts at ``p * chunk + min(p, residual)`` (the first
    ``residual`` parts one item longer); with no more items than parts, one item per part, the rest empty."""
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    chunk, residual = divmod(num_items, num_parts)
    return [p * chunk + min(p, residual) for p in range(num_parts + 1)]


def partition_balanced(weights: list[int], num_parts: int) -> list[int]:
    """DeepSpeed's ``partition_balanced``: boundaries of ``num_parts`` contiguous parts chosen by its dynamic
    program (the cost of a split is its heaviest part minus its lightest, each prefix keeping the heaviest and
    lightest of the split it chose; among equal costs the last cut wins), uniform when items <= parts."""
    n = len(weights)
    if n <= num_parts:
        return partition_uniform(n, num_parts)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    # best[j][i]: (cost, heaviest, lightest, last cut) of i items in j parts, None where impossible
    best: list[list[tuple | None]] = [[None] * (n + 1) for _ in range(num_parts + 1)]
    best[0][0] = (0, None, None, 0)
    for i in range(1, n + 1):
        for j in range(1, min(i, num_parts) + 1):
            chosen = None
            for k in range(j - 1, i):  # the first j - 1 parts hold k items (at least one each)
                before = best[j - 1][k]
                if before is None:
                    continue
                part = prefix[i] - prefix[k]
                heavy = part if before[1] is None else max(before[1], part)
                light = part if before[2] is None else min(before[2], part)
                if chosen is None or heavy - light <= chosen[0]:
                    chosen = (heavy - light, heavy, light, k)
            best[j][i] = chosen
    parts = [n]
    for j in range(num_parts, 0, -1):
        entry = best[j][parts[-1]]
        parts.append(entry[3] if entry is not None else 0)
    return parts[::-1]


@dataclass(frozen=True)
class StageTarget:
    """One target stage: its layers, its domain manifest (the stage's groups in natural order) and layout."""

    stage: int
    layers: range
    manifest: Manifest
    layout: TargetLayout
    buffer_names: list[str]  # the stage's model states' (its layers' persistent buffers)


@dataclass(frozen=True)
class PipelineTarget:
    stages: list[StageTarget]
    partition_method: str
    template: Domain  # the source stage whose optimizer file and model states the targets copy

    @property
    def zero_stage(self) -> int:
        return self.stages[0].layout.zero_stage


def pipeline_target(
    index: CheckpointIndex,
    stages: int,
    world_size: int,
    zero_stage: int | None,
    partition_method: str | None,
    states: StateCache,
    src_dir,
    plans: dict,
    stage0_source: bool = False,
) -> PipelineTarget:
    """The target stages of ``index``'s pipeline at ``stages`` stages and ``world_size`` ranks (CK410 where
    it cannot be written, CK401 where a tie's copies differ); reads the source stages' first optimizer files
    (their hyperparameters) and the tied parameters' masters and moments. ``stage0_source``: ``index`` is a stage-0
    pipeline, its domains' manifests those of the ZeRO-1 pipeline it is written as first
    (``reshard_pipeline_stage0.plan_restaged``): what the stages' layers, parameters and the target's ranks decide is
    refused here; its stages' hyperparameters and its ties' copies are compared when that ZeRO-1 pipeline is moved."""
    method = partition_method or PARTITION_METHODS[0]
    degrees = index.topology.degrees
    _refuse_source(index, method, stage0_source)
    if zero_stage not in (None, 1):
        raise ReshardUnsupported(
            f"--stage {zero_stage} with --pipeline-parallel: DeepSpeed's PipelineEngine asserts \"ZeRO-2 and "
            'ZeRO-3 are incompatible with pipeline parallelism"',
            "give --stage 1 (or leave it out)",
        )
    if world_size % stages:
        raise ReshardUnsupported(
            f"--world-size {world_size} is not a multiple of --pipeline-parallel {stages} (tensor degree "
            f"{degrees.tensor})",
            f"give a multiple of {stages}: each data-parallel rank holds one copy of the {stages} stages",
        )
    layers = pipeline_layers(index)
    num_layers = len(index.layer_files)
    if stages > num_layers:
        raise ReshardUnsupported(
            f"--pipeline-parallel {stages}: the pipeline has {num_layers} layers, fewer than the stages",
            f"give at most {num_layers} stages",
        )
    check_source_stages(layers, index, states, src_dir)
    bounds = _bounds(layers, stages, method)
    domains = sorted(index.domains, key=lambda d: d.coordinate.pipeline or 0)
    template = domains[0]
    if stage0_source:  # its ZeRO-1 pipeline's layout: DeepSpeedZeroOptimizer's partitions
        zero1 = template.manifest.layout.model_copy(update={"tail_padding_saved": False})
        template = template.model_copy(update={"manifest": template.manifest.model_copy(update={"layout": zero1})})
    else:
        _refuse_differing_stages(domains, states, src_dir)
        check_tied_copies(index, plans)
    data = world_size // stages
    targets = []
    for s in range(stages):
        held = range(bounds[s], bounds[s + 1])
        mine = layers.order(held)
        groups = []
        for g in sorted({g for g, _ in natural_groups(template.manifest)}):
            specs = [ParamSpec(p.name, tuple(p.shape), p.dtype) for gg, p in mine if gg == g]
            if not specs:
                raise ReshardUnsupported(
                    f"target stage {s} (layers {held.start}-{held.stop - 1}, partition method {method!r}) "
                    f"has no trainable parameter in optimizer group {g}",
                    "give fewer stages or another --partition-method: DeepSpeed's ZeRO optimizer needs parameters "
                    "in every group of every stage",
                )
            # one partition: the natural order, which target_layout lays out for the target's data degree
            groups.append(flat_group(specs, optimizer_group=g, partition_count=1, zero_stage=1))
        manifest = template.manifest.model_copy(
            update={
                "groups": groups,
                "layout": template.manifest.layout.model_copy(
                    update={"world_size": 1, "pipeline_parallel_size": stages, "model_parallel_size": stages}
                ),
            }
        )
        layout = target_layout(manifest, data, 1, domain=True)
        targets.append(StageTarget(s, held, manifest, layout, layers.buffer_names(held)))
    return PipelineTarget(targets, method, template)


def _bounds(layers: PipelineLayers, stages: int, method: str) -> list[int]:
    """The first layer of each target stage, and the layer count: DeepSpeed's ``_partition_layers``. The weights
    of "parameters" with and without the frozen parameters must give the same stages (reshard_pipeline_layers)."""
    if method == "uniform":
        return partition_uniform(len(layers.tensors), stages)
    bounds = partition_balanced(layers.weights(count_frozen=False), stages)
    if layers.frozen and partition_balanced(layers.weights(count_frozen=True), stages) != bounds:
        raise ReshardUnsupported(
            f"--partition-method parameters at {stages} stages: DeepSpeed counts the frozen {layers.frozen[0]!r} "
            "if it was frozen after the model was built, not if its layer froze it, and the stages differ; the "
            "files cannot tell which",
            "give --partition-method uniform, or another number of stages",
        )
    return bounds


def write_stages(
    target: PipelineTarget,
    index: CheckpointIndex,
    plans: dict,
    state_plans: dict[str, OptimizerStatePlan],
    states: StateCache,
    tag_dir: Path,
    tensor: int = 0,
    tensor_degree: int = 1,
) -> list[Path]:
    """Every target stage's optimizer and model-states files (the layer files are the caller's); of tensor rank
    ``tensor`` of ``tensor_degree`` (``reshard_tp_pipeline_stages``): ``mp_rank = stage * tp + tensor``."""
    first = plans[target.template.id]
    sources = {name: s for plan in plans.values() for name, s in plan.sources.items()}
    plan = dataclasses.replace(first, sources=sources)
    state_plan = OptimizerStatePlan(
        {k: v for p in state_plans.values() for k, v in p.sources.items()},
        {k: v for p in state_plans.values() for k, v in p.states.items()},
        {},
    )
    stages = len(target.stages)
    model = next(f for f in target.template.manifest.files if f.role == "model_states")
    template_state = states.state(first.tag_dir / model.path)
    changes: dict = {"mp_world_size": stages * tensor_degree}  # pp x tp
    if isinstance(template_state.get("checkpoint_parallel_dimensions"), dict):
        changes["checkpoint_parallel_dimensions"] = {"pp_degree": stages, "tp_degree": tensor_degree}
    files: list[Path] = []
    for stage in target.stages:
        files += write_files(
            stage.manifest,
            plan,
            state_plan,
            stage.layout,
            states,
            tag_dir,
            mp_rank=stage.stage * tensor_degree + tensor,
            model_changes={**changes, "buffer_names": stage.buffer_names},
        )
    return files


def _refuse_source(index: CheckpointIndex, method: str, stage0_source: bool = False) -> None:
    degrees = index.topology.degrees
    if method not in PARTITION_METHODS:
        raise ReshardUnsupported(
            f"--partition-method {method!r} is not supported",
            f"give one of {', '.join(PARTITION_METHODS)} (DeepSpeed's PipelineModule partition_method)",
        )
    if not index.layer_files:
        raise ReshardUnsupported(
            "--pipeline-parallel: the checkpoint has no pipeline layer files (it is not a PipelineModule's)",
            "leave --pipeline-parallel out",
        )
    if degrees.tensor != 1 or any(f.tensor is not None for f in index.layer_files):
        raise ReshardUnsupported(
            f"--pipeline-parallel of a pipeline with tensor degree {degrees.tensor}: not supported",
            "change the pipeline degree of tensor degree 1 checkpoints only",
        )
    for d in index.domains:
        stage = d.manifest.layout.zero_stage
        if not stage0_source and (d.masters is not None or stage != 1):
            raise ReshardUnsupported(
                f"--pipeline-parallel: domain {d.id} is ZeRO stage {stage}"
                f"{' (BF16_Optimizer)' if d.masters is not None else ''}; ZeRO-1 pipelines are what reshard moves",
                "resume at the same pipeline degree",
            )
        for section in ("frozen", "buffers", "aliases"):  # a stage's own, outside its layer files
            items = getattr(d.manifest, section)
            if items:
                raise ReshardUnsupported(
                    f"--pipeline-parallel: {section} ({items[0].name!r}) in stage {d.id}'s model states, not moved "
                    "between stages yet",
                    "resume at the same pipeline degree",
                )
    layers = sorted(f.layer for f in index.layer_files)
    missing = sorted(set(range(layers[-1] + 1)) - set(layers))
    if missing or len(set(layers)) != len(layers):
        raise ReshardUnsupported(
            f"--pipeline-parallel: layer {missing[0] if missing else layers[0]} has "
            f"{'no' if missing else 'more than one'} layer file (a function layer, or files of two saves): "
            "the pipeline's layer count cannot be known",
            "resume at the same pipeline degree",
        )


def _refuse_differing_stages(domains: list[Domain], states: StateCache, src_dir) -> None:
    """Every source stage must have the template's optimizer groups and hyperparameters: the target's stages
    are written with the template's (DeepSpeed builds each stage's optimizer from one client config)."""
    seen = None
    for d in domains:
        first = next(f.path for f in d.manifest.files if f.role == "optimizer_states" and 0 in f.ranks)
        source = source_optimizer(d.manifest, states.state(src_dir / first))
        groups = [_plain(g) for g in source.param_groups]
        if seen is not None and groups != seen:
            raise ReshardUnsupported(
                f"--pipeline-parallel: stage {d.id}'s optimizer groups or hyperparameters differ from the first "
                "stage's",
                "resume at the same pipeline degree",
            )
        seen = groups


def _plain(group) -> dict:
    """A param group's hyperparameters (its ``params`` aside), as comparable values."""
    return {k: repr(v) for k, v in dict(group).items() if k != "params"}
