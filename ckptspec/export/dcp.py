"""Export to PyTorch Distributed Checkpoint (DCP): a DeepSpeed run of any kind continues under FSDP2 at any
world size.

The writer takes the one ``Checkpoint`` model (``ckptspec.open``): every kind's whole tensors and optimizer
states, located as ``Checkpoint.tensors`` and ``optimizer_tensors`` are. The output has the keys
``torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer)`` gives for a plain FSDP2 model
of the consolidated module (tp1, pp1, ep1), saved as ``{"model": ..., "optim": ...}``:

* ``model.<name>``: every entry of the module's state dict: trainable parameters as their fp32
  masters, frozen parameters and persistent buffers as stored, a tied alias under each of its
  names (``module.state_dict()`` has them all);
* ``optim.state.<param>.{exp_avg, exp_avg_sq, step}``: per parameter, a tie once (under the
  name ``named_parameters()`` gives it), ``step`` a 0-d float32 tensor as torch's Adam keeps it;
* ``optim.param_groups.<i>.*``: each optimizer group's hyperparameters and ``params`` (names).

Every tensor is written whole (one chunk); DCP's load reshards it into whatever DTensor layout
the loading job has. torch's own writer writes everything (``dcp.save`` with a
``FileSystemWriter``, torch writes ``.metadata``): its state dict holds zero-byte stand-ins of the
right shape and dtype, and the planner reads each tensor from the shard files only when the
writer asks for it. The writer keeps every tensor of one output file until the file is done, so
each tensor gets a file of its own (``single_file_per_rank=False``): one tensor in memory at a time
(two while the writer's loop still holds the previous one).
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._fs import fsync_dir, write_atomic
from .._version import __version__
from ..errors import ForeignOutput, ReconstructUnsupported
from ..format.dtypes import ITEMSIZE
from ..format.models import Manifest, Optimizer
from ..location import RemotePath, location
from .arrays import ShardReader, read_array
from .checkpoint import Checkpoint
from .model_plan import ModelPlan, ReconstructionPlan, TensorSource
from .optimizer_state import optimizer_state_plan
from .output_dir import build_and_publish, held_output
from .writers import to_torch

MARKER = "ckptspec-export.json"  # what the export holds and left out; marks the directory as ckptspec's
ADAM_STATES = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}
# torch's Adam and AdamW keep these with the value None; a manifest records no None.
_NONE_DEFAULTS = ("foreach", "fused")


@dataclass
class DcpPlan:
    tensors: dict[str, TensorSource]  # flattened DCP key -> where its bytes are (written as stored)
    steps: dict[str, float]  # flattened DCP key -> an optimizer step (a 0-d float32 tensor)
    param_groups: list[dict[str, Any]]
    not_carried: list[str] = field(default_factory=list)  # what the source has and DCP does not get

    @property
    def nbytes(self) -> int:
        return sum(s.numel * ITEMSIZE[s.dtype] for s in self.tensors.values()) + 4 * len(self.steps)


@dataclass
class DcpResult:
    output_dir: Path | RemotePath  # a URL's is a RemotePath
    tensors: int
    nbytes: int
    files: int
    not_carried: list[str]


def plan_dcp(checkpoint: Checkpoint) -> DcpPlan:
    """Every DCP key of the export of a checkpoint of any kind and where its data is: the whole model's
    tensors and each parameter's optimizer states, located as ``checkpoint.tensors`` and
    ``checkpoint.optimizer_tensors`` are. CK402, naming the kind, where the optimizer state is not
    located or is not Adam's (nothing is written then)."""
    plan = checkpoint.plan
    try:
        state = optimizer_state_plan(plan)  # CK402 when the document locates no optimizer state
    except ReconstructUnsupported as exc:
        needs = f"the DCP export of a {checkpoint.kind.label} checkpoint needs its Adam state"
        raise ReconstructUnsupported(f"{exc.message} ({needs})", exc.hint, exc.file) from None
    keys = {key for by_key in state.states.values() for key in by_key}
    if not {"exp_avg", "exp_avg_sq"} <= keys or not keys <= ADAM_STATES:
        raise ReconstructUnsupported(
            f"the {checkpoint.kind.label} checkpoint's optimizer state has the keys {sorted(keys)}, not Adam's "
            "(exp_avg, exp_avg_sq)",
            "the DCP export writes torch.optim.Adam/AdamW state; export the weights with `ckptspec reconstruct`",
        )
    optimizer = Optimizer.model_validate(json.loads(state.metadata["ckptspec.optimizer"]))
    tensors: dict[str, TensorSource] = {}
    for name in plan.order:
        tensors[f"model.{name}"] = plan.sources[plan.aliases.get(name, name)]

    group_of: dict[str, int] = json.loads(state.metadata["ckptspec.optimizer_groups"])
    scalars = {g.optimizer_group: g for g in optimizer.groups}
    steps: dict[str, float] = {}
    members: dict[int, list[str]] = {}
    for name in plan.order:  # the model's order, as get_state_dict lists param_groups' params
        if name in plan.aliases or name not in state.states:
            continue
        g = group_of[name]
        if g not in scalars:
            raise ReconstructUnsupported(f"{name}: optimizer group {g} has no hyperparameters or step", "regenerate")
        members.setdefault(g, []).append(name)
        for key, source_name in state.states[name].items():
            tensors[f"optim.state.{name}.{key}"] = state.sources[source_name]
        steps[f"optim.state.{name}.step"] = float(scalars[g].step)
    param_groups = []
    for g in sorted(scalars):
        settings: dict[str, Any] = {
            k: tuple(v) if isinstance(v, list) else v for k, v in scalars[g].hyperparameters.items()
        }
        for key in _NONE_DEFAULTS:
            settings.setdefault(key, None)
        param_groups.append({**settings, "params": members.get(g, [])})
    return DcpPlan(tensors, steps, param_groups, _not_carried(plan, optimizer))


