"""Format 1.1's ``optimizer`` and ``save`` objects of a DeepSpeed tag directory, from its metadata.

The torch optimizer's param groups (hyperparameters) and ``step``, the loss scaler and the
gradient clipping are pickled plain values in the optimizer-states files; the training
counters are in the model states. ``step`` is a 0-d tensor there: its value is read from the
file's bytes (4 or 8 bytes, never through torch). The optimizer's class is recorded nowhere in
DeepSpeed's files when a client optimizer is used: ``"unknown"``, unless a manifest embedded by
the save hook (which knew the live engine) names it. The save hook's ``save.id`` comes from
that embedded copy too.
"""

from __future__ import annotations

import math
import struct
from pathlib import Path
from typing import Any

from ...checkpoint.embedded import CLIENT_STATE_KEY
from ...checkpoint.torchfile import DynamicLossScalerState, LossScalerState, TensorRef
from ...errors import CkptspecError
from ...format.codec import decode
from ...format.models import LossScaler, Manifest, Optimizer, OptimizerGroup, Save
from ...location import RemotePath, open_binary
from .locators import torch_optimizer_state

UNKNOWN_CLASS = "unknown"
_SCALAR_FORMATS = {"float32": "<f", "float64": "<d", "int64": "<q", "int32": "<i", "float16": "<e"}


def plain_value(value: Any) -> Any:
    """A JSON-representable setting (number, boolean, string, or a list of those), or None when it is not.

    ``None`` values (torch's "default" for foreach, fused...) and tensors are not recorded.
    """
    if isinstance(value, bool):
        return value
    if isinstance(value, str):  # DType (a dtype in the loss scaler) is a str
        return str(value)
    if isinstance(value, int):  # ZeroStage and friends are ints
        return int(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, (list, tuple)) and len(value) <= 1024:
        items = [plain_value(v) for v in value]
        if all(v is not None and not isinstance(v, list) for v in items):
            return items
    return None


def plain_values(mapping: dict, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    out = {}
    for key, value in mapping.items():
        if isinstance(key, str) and key and key not in skip and (plain := plain_value(value)) is not None:
            out[key] = plain
    return out


def scalar_value(value: Any, path: Path | RemotePath, members: dict[str, tuple[int, int]]) -> float | int | None:
    """A number as saved: an int, or a one-element tensor read from the file's bytes."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    if not isinstance(value, TensorRef) or value.numel != 1 or value.dtype not in _SCALAR_FORMATS:
        return None
    if value.storage.member not in members:
        return None
    offset = members[value.storage.member][0] + value.storage_offset * value.storage.itemsize
    fmt = _SCALAR_FORMATS[value.dtype]
    with open_binary(path) as fh:  # a remote file: one small range request
        fh.seek(offset)
        data = fh.read(struct.calcsize(fmt))
    if len(data) != struct.calcsize(fmt):
        return None
    number = struct.unpack(fmt, data)[0]
    return number if not isinstance(number, float) or math.isfinite(number) else None


def index_steps(manifest: Manifest, state: Any, path: Path | RemotePath, members) -> dict[int, Any]:
    """Group index (stage 3: sub-group) -> the ``step`` this file records for it."""
    by_index = torch_optimizer_state(state).get("state")
    out: dict[int, Any] = {}
    for g in range(len(manifest.groups)):
        entry = by_index.get(g) if isinstance(by_index, dict) else None
        if isinstance(entry, dict) and "step" in entry:
            value = scalar_value(entry["step"], path, members)
            if value is not None:
                out[g] = value
    return out


def group_steps(manifest: Manifest, state: Any, path: Path | RemotePath, members) -> dict[int, Any]:
    """Optimizer group -> the ``step`` this file records for it (its first group or sub-group's)."""
    out: dict[int, Any] = {}
    for g, value in index_steps(manifest, state, path, members).items():
        out.setdefault(manifest.groups[g].optimizer_group, value)
    return out


def loss_scaler(osd: dict) -> LossScaler | None:
    scaler = osd.get("loss_scaler")
    if isinstance(scaler, (LossScalerState, DynamicLossScalerState)):
        return LossScaler(kind=scaler.kind, state=plain_values(scaler.state))
    return None


def optimizer_from_states(manifest: Manifest, state: Any, path: Path | RemotePath, members) -> Optimizer | None:
    """The ``optimizer`` object of one optimizer-states file (every rank's file holds the same copy)."""
    osd = state.get("optimizer_state_dict") if isinstance(state, dict) else None
    inner = torch_optimizer_state(state)
    param_groups = inner.get("param_groups")
    if not isinstance(osd, dict) or not isinstance(param_groups, list):
        return None
    steps = group_steps(manifest, state, path, members)
    groups = []
    for g, entry in enumerate(param_groups):
        if isinstance(entry, dict):  # no step saved: not stepped yet, or an optimizer that counts none: 0
            groups.append(
                OptimizerGroup(
                    optimizer_group=g, hyperparameters=plain_values(entry, skip=("params",)), step=steps.get(g, 0)
                )
            )
    optimizer = Optimizer(class_=UNKNOWN_CLASS, groups=groups)
    if (scaler := loss_scaler(osd)) is not None:
        optimizer.loss_scaler = scaler
    clip = plain_value(osd.get("clip_grad"))
    if isinstance(clip, (int, float)) and not isinstance(clip, bool) and clip >= 0:
        optimizer.clip_grad = clip
    return optimizer


def counters(model_state: Any) -> dict[str, int] | None:
    """The training counters DeepSpeed saves in the model states, or None when one is missing."""
    if not isinstance(model_state, dict):
        return None
    out: dict[str, Any] = {key: model_state.get(key) for key in ("global_steps", "global_samples", "skipped_steps")}
    if not all(type(v) is int and v >= 0 for v in out.values()):
        return None
    return out


def embedded_copy(model_state: Any) -> dict | None:
    """The manifest the save hook embedded in a model-states file (client state), decoded, or None."""
    value = model_state.get(CLIENT_STATE_KEY) if isinstance(model_state, dict) else None
    if not isinstance(value, str):
        return None
    try:
        doc = decode(value.encode("utf-8"), "json", CLIENT_STATE_KEY)
    except (CkptspecError, UnicodeEncodeError):  # an unreadable copy is CK302's business, not the producer's
        return None
    return doc if isinstance(doc, dict) else None


def save_from_states(model_state: Any) -> Save | None:
    found = counters(model_state)
    if found is None:
        return None
    save = Save(
        global_steps=found["global_steps"], global_samples=found["global_samples"], skipped_steps=found["skipped_steps"]
    )
    embedded = (embedded_copy(model_state) or {}).get("save")
    if isinstance(embedded, dict) and isinstance(embedded.get("id"), str) and embedded["id"]:
        save.id = embedded["id"]
    return save


def embedded_class(model_state: Any) -> str | None:
    optimizer = (embedded_copy(model_state) or {}).get("optimizer")
    name = optimizer.get("class") if isinstance(optimizer, dict) else None
    return name if isinstance(name, str) and name and name != UNKNOWN_CLASS else None
