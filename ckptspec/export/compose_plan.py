"""A tensor/pipeline-parallel checkpoint's whole model as an ordinary reconstruction plan.

Every whole-model tensor (a parameter's fp32 master, and with ``--optimizer-state`` each of its
optimizer states) becomes one ``TensorSource`` whose segments, concatenated, are the whole tensor
in row-major order: the shards' own byte ranges cut where the placement interleaves them (a split
along axis ``a`` interleaves each shard's blocks of ``prod(shape[a:])`` elements; DeepSpeed's affine
pieces are read a row at a time, merged in whole order). A ``whole`` or ``replicated`` tensor
is its primary shard's source unchanged. The 1.x writers (``writers.write_consolidated``: safetensors
or torch files, sharding, ``optimizer.safetensors``) then write it as they write any plan.
"""

from __future__ import annotations

import bisect
import functools
import heapq
import itertools
import json
import math
import operator
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from .._version import __version__
from ..checkpoint.states import StateCache
from ..errors import ReconstructMismatch
from ..format.dtypes import ITEMSIZE
from ..format.index_models import CheckpointIndex, IndexParameter, Shard
from ..location import RemotePath
from .model_plan import LazySegments, ModelPlan, ReconstructionPlan, Segment, TensorSource, coalesced
from .optimizer_state import OptimizerStatePlan, plan_optimizer_state

Runs = Callable[[], Iterable[tuple[int, int, int]]]  # a shard's (whole flat start, local flat start, count), in order


def _runs_of(placement, whole: list[int], local: list[int]) -> Runs:
    """The shard's elements as runs in whole order, made each time they are asked for (a split: one per row)."""
    if hasattr(placement, "split"):
        split = placement.split
        inner = math.prod(whole[split.axis + 1 :])
        outer = math.prod(whole[: split.axis])
        block, stride = split.length * inner, whole[split.axis] * inner
        return functools.partial(_split_runs, outer, stride, split.offset * inner, block)
    return functools.partial(_piece_runs, tuple(placement.pieces))


def _split_runs(outer: int, stride: int, first: int, block: int) -> Iterator[tuple[int, int, int]]:
    """``block`` elements of every ``stride`` of the whole tensor from ``first``: the shard's rows, in order."""
    return ((o * stride + first, o * block, block) for o in range(outer) if block)


def _piece_runs(pieces: tuple) -> Iterator[tuple[int, int, int]]:
    """DeepSpeed's affine pieces as runs in whole order: each piece's rows, the pieces merged by where their rows
    start, neighbours joined. Made as they are read (a row at a time): mapping the pieces element by element held
    an index of the whole tensor, 8 bytes an element."""
    rows = heapq.merge(*(_box_rows(piece) for piece in pieces), key=operator.itemgetter(0))
    return _joined(rows)


def _box_rows(piece) -> Iterator[tuple[int, int, int]]:
    """(whole flat start, local flat start, count) of one piece's rows, in whole order: its axes from the largest
    source stride in (a piece of DeepSpeed's is a row-major block, so its rows come out in whole order; one that
    is not is refused by ``_check_cover``), the innermost axis one row where it is contiguous on both sides."""
    shape = list(piece.shape)
    if not all(shape):
        return iter(())
    (src_at, src_strides), (dst_at, dst_strides) = piece.source, piece.dest
    axes = sorted(range(len(shape)), key=lambda a: -src_strides[a])
    row = 1
    if axes and src_strides[axes[-1]] == 1 and dst_strides[axes[-1]] == 1:
        row = shape[axes.pop()]
    starts = itertools.product(*(range(shape[a]) for a in axes))
    return (
        (
            src_at + sum(i * src_strides[a] for i, a in zip(at, axes, strict=True)),
            dst_at + sum(i * dst_strides[a] for i, a in zip(at, axes, strict=True)),
            row,
        )
        for at in starts
    )


