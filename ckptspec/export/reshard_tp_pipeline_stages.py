"""``ckptspec reshard --pipeline-parallel N`` of a tensor-parallel pipeline (Megatron-style layers in a PipelineModule
over a PipeModelDataParallelTopology), keeping its tensor degree; with ``--tensor-parallel 1`` too.

Each tensor rank's stages and layer files are a pipeline of their own (``describe/tp_pipeline.py``): its domains
hold its shards of the stage's parameters under their local names and shapes, its layer files
(``layer_XX-model_YY-model_states.pt``) its shards of the layers' tensors. Each tensor rank's pipeline is moved to
``N`` stages by the pipeline reshard (``reshard_pipeline.pipeline_target``/``write_stages``: the same rules,
refusals and writer), at ``world_size / tp`` ranks, its files named ``mp_rank = stage * tp + tensor`` as
DeepSpeed's grid numbers them, the model states' ``mp_world_size`` = N x tp and ``checkpoint_parallel_dimensions``
pp N, tp kept. The layer files carry over as saved: their names depend on the layer and the tensor rank, not on
the stage. Every tensor rank must give the same stages (DeepSpeed's ``_partition_layers`` weighs each rank's own
shards: equal shapes on every tensor rank give equal stages); CK410 otherwise.

``--tensor-parallel 1 --pipeline-parallel N``: the tensor ranks are merged at the source's stages
(``reshard_tp_pipeline``) into a temporary directory, whose tp1 pipeline is then moved to ``N`` stages as above
(``reshard_model_parallel`` of it): the two steps the output of each of which a job loads. Refused by name (CK410)
before anything is written to the output: what the merge refuses, a world size that is not a multiple of ``N``,
more stages than layers; what the second step refuses (its partition of the merged layers) before the output is
written.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..checkpoint.states import StateCache
from ..errors import ReshardUnsupported
from ..format.index_models import CheckpointIndex, Shard
from .optimizer_state import plan_optimizer_state
from .reshard_pipeline import PARTITION_METHODS, PipelineTarget, pipeline_target, write_stages


@dataclass
class TensorRankStages:
    """One tensor rank's pipeline at the target's stages."""

    target: PipelineTarget
    tensor: int
    tensor_degree: int
    index: CheckpointIndex  # the tensor rank's pipeline (``tensor_rank_pipeline``)
    plans: dict  # its domains' plans

    @property
    def zero_stage(self) -> int:
        return self.target.zero_stage

    def write(self, states: StateCache, tag_dir: Path) -> list[Path]:
        state_plans = {key: plan_optimizer_state(plan) for key, plan in self.plans.items()}
        return write_stages(
            self.target, self.index, self.plans, state_plans, states, tag_dir, self.tensor, self.tensor_degree
        )


def is_tensor_pipeline(index: CheckpointIndex) -> bool:
    """A pipeline whose layer files are per tensor rank (``layer_XX-model_YY``)."""
    return index.topology.degrees.tensor != 1 and any(f.tensor is not None for f in index.layer_files)


def tensor_rank_pipeline(index: CheckpointIndex, tensor: int) -> CheckpointIndex:
    """Tensor rank ``tensor``'s stages and layer files as a pipeline of tensor degree 1 (local names and shapes: its
    domains' manifests; its ties, frozen parameters and buffers: ``_own_shards``)."""
    degrees = index.topology.degrees.model_copy(update={"tensor": 1})
    topology = index.topology.model_copy(
        update={"degrees": degrees, "model_parallel_size": degrees.pipeline, "ranks": None}
    )
    return index.model_copy(
        update={
            "topology": topology,
            "domains": [d for d in index.domains if d.coordinate.tensor == tensor],
            "layer_files": [f.model_copy(update={"tensor": None}) for f in index.layer_files if f.tensor == tensor],
            "parameters": _own_shards(index.parameters, index, tensor, ties_only=True),
            "extras": _own_shards(index.extras or [], index, tensor) or None,
        }
    )


