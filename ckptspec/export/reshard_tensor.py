"""``ckptspec reshard --tensor-parallel 1``: an AutoTP ZeRO checkpoint merged for a job without tensor parallelism.

The checkpoint index places every shard of every whole tensor (row- or column-parallel splits, replicated copies:
``compose_plan``); the whole model's fp32 masters, Adam moments and module weights are composed from them, then
written as one ZeRO data-parallel checkpoint at the target world size by the same writer as any ZeRO reshard
(``reshard_files.write_files``): the target's groups are tensor rank 0's in its parameter order (AutoTP keeps the
model's parameters and names, only their shapes change), each parameter at its whole shape.

The module's low-precision weights are the saved ones, merged (not re-cast from the masters); a ZeRO-3 source's
module holds placeholders, so its weights are the whole masters cast to the model dtype (as the plain stage 3 -> 1/2
reshard writes them, and what stage 1/2 rebuilds them from on load); at stage 3 (its default) the whole model is
written by the plain ZeRO-3 writer (``reshard_stage3``) with the same ``ModelChanges`` (frozen parameters' fragments
and ``frozen_param_shapes`` at their whole shapes). Frozen parameters and buffers are the index's whole ones. What a
job without tensor parallelism saves differs from an AutoTP job's in four entries, set here (``ModelChanges``):
``mp_world_size`` 1, ``checkpoint_parallel_dimensions`` tp 1, no ``universal_checkpoint_info`` (its patterns and
affine map describe tp shards) and no ``tensor_parallel`` section in the saved ``ds_config``. Replicated copies are
compared before anything is written (CK401).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..checkpoint.states import StateCache
from ..errors import ReshardUnsupported
from ..format.index_models import CheckpointIndex, IndexParameter
from ..format.models import Manifest
from .arrays import ShardReader
from .compose import check_replicas
from .compose_extras import extras_of
from .compose_plan import compose_source, whole_plan
from .model_plan import ModelPlan, ReconstructionPlan, TensorSource
from .optimizer_state import OptimizerStatePlan
from .reshard_files import ModelChanges, lazy_reader, write_files
from .reshard_layout import TargetLayout, target_layout
from .reshard_source import SourceOptimizer

# What an AutoTP job's files hold that a job without tensor parallelism does not save.
AUTOTP_ONLY_KEYS = ("universal_checkpoint_info",)


@dataclass
class DataParallelTarget:
    """Everything a data-parallel ZeRO-1/2 checkpoint made of another kind is written from (an AutoTP merge, a
    stage-0 source: ``reshard_stage0_source``), planned before anything is written."""

    manifest: Manifest  # the whole model's ZeRO domain: tensor rank 0's, every tensor at its whole shape
    plan: ModelPlan  # the fp32 masters, frozen parameters and buffers it is written from
    state_plan: OptimizerStatePlan  # the whole model's optimizer states
    target: TargetLayout
    changes: ModelChanges
    source: SourceOptimizer | None = None  # made when the source has no ZeRO-1/2 optimizer files
    mp_rank: int | None = None  # the tensor rank of the written files' names (``reshard_tensor_split``)
    sub_group_size: int | None = None  # a ZeRO-3 target's (default: a ZeRO-3 source's, else DeepSpeed's)

    @property
    def zero_stage(self) -> int:
        return self.target.zero_stage

    def write(self, states: StateCache, tag_dir: Path) -> list[Path]:
        if self.target.zero_stage == 0:  # for a stage-0 job: one model-states file (a tensor rank's)
            from .reshard_stage0 import write_stage0_files

            args = (self.manifest, self.plan, self.state_plan, self.target, states, tag_dir)
            return write_stage0_files(*args, self.changes, self.mp_rank, self.source)
        if self.target.zero_stage == 3:  # an AutoTP merge or split to stage 3
            from .reshard_stage3 import write_stage3_files

            return write_stage3_files(
                self.manifest,
                self.plan,
                self.state_plan,
                self.target,
                states,
                tag_dir,
                self.sub_group_size,
                self.changes,
                self.mp_rank,
                source=self.source,
            )
        return write_files(
            self.manifest,
            self.plan,
            self.state_plan,
            self.target,
            states,
            tag_dir,
            self.changes,
            mp_rank=self.mp_rank,
            source=self.source,
        )


def plan_tensor_merge(
    index: CheckpointIndex,
    tag_dir: Path,
    plans: dict[str, ReconstructionPlan],
    states: StateCache,
    world_size: int,
    zero_stage: int | None,
    sub_group_size: int | None = None,
) -> DataParallelTarget:
    """The merge of ``index``'s tensor-parallel domains into one data-parallel group of ``world_size`` ranks (a
    ZeRO-3 source's at stage 3 by default, cut into sub-groups of ``sub_group_size``); CK410 for a source it
    cannot merge, CK401 where replicated copies differ: before anything is written."""
    refuse_unmergeable(index, world_size)
    manifest, whole, _, module = whole_model(index, tag_dir, plans, states)
    target = target_layout(manifest, world_size, zero_stage, sub_group_size, domain=True, writes_stage0=True)
    if target.zero_stage == 0:  # what a stage-0 checkpoint could not describe (ties, frozen parameters...)
        from .reshard_stage0 import module_order, refuse_stage0, source_osd

        # frozen parameters: told from the masters by their whole shapes in tensor rank 0's module order
        refuse_stage0(manifest, source_osd(manifest, whole, states), module_order(manifest, whole, states))
    changes = ModelChanges(
        module=module,
        set_keys={"mp_world_size": 1, "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1}},
        drop_keys=AUTOTP_ONLY_KEYS,
        config=without_tensor_parallel,
    )
    state_plan = whole.optimizer_state_plan()
    return DataParallelTarget(manifest, whole, state_plan, target, changes, sub_group_size=sub_group_size)


def whole_model(index: CheckpointIndex, tag_dir: Path, plans: dict[str, ReconstructionPlan], states: StateCache):
    """The AutoTP checkpoint ``index`` as one model: (tensor rank 0's manifest at whole shapes, the whole plan, the
    frozen parameters and buffers (``extras_of``), the module's saved weights merged). Replicated copies are
    compared first (CK401)."""
    first = next(d for d in index.domains if d.coordinate.tensor == 0)
    extras, ties = extras_of(index, tag_dir, plans, states)
    whole = whole_plan(index, tag_dir, plans, extras, ties)
    whole.states = states
    with ShardReader() as files:
        check_replicas(whole, files)  # a replicated copy that differs between tensor ranks: CK401
    by_local = {s.local_name: p for p in index.parameters for s in p.shards if s.domain == first.id}
    manifest = whole_manifest(first.manifest, by_local, {name: shape for name, (shape, _) in extras.items()})
    if first.manifest.layout.zero_stage == 3:  # its module holds placeholders: the weights are the masters, cast
        saved = {n: s for n, s in whole.sources.items() if s.role == "trainable"}
    else:
        saved = _merged_module(index, plans, tag_dir, states)
    module = {**saved, **{n: whole.sources[n] for n in extras}}
    return manifest, whole, extras, module


def refuse_unmergeable(index: CheckpointIndex, world_size: int) -> None:
    """CK410: what an AutoTP merge or split does not read, by name: ZeRO-1/2 sources are read, and ZeRO-3 ones
    (every domain a ZeRO-3 partition)."""
    degrees = index.topology.degrees
    if degrees.pipeline != 1 or index.expert_files:
        raise ReshardUnsupported(
            f"another --tensor-parallel degree of a pipeline or MoE checkpoint (pp {degrees.pipeline}) is not "
            "supported yet",
            "AutoTP checkpoints (pipeline degree 1, no experts) are merged and split; a tensor-parallel pipeline is "
            "merged (--tensor-parallel 1)",
        )
    if not all_zero3_partitions(index):
        refuse_unpartitioned(index, "tensor-parallel ZeRO-1/2 checkpoints, or ZeRO-3 ones, are merged so far")
    if world_size < 1:
        raise ReshardUnsupported(f"--world-size must be at least 1, not {world_size}", "give a positive world size")


def all_zero3_partitions(index: CheckpointIndex) -> bool:
    """Every domain a ZeRO-3 partition with its masters in its own files (what the ZeRO-3 writers read)."""
    return all(d.masters is None and d.manifest.layout.zero_stage == 3 for d in index.domains)


def refuse_unpartitioned(index: CheckpointIndex, what_is_written: str) -> None:
    """CK410 for a domain that is not a ZeRO stage 1 or 2 partition (ZeRO-3, or masters located apart)."""
    for d in index.domains:
        if d.masters is not None or d.manifest.layout.zero_stage not in (1, 2):
            raise ReshardUnsupported(
                f"domain {d.id} is not a ZeRO stage 1 or 2 partition (stage {d.manifest.layout.zero_stage}); "
                f"{what_is_written}",
                "resume at the same layout",
            )


def whole_manifest(
    local: Manifest, by_local: dict[str, IndexParameter], frozen_shapes: dict[str, list[int]]
) -> Manifest:
    """``local`` (tensor rank 0's domain) with every parameter and frozen parameter at its whole shape and name,
    tensor degree 1. Its group offsets no longer describe files: it is read for the order, dtypes, groups,
    optimizer and templates only (``target_layout``, ``write_files``)."""
    out = local.model_copy(deep=True)
    for group in out.groups:
        for p in group.params:
            whole = by_local.get(p.name)
            if whole is None:
                raise ReshardUnsupported(
                    f"{p.name} of domain tensor 0 is not a parameter of the checkpoint index",
                    "regenerate the index: `ckptspec generate CHECKPOINT`",
                )
            p.name, p.shape, p.numel = whole.name, list(whole.shape), math.prod(whole.shape)
            p.digest = p.model_digest = p.state_digests = None  # type: ignore[assignment]  # of the shard
    for f in out.frozen:
        if f.name in frozen_shapes:
            f.shape, f.numel, f.digest = list(frozen_shapes[f.name]), math.prod(frozen_shapes[f.name]), None  # type: ignore[assignment]
    out.layout.tensor_parallel_size = 1
    return out


def _merged_module(
    index: CheckpointIndex, plans: dict[str, ReconstructionPlan], tag_dir: Path, states: StateCache
) -> dict[str, TensorSource]:
    """Every trainable parameter's saved low-precision weight, whole: its shards' module tensors composed as
    the index places them (a replicated one: its primary copy)."""
    located = {}
    with ShardReader() as files:
        for d in index.domains:
            model = next(f.path for f in d.manifest.files if f.role == "model_states")
            module = states.state(tag_dir / model)["module"] or {}
            read = lazy_reader(tag_dir / model, states, files)
            located[d.id] = {name: read.located(name, ref) for name, ref in module.items()}
    out = {}
    for p in index.parameters:
        shards = []
        for s in p.shards:
            source = located[s.domain].get(s.local_name)
            if source is None:
                raise ReshardUnsupported(
                    f"{p.name}: domain {s.domain}'s module holds no contiguous {s.local_name}",
                    "resume at the same layout",
                )
            shards.append((s, source))
        out[p.name] = compose_source(p.name, p.shape, shards, "lp")
    return out


def without_tensor_parallel(config: Any) -> Any:
    """The saved ``ds_config`` as a job without tensor parallelism's: no ``tensor_parallel`` section."""
    if isinstance(config, dict):
        return {k: v for k, v in config.items() if k != "tensor_parallel"}
    return config
