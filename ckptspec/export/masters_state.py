"""The optimizer state of a domain whose checkpoint index locates its masters (issue #39: ZeRO stage 0,
native MoE, a stage-0 pipeline, a universal folder), as the 1.x export gives it
(``optimizer_state.OptimizerStatePlan``).

The index locates the fp32 masters only (format 1.0 has no locator for their moments). The moments are
located when the plan is built, from the optimizer files' pickled structure read through the
restricted reader (``deepspeed/layout/moments.py``): each master locator's elements, at the same
positions in the state of the tensor that holds it. ``step`` and the hyperparameters are the torch
optimizer's, per param group, read from the same files; every file read must agree on them.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..checkpoint.states import StateCache
from ..deepspeed.describe.scalars import UNKNOWN_CLASS, loss_scaler, plain_value, plain_values, scalar_value
from ..deepspeed.layout.moments import MomentFinder, Moments
from ..errors import ReconstructMismatch
from ..format.dtypes import ITEMSIZE
from ..format.index_models import Domain
from ..format.models import Optimizer, OptimizerGroup
from ..location import RemotePath
from .model_plan import Segment, TensorSource
from .optimizer_state import OptimizerStatePlan


def masters_state_plan(tag_dir: Path | RemotePath, domain: Domain, states: StateCache) -> OptimizerStatePlan:
    """Every master's optimizer states of ``domain`` (local names), and the optimizer's scalars."""
    assert domain.masters is not None
    finder = MomentFinder(tag_dir, states)
    shapes = {p.name: tuple(p.shape) for g in domain.manifest.groups for p in g.params}
    digests = {p.name: p.state_digests or {} for g in domain.manifest.groups for p in g.params}
    sources: dict[str, TensorSource] = {}
    names: dict[str, dict[str, str]] = {}
    groups: dict[int, OptimizerGroup] = {}
    wrapper: dict = {}
    for loc in domain.masters.tensors:
        found = finder.locate(loc.param, loc.file, list(loc.key), loc.element_offset, loc.numel)
        if loc.param in names and set(names[loc.param]) != set(found.ranges):
            raise ReconstructMismatch(
                f"the pieces of {loc.param!r} have different optimizer states", tag_dir / found.file
            )
        for key, (offset, nbytes, dtype) in found.ranges.items():
            name = f"{loc.param}.{key}"
            segment = Segment(tag_dir / found.file, offset, nbytes)
            if name in sources:
                segments = sources[name].segments
                assert isinstance(segments, list)  # made just below, as a list
                segments.append(segment)
            else:
                digest = digests[loc.param].get(key)  # generate --hash: checked as the bytes stream (CK222)
                sources[name] = TensorSource(
                    name, shapes[loc.param], dtype, [segment], "state", digest.sha256 if digest else None
                )
            names.setdefault(loc.param, {})[key] = name
        members = finder.members(found.file)
        for g, settings in enumerate(_settings(found)):
            step = scalar_value(found.group_steps.get(g, 0), tag_dir / found.file, members)
            group = OptimizerGroup(optimizer_group=g, hyperparameters=settings, step=step if step is not None else 0)
            if groups.setdefault(g, group) != group:
                raise ReconstructMismatch(
                    f"optimizer param group {g} differs between the files (hyperparameters, step)", tag_dir / found.file
                )
        wrapper = wrapper or found.wrapper
    for name, source in sources.items():
        if source.numel * ITEMSIZE[source.dtype] != sum(s.nbytes for s in source.segments):
            raise ReconstructMismatch(f"the optimizer state {name!r} does not fill its shape", tag_dir)
    optimizer = Optimizer(class_=UNKNOWN_CLASS, groups=[groups[g] for g in sorted(groups)])
    if (scaler := loss_scaler(wrapper)) is not None:
        optimizer.loss_scaler = scaler
    clip = plain_value(wrapper.get("clip_grad"))
    if isinstance(clip, (int, float)) and not isinstance(clip, bool) and clip >= 0:
        optimizer.clip_grad = clip
    by_group = {p.name: g.optimizer_group for g in domain.manifest.groups for p in g.params}
    metadata = {
        "format": "pt",
        "ckptspec.tag": tag_dir.name,
        "ckptspec.optimizer": json.dumps(optimizer.model_dump(mode="json", by_alias=True, exclude_unset=True)),
        "ckptspec.optimizer_groups": json.dumps({n: by_group[n] for n in names}, sort_keys=True),
        "ckptspec.states": json.dumps(names, sort_keys=True),
        "ckptspec.aliases": "{}",
    }
    return OptimizerStatePlan(sources, names, metadata)


def _settings(found: Moments) -> list[dict]:
    """The hyperparameters of every param group of the torch state the moments were found in."""
    return [_settings_of(g) if isinstance(g, dict) else {} for g in found.param_groups]


def universal_state_plan(tag_dir: Path | RemotePath, domain: Domain, states: StateCache) -> OptimizerStatePlan:
    """Every master's optimizer states of a universal folder (``layout/universal_moments.py``): each state
    file's tensor where the master's is, the step of each parameter (one per group: they must agree), the
    hyperparameters, loss scaler and gradient clipping of ``zero/optimizer_state.pt``."""
    from ..deepspeed.layout.universal_moments import universal_moments

    found = universal_moments(tag_dir, states, domain)
    shapes = {p.name: tuple(p.shape) for g in domain.manifest.groups for p in g.params}
    digests = {p.name: p.state_digests or {} for g in domain.manifest.groups for p in g.params}
    sources: dict[str, TensorSource] = {}
    names: dict[str, dict[str, str]] = {}
    for param, by_key in found.ranges.items():
        for key, (rel, offset, nbytes, dtype) in by_key.items():
            name = f"{param}.{key}"
            digest = digests[param].get(key)  # generate --hash: checked as the bytes stream (CK222)
            segments = [Segment(tag_dir / rel, offset, nbytes)]
            sha256 = digest.sha256 if digest else None
            sources[name] = TensorSource(name, shapes[param], dtype, segments, "state", sha256)
            if sources[name].numel * ITEMSIZE[dtype] != nbytes:
                raise ReconstructMismatch(f"the optimizer state {name!r} does not fill its shape", tag_dir / rel)
            names.setdefault(param, {})[key] = name
    steps: dict[int, float | int] = {}
    for param, (rel, value) in found.steps.items():
        got = scalar_value(value, tag_dir / rel, states.members(tag_dir / rel))
        g = found.groups[param]
        if got is None or steps.setdefault(g, got) != got:
            raise ReconstructMismatch(f"the step of {param!r} ({got}) is not its group's ({steps[g]})", tag_dir / rel)
    groups = [
        OptimizerGroup(optimizer_group=g, hyperparameters=_settings_of(settings), step=steps.get(g, 0))
        for g, settings in enumerate(found.param_groups)
        if g in steps
    ]
    optimizer = Optimizer(class_=UNKNOWN_CLASS, groups=groups)
    if (scaler := loss_scaler(found.wrapper)) is not None:
        optimizer.loss_scaler = scaler
    clip = plain_value(found.wrapper.get("clip_grad"))
    if isinstance(clip, (int, float)) and not isinstance(clip, bool) and clip >= 0:
        optimizer.clip_grad = clip
    metadata = {
        "format": "pt",
        "ckptspec.tag": tag_dir.name,
        "ckptspec.optimizer": json.dumps(optimizer.model_dump(mode="json", by_alias=True, exclude_unset=True)),
        "ckptspec.optimizer_groups": json.dumps({n: found.groups[n] for n in names}, sort_keys=True),
        "ckptspec.states": json.dumps(names, sort_keys=True),
        "ckptspec.aliases": "{}",
    }
    return OptimizerStatePlan(sources, names, metadata)


def _settings_of(group: dict) -> dict:
    return plain_values(group, skip=("params",))
