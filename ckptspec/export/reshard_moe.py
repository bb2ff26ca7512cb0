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

A ZeRO stage-0 MoE source (``--stage 1|2`` required) keeps no partitions: the index locates its masters in the
module (fp32), the expert files (fp32) or each expert-parallel rank's ``expp_rank_<e>`` optimizer file (bf16), and
its moments beside them (``masters_state_plan``); its optimizer's entries (param groups, step, loss scale) are read
by ``reshard_stage0_source.stage0_optimizer`` from the model states' ``optimizer``: expert-parallel rank 0's, whose
groups are the dense and the expert group. Its model states are written as a ZeRO job saves them: ``optimizer``
None and ``shared_params`` set. The rest is written as from a ZeRO-1/2 source.
A stage-0 target (``--stage 0``, or a stage-0 source without ``--stage``) is planned here too, its parts without
partitions (``MoePart.target`` None), and written by ``reshard_moe_stage0`` (what ``reshard_stage0.refuse_stage0``
refuses of a dense stage-0 target is refused here first).
Refused by name (CK410): a world size E does not divide, an expert degree that does not divide the experts,
tensor/pipeline parallelism with experts, ZeRO-3 (its own kind) and ``--stage 3``.
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
from . import ds_pickle
from .arrays import ShardReader
from .masters_state import masters_state_plan
from .model_plan import ReconstructionPlan
from .reshard_files import (
    _model_states,
    _no_tensor,
    _slice_mappings,
    lazy_partition,
    lazy_reader,
    optim_file_names,
    tensor_reader,
)
from .reshard_layout import TargetLayout, located_target_layout, natural_groups
from .reshard_source import SourceOptimizer, with_stage
from .reshard_stage0 import refuse_stage0
from .reshard_stage0_source import STAGE0_MASTERS, stage0_optimizer

_EXPERT = re.compile(r"(deepspeed_experts\.)(\d+)(\.)")
# where a source domain's masters are, by its ZeRO stage: stage 0's where the index locates them (an expert's in
# its expert file in fp32), ZeRO-1/2's in the partitions
_MASTERS_AT = {0: (*STAGE0_MASTERS, "expert_files"), 1: ("optimizer_states",), 2: ("optimizer_states",)}


@dataclass
class MoePart:
    """One partitioning at the target (the dense group, or one expert-parallel rank's experts): its groups under
    the names the rank's files use."""

    target: TargetLayout | None  # None at stage 0 (no partitions)
    masters: dict  # local name -> its master's bytes
    states: dict[str, dict[str, str]]  # local name -> state -> the name of its bytes in ``moments``
    moments: dict  # state source name -> its bytes
    natural: list[tuple[int, list[str]]]  # each optimizer group's local names in model order

    @property
    def layout(self) -> TargetLayout:
        assert self.target is not None, "a stage-0 target has no partitions"
        return self.target


