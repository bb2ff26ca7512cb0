"""``ckptspec reshard --tensor-parallel 1`` of a tensor-parallel pipeline: Megatron-style layers merged for the same
PipelineModule without tensor parallelism, at the same number of stages.

The checkpoint index places every tensor rank's shard of each whole tensor (``describe/tp_pipeline.py``: the
recorded split rules). Each target stage is the AutoTP merge of that stage (``reshard_tensor.whole_model``'s
parts, composed): tensor rank 0's domain of the stage with every parameter at its whole shape, its masters and
Adam moments composed from the tensor ranks' partitions (replicated copies compared first, CK401), written by the
ZeRO writer (``reshard_files.write_files``) at ``world_size / stages`` data-parallel ranks under the stage's
``mp_rank`` (``mp_rank = stage`` at tensor degree 1). Each layer's tensor-rank files become one
``layer_XX-model_states.pt``: its tensors whole, composed from the tensor ranks' saved low-precision weights in
the order of the saved keys. The model states change as a tp1 pipeline saves them: ``mp_world_size`` = stages,
``checkpoint_parallel_dimensions`` tp 1; the client state (Megatron-DeepSpeed's ``universal_checkpoint_info``
patterns too: they still hold at tp 1) is carried as saved.

A ``TiedLayerSpec``'s module (replicated on every tensor rank, ``describe/tp_pipeline.py``) keeps its stage name
(``tied_modules.<key>.<attribute>``) in each stage's optimizer; its copies on every stage and tensor rank are
compared first (CK401: masters, and moments as ``reshard_pipeline_layers.check_tied_copies`` compares a tp1
pipeline's), as are the tensor ranks' copies of a buffer. Each layer file's frozen parameters and buffers
(the index's extras) are composed like its trainable weights: a frozen shard by the rules, a buffer tensor rank 0's
copy; a key that is a tie of a parameter another of its stage's layer files holds (its ``aliases``) takes that one.

Another number of stages at once: the merge at the source's stages, then moved (``reshard_tp_pipeline_stages``).
Refused by name (CK410) before anything is written: a ZeRO stage other than 1
(DeepSpeed's PipelineEngine asserts "ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism"), a world size
that is not a multiple of the stages, a domain that is not a ZeRO-1/2 partition.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path

from ..checkpoint.states import StateCache
from ..deepspeed.describe.pipeline_params import TIED_PREFIX
from ..errors import ReshardUnsupported
from ..format.index_models import CheckpointIndex, Shard, SplitPlacement
from . import ds_pickle
from .arrays import ShardReader, iter_chunks
from .compose import check_replicas
from .compose_extras import extras_of
from .compose_plan import compose_source, whole_plan
from .model_plan import ReconstructionPlan, TensorSource
from .reshard_files import ModelChanges, lazy_reader
from .reshard_layout import target_layout
from .reshard_pipeline_layers import check_tied_copies
from .reshard_tensor import DataParallelTarget, refuse_unpartitioned, whole_manifest

RESUME = "resume at the same tensor degree"


@dataclass
class TensorPipelineMerge:
    """Every target stage (a ZeRO-1 domain of whole tensors) and every merged layer file, planned."""

    stages: list[DataParallelTarget]
    layers: dict[str, dict[str, TensorSource]]  # target layer file -> its keys' whole low-precision tensors

    @property
    def zero_stage(self) -> int:
        return self.stages[0].zero_stage

    def write(self, states: StateCache, tag_dir: Path) -> list[Path]:
        files = [path for stage in self.stages for path in stage.write(states, tag_dir)]
        with ShardReader() as reader:
            for name, tensors in self.layers.items():
                doc = collections.OrderedDict((key, _lazy(source, reader)) for key, source in tensors.items())
                ds_pickle.save_streamed(doc, tag_dir / name)  # as DeepSpeed's torch.save of layer.state_dict()
                files.append(tag_dir / name)
        return files


def _lazy(source: TensorSource, reader: ShardReader) -> ds_pickle.Lazy:
    chunks = functools.partial(iter_chunks, source.segments, source.dtype, source.dtype, reader, source)
    return ds_pickle.Lazy(source.dtype, tuple(source.shape), chunks)


def plan_tensor_pipeline_merge(
    index: CheckpointIndex,
    tag_dir: Path,
    plans: dict[str, ReconstructionPlan],
    states: StateCache,
    world_size: int,
    zero_stage: int | None,
) -> TensorPipelineMerge:
    """The merge of ``index``'s tensor ranks, stage by stage (module docstring); CK410/CK401 before writing."""
    stages = index.topology.degrees.pipeline
    refuse_tensor_pipeline_merge(index, world_size, zero_stage)
    whole, state_plan, manifests = whole_stages(index, tag_dir, plans, states)
    changes = ModelChanges(
        module={},  # a stage's module is None: its weights are the layer files'
        set_keys={"mp_world_size": stages, "checkpoint_parallel_dimensions": {"pp_degree": stages, "tp_degree": 1}},
        drop_keys=(),
        config=lambda value: value,
    )
    targets = []
    for stage, (manifest, _, plan) in enumerate(manifests):
        target = target_layout(manifest, world_size // stages, zero_stage, domain=True)
        targets.append(DataParallelTarget(manifest, plan, state_plan, target, changes, mp_rank=stage))
    return TensorPipelineMerge(targets, _merged_layers(index, tag_dir, states))


def whole_stages(index: CheckpointIndex, tag_dir: Path, plans: dict[str, ReconstructionPlan], states: StateCache):
    """(the whole model's plan, its optimizer-state plan, each stage's (manifest, source domain, plan)): a stage's
    manifest is its tensor rank 0 domain's with every parameter at its whole shape, tensor degree 1, its plan the
    whole plan's tensors of its parameters. Replicated copies are compared first (CK401). ``export-universal`` writes
    its folder from the same (``universal_parallel``: each stage's parameters with its own step)."""
    stages = index.topology.degrees.pipeline
    extras, _ = extras_of(index, tag_dir, plans, states)
    whole = whole_plan(index, tag_dir, plans, extras, {})
    whole.states = states
    with ShardReader() as files:
        check_replicas(whole, files)  # a replicated copy that differs between tensor ranks or stages: CK401
    stage_of = {d.id: d.coordinate.pipeline for d in index.domains}
    ties = [p for p in index.parameters if len({stage_of[s.domain] for s in p.shards}) > 1]
    if ties:  # each stage is given one copy of a tie's moments too: every copy's must be equal (CK401)
        check_tied_copies(index.model_copy(update={"parameters": ties}), plans)
    state_plan = whole.optimizer_state_plan()
    manifests = []
    for stage in range(stages):
        first = next(d for d in index.domains if d.coordinate.pipeline == stage and d.coordinate.tensor == 0)
        by_local = {s.local_name: p for p in index.parameters for s in p.shards if s.domain == first.id}
        manifest = whole_manifest(first.manifest, by_local, {})
        manifest.layout.pipeline_parallel_size = manifest.layout.model_parallel_size = stages
        sources = {}
        for group, local in zip(manifest.groups, first.manifest.groups):
            for p, own in zip(group.params, local.params):
                if own.name.startswith(TIED_PREFIX):  # the stage's name of the tie, as a tp1 stage trains it
                    state_plan.states[own.name] = state_plan.states[p.name]
                    sources[own.name], p.name = whole.sources[p.name], own.name
                else:
                    sources[p.name] = whole.sources[p.name]
        plan = dataclasses.replace(whole, sources=sources)
        manifests.append((manifest, first, plan))
    return whole, state_plan, manifests


def _merged_layers(index: CheckpointIndex, tag_dir: Path, states: StateCache) -> dict[str, dict[str, TensorSource]]:
    """Each layer's file at tensor degree 1: tensor rank 0's keys, each its tensor ranks' saved weights composed
    as the index places the parameter, frozen parameter or buffer they are shards of (module docstring)."""
    located: dict[tuple[str, str], TensorSource] = {}
    with ShardReader() as files:
        for lf in index.layer_files:
            state = states.state(tag_dir / lf.path)
            read = lazy_reader(tag_dir / lf.path, states, files)
            for key, ref in state.items():
                source = read.located(key, ref)
                if source is None:
                    raise ReshardUnsupported(f"{lf.path}: {key!r} is not contiguous", "resume at the same layout")
                located[lf.path, key] = source
    layer_of = {f.path: f.layer for f in index.layer_files}
    tensor_of = {d.id: d.coordinate.tensor for d in index.domains}
    placed = [(p.name, p.shape, p.shards) for p in index.parameters]
    placed += [(e.name, e.shape, e.shards) for e in index.extras or ()]
    whole: dict[tuple[int, str], TensorSource] = {}  # (layer, key) -> its tensor, whole
    first: dict[str, TensorSource] = {}  # whole name -> its first layer's tensor
    for name, shape, shards in placed:
        by_layer: dict[int, list[Shard]] = {}
        for s in shards:
            by_layer.setdefault(layer_of[s.layer_file], []).append(s)
        for layer, own in sorted(by_layer.items()):  # a tie: each of its layer files' copies, on its own
            own = [s.model_copy(update={"primary": tensor_of[s.domain] == 0}) for s in own]
            source = compose_source(name, shape, [(t, located[t.layer_file, t.layer_key]) for t in own], "lp")
            whole[layer, own[0].layer_key] = source
            first.setdefault(name, source)
    aliases = dict(index.aliases or {})
    out: dict[str, dict[str, TensorSource]] = {}
    for lf in sorted((f for f in index.layer_files if f.tensor == 0), key=lambda f: f.layer):
        keys = [k for k in states.state(tag_dir / lf.path)]
        tensors = {}
        for k in keys:  # a tie's second layer on one stage: no shard of its own, the owner's copy
            held = whole.get((lf.layer, k)) or first.get(aliases.get(f"{lf.layer}.{k}", ""))
            if held is None:
                raise ReshardUnsupported(f"{lf.path}: {k!r} is placed by no parameter or extra of the index", RESUME)
            tensors[k] = held
        out[f"layer_{lf.layer:02d}-model_states.pt"] = tensors
    return out


def refuse_tensor_pipeline_merge(index: CheckpointIndex, world_size: int, zero_stage: int | None) -> None:
    """CK410 for what the merge does not write, from the index alone (module docstring)."""
    stages = index.topology.degrees.pipeline
    if zero_stage not in (None, 1):
        raise ReshardUnsupported(
            f"--stage {zero_stage} for a pipeline: DeepSpeed's PipelineEngine asserts \"ZeRO-2 and ZeRO-3 are "
            'incompatible with pipeline parallelism"',
            "give --stage 1 (or leave it out)",
        )
    if world_size < stages or world_size % stages:
        raise ReshardUnsupported(
            f"--world-size {world_size} is not a multiple of the pipeline degree {stages}, which the merge keeps",
            f"give a multiple of {stages}",
        )
    refuse_unpartitioned(index, "tensor-parallel pipelines at ZeRO-1 are merged")


def universal_entries(index: CheckpointIndex) -> dict[str, dict]:
    """Each parameter's entries beside ``param`` in a universal folder, as ``ds_to_universal`` writes them from the
    pattern lists: a split tensor's split dim (``cat_dim``), none for a replicated one (a tie's under its stage name
    too, ``tied_modules.<key>.<attribute>``, the name its folder has)."""
    out: dict[str, dict] = {}
    for p in index.parameters:
        placement = p.shards[0].placement
        out[p.name] = {"cat_dim": placement.split.axis} if isinstance(placement, SplitPlacement) else {}
        out.update({s.local_name: out[p.name] for s in p.shards if s.local_name.startswith(TIED_PREFIX)})
    return out