def _manifests(plan: ModelPlan) -> list[Manifest]:
    """The 1.x manifests behind the plan: a ZeRO checkpoint's, or each domain's of a checkpoint index."""
    if isinstance(plan, ReconstructionPlan):
        return [plan.manifest]
    from .compose_plan import IndexReconstructionPlan

    assert isinstance(plan, IndexReconstructionPlan), type(plan)
    return [p.manifest for p in plan.domain_plans.values()]


def _not_carried(plan: ModelPlan, optimizer: Optimizer) -> list[str]:
    """What the checkpoint holds (or lacks) that a DCP of get_state_dict's keys cannot carry."""
    out = []
    if optimizer.class_ in (None, "unknown"):
        out.append("optimizer class: not recorded in the checkpoint (the state is Adam's: use torch.optim.AdamW/Adam)")
    else:
        out.append(f"optimizer class: {optimizer.class_} (construct the equivalent torch optimizer)")
    if optimizer.loss_scaler is not None:
        out.append(
            f"loss scaler: {optimizer.loss_scaler.kind} {json.dumps(optimizer.loss_scaler.state, sort_keys=True)}"
        )
    if optimizer.clip_grad is not None:
        out.append(f"gradient clipping: {optimizer.clip_grad} (clip in your training loop)")
    manifests = _manifests(plan)
    s = next((m.save for m in manifests if m.save is not None), None)
    if s is not None:  # every domain of one save records the same counters
        out.append(
            f"training counters: global_steps={s.global_steps} global_samples={s.global_samples} "
            f"skipped_steps={s.skipped_steps}"
        )
    for excluded in (e for m in manifests for e in m.excluded):
        out.append(f"{excluded.name}: not in the checkpoint ({excluded.reason}); load with allow_partial_load")
    return out


def _standin(torch, shape, dtype: str):
    """A zero-byte tensor of ``shape`` and ``dtype``: what the planner sees, never what is written."""
    return torch.empty((), dtype=getattr(torch, dtype)).expand(tuple(shape))