@dataclass
class MoeTarget:
    world_size: int
    zero_stage: int
    dense_domain: Domain  # the source's: its model states are the template
    dense: MoePart
    experts: list[MoePart]  # by the target's expert-parallel rank
    source: SourceOptimizer  # the optimizer entries besides the partitions, and the file they are read from
    model_keys: dict[str, Any]  # model-states entries a ZeRO job saves otherwise than the source (stage 0)

    def write(self, states: StateCache, tag_dir: Path, src_dir: Path) -> list[Path]:
        """The ZeRO-1/2 files (a stage-0 target's: ``reshard_moe_stage0.write_moe_stage0``)."""
        assert self.zero_stage, "a stage-0 MoE is written by reshard_moe_stage0"
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
    """The MoE checkpoint ``index`` at ``world_size`` ranks, ``expert_parallel`` expert-parallel ranks (default:
    the source's) and ``zero_stage``; CK410 before anything is written."""
    ep = expert_parallel or index.topology.degrees.expert
    _refuse(index, world_size, zero_stage, ep)
    stage = zero_stage if zero_stage is not None else index.domains[0].configured_zero_stage
    dense = next(d for d in index.domains if d.coordinate.expert is None)
    moments = {d.id: masters_state_plan(tag_dir, d, states) for d in index.domains}
    keys = sorted({key for m in moments.values() for names in m.states.values() for key in names})
    if dense.configured_zero_stage == 0:
        source = stage0_optimizer(tag_dir, dense, states, keys, stage)
        model_keys = {"optimizer": None, "shared_params": {a.name: a.owner for a in dense.manifest.aliases}}
    else:
        source, model_keys = _zero_source(tag_dir, dense, states, keys), {}
    if stage == 0:  # what a stage-0 checkpoint could not describe (reshard_moe_stage0)
        refuse_stage0(dense.manifest, source.osd)
    by_name = {p.name: p for d in index.domains for g in d.manifest.groups for p in g.params}
    domain_of = {p.name: d.id for d in index.domains for g in d.manifest.groups for p in g.params}

    sources = {k: v for m in moments.values() for k, v in m.sources.items()}  # every domain's moments

    def part(manifest, names: dict[str, str], size: int) -> MoePart:
        """``manifest``'s groups (local names) at ``size`` ranks; ``names``: local name -> global name."""
        optimizer = moments[dense.id].metadata["ckptspec.optimizer"]
        target = located_target_layout(manifest, optimizer, size, stage) if stage else None
        masters = {n: plans[domain_of[g]].sources[g] for n, g in names.items()}
        states = {n: moments[domain_of[g]].states[g] for n, g in names.items()}
        natural = [(g, [p.name for p in params]) for g, params in natural_groups(manifest)]
        return MoePart(target, masters, states, sources, natural)

    dense_names = {p.name: p.name for g in dense.manifest.groups for p in g.params}
    expert_parts = []
    for names in expert_ranks(index, ep):
        template = next(d for d in index.domains if d.coordinate.expert is not None).manifest.model_copy(deep=True)
        (group,) = template.groups  # one expert group (_refuse)
        group.params = [by_name[g].model_copy(update={"name": n}) for n, g in names.items()]
        expert_parts.append(part(template, names, world_size // ep))
    dense_part = part(dense.manifest.model_copy(deep=True), dense_names, world_size)
    return MoeTarget(world_size, stage, dense, dense_part, expert_parts, source, model_keys)


def _zero_source(tag_dir: Path, dense: Domain, states: StateCache, moments: list[str]) -> SourceOptimizer:
    """Source rank 0's ZeRO-1/2 optimizer-state file, its entries as saved (each group's scalar state: ``step``)."""
    first = next(p for p, r in dense.file_ranks.items() if r == 0 and "optim_states" in p)
    template = states.state(tag_dir / first)
    osd = template["optimizer_state_dict"]
    base = osd["base_optimizer_state"]
    groups = range(len(base["param_groups"]))
    scalars = {g: {k: v for k, v in base["state"][g].items() if k not in moments} for g in groups}
    keys = dict.fromkeys(groups, moments)
    stage = dense.configured_zero_stage
    return SourceOptimizer(template, osd, base["param_groups"], scalars, keys, stage, tag_dir / first, first)


def _refuse(index: CheckpointIndex, world_size: int, zero_stage: int | None, ep: int) -> None:
    degrees = index.topology.degrees
    if degrees.tensor != 1 or degrees.pipeline != 1:
        raise ReshardUnsupported(
            f"a MoE checkpoint of tensor {degrees.tensor} x pipeline {degrees.pipeline} degrees is not resharded yet",
            "data-parallel MoE checkpoints (ZeRO-1/2) are",
        )
    counts = collections.Counter(f.moe_layer for f in index.expert_files or ())
    if len(set(counts.values())) != 1 or next(iter(counts.values())) % ep:
        raise ReshardUnsupported(
            f"--expert-parallel {ep}: the MoE layers' expert counts ({sorted(counts.values())}) are not its multiples",
            "give an expert-parallel degree that divides the number of experts",
        )
    if world_size < 1 or world_size % ep:
        raise ReshardUnsupported(
            f"--world-size {world_size} is not a multiple of the expert-parallel degree ({ep})",
            f"give a multiple of {ep}: each expert-parallel group spans {ep} ranks",
        )
    if any(d.coordinate.expert is not None and len(d.manifest.groups) != 1 for d in index.domains):
        raise ReshardUnsupported(
            "an expert domain with several optimizer groups (experts of several expert-parallel degrees) is not "
            "resharded yet",
            "resume at the same layout",
        )
    for d in index.domains:
        if d.masters is None or d.masters.stored_in not in _MASTERS_AT.get(d.configured_zero_stage, ()):
            raise ReshardUnsupported(
                f"domain {d.id} is not a ZeRO stage 0, 1 or 2 MoE domain (stage {d.configured_zero_stage}, masters "
                f"in {d.masters.stored_in if d.masters else 'ZeRO-3 partitions'}); MoE checkpoints at ZeRO-0/1/2 are "
                "resharded so far",
                "resume at the same layout",
            )
    if zero_stage not in (None, 0, 1, 2):
        raise ReshardUnsupported(
            f"--stage {zero_stage} for a MoE checkpoint: stages 0, 1 and 2 are written", "give 0, 1 or 2"
        )


def expert_ranks(index: CheckpointIndex, ep: int) -> list[dict[str, str]]:
    """For each target expert-parallel rank, in its module's order: local name -> global name of its experts'
    parameters. Rank e holds experts e*L .. e*L+L-1 of every MoE layer (L = experts / ep), named 0 .. L-1; each
    expert's parameters in the source's order (its expert-parallel rank 0's)."""
    experts = next(iter(collections.Counter(f.moe_layer for f in index.expert_files).values()))
    per_rank = experts // ep
    first = next(d for d in index.domains if d.coordinate.expert == 0)
    layers: dict[str, list[str]] = {}  # the text before an expert's index -> that expert's suffixes, in order
    seen: dict[str, int] = {}
    for p in first.manifest.groups[0].params:
        match = _EXPERT.search(p.name)
        if match is None:
            raise ReshardUnsupported(f"{p.name}: an expert parameter without an expert index", "resume as it is")
        prefix, g = p.name[: match.end(1)], int(match.group(2))
        if seen.setdefault(prefix, g) == g:
            layers.setdefault(prefix, []).append(p.name[match.end(2) :])
    return [
        {
            f"{prefix}{j}{suffix}": f"{prefix}{rank * per_rank + j}{suffix}"
            for prefix, suffixes in layers.items()
            for j in range(per_rank)
            for suffix in suffixes
        }
        for rank in range(ep)
    ]


def _write(moe: MoeTarget, states: StateCache, tag_dir: Path, src_dir: Path) -> list[Path]:
    """Each rank's optimizer-state file, the model states, the expert files."""
    dense, ep, source = moe.dense, len(moe.experts), moe.source
    assert source.path is not None and source.file_name is not None  # set by plan_moe
    written = []
    with ShardReader() as files:
        read = tensor_reader(source.path, states, files)
        for rank, name in enumerate(optim_file_names(source.file_name, moe.world_size)):
            parts = [(dense, rank), (moe.experts[rank % ep], rank // ep)]
            out = _rank_osd(source, parts, moe.zero_stage, ep, read, files)
            doc = {
                k: out
                if k == "optimizer_state_dict"
                else ds_pickle.from_standins(with_stage(v, moe.zero_stage), read)
                if k == "ds_config"
                else ds_pickle.from_standins(v, read)
                for k, v in source.top.items()
            }
            ds_pickle.save_streamed(doc, tag_dir / name)
            written.append(tag_dir / name)
        model = next(p for p in moe.dense_domain.file_ranks if "model_states" in p)
        lazy = lazy_reader(src_dir / model, states, files)
        found = moe.dense_domain.manifest.model_copy(deep=True)
        found.layout.zero_stage = moe.zero_stage
        saved = states.state(src_dir / model)
        doc = _model_states(saved, found, dense.layout, lazy, {}, files)
        doc["ds_config"] = with_stage(doc["ds_config"], moe.zero_stage)
        doc.update(moe.model_keys)
        # rank 0's groups in flat order: the dense one and its expert-parallel rank's (local names)
        groups = [g for part in (dense, moe.experts[0]) for g in part.layout.groups]
        shapes = [collections.OrderedDict((p.name, tuple(p.shape)) for p in g.params) for g in groups]
        doc["param_shapes"] = ds_pickle.sizes(shapes)
        ds_pickle.save_streamed(doc, tag_dir / model, shapes_as_tuples=True)
        written.append(tag_dir / model)
    return written


def _rank_osd(source: SourceOptimizer, parts: list[tuple[MoePart, int]], stage: int, ep: int, read, files) -> dict:
    """The optimizer-state dict of one rank: every optimizer group of its parts, in optimizer-group order."""
    by_group: dict[int, tuple[MoePart, int, Any]] = {}
    for part, rank in parts:
        for group in part.layout.groups:
            by_group[group.optimizer_group] = (part, rank, group)
    states, masters, paddings, alignments, counts, mappings = {}, [], [], [], [], []
    for g in sorted(by_group):
        part, rank, group = by_group[g]
        keys = sorted({k for per in part.states.values() for k in per})
        entry = {}
        for key in keys:
            sources = {p.name: part.moments[part.states[p.name][key]] for p in group.params}
            dtype = next(iter(sources.values())).dtype if sources else "float32"
            entry[key] = lazy_partition(group, rank, sources, dtype, files)
        for key, value in source.group_scalars.get(g, {}).items():  # step...: as saved
            entry[key] = ds_pickle.copied(ds_pickle.from_standins(value, read))
        states[g] = entry
        masters.append(lazy_partition(group, rank, part.masters, "float32", files, group.saved_numels[rank]))
        last = rank == part.layout.world_size - 1
        end = group.params[-1].offset + group.params[-1].numel if group.params else 0
        paddings.append(group.padded_numel - end if last else 0)
        alignments.append([p.padding for p in group.params])
        counts.append(part.layout.world_size)
        natural = next(n for _, n in part.natural if set(n) == {p.name for p in group.params})
        mappings.append(_slice_mappings(group, rank, natural, False))
    param_groups = expert_groups_named(ds_pickle.from_standins(source.param_groups, _no_tensor), ep)
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
        (k, replaced[k] if k in replaced else ds_pickle.from_standins(v, _no_tensor)) for k, v in source.osd.items()
    )


def expert_groups_named(param_groups: list, ep: int) -> list:
    """``param_groups`` with each expert group named as DeepSpeed names it, by the expert-parallel degree ``ep``."""
    for pg in param_groups:
        if pg.get("moe"):
            pg["name"] = f"ep_size_{ep}"
    return param_groups
