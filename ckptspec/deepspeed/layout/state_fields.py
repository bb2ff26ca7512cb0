"""Fields of DeepSpeed's saved states, read tolerantly: dtypes, shapes, world size, master partitions.

What ``describe`` reads from the model- and optimizer-states dicts (decoded by the restricted
reader: tensors are ``TensorRef``), one small function each.
"""

from __future__ import annotations

from itertools import chain
from operator import attrgetter
from typing import Any

from ...checkpoint.torchfile import TensorRef
from ...format.dtypes import Dtype

DEEPSPEED_DEFAULT_SUB_GROUP_SIZE = 10**9  # deepspeed/runtime/zero/config.py (0.15-0.19)
_INT_ONLY = frozenset({int})
_STORAGE_DTYPE = attrgetter("storage.dtype")


def dtype_of_config(ds_config: dict) -> Dtype:
    if (ds_config.get("bf16") or ds_config.get("bfloat16") or {}).get("enabled"):
        return "bfloat16"
    if (ds_config.get("fp16") or {}).get("enabled"):
        return "float16"
    return "float32"


def world_size_of(osd: dict) -> int:
    counts: Any = osd.get("partition_count")  # as saved: a list (one count per group) or one int
    return max(counts) if isinstance(counts, list) else int(counts)


def int_shape(shape) -> tuple[int, ...]:
    # torch.Size comes out of the reader as a checked tuple of ints: no copy for it (100k per manifest).
    if type(shape) is tuple and _INT_ONLY.issuperset(map(type, shape)):
        return shape
    return tuple(int(d) for d in shape)


def int_shapes(shapes) -> list[tuple[int, ...]]:
    """``int_shape`` of each: by C loops when every one is a tuple of ints (no Python call per shape)."""
    shapes = list(shapes)
    if {tuple}.issuperset(map(type, shapes)) and _INT_ONLY.issuperset(map(type, chain.from_iterable(shapes))):
        return shapes
    return list(map(int_shape, shapes))


def module_dtypes(module: Any, default: Dtype, names: list[str]) -> list[Dtype]:
    """The dtype of the module's tensor of each name, else ``default``."""
    if not isinstance(module, dict):
        return [default] * len(names)
    refs = list(map(module.get, names))
    if {TensorRef}.issuperset(map(type, refs)):  # every name a tensor (the rule): C loops
        return list(map(_STORAGE_DTYPE, refs))
    return [ref.storage.dtype if type(ref) is TensorRef else default for ref in refs]


def flat_partitions(optim_state: Any, stage: int) -> list:
    """The optimizer file's flat fp32 master partitions, one per group (``TensorRef`` each)."""
    osd = optim_state["optimizer_state_dict"]
    key = "fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"
    parts = osd.get(key)
    return list(parts) if isinstance(parts, list) else []


def master_dtype(optim_state: dict, stage: int) -> Dtype:
    parts = flat_partitions(optim_state, stage)
    return parts[0].dtype if parts and isinstance(parts[0], TensorRef) else "float32"


def stage3_sub_group_owners(osd: dict, n_sub_groups: int) -> list[int]:
    """Sub-group j belongs to the optimizer param group whose 'params' lists j."""
    owners = [0] * n_sub_groups
    inner = osd.get("optimizer_state_dict") or {}
    for g, group in enumerate(inner.get("param_groups") or []):
        for j in group.get("params") or []:
            if isinstance(j, int) and 0 <= j < n_sub_groups:
                owners[j] = g
    return owners
