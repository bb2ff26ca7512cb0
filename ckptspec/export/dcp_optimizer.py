"""The optimizer state of a torch DCP checkpoint, planned for ``reconstruct DCP_DIR OUT --optimizer-state``.

``get_state_dict(model, optimizer)`` saves a torch optimizer's state flattened by parameter name:
``optim.state.<param>.<state>`` (tensor entries: ``exp_avg`` and ``exp_avg_sq`` in the parameter's shape, chunked as
it is; ``step`` a 0-d tensor) and ``optim.param_groups.<g>.<key>`` (bytes items: the hyperparameters and ``params``,
the group's parameter names), read here as the checks read them (``checks.bytes_values``: plain values, nothing run).
``plan_dcp_optimizer`` pairs them into what ``reconstruct --optimizer-state`` writes for a DeepSpeed checkpoint
(docs/reconstruct.md): ``<param>.<state>`` tensors in the parameter's shape at their saved dtype, and the
``__metadata__`` keys ``ckptspec.optimizer`` (class ``unknown``: DCP records none; each group's hyperparameters and
step), ``ckptspec.optimizer_groups``, ``ckptspec.states``, ``ckptspec.aliases``. Anything it cannot pair is refused
(CK402) and steps that disagree within a group (CK401), before anything is written. Standard library only.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass

from ..checkpoint.dcp.checks import Where, bytes_values
from ..checkpoint.dcp.metadata import DcpMetadata, Item, TensorEntry
from ..checkpoint.dcp.records import read_record
from ..deepspeed.describe.scalars import UNKNOWN_CLASS, plain_values
from ..errors import FileUnreadable, ReconstructMismatch, ReconstructUnsupported
from ..format.models import Optimizer, OptimizerGroup
from ..location import open_binary

STATE_PREFIX = "optim.state."
_GROUP_KEY = re.compile(r"optim\.param_groups\.(\d+)\.(.+)")
_SCALARS = {"float32": "<f", "float64": "<d", "int64": "<q", "int32": "<i"}


@dataclass(frozen=True)
class DcpOptimizerPlan:
    tensors: dict[str, tuple[str, TensorEntry]]  # output name "<param>.<state>" -> (its DCP fqn, its entry)
    metadata: dict[str, str]


def _groups(directory: Where, meta: DcpMetadata) -> dict[int, dict]:
    """Each param group's values by key, from its bytes items (``checks`` refused any that is not plain)."""
    groups: dict[int, dict] = {}
    for fqn, value in bytes_values(directory, meta).items():
        if (m := _GROUP_KEY.fullmatch(fqn)) is not None:
            groups.setdefault(int(m.group(1)), {})[m.group(2)] = value
    return groups


def _step(directory: Where, meta: DcpMetadata, fqn: str, items: dict[str, Item]) -> float | int:
    """The value of the 0-d tensor ``fqn`` (a parameter's ``step``; ``items``: its one item), from its record."""
    entry = meta.entries[fqn]
    item = items[fqn]
    assert isinstance(entry, TensorEntry)
    if entry.dtype not in _SCALARS:
        raise ReconstructUnsupported(f"{fqn}: a step of dtype {entry.dtype}", "", directory / item.file)
    path = directory / item.file
    try:
        with open_binary(path) as fh:  # a URL: the record and its few bytes, in range requests
            record = read_record(fh, path, item.offset, item.length)
            fh.seek(record.data_offset)
            (value,) = struct.unpack(_SCALARS[entry.dtype], fh.read(record.nbytes))
    except OSError as exc:
        raise FileUnreadable(path, exc) from None
    return int(value) if float(value).is_integer() else value


def plan_dcp_optimizer(directory: Where, meta: DcpMetadata, model: dict[str, TensorEntry]) -> DcpOptimizerPlan:
    """The optimizer state of the checked checkpoint in ``directory``, beside its ``model`` tensors (by output
    name): every per-element state of every parameter a param group lists, and each group's step."""
    states = {fqn: e for fqn, e in meta.entries.items() if fqn.startswith(STATE_PREFIX) and isinstance(e, TensorEntry)}
    if not states:
        raise ReconstructUnsupported(
            "no optimizer state: no tensor entry's name starts with 'optim.state.'",
            "save with dcp.save({'model': ..., 'optim': ...}) from get_state_dict(model, optimizer)",
            directory,
        )
    groups = _groups(directory, meta)
    items = {i.fqn: i for i in meta.items if i.fqn in states and states[i.fqn].size == ()}  # the 0-d ones: one each
    tensors: dict[str, tuple[str, TensorEntry]] = {}
    by_param: dict[str, dict[str, str]] = {}
    group_of: dict[str, int] = {}
    out_groups = []
    used = set()
    for g in sorted(groups):
        params = groups[g].get("params")
        if type(params) is not list or not all(type(p) is str for p in params):
            raise ReconstructUnsupported(f"optim.param_groups.{g}.params is {params!r:.80}, not parameter names", "")
        steps = {}
        for p in params:
            prefix = f"{STATE_PREFIX}{p}."
            for fqn, entry in states.items():
                key = fqn.removeprefix(prefix)
                if not fqn.startswith(prefix) or "." in key:
                    continue
                used.add(fqn)
                if key == "step" and entry.size == ():
                    steps[p] = _step(directory, meta, fqn, items)
                elif p in model and entry.size == model[p].size:
                    tensors[f"{p}.{key}"] = (fqn, entry)
                    by_param.setdefault(p, {})[key] = f"{p}.{key}"
                else:
                    raise ReconstructUnsupported(
                        f"{fqn}: a state of size {list(entry.size)}, neither the step nor per element of {p}", ""
                    )
            group_of[p] = g
        if len(set(steps.values())) > 1:
            raise ReconstructMismatch(f"param group {g}: its parameters' steps differ: {steps}", directory)
        step = next(iter(steps.values()), 0)
        out_groups.append(
            OptimizerGroup(optimizer_group=g, hyperparameters=plain_values(groups[g], skip=("params",)), step=step)
        )
    if unlisted := sorted(set(states) - used):
        raise ReconstructUnsupported(f"{unlisted[0]}: the state of a parameter no param group lists", "")
    optimizer = Optimizer(class_=UNKNOWN_CLASS, groups=out_groups)
    metadata = {
        "format": "pt",
        "ckptspec.optimizer": json.dumps(optimizer.model_dump(mode="json", by_alias=True, exclude_unset=True)),
        "ckptspec.optimizer_groups": json.dumps({p: group_of[p] for p in by_param}, sort_keys=True),
        "ckptspec.states": json.dumps(by_param, sort_keys=True),
        "ckptspec.aliases": json.dumps({}),  # a DCP save records no tie: each name's tensor is saved on its own
    }
    return DcpOptimizerPlan(tensors, metadata)
