"""The save hook's model-states files described from the state DeepSpeed handed to ``torch.save``.

Reading a model-states file back means unpickling a record per module tensor: most of the hook's
own time at 100k tensors, for a handful of locators (the frozen parameters, the buffers, each
flat group's low-precision storage). The state ``torch.save`` pickled is still at hand when
DeepSpeed returns, and ``torch.save`` names the storages it writes in the order it first meets
them while pickling (``<archive>/data/0``, ``data/1``, ...): walking the state in pickle order
gives every storage's member, dtype and size, and the tensors give their offsets and shapes.

What the read-back proved is checked on the file, cheaply: its zip directory (the restricted
reader's ``zip_member_locations``: stored, inside the file) must list exactly the predicted
storages, each of exactly its size; a state holding anything the walk does not know, or any
disagreement, sends the file back to the restricted reader. The locators themselves come from
the functions that read files (``locators.py``). ``tests/deepspeed/test_saved_state.py``
compares both ways on every real model-states file of the harness.
"""

from __future__ import annotations

import contextlib
import sys
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ...checkpoint.standins import StorageRef, TensorRef
from ...checkpoint.states import StateCache
from ...checkpoint.torchfile import zip_member_locations
from ...errors import FileUnreadable, TorchFileError
from ...format.dtypes import ITEMSIZE, dtype_name
from ..describe.locators import STORAGE_OF

_ATOMS = (str, int, float, bool, bytes, type(None))


def _torch_engine(checkpoint_engine) -> bool:
    """DeepSpeed's plain ``torch.save`` engine, zip format, its ``save`` not wrapped by anyone else."""
    kind = type(checkpoint_engine)
    return (
        kind.__name__ == "TorchCheckpointEngine"
        and kind.__module__.startswith("deepspeed.")
        and getattr(checkpoint_engine, "zipfile_serialization", False) is True
        and "save" not in vars(checkpoint_engine)
    )


@contextlib.contextmanager
def capturing(engine, into: dict[str, Any]) -> Iterator[None]:
    """While DeepSpeed saves: the state of each model-states file handed to ``torch.save``, by file name."""
    checkpoint_engine: Any = getattr(engine, "checkpoint_engine", None)  # DeepSpeed's object (torch is not followed)
    if not _torch_engine(checkpoint_engine):
        yield
        return
    original = checkpoint_engine.save

    def save(state_dict, path):
        original(state_dict, path)
        if str(path).endswith("model_states.pt"):
            into[Path(path).name] = state_dict

    checkpoint_engine.save = save
    try:
        yield
    finally:
        del checkpoint_engine.save


def storage_order(state: Any) -> dict[int, tuple[str, Any]] | None:
    """The storages ``torch.save(state)`` writes: storage id -> (key, a tensor on it), in pickle
    order; None when the state holds anything but containers, plain values and plain tensors."""
    import torch

    tensor_types = (torch.Tensor, torch.nn.Parameter)
    atoms = (*_ATOMS, torch.Size)  # a torch.Size holds ints only
    found: dict[int, tuple[str, Any]] = {}
    visited: set[int] = set()

    def walk(obj) -> bool:
        kind = type(obj)
        if kind in tensor_types:
            if obj.layout is not torch.strided or obj.is_quantized or obj.is_nested or obj.is_meta or obj.__dict__:
                return False  # pickled another way (or with attributes that may hold tensors)
            cdata = obj.untyped_storage()._cdata
            if cdata not in found:
                found[cdata] = (str(len(found)), obj)
            return True
        if kind not in (dict, OrderedDict, list, tuple):
            return kind in atoms
        if id(obj) in visited:  # pickled once: its storages are known already
            return True
        visited.add(id(obj))
        if kind is list or kind is tuple:
            for item in obj:
                if type(item) not in atoms and not walk(item):
                    return False
            return True
        for key, value in obj.items():  # items first, then an OrderedDict's attributes (_metadata)
            if (type(key) not in atoms and not walk(key)) or (type(value) not in atoms and not walk(value)):
                return False
        return kind is dict or walk(vars(obj))

    return found if walk(state) else None