def _state_dict(torch, dcp_plan: DcpPlan) -> dict[str, Any]:
    """The nested state dict DCP flattens to the plan's keys, with stand-ins for the tensors."""
    root: dict[str, Any] = {"model": {}, "optim": {"state": {}, "param_groups": dcp_plan.param_groups}}
    for key, source in dcp_plan.tensors.items():
        tensor = _standin(torch, source.shape, source.dtype)
        if key.startswith("model."):
            root["model"][key.removeprefix("model.")] = tensor
        else:
            name, state = key.removeprefix("optim.state.").rsplit(".", 1)
            root["optim"]["state"].setdefault(name, {})[state] = tensor
    for key in dcp_plan.steps:
        name = key.removeprefix("optim.state.").rsplit(".", 1)[0]
        root["optim"]["state"].setdefault(name, {})["step"] = _standin(torch, (), "float32")
    return root


@contextlib.contextmanager
def held_export_output(output_dir: str | os.PathLike) -> Iterator[Path]:
    """OUTPUT held against other runs (CK908; ``output_dir.held_output``) and found empty or an earlier
    export (CK909). The command holds it from its start, so a second run is refused while the first
    still validates or reads (issue #37, M6), not only while it writes."""
    with held_output(output_dir, "the export") as out:
        if any(out.iterdir()) and not (out / MARKER).is_file():
            raise ForeignOutput(os.fspath(output_dir), Path(output_dir).name)
        yield out


def write_dcp(
    checkpoint: Checkpoint,
    output_dir: str | os.PathLike,
    progress: Callable[[int], None] | None = None,
    *,
    held: Path | None = None,
) -> DcpResult:
    """Write the DCP directory ``output_dir``: complete or not at all (a temporary directory beside
    it, renamed when done), held against other runs: here, or by the caller (``held``, what
    ``held_export_output`` yielded). An existing ``output_dir`` is replaced only if empty or an
    earlier export."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import WriteItemType

    dcp_plan = plan_dcp(checkpoint)
    checkpoint.check_copies()  # a model's replicated copies are equal (CK401) before any tensor is written
    progress = progress or (lambda n: None)
    files = ShardReader(checkpoint.plan.file_hashes)

    def produce(key: str):
        if key in dcp_plan.steps:
            progress(4)
            return torch.tensor(dcp_plan.steps[key], dtype=torch.float32)
        source = dcp_plan.tensors[key]
        tensor = to_torch(read_array(source, source.dtype, files), source.dtype)
        progress(source.numel * ITEMSIZE[source.dtype])
        return tensor

    class StreamingPlanner(DefaultSavePlanner):
        """The default planner, reading each tensor from the checkpoint when the writer asks for it."""

        def resolve_data(self, write_item):
            if write_item.type == WriteItemType.BYTE_IO:
                return super().resolve_data(write_item)
            return produce(write_item.index.fqn)

    def build(tmp: Path) -> int:
        writer = dcp.FileSystemWriter(str(tmp), single_file_per_rank=False, sync_files=True)
        with files, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process": it is
            dcp.save(_state_dict(torch, dcp_plan), storage_writer=writer, planner=StreamingPlanner(), no_dist=True)
            files.verify()  # a remote file's recorded hash, from the bytes read once
        marker = {
            "ckptspec.tool_version": __version__,
            "source": str(checkpoint.tag_dir),
            "kind": checkpoint.kind.value,
            "keys": len(dcp_plan.tensors) + len(dcp_plan.steps),
            "not_carried": dcp_plan.not_carried,
        }
        write_atomic(tmp / MARKER, (json.dumps(marker, indent=1) + "\n").encode())
        fsync_dir(tmp)
        return sum(1 for p in tmp.iterdir() if p.name.endswith(".distcp"))

    if held is not None:
        written = build_and_publish(held, build)
    else:
        with held_export_output(output_dir) as out:
            written = build_and_publish(out, build)
    keys = len(dcp_plan.tensors) + len(dcp_plan.steps)
    return DcpResult(location(output_dir), keys, dcp_plan.nbytes, written, dcp_plan.not_carried)
