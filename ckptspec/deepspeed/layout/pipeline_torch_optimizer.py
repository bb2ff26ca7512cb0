"""Which layer-file weight each optimizer state entry of a pipeline at ZeRO stage 0 without mixed precision is (#40).

DeepSpeed 0.19.8's fp32 pipeline at stage 0 steps the client's torch optimizer itself: no optimizer-state files,
each stage's ``mp_rank_<s>_model_states.pt`` holds that optimizer's ``state_dict()`` (``optimizer``: ``state`` per
parameter index, ``param_groups``), ``param_shapes`` None, and the fp32 weights in the layer files are the masters.
The state names no parameter: its groups take the stage's trainable parameters in module order, which for a
``PipelineModule`` is layer order, then each layer's key order (its state dict's). So the stages, in order, take
the layer files' tensors in order, each as many as its groups list; every taken weight must have its entry's
``exp_avg`` shape and be fp32, a layer must lie on one stage, and every tensor must be taken (frozen parameters,
buffers and ties are not told apart here: refused). A tensor-parallel pipeline's stages of each tensor rank are such a
pipeline, taking that rank's layer files.

An fp16 pipeline at stage 0 (``FP16_UnfusedOptimizer`` around the client's torch optimizer) is paired the same way:
``optimizer`` holds the torch ``state_dict()`` as ``optimizer_state_dict`` beside ``fp32_groups`` (one fp32 master per
parameter, ``fp32_groups[g][i]`` the one of ``param_groups[g].params[i]``) and its dynamic loss scale; the layer
files' weights are fp16 and the masters are those fp32 tensors, each of its weight's shape. Metadata only, no pickle
code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...checkpoint.states import StateCache
from ...checkpoint.torchfile import TensorRef
from ...errors import UnsupportedCheckpoint
from .parallel_files import ParallelFiles, degrees_of, tensor_rank_files

_HINT = "the parameters of this fp32 or fp16 stage-0 pipeline cannot be told from its files; it is not described"


def is_torch_optimizer_state(optimizer: Any) -> bool:
    """A torch optimizer's own ``state_dict()`` (no DeepSpeed wrapper around it)."""
    return isinstance(optimizer, dict) and set(optimizer) == {"state", "param_groups"}


def is_unfused_state(optimizer: Any) -> bool:
    """``FP16_UnfusedOptimizer.state_dict()``: per-parameter fp32 masters around a torch optimizer's state."""
    return (
        isinstance(optimizer, dict)
        and isinstance(optimizer.get("fp32_groups"), list)
        and is_torch_optimizer_state(optimizer.get("optimizer_state_dict"))
    )


def _torch_state(optimizer: Any) -> Any:
    """The torch optimizer's ``state_dict()`` in a stage's ``optimizer``: itself, or FP16_UnfusedOptimizer's inner."""
    return optimizer["optimizer_state_dict"] if is_unfused_state(optimizer) else optimizer


@dataclass(frozen=True)
class StageParam:
    """One trainable parameter of a stage: ``<layer>.<key>``, its weight in ``layer_file`` (the master), and its
    torch optimizer state entry ``entry`` of group ``group`` in the stage's ``model_file``; ``master``: its fp32 master
    at ``master_key`` of ``model_file`` in an fp16 pipeline (FP16_UnfusedOptimizer), None when the weight is it."""

    name: str
    layer_file: str
    key: str
    ref: TensorRef
    model_file: str
    entry: Any
    group: int
    master: TensorRef | None = None
    master_key: tuple = ()


