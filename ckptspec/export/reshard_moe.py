"""``ckptspec reshard`` of a MoE ZeRO-1/2 checkpoint (DeepSpeed's ``deepspeed.moe.layer.MoE``) to another world size.

The expert-parallel degree E stays as it is. A MoE job of W ranks partitions two kinds of optimizer group:
- the dense group, over all W ranks;
- each expert group (``moe: True``, named ``ep_size_E``), over the W / E ranks of its expert-data-parallel group.
Expert-parallel rank ``r % E`` holds experts ``e*L .. e*L+L-1`` (L local experts), named locally ``0 .. L-1``.
Rank r's optimizer-state file holds the dense group's partition ``r`` and its experts' group's partition
``r // E``.

The checkpoint index gives one domain per partitioning: ``dense``, and ``expert:ep_size_E:ep<e>`` with the experts'
global names. Each domain is laid out anew at its target size (``target_layout``). Its masters and moments are
located by the index (``masters_state_plan``). Its names in the files are the rank's local ones.

What stays as saved:
- the expert files (one per global expert, whatever the world size): copied;
- the model states: rank 0's, with ``dp_world_size`` and the dense flat buffer re-laid (``_model_states``);
- ``param_shapes``: rank 0's groups, the same at any world size for the same E.
Refused by name (CK410): another expert degree, a world size E does not divide, tensor/pipeline parallelism with
experts, ZeRO-3 and stage 0 (their own kinds) and ``--stage 3``.
"""

from __future__ import annotations

import collections
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..checkpoint.states import StateCache
from ..errors import ReshardUnsupported
from ..format.index_models import CheckpointIndex, Domain
from ..format.models import Optimizer
from . import ds_pickle
from .arrays import ShardReader
from .masters_state import masters_state_plan
from .model_plan import ReconstructionPlan
from .optimizer_state import OptimizerStatePlan
from .reshard_files import (
    _lazy_partition,
    _model_states,
    _no_tensor,
    _optim_file_names,
    _slice_mappings,
    _storage_reader,
    lazy_reader,
)
from .reshard_layout import TargetLayout, natural_groups, target_layout
from .reshard_source import with_stage

_EXPERT = re.compile(r"(deepspeed_experts\.)(\d+)(\.)")


@dataclass
class MoePart:
    """One domain's partitioning at the target: its groups under the names the rank's files use."""

    domain: Domain
    target: TargetLayout
    masters: dict  # local name -> its master's bytes
    states: dict[str, dict[str, str]]  # local name -> state -> the state plan's source name
    state_plan: OptimizerStatePlan
    natural: list[list[str]]  # each group's local names in model order (param_slice_mappings)


@dataclass
class MoeTarget:
    index: CheckpointIndex
    world_size: int
    zero_stage: int
    dense: MoePart
    experts: list[MoePart]  # by expert-parallel rank

    def write(self, states: StateCache, tag_dir: Path, src_dir: Path) -> list[Path]:
        return _write(self, states, tag_dir, src_dir)


