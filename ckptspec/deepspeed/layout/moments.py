"""Where the optimizer state of a master that a checkpoint index locates is (issue #39): ZeRO stage 0,
native MoE at stage 0/1/2, a stage-0 pipeline.

The torch optimizer DeepSpeed wraps keeps one state entry (``exp_avg``, ``exp_avg_sq``, ``step``) per
tensor it steps, the index of that tensor in its ``param_groups`` (``params``) being the entry's key.
A per-element state has the shape of the tensor it belongs to, so a master's moments are at the
master's element positions in the state of the tensor that holds it. Which tensor that is follows from
the master locator's ``key`` (its place in the pickle), in the same file:

* ``optimizer/fp32_groups/g/i`` (FP16_UnfusedOptimizer): ``optimizer/optimizer_state_dict``, entry
  ``param_groups[g].params[i]``;
* ``optimizer/fp32_groups_flat/g`` (FP16_Optimizer): the same, entry ``param_groups[g].params[0]`` (one
  flat tensor per group);
* ``optimizer_state_dict/single_partition_of_fp32_groups/g`` (ZeRO 1/2, BF16_Optimizer): the rank's
  flat partition; ``optimizer_state_dict/base_optimizer_state``, entry ``param_groups[g].params[0]``.

Without mixed precision (stage 0 fp32) a weight is its own master (``module/<name>``, or ``<name>`` in
an expert file) and the client optimizer's ``state_dict()`` is ``optimizer`` of the model states, its
groups taking the trainable parameters in module order (frozen ones, which it does not step, left out:
``masters.stage0_frozen``), or with MoE ``optimizer`` of each
``expp_rank_<R>`` file: group 0 the dense parameters (rank 0's file is authoritative, as for the
masters), group 1 expert-parallel rank R's experts (by layer, expert, key: ``masters.expert_params``); in
an fp32 pipeline at stage 0 each layer file's weight is its own master and its stage's model states hold
``optimizer`` (``pipeline_torch_optimizer.stage_params``).
A state is taken only when it is one contiguous tensor of at least the master tensor's elements (the
state of the last ZeRO partition keeps the padding its saved fp32 partition drops); anything else is
refused by name. Metadata only: no tensor bytes, no pickle code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...checkpoint.states import StateCache
from ...checkpoint.torchfile import TensorRef, tensor_byte_range
from ...errors import UnsupportedCheckpoint
from ...location import RemotePath
from .masters import (
    EXPERT_FILE_RE,
    EXPP_RE,
    MODEL_FILE,
    expert_params,
    list_expert_files,
    stage0_frozen,
    value_at,
)
from .names import PIPE_LAYER_RE
from .parallel_files import scan_parallel
from .pipeline_torch_optimizer import stage_params
from .stage0_names import stage0_ties

_HINT = "the optimizer state of this checkpoint cannot be located from its files; reconstruct without it"
_FLAT_KEYS = {
    ("optimizer", "fp32_groups_flat"): ("optimizer", "optimizer_state_dict"),
    ("optimizer_state_dict", "single_partition_of_fp32_groups"): ("optimizer_state_dict", "base_optimizer_state"),
}


@dataclass(frozen=True)
class Moments:
    """The optimizer state of one master locator's elements: ``ranges`` state -> (absolute byte offset,
    byte count, dtype) in ``file``; ``group`` the torch param group of the entry; ``param_groups`` every
    param group of that torch state, and ``group_steps`` the ``step`` of each as saved (its first entry's:
    a number or a 0-d ``TensorRef``); ``wrapper`` the dict holding the torch
    state (DeepSpeed's loss scaler and gradient clipping), if any."""

    file: str
    group: int
    ranges: dict[str, tuple[int, int, str]]
    param_groups: list
    group_steps: dict[int, Any]
    wrapper: dict = field(default_factory=dict)


def _params(inner: Any, g: Any, where: str) -> list:
    groups = inner.get("param_groups") if isinstance(inner, dict) else None
    if not isinstance(groups, list) or not isinstance(g, int) or not 0 <= g < len(groups):
        raise UnsupportedCheckpoint(f"no optimizer param group {g}", _HINT, where)
    params = groups[g].get("params") if isinstance(groups[g], dict) else None
    if not isinstance(params, list):
        raise UnsupportedCheckpoint(f"optimizer param group {g} lists no params", _HINT, where)
    return params


class MomentFinder:
    """``locate`` each master locator's moments in one tag directory (decoded files from ``states``)."""

    def __init__(self, folder: Path | RemotePath, states: StateCache):
        self.folder, self.states = folder, states
        self._plain: dict[str | tuple[str, str], tuple[str, int, int]] | None = None

    def _slot(self, name: str, rel: str, key: list) -> tuple[str, list, Any, int]:
        """(file, key of the torch state dict in it, state entry key, group) of the tensor at ``key``."""
        head = tuple(key[:2])
        if head == ("optimizer", "fp32_groups") and len(key) == 4:
            inner_key = ["optimizer", "optimizer_state_dict"]
            inner = value_at(self.states.state(self.folder / rel), inner_key)
            params = _params(inner, key[2], rel)
            if not isinstance(key[3], int) or not 0 <= key[3] < len(params):
                raise UnsupportedCheckpoint(f"optimizer param group {key[2]} has no param {key[3]}", _HINT, rel)
            return rel, inner_key, params[key[3]], key[2]
        if head in _FLAT_KEYS and len(key) == 3:
            inner_key = list(_FLAT_KEYS[head])
            params = _params(value_at(self.states.state(self.folder / rel), inner_key), key[2], rel)
            if len(params) != 1:
                raise UnsupportedCheckpoint(
                    f"optimizer param group {key[2]} holds {len(params)} flat tensors", _HINT, rel
                )
            return rel, inner_key, params[0], key[2]
        slots = self._plain_slots()
        found = slots.get((rel, name), slots.get(name))  # a pipeline's by its layer file: tensor ranks share names
        if found is None:
            raise UnsupportedCheckpoint(f"no optimizer state entry of {name!r} ({'/'.join(map(str, key))})", _HINT, rel)
        return found[0], ["optimizer"], found[1], found[2]

    def _plain_slots(self) -> dict[str | tuple[str, str], tuple[str, int, int]]:
        """name (a pipeline's: (layer file, name)) -> (file, state entry key, group) where the weights are the
        masters (stage 0 fp32)."""
        if self._plain is not None:
            return self._plain
        if any(PIPE_LAYER_RE.match(p.name) for p in self.folder.iterdir()):  # an fp32 pipeline: its layer weights
            stages = stage_params(scan_parallel(self.folder), self.states)
            self._plain = {
                (p.layer_file, p.name): (p.model_file, p.entry, p.group) for params in stages.values() for p in params
            }
            return self._plain
        model = self.states.state(self.folder / MODEL_FILE)
        module = model.get("module") if isinstance(model, dict) else None
        buffers = set(model.get("buffer_names") or []) if isinstance(model, dict) else set()
        ties = stage0_ties(model) if isinstance(model, dict) else {}  # the optimizer holds a tie once
        dense = [n for n, r in (module or {}).items() if n not in buffers | ties.keys() and isinstance(r, TensorRef)]
        expp = sorted((int(m.group(1)), p.name) for p in self.folder.iterdir() if (m := EXPP_RE.match(p.name)))
        out: dict[str | tuple[str, str], tuple[str, int, int]] = {}
        if not expp:  # the parameters the optimizer steps: frozen ones are in the module only (masters.stage0_frozen)
            frozen = set(stage0_frozen(self.folder, self.states))
            self._pair(out, MODEL_FILE, None, [n for n in dense if n not in frozen])
        else:
            n_experts = len({e for _, e, _ in list_expert_files(self.folder)})
            per_rank = n_experts // len(expp)
            experts: dict[int, list[str]] = {}
            for rel, name, _ in expert_params(self.folder, self.states):
                match = EXPERT_FILE_RE.match(rel)
                assert match is not None  # expert_params lists expert files only
                experts.setdefault(int(match.group(2)) // per_rank, []).append(name)
            for r, rel in expp:
                if r == 0:
                    self._pair(out, rel, 0, dense)
                self._pair(out, rel, 1, experts.get(r, []))
        self._plain = out
        return out

    def _pair(self, out: dict, rel: str, group: int | None, names: list[str]) -> None:
        """The entries of ``group`` (None: every group in order) of ``rel``'s ``optimizer``, one per name."""
        inner = value_at(self.states.state(self.folder / rel), ["optimizer"])
        groups = range(len(inner.get("param_groups") or [])) if group is None and isinstance(inner, dict) else [group]
        slots = [(entry, g) for g in groups for entry in _params(inner, g, rel)]
        if len(slots) != len(names):
            raise UnsupportedCheckpoint(
                f"optimizer holds {len(slots)} parameters for {len(names)} trainable ones "
                "(frozen or tied parameters are not told apart at stage 0)",
                _HINT,
                rel,
            )
        out.update({name: (rel, entry, g) for name, (entry, g) in zip(names, slots)})

    def locate(self, name: str, rel: str, key: list, element_offset: int, numel: int) -> Moments:
        """The moments of master ``name``'s ``numel`` elements at ``element_offset`` of the tensor at
        ``key`` of ``rel`` (a master locator)."""
        master = value_at(self.states.state(self.folder / rel), key)
        if not isinstance(master, TensorRef):
            raise UnsupportedCheckpoint(f"{'/'.join(map(str, key))} is not a tensor (master of {name!r})", _HINT, rel)
        position = element_offset - master.storage_offset
        if position < 0 or position + numel > master.numel:
            raise UnsupportedCheckpoint(f"the master of {name!r} is not inside {'/'.join(map(str, key))}", _HINT, rel)
        file, inner_key, entry_key, group = self._slot(name, rel, key)
        state = self.states.state(self.folder / file)
        inner = value_at(state, inner_key)
        table = inner.get("state") if isinstance(inner, dict) else None
        if not isinstance(table, dict) or not isinstance(entry := table.get(entry_key), dict):
            raise UnsupportedCheckpoint(f"no optimizer state of {name!r} (entry {entry_key})", _HINT, file)
        members = self.states.members(self.folder / file)
        ranges: dict[str, tuple[int, int, str]] = {}
        for k, ref in entry.items():
            if isinstance(k, str) and isinstance(ref, TensorRef) and ref.shape:  # per element; "step" is 0-d
                if ref.numel < master.numel or not ref.is_contiguous():  # a ZeRO partition's state keeps its padding
                    raise UnsupportedCheckpoint(
                        f"optimizer state {k!r} of {name!r} has {ref.numel} elements, its master's {master.numel}",
                        _HINT,
                        file,
                    )
                start, _ = tensor_byte_range(ref, members)
                item = ref.storage.itemsize
                ranges[k] = (start + position * item, numel * item, ref.dtype)
        groups = inner.get("param_groups") if isinstance(inner, dict) else []
        steps = {}
        for g, settings in enumerate(groups if isinstance(groups, list) else []):
            first = settings.get("params") if isinstance(settings, dict) else None
            got = table.get(first[0]) if isinstance(first, list) and first else None
            if isinstance(got, dict) and "step" in got:
                steps[g] = got["step"]
        wrapper = value_at(state, inner_key[:-1]) if len(inner_key) > 1 else None
        return Moments(
            file=file,
            group=group,
            ranges=ranges,
            param_groups=groups if isinstance(groups, list) else [],
            group_steps=steps,
            wrapper=wrapper if isinstance(wrapper, dict) else {},
        )

    def members(self, rel: str) -> dict[str, tuple[int, int]]:
        return self.states.members(self.folder / rel)