def _joined(runs: Iterable[tuple[int, int, int]]) -> Iterator[tuple[int, int, int]]:
    """The runs with each one that continues the last on both sides (whole and local) joined to it."""
    last: tuple[int, int, int] | None = None
    for w, lo, n in runs:
        if last is not None and last[0] + last[2] == w and last[1] + last[2] == lo:
            last = (last[0], last[1], last[2] + n)
            continue
        if last is not None:
            yield last
        last = (w, lo, n)
    if last is not None:
        yield last


class InterleavedSegments(LazySegments):
    """A whole tensor's segments, from its shards' sources: the shards' runs merged in whole order, each cut from its
    shard's segments, neighbours in one file joined. Made each time they are read: a weight split along an inner
    axis is a segment per row of each shard (held for every tensor, they grew a merge's memory with the model)."""

    def __init__(self, shards: list[tuple[TensorSource, Runs]]):
        self.shards = shards

    def runs(self) -> Iterator[tuple[int, int, int, int]]:
        """(whole flat start, shard, local flat start, count) of every run, in whole order."""
        each = [_numbered(i, runs()) for i, (_, runs) in enumerate(self.shards)]
        return heapq.merge(*each, key=operator.itemgetter(0))

    def __iter__(self) -> Iterator[Segment]:
        cuts = [_Cuts(source) for source, _ in self.shards]
        yield from coalesced(seg for _, i, lo, n in self.runs() for seg in cuts[i].cut(lo, n))


def _numbered(shard: int, runs: Iterable[tuple[int, int, int]]) -> Iterator[tuple[int, int, int, int]]:
    """The runs tagged with their shard's number (a function: a generator inside a comprehension would read the
    comprehension's last number, not its own)."""
    return ((w, shard, lo, n) for w, lo, n in runs)