def _entries(model_file: str, wrapper: Any) -> list[tuple[Any, int, tuple, TensorRef | None]]:
    """(state entry key, group, its ``exp_avg`` shape, its fp32 master or None) of every parameter the stage's
    optimizer steps, in order."""
    optimizer = _torch_state(wrapper)
    if not is_torch_optimizer_state(optimizer):
        raise UnsupportedCheckpoint("the model states hold no torch optimizer state_dict", _HINT, model_file)
    groups = wrapper["fp32_groups"] if optimizer is not wrapper else None
    out = []
    for g, group in enumerate(optimizer["param_groups"] if isinstance(optimizer["param_groups"], list) else []):
        for i, entry in enumerate(group.get("params", []) if isinstance(group, dict) else []):
            state = optimizer["state"].get(entry) if isinstance(optimizer["state"], dict) else None
            moment = state.get("exp_avg") if isinstance(state, dict) else None
            if not isinstance(moment, TensorRef):
                raise UnsupportedCheckpoint(f"optimizer state entry {entry} holds no exp_avg", _HINT, model_file)
            master = None
            if groups is not None:
                group_masters = groups[g] if g < len(groups) and isinstance(groups[g], list) else []
                master = group_masters[i] if i < len(group_masters) else None
                if not isinstance(master, TensorRef) or tuple(master.shape) != tuple(moment.shape):
                    raise UnsupportedCheckpoint(
                        f"optimizer/fp32_groups/{g}/{i} is no master of state entry {entry}'s shape", _HINT, model_file
                    )
            out.append((entry, g, tuple(moment.shape), master))
    return out


def stage_params(files: ParallelFiles, states: StateCache) -> dict[int, list[StageParam]]:
    """Every stage's trainable parameters (model-parallel rank -> in its optimizer's order); in a tensor-parallel
    pipeline each tensor rank's stages take its own layer files (``layer_XX-model_YY``), a pipeline of their own."""
    degrees = degrees_of(files, states)
    out: dict[int, list[StageParam]] = {}
    for tensor in range(degrees.tensor):
        out.update(_pipeline_params(tensor_rank_files(files, degrees, tensor), states))
    return out


def _pipeline_params(files: ParallelFiles, states: StateCache) -> dict[int, list[StageParam]]:
    tensors = []  # (layer, file, key, ref) of every layer file's tensor, in module order
    for layer, path in sorted(files.layer_files.items()):
        state = states.state(path)
        if not isinstance(state, dict) or not all(isinstance(r, TensorRef) for r in state.values()):
            raise UnsupportedCheckpoint("a pipeline layer file that is not a dict of tensors", "restore it", path.name)
        tensors += [(layer, path.name, key, ref) for key, ref in state.items()]
    out: dict[int, list[StageParam]] = {}
    taken = 0
    stage_of_layer: dict[int, int] = {}  # layer -> the stage that took its first tensor
    for mp, shards in sorted(files.by_mp_rank.items()):
        model = shards.model_files[min(shards.model_files)]
        state = states.state(model)
        entries = _entries(model.name, state.get("optimizer") if isinstance(state, dict) else None)
        out[mp] = []
        place: dict[int, int] = {}  # group -> the next entry's place in it (its master's in fp32_groups)
        for entry, g, shape, master in entries:
            if taken >= len(tensors):
                raise UnsupportedCheckpoint(
                    f"the optimizer of stage {mp} steps more parameters than the layer files hold", _HINT, model.name
                )
            layer, rel, key, ref = tensors[taken]
            taken += 1
            if tuple(ref.shape) != shape or (master is None and ref.dtype != "float32"):
                raise UnsupportedCheckpoint(
                    f"state entry {entry} of stage {mp} has shape {list(shape)}, the next layer weight "
                    f"{layer}.{key} ({rel}) {list(ref.shape)} {ref.dtype}",
                    _HINT,
                    model.name,
                )
            if stage_of_layer.setdefault(layer, mp) != mp:
                raise UnsupportedCheckpoint(f"{rel} would hold parameters of two stages", _HINT, rel)
            i = place[g] = place.get(g, -1) + 1
            master_key = ("optimizer", "fp32_groups", g, i) if master is not None else ()
            out[mp].append(StageParam(f"{layer}.{key}", rel, key, ref, model.name, entry, g, master, master_key))
    if taken != len(tensors):
        layer, rel, key, _ = tensors[taken]
        raise UnsupportedCheckpoint(
            f"{rel} holds {key!r}, which no stage's optimizer steps (a frozen parameter, buffer or tie)", _HINT, rel
        )
    return out