class SavedStates:
    """``StateCache``'s ``state``/``members`` for the files of one save: the captured model-states
    files from their live state where it checks out (stand-ins carrying it), the rest read back."""

    def __init__(self, captured: dict[str, Any]) -> None:
        self.captured, self.read_back = captured, StateCache()
        self._described: dict[Path, tuple[dict, dict]] = {}
        self.from_live: list[str] = []  # the files described from their live state

    def _live(self, path: Path) -> tuple[dict, dict] | None:
        path = Path(path)
        if path in self._described:
            return self._described[path]
        state = self.captured.get(path.name)
        found = live_description(state, path) if isinstance(state, dict) else None
        if found is not None:
            self._described[path] = found
            self.from_live.append(path.name)
        return found

    def state(self, path) -> Any:
        found = self._live(path)
        return found[0] if found is not None else self.read_back.state(path)

    def members(self, path) -> dict[str, tuple[int, int]]:
        found = self._live(path)
        return found[1] if found is not None else self.read_back.members(path)


def live_description(state: dict, path: Path) -> tuple[dict, dict] | None:
    """(stand-in state, zip members) of a model-states file written from ``state``, or None when
    its zip directory is not exactly the storages the state predicts."""
    order = storage_order(state)
    if order is None or sys.byteorder != "little":
        return None
    try:
        members = zip_member_locations(path)
    except (TorchFileError, FileUnreadable, OSError):
        return None  # read back: the reader says what is wrong
    prefix = next((n[: -len("/data.pkl")] for n in members if n.endswith("/data.pkl") and n.count("/") == 1), None)
    if prefix is None:
        return None
    storages: dict[int, StorageRef] = {}
    for cdata, (key, tensor) in order.items():
        try:
            dtype = dtype_name(tensor.dtype)
        except (KeyError, ValueError):
            return None
        itemsize = ITEMSIZE.get(dtype)
        nbytes = tensor.untyped_storage().nbytes()
        if itemsize is None or nbytes % itemsize:
            return None
        storages[cdata] = StorageRef(
            f"{prefix}/data/{key}", key, dtype, itemsize, nbytes // itemsize, tensor.device.type
        )
    written = {n: size for n, (_, size) in members.items() if n.startswith(f"{prefix}/data/")}
    if written != {s.member: s.nbytes for s in storages.values()}:
        return None
    return _stand_in(state, storages), members


def _stand_in(state: dict, storages: dict[int, StorageRef]) -> dict:
    """What the locators read: the module and frozen fragment tables, as the reader gives them (their
    tensors as ``TensorRef`` when looked up), and each module tensor's storage by name
    (``locators.STORAGE_OF``: for the flat groups' weights, without 100k ``TensorRef``)."""
    import torch

    tensor_types = (torch.Tensor, torch.nn.Parameter)
    module = state.get("module")

    def storage_of(name: str) -> StorageRef | None:
        tensor: Any = module.get(name) if isinstance(module, dict) else None  # a torch.Tensor, or anything
        return storages[tensor.untyped_storage()._cdata] if type(tensor) in tensor_types else None

    out: dict = {STORAGE_OF: storage_of}
    for key in ("module", "frozen_param_fragments"):
        table = state.get(key)
        out[key] = _RefTable(table, storages) if isinstance(table, dict) else table
    return out


class _RefTable(dict):
    """A module table whose tensors become ``TensorRef`` stand-ins when looked up (only the frozen
    parameters and buffers are: building 100k would cost what reading them back did)."""

    def __init__(self, table: dict, storages: dict[int, StorageRef]) -> None:
        super().__init__()
        self._table, self._storages = table, storages

    def get(self, name, default=None):
        import torch

        value = self._table.get(name, default)
        if type(value) in (torch.Tensor, torch.nn.Parameter):  # the walk took it: its storage is known
            return _ref(value, self._storages)
        return value  # anything else is no TensorRef in the file either


def _ref(tensor, storages: dict[int, StorageRef]) -> TensorRef:
    import torch

    return TensorRef(
        storages[tensor.untyped_storage()._cdata],
        tensor.storage_offset(),
        tuple(tensor.shape),
        tuple(tensor.stride()),
        tensor.requires_grad,
        type(tensor) is torch.nn.Parameter,
    )
