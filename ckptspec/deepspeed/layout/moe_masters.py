"""The fp32 masters of a native MoE checkpoint at ZeRO stage 1 or 2 (issue #17), from its files.

DeepSpeed splits the parameters into optimizer groups (``moe/utils.py``
``split_params_into_different_moe_groups_for_optimizer``): group 0 the dense ones, partitioned
over the whole data-parallel group (``partition_count[0]`` = world size), then one group per
expert-parallel size, partitioned over the **expert-data-parallel** group (``partition_count[1]``).
Each ``zero_pp_rank_<R>`` file holds rank R's partition of every group. The expert group's
parameters differ per expert-parallel rank: ``param_shapes[1]`` names rank 0's local experts
(``…deepspeed_experts.<local>.…``); expert-parallel rank ``e`` holds global experts
``e * L .. e * L + L - 1`` (``L`` local experts) in the same layout.

Which ranks form an expert-data-parallel group is not in the files: DeepSpeed's rule
(``groups._create_expert_and_data_parallel``, ``use_data_before_expert_parallel_`` false) puts rank
R in expert-parallel rank ``R mod ep`` at expert-data-parallel rank ``R // ep``, with
``ep = world size / partition_count[1]``. It is recorded as derived, and cross-checked: every
global name must be a key of its expert file with the same shape (CK202 otherwise).
"""

from __future__ import annotations

import re
from pathlib import Path

from ...checkpoint.states import StateCache
from ...checkpoint.torchfile import TensorRef, tensor_byte_range
from ...errors import UnsupportedCheckpoint
from ...format.dtypes import ITEMSIZE
from ...format.partition import ParamSpec, flat_group
from .masters import MODEL_FILE, MasterTensor, expert_params
from .names import OPTIM_RE

_LOCAL_EXPERT = re.compile(r"(\.deepspeed_experts\.)(\d+)(\.)")
_HINT = "the expert layout of this MoE checkpoint cannot be derived from its files; it is not described"


def _global_name(local: str, ep_rank: int, per_rank: int) -> str:
    m = _LOCAL_EXPERT.search(local)
    if m is None:
        raise UnsupportedCheckpoint(f"expert parameter {local!r} names no expert", _HINT, MODEL_FILE)
    return local[: m.start(2)] + str(ep_rank * per_rank + int(m.group(2))) + local[m.end(2) :]


def _partitions(folder: Path, files: dict[int, str], group: int, states: StateCache) -> dict[int, tuple]:
    """rank -> (file, absolute byte offset, numel, dtype) of its flat partition of ``group``."""
    out = {}
    for rank, rel in files.items():
        osd = states.state(folder / rel).get("optimizer_state_dict") or {}
        ref = (osd.get("single_partition_of_fp32_groups") or [None] * (group + 1))[group]
        if not isinstance(ref, TensorRef):
            raise UnsupportedCheckpoint(f"no flat partition of group {group}", _HINT, rel)
        offset, _ = tensor_byte_range(ref, states.members(folder / rel))
        out[rank] = (rel, offset, ref.numel, ref.dtype)
    return out


def _place(group, names: list[str], parts: list[tuple]) -> list[MasterTensor]:
    """Each parameter of a flat ``group`` (given its output names) as segments of the partitions
    (in partition order) it falls into: a parameter may straddle two ranks."""
    out = []
    size = group.partition_numel
    for param, name in zip(group.params, names):
        segments, start, stop = [], param.offset, param.offset + param.numel
        while start < stop:
            p = start // size
            rel, base, numel, dtype = parts[p]
            end = min(stop, (p + 1) * size)
            if end - p * size > numel:
                raise UnsupportedCheckpoint(f"partition {p} of group {group.optimizer_group} is short", _HINT, rel)
            item = ITEMSIZE[dtype]
            segments.append((rel, base + (start - p * size) * item, (end - start) * item))
            start = end
        out.append(
            MasterTensor(name, tuple(param.shape), parts[0][3], tuple(segments), ("flat", group.optimizer_group))
        )
    return out


def moe_zero_masters(folder: Path, states: StateCache | None = None) -> dict[str, MasterTensor]:
    """Every parameter's master in a native-MoE stage-1/2 tag directory, by global name."""
    states = states if states is not None else StateCache()
    model = states.state(folder / MODEL_FILE)
    files = {int(m.group(1)): p.name for p in folder.iterdir() if (m := OPTIM_RE.match(p.name))}
    first = states.state(folder / files[min(files)])["optimizer_state_dict"]
    counts, paddings = first.get("partition_count"), first.get("param_alignment_paddings")
    shapes, stage = model.get("param_shapes"), int(first["zero_stage"])
    if not isinstance(counts, list) or not isinstance(shapes, list) or len(counts) != 2 or len(shapes) != 2:
        raise UnsupportedCheckpoint("not one dense and one expert optimizer group", _HINT, files[min(files)])
    world, edp = len(files), int(counts[1])
    if int(counts[0]) != world or world % edp:
        raise UnsupportedCheckpoint(f"partition counts {counts} do not fit {world} optimizer files", _HINT, MODEL_FILE)
    ep = world // edp
    per_rank = int((model.get("num_experts") or [0])[0]) // ep
    experts = {name: tuple(ref.shape) for _, name, ref in expert_params(folder, states)}

    def group_of(g: int):
        specs = [ParamSpec(n, tuple(int(d) for d in s), "float32") for n, s in shapes[g].items()]
        pads = paddings[g] if paddings else None
        return flat_group(specs, optimizer_group=g, partition_count=int(counts[g]), zero_stage=stage, paddings=pads)

    dense = group_of(0)
    parts = _partitions(folder, files, 0, states)
    out = {m.name: m for m in _place(dense, [p.name for p in dense.params], [parts[r] for r in range(world)])}
    expert_group = group_of(1)
    parts = _partitions(folder, files, 1, states)
    for e in range(ep):
        names = [_global_name(p.name, e, per_rank) for p in expert_group.params]
        for name, param in zip(names, expert_group.params):
            if experts.get(name) != tuple(param.shape):
                raise UnsupportedCheckpoint(
                    f"expert parameter {name!r} (expert-parallel rank {e}) is not in an expert file with shape "
                    f"{list(param.shape)}",
                    _HINT,
                    MODEL_FILE,
                )
        members = [parts[r] for r in range(world) if r % ep == e]  # by expert-data-parallel rank r // ep
        out.update({m.name: m for m in _place(expert_group, names, members)})
    return out
