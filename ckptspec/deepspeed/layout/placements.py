"""How a tensor-parallel rank's shard sits in the whole tensor, from what DeepSpeed recorded.

AutoTP (DeepSpeed >= 0.19) saves ``universal_checkpoint_info["affine_map"]`` (version 1) in every
mp rank's model states: per parameter-name pattern, the logical (whole) shape and, per tensor rank,
the shard shape and its pieces, each ``shape`` elements at ``source`` = (offset, strides) of the
whole tensor and ``dest`` = (offset, strides) of the shard. One piece that is a contiguous block
along one axis becomes ``{"split": {axis, offset, length}}``; a piece covering the whole tensor is
``"replicated"``; anything else (fused QKV sub-parameters, uneven splits) is kept as the pieces.

A parameter no entry matches is refused by name (CK202): a wrong merge is worse than none
(EleutherAI/gpt-neox #880). The older regular expressions of ``universal_checkpoint_info`` that
Megatron-DeepSpeed saves in its client state (``rule_placement``) are read for even splits only: a
``tp_replicated_parameter_patterns`` match is replicated, a ``parameter_with_row_parallelism_patterns``
one split along dim 1, any other along dim 0 (ds_to_universal's rules), every tensor rank holding an
equal block; a vocabulary (padded), averaged or sub-parameter pattern's match is refused by name.
"""

from __future__ import annotations

import math
import re
from typing import Any

from ...errors import UnsupportedCheckpoint


def contiguous_strides(shape: list[int]) -> list[int]:
    strides, step = [], 1
    for dim in reversed(shape):
        strides.append(step)
        step *= max(dim, 1)
    return strides[::-1]


def affine_params(model_states: Any) -> dict[str, dict] | None:
    """The affine map's pattern -> entry table, or None when the model states have none."""
    info = model_states.get("universal_checkpoint_info") if isinstance(model_states, dict) else None
    amap = info.get("affine_map") if isinstance(info, dict) else None
    if not isinstance(amap, dict) or amap.get("version") != 1 or not isinstance(amap.get("params"), dict):
        return None
    return amap["params"]


def _entry(params: dict[str, dict], name: str) -> dict | None:
    hits = [entry for pattern, entry in params.items() if re.match(pattern, name)]
    return hits[0] if len(hits) == 1 else None


def tp_placement(params: dict[str, dict] | None, name: str, tp_rank: int, local_shape: list[int], file: str):
    """(whole shape, placement) of ``name``'s shard on tensor rank ``tp_rank``."""
    entry = _entry(params, name) if params is not None else None
    rank_entry = (entry or {}).get("ranks", {}).get(tp_rank) if entry else None
    if entry is None or not isinstance(rank_entry, dict):
        raise UnsupportedCheckpoint(
            f"no tensor-parallel merge rule for {name!r} on tensor rank {tp_rank}: the model states' "
            "universal_checkpoint_info has no affine_map entry for it",
            "ckptspec never guesses how tensor-parallel shards compose; save with a DeepSpeed that records "
            "AutoTP's affine_map (0.19), or describe the checkpoint from the live engine",
            file,
        )
    whole = [int(d) for d in entry["logical_shape"]]
    if [int(d) for d in rank_entry["shard_shape"]] != list(local_shape):
        raise UnsupportedCheckpoint(
            f"{name!r} on tensor rank {tp_rank} has shape {list(local_shape)}; the affine_map says "
            f"{rank_entry['shard_shape']}",
            "the model states disagree with themselves: restore the files of one save",
            file,
        )
    pieces = [
        {
            "shape": [int(d) for d in p["shape"]],
            "source": [int(p["source"][0]), [int(s) for s in p["source"][1]]],
            "dest": [int(p["dest"][0]), [int(s) for s in p["dest"][1]]],
        }
        for p in rank_entry["pieces"]
    ]
    return whole, _simplest(pieces, whole, list(local_shape))


def untrainable_placement(
    params: dict[str, dict] | None, name: str, tp_rank: int, local_shape: list[int], file: str, *, buffer: bool
):
    """(whole shape, placement) of a frozen parameter's or persistent buffer's copy on tensor rank ``tp_rank``.

    A frozen parameter is a parameter: AutoTP splits it as a trainable one and records it in the
    affine_map (no entry: CK202, as for a trainable). A buffer is no parameter: AutoTP never
    partitions one and its affine_map names none, so an unmatched buffer is ``"replicated"``, every
    tensor rank holding it whole (the copies must agree, CK401)."""
    if buffer and (params is None or _entry(params, name) is None):
        return list(local_shape), "replicated"
    return tp_placement(params, name, tp_rank, local_shape, file)


