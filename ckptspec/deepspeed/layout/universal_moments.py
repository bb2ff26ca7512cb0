"""Where the optimizer state of a universal folder (``ds_to_universal``'s output) is (issue #39).

Beside each parameter's master ``zero/<name>/fp32.pt`` the folder holds one file per optimizer state,
``zero/<name>/<state>.pt`` (``exp_avg``, ``exp_avg_sq``), its tensor where the master's is (``{'param':
tensor}`` in the whole shape from a stage <= 2 source, a bare flat tensor from a stage-3 one), and
``zero/optimizer_state.pt``: the torch optimizer's ``param_groups`` (hyperparameters), the loss scaler and
gradient clipping. The ``step`` is ``zero/<name>/step.pt`` (a stage <= 2 source: the step of the
parameter's group) or, from a stage-3 source, ``optimizer_state_dict.state[0].step`` of
``optimizer_state.pt``, which DeepSpeed's universal loader gives every group
(``load_hp_checkpoint_state_from_checkpoint_dir_stage3``).

The files are the ones the checkpoint index lists (its domain's ``files``: validated, and no directory
listing, so a URL costs no request). A parameter whose directory holds its master alone has no optimizer
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

OPTIMIZER_STATE = "zero/optimizer_state.pt"
MASTER, STEP = "fp32", "step"
_HINT = "the optimizer state of this universal folder cannot be located from its files; reconstruct without it"


@dataclass(frozen=True)
class UniversalMoments:
    """``ranges``: param -> state -> (file, absolute byte offset, byte count, dtype) of its elements, at the
    master's positions; ``steps``: param -> (file, the step as saved: a number or a 0-d ``TensorRef``);
    ``param_groups``: the torch optimizer's groups (one: every parameter is in it); ``wrapper``: the
    decoded ``optimizer_state.pt`` (loss scaler, gradient clipping)."""

    ranges: dict[str, dict[str, tuple[str, int, int, str]]]
    steps: dict[str, tuple[str, Any]]
    param_groups: list
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
    if not isinstance(groups, list) or len(groups) != 1 or not isinstance(groups[0], dict):
        raise UnsupportedCheckpoint(
            f"{OPTIMIZER_STATE} holds {len(groups) if isinstance(groups, list) else 'no'} param groups; a universal "
            "folder does not record which parameter is in which group, so only one is read",
            _HINT,
            OPTIMIZER_STATE,
        )
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
    return UniversalMoments(ranges, steps, groups, wrapper)


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
