"""Where the optimizer state of a universal folder (``ds_to_universal``'s output) is (issue #39).

Beside each parameter's master ``zero/<name>/fp32.pt`` the folder holds one file per optimizer state,
``zero/<name>/<state>.pt`` (``exp_avg``, ``exp_avg_sq``), its tensor where the master's is (``{'param':
tensor}`` in the whole shape from a stage <= 2 source, a bare flat tensor from a stage-3 one), and
``zero/optimizer_state.pt``: the torch optimizer's ``param_groups`` (hyperparameters), the loss scaler and
gradient clipping. The ``step`` is ``zero/<name>/step.pt`` (a stage <= 2 source: the step of the
parameter's group) or, from a stage-3 source, ``optimizer_state_dict.state[0].step`` of
``optimizer_state.pt``, which DeepSpeed's universal loader gives every group
(``load_hp_checkpoint_state_from_checkpoint_dir_stage3``). With several param groups, a parameter's is
the index of the copied model states' ``param_shapes`` entry that names it (one per group: ZeRO 1/2, and
ZeRO-3 without sub-groups); where those do not pair one to one with the groups it is refused by name.

The files are the ones the checkpoint index lists (its domain's ``files``: validated; no directory is
listed). A parameter whose directory holds its master alone has no optimizer
state (what both converters write for a frozen parameter, which DeepSpeed's universal loader skips); one
that holds some of the states the folder's other parameters have lacks a file: CK206, naming it.
Anything else unexpected is refused by name (CK202). Metadata only: no tensor bytes, no pickle code.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...checkpoint.states import StateCache
from ...checkpoint.torchfile import TensorRef, tensor_byte_range
from ...errors import CheckpointInvalid, UnsupportedCheckpoint
from ...findings import finding, json_path
from ...format.index_models import Domain
from ...location import RemotePath
from .masters import value_at
from .names import MODEL_RE

OPTIMIZER_STATE = "zero/optimizer_state.pt"
MASTER, STEP = "fp32", "step"
_HINT = "the optimizer state of this universal folder cannot be located from its files; reconstruct without it"


@dataclass(frozen=True)
class UniversalMoments:
    """``ranges``: param -> state -> (file, absolute byte offset, byte count, dtype) of its elements, at the
    master's positions; ``steps``: param -> (file, the step as saved: a number or a 0-d ``TensorRef``);
    ``param_groups``: the torch optimizer's groups; ``groups``: param -> the index of its group;
    ``wrapper``: the decoded ``optimizer_state.pt`` (loss scaler, gradient clipping)."""

    ranges: dict[str, dict[str, tuple[str, int, int, str]]]
    steps: dict[str, tuple[str, Any]]
    param_groups: list
    groups: dict[str, int]
    wrapper: dict


def _missing(folder: Path | RemotePath, rel: str, at: str, what: str) -> CheckpointInvalid:
    problem = finding(
        "CK206",
        at,
        f"{rel} is missing: {what}",
        "restore the file, or convert the checkpoint again (ds_to_universal)",
        file=rel,
    )
    return CheckpointInvalid([problem], str(folder))


def _state_dir(rel: str) -> str:
    head, _, name = rel.rpartition("/")
    if not head.startswith("zero/") or name != f"{MASTER}.pt":
        raise UnsupportedCheckpoint(f"{rel} is not a universal folder's zero/<param>/fp32.pt", _HINT, rel)
    return head


def universal_moments(folder: Path | RemotePath, states: StateCache, domain: Domain) -> UniversalMoments:
    """Every master's optimizer states in the universal folder ``folder`` (``domain``: its one domain)."""
    assert domain.masters is not None
    listed = {f.path for f in domain.manifest.files}
    dirs = {loc.param: _state_dir(loc.file) for loc in domain.masters.tensors}
    held = {
        param: {rel[len(d) + 1 : -3] for rel in listed if rel.startswith(d + "/") and rel.endswith(".pt")} - {MASTER}
        for param, d in dirs.items()
    }
    keys = set().union(*held.values()) if held else set()
    if not keys - {STEP}:
        raise UnsupportedCheckpoint("the universal folder holds no optimizer state (no zero/<param>/exp_avg.pt)", _HINT)
    if OPTIMIZER_STATE not in listed:
        raise _missing(folder, OPTIMIZER_STATE, "$.domains[0].manifest.files", "the optimizer's param groups")
    wrapper = states.state(folder / OPTIMIZER_STATE)
    groups = wrapper.get("param_groups") if isinstance(wrapper, dict) else None
    if not isinstance(groups, list) or not groups or not all(isinstance(g, dict) for g in groups):
        raise UnsupportedCheckpoint(f"{OPTIMIZER_STATE} holds no param groups", _HINT, OPTIMIZER_STATE)
    group_of = _group_of(folder, states, sorted(listed), [p for p, h in held.items() if h], len(groups))
    ranges: dict[str, dict[str, tuple[str, int, int, str]]] = {}
    steps: dict[str, tuple[str, Any]] = {}
    for j, loc in enumerate(domain.masters.tensors):
        if not held[loc.param]:
            continue  # its master alone: a parameter without optimizer state (frozen)
        at = json_path("domains", 0, "masters", "tensors", j)
        master = value_at(states.state(folder / loc.file), list(loc.key))
        if not isinstance(master, TensorRef):
            raise UnsupportedCheckpoint(f"the master of {loc.param!r} is not a tensor", _HINT, loc.file)
        position = loc.element_offset - master.storage_offset
        for key in sorted(keys):
            rel = f"{dirs[loc.param]}/{key}.pt"
            if key not in held[loc.param]:
                raise _missing(folder, rel, at, f"{loc.param!r} has other optimizer states but not {key!r}")
            value = states.state(folder / rel)
            if key == STEP:
                steps[loc.param] = (rel, value)
                continue
            ref = value_at(value, list(loc.key))
            if not isinstance(ref, TensorRef) or ref.numel != master.numel or not ref.is_contiguous():
                got = f"{ref.numel} elements" if isinstance(ref, TensorRef) else "no tensor"
                raise UnsupportedCheckpoint(f"{rel} holds {got} where its master has {master.numel}", _HINT, rel)
            start, _ = tensor_byte_range(ref, states.members(folder / rel))
            item = ref.storage.itemsize
            ranges.setdefault(loc.param, {})[key] = (rel, start + position * item, loc.numel * item, ref.dtype)
        if loc.param not in steps:  # a stage-3 source: the step DeepSpeed's loader gives every group
            osd = wrapper.get("optimizer_state_dict")
            step = value_at(osd, ["state", 0, STEP]) if isinstance(osd, dict) else None
            if step is None:
                raise UnsupportedCheckpoint(
                    f"no step of {loc.param!r}: neither {dirs[loc.param]}/step.pt nor "
                    "optimizer_state_dict.state[0].step of the optimizer state",
                    _HINT,
                    OPTIMIZER_STATE,
                )
            steps[loc.param] = (OPTIMIZER_STATE, step)
    return UniversalMoments(ranges, steps, groups, {p: group_of[p] for p in ranges}, wrapper)