def _own_shards(items: list, index: CheckpointIndex, tensor: int, ties_only: bool = False) -> list:
    """The whole model's parameters (``ties_only``: those on several stages, a ``TiedLayerSpec``'s) or extras as
    tensor rank ``tensor``'s pipeline holds them: its shards, at its local shape, whole on one stage or replicated
    over the stages running a tie (the whole one's primary stage primary)."""
    tensor_of = {d.id: d.coordinate.tensor for d in index.domains}
    stage_of = {d.id: d.coordinate.pipeline for d in index.domains}
    out = []
    for item in items:
        own = [s for s in item.shards if tensor_of[s.domain] == tensor]
        if ties_only and len(own) < 2:
            continue
        primary = next((stage_of[s.domain] for s in item.shards if s.primary), stage_of[own[0].domain])
        shards = []
        for s in own:
            kept = s.model_dump(exclude_unset=True, exclude={"placement", "primary"})
            tie = {"placement": "replicated", "primary": stage_of[s.domain] == primary}
            shards.append(Shard.model_validate({**kept, **(tie if len(own) > 1 else {"placement": "whole"})}))
        out.append(item.model_copy(update={"shape": list(own[0].local_shape), "shards": shards}))
    return out


def plan_tensor_pipeline_stages(
    index: CheckpointIndex,
    src_dir: Path,
    plans: dict,
    states: StateCache,
    world_size: int,
    zero_stage: int | None,
    stages: int,
    partition_method: str | None,
    stage0_source: bool = False,
) -> list[TensorRankStages]:
    """Every tensor rank's pipeline at ``stages`` stages (module docstring); CK410 before anything is written.
    ``stage0_source``: a stage-0 one planned as the ZeRO-1 pipeline it is written as first (``pipeline_target``'s)."""
    tp = index.topology.degrees.tensor
    if world_size % (tp * stages):
        raise ReshardUnsupported(
            f"--world-size {world_size} is not a multiple of --pipeline-parallel {stages} x the tensor degree {tp}, "
            "which is kept",
            f"give a multiple of {tp * stages}",
        )
    out: list[TensorRankStages] = []
    for tensor in range(tp):
        own = tensor_rank_pipeline(index, tensor)
        own_plans = {d.id: plans[d.id] for d in own.domains}
        target = pipeline_target(
            own, stages, world_size // tp, zero_stage, partition_method, states, src_dir, own_plans, stage0_source
        )
        if out and [s.layers for s in target.stages] != [s.layers for s in out[0].target.stages]:
            raise ReshardUnsupported(
                f"--pipeline-parallel {stages}: tensor rank {tensor}'s stages "
                f"{[list(s.layers) for s in target.stages]} are not tensor rank 0's "
                f"{[list(s.layers) for s in out[0].target.stages]} (partition method {target.partition_method!r})",
                "give --partition-method uniform",
            )
        out.append(TensorRankStages(target, tensor, tp, own, own_plans))
    return out


def refuse_merge_and_stages(index: CheckpointIndex, world_size: int, stages: int, partition_method: str | None) -> None:
    """CK410 for ``--tensor-parallel 1 --pipeline-parallel N`` before anything is written, beyond the merge's own
    refusals (checked by planning it)."""
    layers = len({f.layer for f in index.layer_files})
    if partition_method not in (None, *PARTITION_METHODS):
        raise ReshardUnsupported(
            f"--partition-method {partition_method!r} is not supported",
            f"give one of {', '.join(PARTITION_METHODS)} (DeepSpeed's PipelineModule partition_method)",
        )
    if world_size % stages:
        raise ReshardUnsupported(
            f"--world-size {world_size} is not a multiple of --pipeline-parallel {stages}",
            f"give a multiple of {stages}: each data-parallel rank holds one copy of the {stages} stages",
        )
    if stages > layers:
        raise ReshardUnsupported(
            f"--pipeline-parallel {stages}: the pipeline has {layers} layers, fewer than the stages",
            f"give at most {layers} stages",
        )
