"""The consolidated optimizer state of a ZeRO checkpoint, per parameter, from format 1.1's locators.

Each rank's partition of each per-element state (``exp_avg``, ``exp_avg_sq``, ...) has the element
positions of the group's master partition (``files[].state_partitions``), so a parameter's state
is assembled exactly as its master is (``format.partition.param_pieces``) and viewed in its
shape. This is not DeepSpeed's ``safe_get_full_optimizer_state``, whose ``_hp_mapping`` ignores
``round_robin_gradients`` and returns another parameter's state there (docs/reconstruct.md).

``optimizer.safetensors`` holds ``<param>.<state>`` tensors as stored (no cast; tied aliases are
their owner's, named once), and in ``__metadata__`` the per-group scalars of the manifest's
``optimizer`` object (class, hyperparameters, step, loss scaler, gradient clipping).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ReconstructMismatch, ReconstructUnsupported
from ..format.dtypes import ITEMSIZE
from ..format.partition import param_pieces
from ..location import RemotePath
from .arrays import ShardReader, read_array, stream
from .model_plan import ModelPlan, ReconstructionPlan, Segment, TensorSource
from .plan import _inside
from .safetensors_writer import SafetensorsWriter, TensorEntry

OPTIMIZER_FILE = "optimizer.safetensors"


@dataclass
class OptimizerStatePlan:
    sources: dict[str, TensorSource]  # "<param>.<state>" -> the state in the param's shape
    states: dict[str, dict[str, str]]  # param -> state -> output name
    metadata: dict[str, str]


def plan_optimizer_state(plan: ReconstructionPlan) -> OptimizerStatePlan:
    """Byte ranges of every parameter's optimizer state; CK402 when the manifest locates none."""
    manifest, tag_dir = plan.manifest, plan.tag_dir
    located: dict[tuple[int, int, str], tuple[Path | RemotePath, Any]] = {}
    for shard in manifest.files:
        for loc in shard.state_partitions or ():
            located[(loc.group, loc.rank, loc.state)] = (_inside(tag_dir, shard.path), loc)
    if not located or manifest.optimizer is None:
        raise ReconstructUnsupported(
            "the manifest locates no optimizer state",
            "use a format 1.1 manifest: `ckptspec generate CHECKPOINT` (or `ckptspec migrate M --to 1.1 --checkpoint "
            "CHECKPOINT`)",
        )
    sources: dict[str, TensorSource] = {}
    states: dict[str, dict[str, str]] = {}
    for g, group in enumerate(manifest.groups):
        keys = sorted({s for (gg, _, s) in located if gg == g})
        for p in group.params:
            pieces = param_pieces(
                group.partitioning, group.partition_count, group.partition_numel, p.offset, p.numel, p.padding
            )
            for key in keys:
                segments = []
                for rank, start, count in pieces:
                    if (g, rank, key) not in located:
                        raise ReconstructMismatch(f"no partition of state {key!r} of group {g} on rank {rank}")
                    path, loc = located[(g, rank, key)]
                    if start + count > loc.numel:
                        raise ReconstructMismatch(f"{p.name}: state {key!r} ends past rank {rank}'s partition", path)
                    item = ITEMSIZE[loc.dtype]
                    segments.append(Segment(path, loc.data_offset + (loc.element_offset + start) * item, count * item))
                dtype = next(loc.dtype for (gg, _, s), (_, loc) in located.items() if (gg, s) == (g, key))
                name = f"{p.name}.{key}"
                if name in sources or name in plan.sources:
                    raise ReconstructUnsupported(f"{name!r} names two tensors", "rename the parameter")
                digest = (p.state_digests or {}).get(key)
                sources[name] = TensorSource(
                    name, tuple(p.shape), dtype, segments, "state", digest.sha256 if digest is not None else None
                )
                states.setdefault(p.name, {})[key] = name
    groups = {p.name: group.optimizer_group for group in manifest.groups for p in group.params}
    metadata = {
        "format": "pt",
        "ckptspec.format_version": manifest.format_version,
        "ckptspec.tag": tag_dir.name,
        "ckptspec.optimizer": json.dumps(manifest.optimizer.model_dump(mode="json", by_alias=True, exclude_unset=True)),
        "ckptspec.optimizer_groups": json.dumps(groups, sort_keys=True),
        "ckptspec.states": json.dumps(states, sort_keys=True),
        "ckptspec.aliases": json.dumps({a: o for a, o in plan.aliases.items() if o in states}, sort_keys=True),
    }
    return OptimizerStatePlan(sources, states, metadata)


def optimizer_state_plan(plan: ModelPlan) -> OptimizerStatePlan:
    """Every parameter's optimizer state: a ZeRO plan's from its manifest's locators (CK402 without them),
    a checkpoint index's composed by its whole-model plan (export/compose_plan.py)."""
    if hasattr(plan, "optimizer_state_plan"):
        return plan.optimizer_state_plan()
    assert isinstance(plan, ReconstructionPlan), type(plan)
    return plan_optimizer_state(plan)


def optimizer_state_temporary(
    plan: ModelPlan, output_dir: Path, files: ShardReader, progress: Callable[[int], None]
) -> tuple[Path, Path]:
    """``optimizer.safetensors`` written under a temporary name in ``output_dir``: (temporary, final).

    ``write_consolidated(..., optimizer_state=True)`` calls it inside its run, so the file is
    committed with the weights, in the same journal: a directory never holds new weights beside
    an earlier run's optimizer state.
    """
    state = optimizer_state_plan(plan)
    target = output_dir / OPTIMIZER_FILE
    entries = [TensorEntry(name, src.dtype, src.shape) for name, src in state.sources.items()]
    writer = SafetensorsWriter(target, entries, state.metadata)
    try:
        files.plan(seg for entry in entries for seg in state.sources[entry.name].segments)  # remote: fetched ahead
        for entry in entries:
            writer.begin(entry.name)
            stream(state.sources[entry.name], entry.dtype, writer, files, progress)
        writer.finish()
    except BaseException:
        writer.abort()
        raise
    return writer.tmp_path, target


def load_optimizer_state_arrays(plan: ModelPlan) -> tuple[dict[str, dict[str, Any]], dict]:
    """{param: {state: numpy array in the param's shape}} (aliases included) and the ``optimizer`` object."""
    state = optimizer_state_plan(plan)
    out: dict[str, dict[str, Any]] = {}
    with ShardReader(plan.file_hashes) as files:  # a remote file's recorded hash, from the bytes read once
        files.plan(
            seg for names in state.states.values() for name in names.values() for seg in state.sources[name].segments
        )
        for param, names in state.states.items():
            out[param] = {
                key: read_array(state.sources[name], state.sources[name].dtype, files) for key, name in names.items()
            }
        files.verify()
    for alias, owner in plan.aliases.items():
        if owner in out:
            out[alias] = out[owner]
    return out, json.loads(state.metadata["ckptspec.optimizer"])