def _simplest(pieces: list[dict], whole: list[int], local: list[int]) -> Any:
    if len(pieces) != 1:
        return {"pieces": pieces}
    piece = pieces[0]
    if piece["shape"] != local or piece["dest"] != [0, contiguous_strides(local)]:
        return {"pieces": pieces}
    offset, strides = piece["source"]
    if strides != contiguous_strides(whole):
        return {"pieces": pieces}
    if local == whole and offset == 0:
        return "replicated"
    axes = [a for a, (w, n) in enumerate(zip(whole, local, strict=True)) if w != n]
    if len(axes) != 1 or offset % strides[axes[0]] or offset // strides[axes[0]] + local[axes[0]] > whole[axes[0]]:
        return {"pieces": pieces}
    axis = axes[0]
    # Only a block that starts at the axis' origin in every other dimension is a split.
    if offset >= strides[axis] * whole[axis] or (axis > 0 and offset >= strides[axis - 1]):
        return {"pieces": pieces}
    return {"split": {"axis": axis, "offset": offset // strides[axis], "length": local[axis]}}


def numel(shape: list[int]) -> int:
    return math.prod(shape)


RULE_KEYS = {  # universal_checkpoint_info's pattern lists whose merge an even split cannot express
    "vocabulary_parameter_patterns": "its vocabulary padding",
    "parameter_to_average_patterns": "it is averaged over the tensor ranks",
    "parameter_with_2_sub_params_cat_dim_0": "its two sub-parameters",
}


def rule_info(model_states: Any) -> dict | None:
    """The model states' ``universal_checkpoint_info`` when it holds Megatron's pattern lists (no affine map)."""
    info = model_states.get("universal_checkpoint_info") if isinstance(model_states, dict) else None
    keys = ("parameter_with_row_parallelism_patterns", "tp_replicated_parameter_patterns")
    return info if isinstance(info, dict) and any(isinstance(info.get(k), list) for k in keys) else None


def _matches(info: dict, key: str, name: str) -> bool:
    return any(isinstance(p, str) and re.match(p, name) for p in info.get(key) or [])


def rule_placement(info: dict | None, name: str, tp_rank: int, tp: int, local_shape: list[int], file: str):
    """(whole shape, placement) of ``name``'s shard on tensor rank ``tp_rank`` of ``tp`` by the pattern lists
    (module docstring): replicated, or an even split along dim 1 (row-parallel) or dim 0."""
    if info is None:
        raise UnsupportedCheckpoint(
            f"no tensor-parallel merge rule for {name!r}: the model states have no universal_checkpoint_info",
            "ckptspec never guesses how tensor-parallel shards compose; save the split rules with the checkpoint "
            "(Megatron-DeepSpeed's universal_checkpoint_info client state)",
            file,
        )
    subparams = [s for s in info.get("parameter_with_sub_params") or [] if isinstance(s, dict)]
    refused = [why for key, why in RULE_KEYS.items() if _matches(info, key, name)]
    refused += ["its sub-parameters" for s in subparams if _matches(s, "patterns", name)]
    if refused:
        raise UnsupportedCheckpoint(
            f"{name!r} matches a universal_checkpoint_info pattern an even split cannot merge ({refused[0]})",
            "only replicated, row-parallel and column-parallel parameters are described",
            file,
        )
    if _matches(info, "tp_replicated_parameter_patterns", name):
        return list(local_shape), "replicated"
    axis = 1 if _matches(info, "parameter_with_row_parallelism_patterns", name) else 0
    if len(local_shape) <= axis:
        raise UnsupportedCheckpoint(
            f"{name!r} of shape {list(local_shape)} has no dim {axis} to split along",
            "the universal_checkpoint_info patterns do not describe this parameter",
            file,
        )
    whole = list(local_shape)
    whole[axis] *= tp
    length = local_shape[axis]
    return whole, {"split": {"axis": axis, "offset": tp_rank * length, "length": length}}
