"""Where the fp32 masters of ZeRO stage-0, stage-0 MoE and universal checkpoints are (issue #17).

These checkpoints keep one tensor per parameter rather than flat ZeRO partitions, in places
format 1.x has no locator for:

* **stage 0, fp32** (the client optimizer itself): the weights in ``module`` are the masters, of the parameters its
  ``state_dict()`` (``optimizer``) lists (``stage0_names.client_moments``: the others are frozen);
* **stage 0, bf16/fp16 with a client optimizer** (``FP16_UnfusedOptimizer``):
  ``optimizer.fp32_groups[g][i]`` in ``mp_rank_00_model_states.pt``, one full-shape fp32 tensor per
  trainable parameter, in the optimizer's parameter order;
* **stage 0, bf16/fp16 with DeepSpeed's FusedAdam** (``FP16_Optimizer``, DeepSpeed's ``"Adam"``):
  ``optimizer.fp32_groups_flat[g]``, one flat fp32 tensor per group, its parameters' masters back to
  back without padding (``_flatten_dense_tensors``);
* **MoE at stage 0**: the dense parameters as above, each expert in its file
  ``layer_<L>_expert_<E>_mp_rank_00_model_states.pt`` (keys carry the global expert id); with
  ``FP16_UnfusedOptimizer`` each ``expp_rank_<R>_mp_rank_00_optim_states.pt`` holds the dense
  masters again (``fp32_groups[0]``) and expert-parallel rank R's experts' (``fp32_groups[1]``);
* **universal folders** (``ds_to_universal``): ``zero/<name>/fp32.pt``, ``{'param': tensor}`` in the
  full shape (``cat_dim`` beside it from a stage <= 2 source) or, from a stage-3 source, a bare flat
  tensor whose shape is in the copied model states' ``param_shapes``.

The order of ``fp32_groups`` is the optimizer's, which DeepSpeed does not record by name at stage 0
(``param_shapes`` is None). It is the module's trainable parameters in ``module`` order (buffers
left out), the dense ones then each expert's: every tensor's shape must match its name's, or the
checkpoint is refused by name (CK202), never guessed. A frozen parameter is in the module but not in
the optimizer: where ``fp32_groups`` hold fewer masters than the module has parameters (a dense or
AutoTP model without experts), they are named by the one order-keeping choice of parameters with
their shapes, the others frozen (at fp32, where the client optimizer's ``param_groups`` list fewer parameters: by
the shapes of their per-element state); a tie (one parameter under two names: the same tensor twice in
``module``) holds one master, under its first name (both rules: ``stage0_names``).
A flat group has no shapes: each group must end where a parameter ends, and the validation compares
every master with the saved weight of its name (CK235). Weights that are not fp32 are never taken for
masters: a stage-0 checkpoint whose model states hold no fp32 copy the optimizer kept is refused by
name. Metadata only: no tensor bytes, no pickle code.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...checkpoint.states import StateCache
from ...checkpoint.torchfile import TensorRef, tensor_byte_range
from ...errors import UnsupportedCheckpoint
from ...format.dtypes import Dtype
from ...location import RemotePath
from .stage0_names import UNNAMED_HINT as _HINT
from .stage0_names import client_moments, frozen_apart, stage0_ties

EXPERT_FILE_RE = re.compile(r"^layer_(\d+)_expert_(\d+)_mp_rank_(\d+)_model_states\.pt$")
EXPP_RE = re.compile(r"^expp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
MODEL_FILE = "mp_rank_00_model_states.pt"


@dataclass(frozen=True)
class MasterTensor:
    """One parameter's fp32 master: its ``segments`` (file relative to the folder read, absolute
    byte offset, byte count), concatenated; ``key`` its place in the pickle (for a reader that
    unpickles; the flat group's index for a ZeRO partition)."""

    name: str
    shape: tuple[int, ...]
    dtype: Dtype
    segments: tuple[tuple[str, int, int], ...]
    key: tuple


def _locate(
    folder: Path | RemotePath, rel: str, ref: object, name: str, key: tuple, states: StateCache
) -> MasterTensor:
    if not isinstance(ref, TensorRef):
        raise UnsupportedCheckpoint(f"{'/'.join(map(str, key))} is not a tensor (master of {name!r})", _HINT, rel)
    offset, nbytes = tensor_byte_range(ref, states.members(folder / rel))
    return MasterTensor(name, tuple(ref.shape), ref.dtype, ((rel, offset, nbytes),), key)


def _trainable_names(model: dict) -> list[tuple[str, tuple[int, ...]]]:
    buffers = set(model.get("buffer_names") or [])
    module = model.get("module") or {}
    return [(n, tuple(r.shape)) for n, r in module.items() if n not in buffers and isinstance(r, TensorRef)]


def list_expert_files(folder: Path | RemotePath) -> list[tuple[int, int, str]]:
    """(MoE layer, global expert, file name) of every expert file, in that order."""
    found = [
        (int(m.group(1)), int(m.group(2)), p.name) for p in folder.iterdir() if (m := EXPERT_FILE_RE.match(p.name))
    ]
    return sorted(found)


def expert_params(folder: Path | RemotePath, states: StateCache) -> list[tuple[str, str, TensorRef]]:
    """(file, global name, tensor) of every expert parameter, by layer, expert, then key order."""
    out = []
    for _, _, rel in list_expert_files(folder):
        state = states.state(folder / rel)
        if not isinstance(state, dict):
            raise UnsupportedCheckpoint("an expert file that is not a dict of tensors", _HINT, rel)
        out += [(rel, name, ref) for name, ref in state.items()]
    return out


def _named_group(
    folder: Path | RemotePath, rel: str, tensors: list, names: list[tuple[str, tuple]], key: tuple, states: StateCache
) -> list[MasterTensor]:
    """Pair a ``fp32_groups`` list with the names of its parameters, checking every shape."""
    if len(tensors) != len(names):
        raise UnsupportedCheckpoint(
            f"{'/'.join(map(str, key))} holds {len(tensors)} masters for {len(names)} trainable parameters", _HINT, rel
        )
    out = []
    for i, (ref, (name, shape)) in enumerate(zip(tensors, names)):
        master = _locate(folder, rel, ref, name, (*key, i), states)
        if master.shape != shape:
            raise UnsupportedCheckpoint(
                f"master {'/'.join(map(str, (*key, i)))} has shape {list(master.shape)}, parameter {name!r} "
                f"{list(shape)}: the optimizer's order is not the module's",
                _HINT,
                rel,
            )
        out.append(master)
    return out


def stage0_masters(
    folder: Path | RemotePath, states: StateCache | None = None, model_file: str = MODEL_FILE
) -> dict[str, MasterTensor]:
    """Every parameter's master in a stage-0 tag directory (dense or native MoE), by global name; ``model_file``: the
    model states of another tensor rank (AutoTP at stage 0: one file per tensor rank, no experts)."""
    states = states if states is not None else StateCache()
    model = states.state(folder / model_file)
    if not isinstance(model, dict) or not isinstance(model.get("module"), dict):
        raise UnsupportedCheckpoint("model states hold no 'module'", _HINT, model_file)
    dense = _trainable_names(model)
    experts = expert_params(folder, states)
    ties = stage0_ties(model)
    if ties and experts:
        raise UnsupportedCheckpoint(
            f"ZeRO stage 0 MoE with tied parameters ({', '.join(f'{a!r} is {o!r}' for a, o in ties.items())}): "
            "not described",
            _HINT,
            model_file,
        )
    dense = [(name, shape) for name, shape in dense if name not in ties]  # the optimizer holds a tie once
    optimizer: Any = model.get("optimizer")  # decoded, unchecked: each branch below tests what it reads
    unfused = isinstance(optimizer, dict) and "fp32_groups" in optimizer
    out: dict[str, MasterTensor] = {}
    if isinstance(optimizer, dict) and "fp32_groups_flat" in optimizer:
        if experts:
            raise UnsupportedCheckpoint(
                "ZeRO stage 0 MoE with FP16_Optimizer (optimizer/fp32_groups_flat): its flat expert groups "
                "are not described",
                _HINT,
                model_file,
            )
        return _flat_groups(folder, optimizer["fp32_groups_flat"], dense, states, model_file)
    if not unfused:  # no mixed precision: the fp32 weights are the masters
        module = model["module"]
        held = None if experts else client_moments(optimizer, len(dense), model_file)
        if held is not None:  # the parameters the client optimizer steps, named by its state's shapes; the rest frozen
            trained = frozen_apart(model, dense, held, model_file)
            dense = dense if trained is None else trained
        for name, _ in dense:
            out[name] = _fp32_weight(
                _locate(folder, model_file, module[name], name, ("module", name), states), optimizer
            )
        for rel, name, ref in experts:
            out[name] = _fp32_weight(_locate(folder, rel, ref, name, (name,), states), optimizer)
        return out
    groups = optimizer["fp32_groups"]
    if not experts:
        held = [ref for group in groups if isinstance(group, list) for ref in group]
        trained = frozen_apart(model, dense, held, model_file)
        if trained is not None:
            dense = trained  # the masters' parameters; the rest are frozen (stage0_frozen)
        if sum(len(group) for group in groups) != len(dense):
            raise UnsupportedCheckpoint(
                f"ZeRO stage 0: optimizer/fp32_groups holds {sum(len(g) for g in groups)} masters for {len(dense)} "
                "trainable parameters (frozen, tied or shared parameters are not told apart at stage 0)",
                _HINT,
                model_file,
            )
        start = 0
        for g, group in enumerate(groups):  # the groups take the parameters in order
            names = dense[start : start + len(group)]
            start += len(group)
            for m in _named_group(folder, model_file, group, names, ("optimizer", "fp32_groups", g), states):
                out[m.name] = m
        return out
    return _moe_unfused(folder, model, dense, experts, states)


def stage0_frozen(
    folder: Path | RemotePath, states: StateCache | None = None, model_file: str = MODEL_FILE
) -> list[str]:
    """The frozen parameters of a stage-0 tag directory's ``model_file`` (AutoTP: a tensor rank's): the module's
    parameters that hold no master (``frozen_apart``), in module order; none where every one does."""
    states = states if states is not None else StateCache()
    masters = stage0_masters(folder, states, model_file)
    model = states.state(folder / model_file)
    ties = stage0_ties(model)
    return [name for name, _ in _trainable_names(model) if name not in masters and name not in ties]


def _fp32_weight(weight: MasterTensor, optimizer) -> MasterTensor:
    """A saved weight taken for its master: only an fp32 one (a run without mixed precision)."""
    if weight.dtype != "float32":
        keys = sorted(optimizer) if isinstance(optimizer, dict) else optimizer
        raise UnsupportedCheckpoint(
            f"ZeRO stage 0: {weight.name!r} is saved in {weight.dtype} and the model states hold no fp32 masters "
            f"(optimizer: {keys}); the {weight.dtype} weights are not taken for masters",
            _HINT,
            weight.segments[0][0],
        )
    return weight


def _flat_groups(
    folder: Path | RemotePath, groups, dense, states: StateCache, model_file: str
) -> dict[str, MasterTensor]:
    """FP16_Optimizer: ``fp32_groups_flat[g]`` is its group's trainable parameters' masters back to back.
    The groups take the module's trainable parameters in order; each must end where a parameter ends."""
    if not isinstance(groups, list) or not groups:
        raise UnsupportedCheckpoint("optimizer/fp32_groups_flat is not a list of flat tensors", _HINT, model_file)
    out: dict[str, MasterTensor] = {}
    i = 0
    for g, ref in enumerate(groups):
        key = ("optimizer", "fp32_groups_flat", g)
        flat = _locate(folder, model_file, ref, f"group {g}", key, states)
        if flat.dtype != "float32" or len(flat.shape) != 1:
            raise UnsupportedCheckpoint(
                f"optimizer/fp32_groups_flat/{g} is {flat.dtype} of shape {list(flat.shape)}, not a flat fp32 tensor",
                _HINT,
                model_file,
            )
        (_, start, nbytes), filled = flat.segments[0], 0
        while filled < nbytes:
            if i == len(dense):
                raise UnsupportedCheckpoint(
                    f"optimizer/fp32_groups_flat holds more elements than the {len(dense)} trainable parameters",
                    _HINT,
                    model_file,
                )
            name, shape = dense[i]
            size = math.prod(shape) * 4
            if not size or filled + size > nbytes:
                raise UnsupportedCheckpoint(
                    f"optimizer/fp32_groups_flat/{g} ({nbytes // 4} elements) does not take {name!r} whole "
                    "(frozen, tied or zero-element parameters are not told apart at stage 0)",
                    _HINT,
                    model_file,
                )
            out[name] = MasterTensor(name, shape, "float32", ((model_file, start + filled, size),), key)
            filled, i = filled + size, i + 1
    if i != len(dense):
        raise UnsupportedCheckpoint(
            f"optimizer/fp32_groups_flat holds the masters of {i} of the {len(dense)} trainable parameters "
            "(frozen or tied parameters are not told apart at stage 0)",
            _HINT,
            model_file,
        )
    return out


def _moe_unfused(folder: Path | RemotePath, model: dict, dense, experts, states: StateCache) -> dict[str, MasterTensor]:
    """FP16_UnfusedOptimizer with MoE: ``expp_rank_R`` holds the dense group and rank R's experts.
    Rank 0's file is authoritative for the dense masters (the copies are compared by the checks)."""
    expp = sorted((int(m.group(1)), p.name) for p in folder.iterdir() if (m := EXPP_RE.match(p.name)))
    n_experts = sum((model.get("num_experts") or [0])[:1]) or len({e for _, e, _ in list_expert_files(folder)})
    per_rank = n_experts // len(expp) if expp else 0
    out: dict[str, MasterTensor] = {}
    by_expert: dict[int, list[tuple[str, tuple]]] = {}
    for rel, name, ref in experts:
        expert_file = EXPERT_FILE_RE.match(rel)
        assert expert_file is not None  # expert_params lists the files this pattern names
        by_expert.setdefault(int(expert_file.group(2)), []).append((name, tuple(ref.shape)))
    for r, rel in expp:
        state = states.state(folder / rel)
        groups = (state.get("optimizer") or {}).get("fp32_groups") if isinstance(state, dict) else None
        if not isinstance(groups, list) or len(groups) != 2:
            raise UnsupportedCheckpoint("optimizer/fp32_groups is not [dense, experts]", _HINT, rel)
        names = [n for e in range(r * per_rank, (r + 1) * per_rank) for n in by_expert.get(e, [])]
        for master in _named_group(folder, rel, groups[1], names, ("optimizer", "fp32_groups", 1), states):
            out[master.name] = master
        if r == 0:
            for master in _named_group(folder, rel, groups[0], dense, ("optimizer", "fp32_groups", 0), states):
                out[master.name] = master
    return out


def universal_masters(folder: Path, states: StateCache | None = None) -> dict[str, MasterTensor]:
    """Every parameter's ``fp32.pt`` in a ``ds_to_universal`` folder, by name, in its whole shape."""
    states = states if states is not None else StateCache()
    shapes: dict[str, tuple[int, ...]] = {}
    for path in sorted(folder.glob("*model_states.pt")):  # a stage-3 source's flat tensors need these
        state = states.state(path)
        for group in (state.get("param_shapes") or []) if isinstance(state, dict) else []:
            shapes.update({n: tuple(int(d) for d in s) for n, s in group.items()})
    out = {}
    for param_dir in sorted(p for p in (folder / "zero").iterdir() if p.is_dir()):
        rel = f"zero/{param_dir.name}/fp32.pt"
        value = states.state(folder / rel)
        ref, key = (value.get("param"), ("param",)) if isinstance(value, dict) else (value, ())
        master = _locate(folder, rel, ref, param_dir.name, key, states)
        shape = master.shape
        bare = not isinstance(value, dict)  # {'param': T} is in its whole (logical) shape already
        if bare and len(shape) == 1 and param_dir.name in shapes and shapes[param_dir.name] != shape:
            if math.prod(shapes[param_dir.name]) != shape[0]:
                raise UnsupportedCheckpoint(  # e.g. a tensor-parallel stage-3 source: param_shapes are shards
                    f"{rel} holds {shape[0]} elements for shape {list(shapes[param_dir.name])}", _HINT, rel
                )
            shape = shapes[param_dir.name]  # a stage-3 source: flat, viewed as the parameter
        out[param_dir.name] = MasterTensor(param_dir.name, shape, master.dtype, master.segments, key)
    return out


def stage0_replicas(folder: Path, states: StateCache | None = None) -> list[tuple[MasterTensor, MasterTensor]]:
    """(master, a copy DeepSpeed saved of it) of every replicated stage-0 MoE master: with
    FP16_UnfusedOptimizer every ``expp_rank_R`` repeats the dense masters (``fp32_groups[0]``), and
    ``mp_rank_00``'s ``optimizer`` repeats ``expp_rank_0``'s whole state. They must be equal, bit for
    bit; which copy a reader took must not matter."""
    states = states if states is not None else StateCache()
    masters = stage0_masters(folder, states)
    model = states.state(folder / MODEL_FILE)
    optimizer = model.get("optimizer")
    experts = expert_params(folder, states)
    if not (isinstance(optimizer, dict) and "fp32_groups" in optimizer) or not experts:
        return []
    dense = _trainable_names(model)
    rank0 = [
        (name, tuple(ref.shape))
        for rel, name, ref in experts
        if name in masters and masters[name].segments[0][0].startswith("expp_rank_0_")
    ]
    # (file, its fp32_groups as decoded, the names of each group it repeats)
    copies: list[tuple[str, Any, tuple[list[tuple[str, tuple]], ...]]] = [
        (MODEL_FILE, optimizer["fp32_groups"], (dense, rank0))
    ]
    for p in sorted(folder.iterdir()):
        m = EXPP_RE.match(p.name)
        if m and int(m.group(1)) != 0:
            groups = (states.state(p).get("optimizer") or {}).get("fp32_groups")
            copies.append((p.name, groups[:1] if isinstance(groups, list) else groups, (dense,)))
    pairs = []
    for rel, groups, names in copies:
        if not isinstance(groups, list) or len(groups) < len(names):
            raise UnsupportedCheckpoint("optimizer/fp32_groups is not [dense, experts]", _HINT, rel)
        for g, group_names in enumerate(names):
            for copy in _named_group(folder, rel, groups[g], group_names, ("optimizer", "fp32_groups", g), states):
                pairs.append((masters[copy.name], copy))
    return pairs


def value_at(state, key: list):
    """The object a locator's ``key`` (dict keys and list indices) names in a decoded state, or None."""
    for part in key:
        if isinstance(state, dict) and part in state:
            state = state[part]
        elif isinstance(state, (list, tuple)) and isinstance(part, int) and part < len(state):
            state = state[part]
        else:
            return None
    return state