def _group_of(
    folder: Path | RemotePath, states: StateCache, listed: list[str], params: list[str], count: int
) -> dict[str, int]:
    """param -> the index of its torch param group: 0 when there is one, else from the copied model
    states' ``param_shapes`` (one ``{name: shape}`` per group; every copy the same)."""
    if count == 1:
        return dict.fromkeys(params, 0)
    seen: list[list[list] | None] = []
    for rel in (r for r in listed if MODEL_RE.match(r)):
        state = states.state(folder / rel)
        shapes = state.get("param_shapes") if isinstance(state, dict) else None
        if isinstance(shapes, list) and all(isinstance(g, dict) for g in shapes):
            seen.append([list(g) for g in shapes])
        else:
            seen.append(None)
    found = seen[0] if seen and all(names == seen[0] for names in seen) else None
    by_name = {name: g for g, names in enumerate(found or []) for name in names}
    if found is None or len(found) != count or not set(params) <= set(by_name):
        raise UnsupportedCheckpoint(
            f"{OPTIMIZER_STATE} holds {count} param groups, and the copied model states' param_shapes do not say "
            "which parameter is in which (one entry per group, naming every parameter)",
            _HINT,
            OPTIMIZER_STATE,
        )
    return {param: by_name[param] for param in params}


def universal_moment_ranges(
    folder: Path | RemotePath, states: StateCache, domain: Domain
) -> dict[str, dict[str, list[tuple[str, int, int]]]] | None:
    """param -> state -> its byte ranges (``describe/masters_digests.moment_ranges``'s shape), or None where
    the moments cannot be located (they get no digest: ``--optimizer-state`` refuses them by name)."""
    try:
        found = universal_moments(folder, states, domain)
    except (UnsupportedCheckpoint, CheckpointInvalid):
        return None
    return {p: {k: [(f, o, n)] for k, (f, o, n, _) in by_key.items()} for p, by_key in found.ranges.items()}
