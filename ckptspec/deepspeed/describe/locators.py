"""Format 1.1's locators of a DeepSpeed tag directory's files, from their metadata alone.

A model-states file locates the frozen parameters (stage 3: this rank's fragment of each) and
buffers it holds (``tensors``) and each flat group's low-precision weights (``model_weights``);
an optimizer-states file locates each per-element optimizer state of each group partition
(``state_partitions``). Every locator comes from a tensor's ``TensorRef`` (the restricted
unpickler) and the zip directory, as the master partitions' locators do; nothing is located
that is not one contiguous byte range (docs/spec.md#byte-order): a non-contiguous frozen
parameter or buffer leaves the whole checkpoint without named locators rather than with wrong ones.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from itertools import compress, repeat
from operator import attrgetter, is_, is_not
from typing import Any

from ...checkpoint.standins import StorageRef
from ...checkpoint.torchfile import TensorRef
from ...format.models import Manifest, ModelWeightsLocator, StateLocator, TensorLocator

# The key of a stand-in state (save/captured_state.py) holding "name -> storage" of its module's tensors; no
# unpickled state has it (it is no string).
STORAGE_OF = object()
_STORAGE, _NAME, _NUMEL = attrgetter("storage"), attrgetter("name"), attrgetter("numel")
_MEMBER, _DTYPE, _OFFSET = attrgetter("storage.member"), attrgetter("dtype"), attrgetter("storage_offset")


def _range(ref: TensorRef, members: dict[str, tuple[int, int]], numel: int) -> dict[str, Any]:
    return {key: column[0] for key, column in _ranges([ref], members, [numel]).items()}


def _ranges(refs: list[TensorRef], members: dict[str, tuple[int, int]], numels: list[int]) -> dict[str, list]:
    """``_range`` of each ref, as columns (C loops)."""
    names = list(map(_MEMBER, refs))
    located = list(map(members.__getitem__, names))
    return {
        "member": names,
        "data_offset": [at for at, _ in located],
        "member_size": [size for _, size in located],
        "dtype": list(map(_DTYPE, refs)),
        "element_offset": list(map(_OFFSET, refs)),
        "numel": numels,
    }


def _table(state: Any, key: str) -> dict:
    table = state.get(key) if isinstance(state, dict) else None
    return table if isinstance(table, dict) else {}


def fragment_numel(numel: int, world_size: int, rank: int) -> int:
    """The real elements of rank ``rank``'s stage-3 fragment: ceil(numel / ws), less at the end."""
    share = -(-numel // world_size)
    return max(0, min(share, numel - rank * share))


def tensor_locators(
    manifest: Manifest, state: Any, members: dict[str, tuple[int, int]], rank: int, first: bool
) -> list[TensorLocator] | None:
    """The frozen parameters and buffers a model-states file holds, or None if one cannot be located.

    ``rank``: the file's rank (stage 3), ``first``: the first model-states file, where buffers and
    whole frozen parameters are located (stage 3 repeats buffers in every rank's file).
    """
    module, fragments = _table(state, "module"), _table(state, "frozen_param_fragments")
    wanted: list[tuple[str, dict, int]] = []  # (name, holder, real elements)
    for f in manifest.frozen:
        if f.stored_in == "partitioned_fragments":
            wanted.append((f.name, fragments, fragment_numel(f.numel, manifest.layout.world_size, rank)))
        elif first:
            wanted.append((f.name, module if f.stored_in == "module" else fragments, f.numel))
    if first:
        wanted += [(b.name, module, _product(b.shape)) for b in manifest.buffers]
    refs = []
    for name, holder, numel in wanted:
        ref = holder.get(name)
        if not isinstance(ref, TensorRef) or not ref.is_contiguous() or ref.numel < numel:
            return None
        refs.append(ref)
    names, numels = [w[0] for w in wanted], [w[2] for w in wanted]
    columns = {"name": names, **_ranges(refs, members, numels)}
    return [TensorLocator(**dict(zip(columns, row))) for row in zip(*columns.values())]


def model_weights_locators(
    manifest: Manifest, state: Any, members: dict[str, tuple[int, int]]
) -> list[ModelWeightsLocator]:
    """Each flat group's low-precision storage, where the module's trainable tensors are views of one.

    DeepSpeed's stage 1/2 (and BF16_Optimizer) save the module's trainable tensors uncloned, as
    views of the flat ``bit16_groups_flat`` buffer: the storage holds the whole padded group.
    A group whose tensors do not share one storage of exactly ``padded_numel`` elements is
    not located (docs/spec.md#model-weights).
    """
    storage_of = state.get(STORAGE_OF) if isinstance(state, dict) else None  # a save/captured_state.py stand-in's
    if storage_of is None:
        return flat_group_locators(manifest, members, partial(module_storages, _table(state, "module")))
    return flat_group_locators(manifest, members, lambda names: list(map(storage_of, names)))


def module_storages(module: dict, names: list[str]) -> list[StorageRef | None]:
    """The storage of the module's tensor of each name (None: not a tensor); by C loops when every
    name is a tensor, as in every real save (no Python call per tensor)."""
    refs = list(map(module.get, names))
    if {TensorRef}.issuperset(map(type, refs)):
        return list(map(_STORAGE, refs))
    return [ref.storage if isinstance(ref, TensorRef) else None for ref in refs]


def flat_group_locators(
    manifest: Manifest, members: dict[str, tuple[int, int]], storages_of: Callable[[list[str]], list]
) -> list[ModelWeightsLocator]:
    """``model_weights_locators`` given the storages of module tensors by their names (None: not a
    tensor); ``save/captured_state.py`` gives them from the live tensors a save just wrote."""
    out = []
    for g, group in enumerate(manifest.groups):
        if group.partitioning != "flat":
            continue
        params = group.params
        storages = storages_of(list(compress(map(_NAME, params), map(_NUMEL, params))))  # zero-element: no bytes
        if not storages or not all(map(is_not, storages, repeat(None))):
            continue
        storage = storages[0]
        # One storage: the reader gives views of one storage the same object; else compare values.
        if not all(map(is_, storages, repeat(storage))) and any(s is not storage and s != storage for s in storages):
            continue
        if storage.numel != group.padded_numel or storage.member not in members:
            continue
        data_offset, member_size = members[storage.member]
        out.append(
            ModelWeightsLocator(
                group=g,
                member=storage.member,
                data_offset=data_offset,
                member_size=member_size,
                dtype=storage.dtype,
                element_offset=0,
                numel=storage.numel,
            )
        )
    return out


def torch_optimizer_state(state: Any) -> dict:
    """The wrapped torch optimizer's ``state_dict()`` in an optimizer-states file (``state``,
    ``param_groups``): ``base_optimizer_state`` at stage 1/2 and for BF16_Optimizer,
    ``optimizer_state_dict`` at stage 3."""
    osd = _table(state, "optimizer_state_dict")
    inner = osd.get("base_optimizer_state", osd.get("optimizer_state_dict"))
    return inner if isinstance(inner, dict) else {}


def state_locators(
    manifest: Manifest, state: Any, members: dict[str, tuple[int, int]], rank: int
) -> list[StateLocator]:
    """Every per-element state (a tensor of one or more dimensions) of each group partition of the file.

    The torch state is indexed like the groups: at stage 1/2 each optimizer param group holds one
    "parameter", the rank's flat partition of group g (state index g); at stage 3 the state
    index is the sub-group. Scalars (``step``) are not located: ``optimizer.groups`` records them.
    """
    by_index = _table(torch_optimizer_state(state), "state")
    out = []
    for g in range(len(manifest.groups)):
        entry = by_index.get(g)
        for key, ref in entry.items() if isinstance(entry, dict) else ():
            if isinstance(key, str) and isinstance(ref, TensorRef) and ref.shape and ref.is_contiguous():
                out.append(StateLocator(group=g, rank=rank, state=key, **_range(ref, members, ref.numel)))
    return out


def _product(shape) -> int:
    out = 1
    for d in shape:
        out *= int(d)
    return out