def plan_moe(
    index: CheckpointIndex,
    tag_dir: Path,
    plans: dict[str, ReconstructionPlan],
    states: StateCache,
    world_size: int,
    zero_stage: int | None,
    expert_parallel: int | None = None,
) -> MoeTarget:
    """The MoE checkpoint ``index`` at ``world_size`` ranks (and ``zero_stage``); CK410 before anything is written."""
    degrees = index.topology.degrees
    ep = degrees.expert
    _refuse(index, world_size, zero_stage, expert_parallel)
    stage = zero_stage if zero_stage is not None else index.domains[0].configured_zero_stage
    local = _local_names(index)
    dense = next(d for d in index.domains if d.coordinate.expert is None)
    experts = sorted((d for d in index.domains if d.coordinate.expert is not None), key=lambda d: d.coordinate.expert)
    return MoeTarget(
        index,
        world_size,
        stage,
        _part(dense, tag_dir, plans[dense.id], states, world_size, stage, {}),
        [_part(d, tag_dir, plans[d.id], states, world_size // ep, stage, local) for d in experts],
    )


def _refuse(index: CheckpointIndex, world_size: int, zero_stage: int | None, expert_parallel: int | None) -> None:
    degrees = index.topology.degrees
    if degrees.tensor != 1 or degrees.pipeline != 1:
        raise ReshardUnsupported(
            f"a MoE checkpoint of tensor {degrees.tensor} x pipeline {degrees.pipeline} degrees is not resharded yet",
            "data-parallel MoE checkpoints (ZeRO-1/2) are",
        )
    if expert_parallel not in (None, degrees.expert):
        raise ReshardUnsupported(
            f"--expert-parallel {expert_parallel}: changing the expert-parallel degree ({degrees.expert}) is not "
            "supported yet",
            f"give --expert-parallel {degrees.expert} (or leave it out): the data axis is what is moved",
        )
    if world_size < 1 or world_size % degrees.expert:
        raise ReshardUnsupported(
            f"--world-size {world_size} is not a multiple of the expert-parallel degree ({degrees.expert})",
            f"give a multiple of {degrees.expert}: each expert-parallel group spans {degrees.expert} ranks",
        )
    for d in index.domains:
        if d.configured_zero_stage not in (1, 2) or d.masters is None or d.masters.stored_in != "optimizer_states":
            raise ReshardUnsupported(
                f"domain {d.id} is not a ZeRO stage 1 or 2 partition (stage {d.configured_zero_stage}); MoE "
                "checkpoints at ZeRO-1/2 are resharded so far",
                "resume at the same layout",
            )
    if zero_stage not in (None, 1, 2):
        raise ReshardUnsupported(f"--stage {zero_stage} for a MoE checkpoint: stage 1 and 2 are written", "give 1 or 2")


def _local_names(index: CheckpointIndex) -> dict[str, str]:
    """Every expert parameter's global name -> the name its expert-parallel rank's module gives it."""
    local_of = {f.expert: f.local_expert for f in index.expert_files or ()}
    out = {}
    for p in index.parameters:
        match = _EXPERT.search(p.name)
        if match and int(match.group(2)) in local_of:
            j = local_of[int(match.group(2))]
            out[p.name] = p.name[: match.start()] + f"{match.group(1)}{j}{match.group(3)}" + p.name[match.end() :]
    return out


def _part(domain: Domain, tag_dir: Path, plan, states: StateCache, size: int, stage: int, local) -> MoePart:
    state_plan = masters_state_plan(tag_dir, domain, states)
    manifest = domain.manifest.model_copy(deep=True)
    manifest.layout.zero_stage = stage  # read for the order, dtypes and groups only
    manifest.optimizer = Optimizer.model_validate_json(state_plan.metadata["ckptspec.optimizer"])
    for group in manifest.groups:
        for p in group.params:
            p.name = local.get(p.name, p.name)
    target = target_layout(manifest, size, stage, domain=True)
    to_global = {local.get(n, n): n for n in state_plan.states}
    masters = {name: plan.sources[to_global[name]] for g in target.groups for name in (p.name for p in g.params)}
    moments = {name: state_plan.states[to_global[name]] for name in masters}
    natural = [[p.name for p in params] for _, params in natural_groups(manifest)]
    return MoePart(domain, target, masters, moments, state_plan, natural)


def _write(moe: MoeTarget, states: StateCache, tag_dir: Path, src_dir: Path) -> list[Path]:
    """Each rank's optimizer-state file, the model states, the expert files."""
    dense, ep = moe.dense, len(moe.experts)
    first = next(p for p, r in dense.domain.file_ranks.items() if r == 0 and "optim_states" in p)
    template = states.state(src_dir / first)
    osd = template["optimizer_state_dict"]
    base = osd["base_optimizer_state"]
    written = []
    with ShardReader() as files:
        read = _storage_reader(src_dir / first, states, files)
        for rank, name in enumerate(_optim_file_names(first, moe.world_size)):
            parts = [(dense, rank), (moe.experts[rank % ep], rank // ep)]
            out = _rank_osd(osd, base, parts, moe.zero_stage, read, files)
            doc = {
                k: out
                if k == "optimizer_state_dict"
                else ds_pickle.from_standins(with_stage(v, moe.zero_stage), read)
                if k == "ds_config"
                else ds_pickle.from_standins(v, read)
                for k, v in template.items()
            }
            ds_pickle.save_streamed(doc, tag_dir / name)
            written.append(tag_dir / name)
        model = next(p for p in dense.domain.file_ranks if "model_states" in p)
        lazy = lazy_reader(src_dir / model, states, files)
        found = dense.domain.manifest.model_copy(deep=True)
        found.layout.zero_stage = moe.zero_stage
        saved = states.state(src_dir / model)
        doc = _model_states(saved, found, dense.target, lazy, {}, files)
        doc["ds_config"] = with_stage(doc["ds_config"], moe.zero_stage)
        doc["param_shapes"] = ds_pickle.sizes(saved["param_shapes"])  # rank 0's groups: the same at this E
        ds_pickle.save_streamed(doc, tag_dir / model, shapes_as_tuples=True)
        written.append(tag_dir / model)
    return written


def _rank_osd(osd: dict, base: dict, parts: list[tuple[MoePart, int]], stage: int, read, files) -> dict:
    """The optimizer-state dict of one rank: every optimizer group of its parts, in optimizer-group order."""
    by_group: dict[int, tuple[MoePart, int, Any]] = {}
    for part, rank in parts:
        for group in part.target.groups:
            by_group[group.optimizer_group] = (part, rank, group)
    states, masters, paddings, alignments, counts, mappings = {}, [], [], [], [], []
    for g in sorted(by_group):
        part, rank, group = by_group[g]
        keys = sorted({k for per in part.states.values() for k in per})
        entry = {}
        for key in keys:
            sources = {p.name: part.state_plan.sources[part.states[p.name][key]] for p in group.params}
            dtype = next(iter(sources.values())).dtype if sources else "float32"
            entry[key] = _lazy_partition(group, rank, sources, dtype, files)
        for key, value in base["state"][g].items():  # step...: as saved
            if key not in keys:
                entry[key] = ds_pickle.copied(ds_pickle.from_standins(value, read))
        states[g] = entry
        masters.append(_lazy_partition(group, rank, part.masters, "float32", files, group.saved_numels[rank]))
        last = rank == part.target.world_size - 1
        end = group.params[-1].offset + group.params[-1].numel if group.params else 0
        paddings.append(group.padded_numel - end if last else 0)
        alignments.append([p.padding for p in group.params])
        counts.append(part.target.world_size)
        natural = next(n for n in part.natural if set(n) == {p.name for p in group.params})
        mappings.append(_slice_mappings(group, rank, natural, False))
    param_groups = ds_pickle.from_standins(base["param_groups"], _no_tensor)
    for g, pg in enumerate(param_groups):
        pg["params"] = [g]
    replaced = {
        "base_optimizer_state": {"state": states, "param_groups": param_groups},
        "single_partition_of_fp32_groups": masters,
        "zero_stage": ds_pickle.zero_stage(stage),
        "group_paddings": paddings,
        "param_alignment_paddings": alignments,
        "partition_count": counts,
        "param_slice_mappings": mappings,
    }
    return collections.OrderedDict(
        (k, replaced[k] if k in replaced else ds_pickle.from_standins(v, _no_tensor)) for k, v in osd.items()
    )
