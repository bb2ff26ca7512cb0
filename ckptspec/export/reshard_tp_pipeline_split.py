"""``ckptspec reshard --tensor-parallel T`` of a tensor-parallel pipeline (Megatron-style layers in a PipelineModule):
the same pipeline at another tensor degree T (more tensor ranks, or fewer than the source's but more than 1), at the
same number of stages; with ``--pipeline-parallel Q`` too.

Each stage is the merge's whole stage (``reshard_tp_pipeline.whole_stages``: tensor rank 0's domain at whole shapes,
replicated copies compared first, CK401), cut into T tensor ranks by the source's own rules as the checkpoint index
places them (``reshard_tensor_split``: a tensor split along an axis keeps it, dim 0 column-parallel, dim 1
row-parallel; a replicated one is copied whole). Each (stage, tensor rank) is written by the ZeRO writer at
``world_size / (stages x T)`` data-parallel ranks under ``mp_rank = stage x T + tensor rank``, as DeepSpeed's grid
numbers them; each layer's tensor-rank files become T ``layer_XX-model_YY-model_states.pt`` files cut from the
merged layer (``reshard_tp_pipeline._merged_layers``). The model states change as a tp T pipeline saves them:
``mp_world_size`` stages x T, ``checkpoint_parallel_dimensions`` pp stages, tp T; the client state (Megatron-
DeepSpeed's ``universal_checkpoint_info`` pattern lists: name patterns, they hold at any degree) is carried as saved.

``--pipeline-parallel Q`` too: the split at the source's stages into a temporary directory, then that tp T pipeline
moved to Q stages at its tensor degree (``reshard_tp_pipeline_stages``), as the merge then restage does.

Frozen parameters, buffers and a ``TiedLayerSpec``'s module are cut the same way, from the index's placements of them
(its extras): a frozen shard of a column-parallel layer along its axis at T, as a tp T job's own layers hold it, a
replicated frozen parameter or buffer whole in every tensor rank's layer file (each layer file's own copy: a tie's
buffer on two stages keeps each stage's), a tie's key on a layer file that holds no shard of its own (``aliases``) its
owner's, replicated; the tie's masters and moments stay under each stage's name (``tied_modules.<key>.<attribute>``).

Refused by name (CK410) before anything is written: a ZeRO stage other than 1, a world size stages x T does not
divide, a split axis T does not divide (a frozen parameter's too), a domain that is not a ZeRO-1/2 partition, a
layer-file key that is no shard of a parameter, frozen parameter or buffer of the index nor a tie of one (the rules
do not place it), and saved split rules that name shards at the source's degree (an AutoTP ``affine_map``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ..checkpoint.states import StateCache
from ..errors import ReshardUnsupported
from ..format.index_models import CheckpointIndex
from .model_plan import ReconstructionPlan, TensorSource
from .reshard_files import ModelChanges
from .reshard_tensor_split import _shard, split_axes, split_writes
from .reshard_tp_pipeline import TensorPipelineMerge, _merged_layers, refuse_tensor_pipeline_merge, whole_stages
from .reshard_tp_pipeline_stages import refuse_merge_and_stages
from .tensor_cuts import Cut


def plan_tensor_pipeline_split(
    index: CheckpointIndex,
    tag_dir: Path,
    plans: dict[str, ReconstructionPlan],
    states: StateCache,
    world_size: int,
    zero_stage: int | None,
    degree: int,
) -> TensorPipelineMerge:
    """Every (stage, tensor rank) of ``degree`` and every layer file of the split (module docstring), planned; CK410
    and CK401 before anything is written."""
    stages = index.topology.degrees.pipeline
    axes = refuse_tensor_pipeline_split(index, tag_dir, states, world_size, zero_stage, degree)
    whole, state_plan, manifests = whole_stages(index, tag_dir, plans, states)
    changes = ModelChanges(
        module={},  # a stage's module is None: its weights are the layer files'
        set_keys={
            "mp_world_size": stages * degree,
            "checkpoint_parallel_dimensions": {"pp_degree": stages, "tp_degree": degree},
        },
        drop_keys=(),
        config=lambda value: value,  # no AutoTP section: the layers split themselves
    )
    targets = []
    for stage, (manifest, _, plan) in enumerate(manifests):
        manifest.layout.model_parallel_size = stages * degree
        cut = split_writes(manifest, plan, state_plan, {}, axes, world_size // stages, zero_stage, degree)
        for tensor, write in enumerate(cut):
            targets.append(dataclasses.replace(write, changes=changes, mp_rank=stage * degree + tensor))
    return TensorPipelineMerge(targets, _split_layers(index, tag_dir, states, axes, degree))


def refuse_tensor_pipeline_split(
    index: CheckpointIndex, tag_dir: Path, states: StateCache, world_size: int, zero_stage: int | None, degree: int
) -> dict[str, Cut]:
    """CK410 for what the split does not write, from the index and the layer files' keys alone (no masters or moments
    read: ``reshard_pipeline_stage0.plan_restaged`` asks it of a stage-0 source planned as the ZeRO-1 pipeline it is
    written as first); the split axes (name -> cut) otherwise."""
    stages = index.topology.degrees.pipeline
    if world_size < stages * degree or world_size % (stages * degree):
        raise ReshardUnsupported(
            f"--world-size {world_size} is not a multiple of the pipeline degree {stages} x --tensor-parallel {degree}",
            f"give a multiple of {stages * degree}: each data-parallel rank holds one copy of the {stages} stages' "
            f"{degree} tensor ranks",
        )
    refuse_tensor_pipeline_merge(index, world_size, zero_stage)
    _refuse_unplaced(index, tag_dir, states)
    extras = {e.name: (list(e.shape), [(s, None) for s in e.shards]) for e in index.extras or ()}
    return split_axes(index, extras, degree)  # the source's placements: CK410 for an axis ``degree`` does not divide


def _split_layers(
    index: CheckpointIndex, tag_dir: Path, states: StateCache, axes: dict[str, Cut], degree: int
) -> dict[str, dict[str, TensorSource]]:
    """Each layer's ``degree`` tensor-rank files: the merged layer's tensors, each cut as the parameter it holds."""
    names = _layer_parameters(index)
    out: dict[str, dict[str, TensorSource]] = {}
    for merged, tensors in _merged_layers(index, tag_dir, states).items():
        layer = int(merged.split("-")[0].removeprefix("layer_"))
        for tensor in range(degree):
            out[f"layer_{layer:02d}-model_{tensor:02d}-model_states.pt"] = {
                key: _shard(source, axes.get(names[layer, key]), tensor, degree) for key, source in tensors.items()
            }
    return out


def _layer_parameters(index: CheckpointIndex) -> dict[tuple[int, str], str]:
    """(layer, key of its tensor rank 0 file) -> the parameter, frozen parameter or buffer whose shard that key
    holds; a tie's key on a layer that holds no shard of its own (``aliases``): its owner's."""
    layer_of = {f.path: f.layer for f in index.layer_files if f.tensor == 0}
    placed = [(p.name, p.shards) for p in index.parameters] + [(e.name, e.shards) for e in index.extras or ()]
    out = {
        (layer_of[s.layer_file], s.layer_key): name
        for name, shards in placed
        for s in shards
        if s.layer_file in layer_of
    }
    for tie, owner in (index.aliases or {}).items():
        layer, _, key = tie.partition(".")
        if layer.isdigit():  # a pipeline's names: ``<layer>.<key>``
            out.setdefault((int(layer), key), owner)
    return out


def _refuse_unplaced(index: CheckpointIndex, tag_dir: Path, states: StateCache) -> None:
    """CK410 for what the saved rules do not place: a layer-file key that is no parameter's, frozen parameter's or
    buffer's shard and no tie of one (``_layer_parameters``), an AutoTP ``affine_map``."""
    placed = _layer_parameters(index)
    for lf in (f for f in index.layer_files if f.tensor == 0):
        for key in states.state(tag_dir / lf.path):
            if (lf.layer, key) not in placed:
                raise ReshardUnsupported(
                    f"{lf.path}: {key!r} is no shard of a parameter, frozen parameter or buffer of the index, nor a "
                    "tie of one: the saved split rules do not place it",
                    "resume at the same tensor degree",
                )
    for d in index.domains:
        model = next(f.path for f in d.manifest.files if f.role == "model_states")
        info = states.state(tag_dir / model).get("universal_checkpoint_info")
        if isinstance(info, dict) and info.get("affine_map"):
            raise ReshardUnsupported(
                f"{model}: universal_checkpoint_info holds an affine_map, which names each shard at the source's "
                "tensor degree",
                "resume at the same tensor degree",
            )


def refuse_split_and_stages(
    index: CheckpointIndex, world_size: int, degree: int, stages: int, partition_method: str | None
) -> None:
    """CK410 for ``--tensor-parallel T --pipeline-parallel Q`` before anything is written, beyond the split's own
    refusals (checked by planning it): what the merge then restage refuses, a world size Q x T does not divide."""
    refuse_merge_and_stages(index, world_size, stages, partition_method)
    if world_size % (stages * degree):
        raise ReshardUnsupported(
            f"--world-size {world_size} is not a multiple of --pipeline-parallel {stages} x --tensor-parallel {degree}",
            f"give a multiple of {stages * degree}",
        )