class _Cuts:
    """Pieces of one shard's flat tensor: the end element of each of its segments, found once per reading."""

    def __init__(self, source: TensorSource):
        self.item = ITEMSIZE[source.dtype]
        self.segments = source.segments if isinstance(source.segments, list) else list(source.segments)
        self.ends = list(itertools.accumulate(seg.nbytes // self.item for seg in self.segments))

    def cut(self, start: int, count: int) -> Iterator[Segment]:
        """The segments of elements ``[start, start + count)``."""
        pos, i = start, bisect.bisect_right(self.ends, start)
        while count > 0:
            seg = self.segments[i]
            first = self.ends[i] - seg.nbytes // self.item
            take = min(count, self.ends[i] - pos)
            yield Segment(seg.path, seg.offset + (pos - first) * self.item, take * self.item)
            pos, count, i = pos + take, count - take, i + 1


def compose_source(name: str, shape: list[int], shards: list[tuple[Shard, TensorSource]], role: str) -> TensorSource:
    """The whole tensor ``name`` from its shards' sources (each in its local shape)."""
    placement = shards[0][0].placement
    if placement in ("whole", "replicated"):
        primary = next(src for s, src in shards if s.primary or len(shards) == 1)
        return TensorSource(name, tuple(shape), primary.dtype, primary.segments, role, primary.digest, primary.origin)
    segments = InterleavedSegments([(src, _runs_of(s.placement, shape, s.local_shape)) for s, src in shards])
    _check_cover(name, segments, math.prod(shape))
    return TensorSource(name, tuple(shape), shards[0][1].dtype, segments, role, origin=shards[0][1].origin)


def _check_cover(name: str, segments: InterleavedSegments, numel: int) -> None:
    """Every element of the whole tensor comes from one shard, inside that shard's source: checked on the runs
    (a few per row) before anything is read, as the segments are made only then."""
    covered = 0
    needs = [0] * len(segments.shards)
    for w, i, lo, n in segments.runs():
        if w != covered:
            raise ReconstructMismatch(f"the shards of {name!r} leave elements {covered}..{w - 1} unset or overlap")
        covered, needs[i] = w + n, max(needs[i], lo + n)
    if covered != numel:
        raise ReconstructMismatch(f"the shards of {name!r} leave elements unset")
    for (source, _), need in zip(segments.shards, needs):
        if sum(seg.nbytes for seg in source.segments) < need * ITEMSIZE[source.dtype]:
            raise ReconstructMismatch(f"{source.name!r} holds fewer elements than its place in {name!r} needs")


@dataclass
class IndexReconstructionPlan(ModelPlan):
    """The whole model of a checkpoint described by a checkpoint index, composed from its domains' plans."""

    index: CheckpointIndex = field(kw_only=True)
    domain_plans: dict[str, ReconstructionPlan] = field(default_factory=dict)
    warnings: list = field(default_factory=list)  # what validating the whole set found, errors aside
    # frozen parameters and buffers of the ZeRO domains: name -> its shards and their sources
    extra_shards: dict[str, list[tuple[Shard, TensorSource]]] = field(default_factory=dict)
    _state: OptimizerStatePlan | None = None
    states: StateCache | None = None  # the decoded files validation read (the moments are located from them)

    def metadata(self, dtype: str, untied: bool) -> dict[str, str]:
        degrees = self.index.topology.degrees
        return {
            "format": "pt",
            "ckptspec.index_format_version": self.index.format_version,
            "ckptspec.tool_version": __version__,
            "ckptspec.tag": self.tag_dir.name,
            "ckptspec.dtype": dtype,
            "ckptspec.parallel": f"pp{degrees.pipeline}-tp{degrees.tensor}-dp{degrees.data}",
            "ckptspec.aliases": json.dumps(self.aliases, sort_keys=True),
            "ckptspec.untied": "true" if untied else "false",
        }

    def optimizer_state_plan(self) -> OptimizerStatePlan:
        """Every whole parameter's optimizer states, composed like its master (CK402 without locators)."""
        if self._state is None:
            self._state = _compose_states(self)
        return self._state


def whole_plan(
    index: CheckpointIndex,
    tag_dir: Path | RemotePath,
    domain_plans: dict[str, ReconstructionPlan],
    extras: dict[str, tuple[list[int], list[tuple[Shard, TensorSource]]]] | None = None,
    ties: dict[str, str] | None = None,
) -> IndexReconstructionPlan:
    """``extras``: the frozen parameters and buffers of the ZeRO domains, placed; ``ties``: alias -> owner
    of a pipeline's tied layers (``compose_extras.py``)."""
    sources = {}
    for param in index.parameters:
        shards = [(s, domain_plans[s.domain].sources[s.local_name]) for s in param.shards]
        sources[param.name] = compose_source(param.name, param.shape, shards, "trainable")
    order = [p.name for p in index.parameters]
    for name, (shape, shards) in (extras or {}).items():
        if name in sources:
            raise ReconstructMismatch(f"{name!r} names two tensors of the whole model", tag_dir)
        sources[name] = compose_source(name, shape, shards, shards[0][1].role)
        order.append(name)
    aliases: dict[str, str] = {}
    for alias, owner in (ties or {}).items():
        if alias in sources or owner not in sources:
            raise ReconstructMismatch(f"tie {alias!r} -> {owner!r}: not one tensor of the whole model", tag_dir)
        aliases[alias] = owner
        order.append(alias)
    # Buffers and ties a domain whose index locates its masters names (stage 0, MoE's dense domain, a
    # universal folder): its names are the whole model's.
    located_apart = {d.id for d in index.domains if d.masters is not None}
    # An AutoTP job at stage 0 saves a copy of every buffer in each tensor rank's file: the copies (compared by
    # check_replicas, CK401), the first tensor rank's taken
    copies: dict[str, list[tuple[Shard, TensorSource]]] = {}
    tensor_copies = index.topology.degrees.tensor > 1 and located_apart == {d.id for d in index.domains}
    for domain_id, plan in domain_plans.items():
        if domain_id not in located_apart:
            continue
        for name in plan.order:
            if name in plan.aliases and name in aliases:  # each tensor rank of an AutoTP stage-0 job names its tie
                if aliases[name] != plan.aliases[name]:
                    raise ReconstructMismatch(
                        f"tie {name!r}: {aliases[name]!r} in one domain, {plan.aliases[name]!r} in {domain_id}", tag_dir
                    )
                continue
            if name in plan.aliases:
                aliases[name] = plan.aliases[name]
            elif plan.sources[name].role == "trainable" or name in (extras or {}):
                continue  # a master; a frozen parameter the index places (an AutoTP stage-0 one: index_extras)
            elif name in copies:
                copies[name].append((_copy(domain_id, plan.sources[name], False), plan.sources[name]))
                continue
            elif name in sources:
                raise ReconstructMismatch(f"{name!r} names two tensors of the whole model", tag_dir)
            else:
                sources[name] = plan.sources[name]
                if tensor_copies:
                    copies[name] = [(_copy(domain_id, plan.sources[name], True), plan.sources[name])]
            order.append(name)
    whole = IndexReconstructionPlan(tag_dir, sources, aliases, order, index=index, domain_plans=domain_plans)
    whole.extra_shards = {name: shards for name, (_, shards) in (extras or {}).items()}
    whole.extra_shards.update({name: shards for name, shards in copies.items() if len(shards) > 1})
    return whole


def _copy(domain_id: str, source: TensorSource, primary: bool) -> Shard:
    """A whole copy of ``source`` that domain ``domain_id`` holds under its own name."""
    return Shard(
        domain=domain_id,
        local_name=source.name,
        local_shape=list(source.shape),
        placement="replicated",
        primary=primary,
    )


def replicas(param: IndexParameter, domain_plans: dict[str, ReconstructionPlan]) -> list[tuple[Shard, TensorSource]]:
    """The shards of a replicated parameter, the primary first (they must be equal)."""
    if not all(s.placement == "replicated" for s in param.shards):
        return []
    shards = sorted(param.shards, key=lambda s: not s.primary)
    return [(s, domain_plans[s.domain].sources[s.local_name]) for s in shards]


def _compose_states(plan: IndexReconstructionPlan) -> OptimizerStatePlan:
    from .masters_state import masters_state_plan, universal_state_plan

    cache = plan.states if plan.states is not None else StateCache()
    per_domain = {  # stage 0, MoE, a stage-0 pipeline, a universal folder: the moments of the masters located
        d.id: plan_optimizer_state(plan.domain_plans[d.id])
        if d.masters is None
        else universal_state_plan(plan.tag_dir, d, cache)
        if d.masters.stored_in == "universal"
        else masters_state_plan(plan.tag_dir, d, cache)
        for d in plan.index.domains
    }
    sources: dict = {}
    states: dict = {}
    groups: dict = {}
    for param in plan.index.parameters:
        keys = sorted(per_domain[param.shards[0].domain].states.get(param.shards[0].local_name, {}))
        for key in keys:
            shards = []
            for s in param.shards:
                local = per_domain[s.domain].states.get(s.local_name, {}).get(key)
                if local is None:
                    raise ReconstructMismatch(f"{param.name}: domain {s.domain} locates no {key!r} of {s.local_name}")
                shards.append((s, per_domain[s.domain].sources[local]))
            name = f"{param.name}.{key}"
            sources[name] = compose_source(name, param.shape, shards, "state")
            states.setdefault(param.name, {})[key] = name
        shard = param.shards[0]
        recorded = json.loads(per_domain[shard.domain].metadata["ckptspec.optimizer_groups"])  # a universal folder's
        groups[param.name] = (  # own (model states' param_shapes), else its manifest's
            recorded[shard.local_name]
            if shard.local_name in recorded
            else next(
                g.optimizer_group
                for g in plan.domain_plans[shard.domain].manifest.groups
                for p in g.params
                if p.name == shard.local_name
            )
        )
    first = next(iter(per_domain.values()))
    for domain, state in per_domain.items():  # one optimizer: every domain records the same hyperparameters and step
        if state.metadata["ckptspec.optimizer"] != first.metadata["ckptspec.optimizer"]:
            raise ReconstructMismatch(f"domain {domain}'s optimizer (hyperparameters, step) differs from the first's")
    metadata = {
        **first.metadata,
        "ckptspec.format_version": plan.index.format_version,
        "ckptspec.optimizer_groups": json.dumps(groups, sort_keys=True),
        "ckptspec.states": json.dumps(states, sort_keys=True),
        "ckptspec.aliases": "{}",
    }
    return OptimizerStatePlan(sources, states, metadata)
