"""``ckptspec reshard DCP_DIR OUT --world-size N --stage 1|2``: an FSDP checkpoint (torch DCP) as a DeepSpeed ZeRO one.

A DCP directory saved the way FSDP2 users save (``dcp.save({"model": ..., "optim": ...})`` from ``get_state_dict``)
holds every tensor whole-model addressed: ``model.<name>``, ``optim.state.<param>.<state>`` and each param group's
hyperparameters and parameter names as bytes items (``optim.param_groups.<g>.<key>``). Read here as the whole-model
plan the ZeRO writer takes (``reshard_files.write_files``), nothing unpickled unsafely (the bytes items through the
restricted reader, plain values only: ``values.plain_value``):

* the fp32 masters are the parameters the param groups name, whose chunks' bytes (``runs``) are their segments;
  ``exp_avg`` and ``exp_avg_sq`` are located the same way; each group's ``step`` (one per group in DeepSpeed: every
  parameter of a group must hold the same) and hyperparameters are the group's;
* every other model tensor (buffers, frozen parameters, a tie's second name: DCP does not say which) is written
  under its name in the module, with its own saved bytes, and listed in ``buffer_names``;
* the model states are what a DeepSpeed fp32 job of the target stage saves (``global_steps`` the step; no LR
  scheduler, no ``global_samples``: DeepSpeed derives it), the loss scaler static at 1, no ``clip_grad`` (the
  target job's ``gradient_clipping`` applies, as DeepSpeed's loader does for a missing one).

Refused by name (CK410) before anything is written: another target stage, a target job in bf16/fp16, masters or
moments not fp32, a state besides ``exp_avg``/``exp_avg_sq``/``step`` (amsgrad's ``max_exp_avg_sq``...), a
parameter without state, steps that differ inside a group, a model entry saved as bytes (``extra_state``).
"""

from __future__ import annotations

import collections
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._version import __version__
from ..checkpoint.dcp.checks import check_dcp
from ..checkpoint.dcp.metadata import BytesEntry, DcpMetadata, Item, TensorEntry
from ..checkpoint.dcp.records import read_record, read_value_pickle
from ..checkpoint.dcp.values import plain_value
from ..checkpoint.standins import LossScalerState
from ..checkpoint.states import StateCache
from ..errors import CheckpointInvalid, ReshardUnsupported, UnsafePickleError
from ..findings import has_errors
from ..format.dtypes import ITEMSIZE
from ..format.models import Manifest
from ..format.partition import ParamSpec, flat_group
from ..location import RemotePath, location
from .arrays import _np
from .dcp_input import MODEL_PREFIX, runs
from .model_plan import ModelPlan, Segment, TensorSource, coalesced
from .optimizer_state import OptimizerStatePlan
from .output_dir import build_and_publish, held_new_output
from .reshard import ReshardResult, embed_and_validate
from .reshard_files import STAGE12_KEYS, ModelChanges, write_files
from .reshard_layout import target_layout
from .reshard_source import SourceOptimizer

STATE_PREFIX, GROUPS_PREFIX = "optim.state.", "optim.param_groups."
MOMENTS = ("exp_avg", "exp_avg_sq")  # AdamW's per-element states, as DeepSpeed keeps them per group
STAGES = (1, 2)  # the targets written from a DCP checkpoint
DS_VERSION = "0.19.8"  # the DeepSpeed release whose files the writers reproduce (its loader needs a ds_version)
MODEL_FILE = "mp_rank_00_model_states.pt"
_SCALARS = {"float32": "<f", "float64": "<d", "int64": "<q"}  # a step's dtypes


@dataclass
class DcpSource:
    """A DCP checkpoint as the ZeRO writer reads a source (``write_files``)."""

    found: Manifest  # the target's whole-model manifest (one flat group per param group, in its order)
    plan: ModelPlan
    state_plan: OptimizerStatePlan
    optimizer: SourceOptimizer
    states: StateCache  # gives the model states DeepSpeed would have saved, made here
    step: int
    ranks: int  # the saving job's (its .distcp files)


class _MadeStates(StateCache):
    """The writers read a source's decoded model states from a ``StateCache``: here one made, not read."""

    def __init__(self, path: Path, state: dict):
        super().__init__()
        self._path, self._made = path, state

    def state(self, path, *args, **kwargs) -> Any:
        assert Path(path) == self._path, path
        return self._made

    def members(self, path, *args, **kwargs) -> Any:
        return {}  # every tensor comes from the plan (``ModelChanges.module``), none from a member


def _refuse(message: str, hint: str, where) -> ReshardUnsupported:
    return ReshardUnsupported(message, hint, os.fspath(where))


Items = dict[tuple[str, tuple[int, ...] | None], Item]  # (fqn, chunk offsets; None for bytes) -> its storage item


def _located(directory: Path, items: Items, fqn: str, entry: TensorEntry) -> list[Segment]:
    """The tensor's flat bytes as segments: each chunk's runs of the whole tensor, in the whole tensor's order."""
    itemsize, placed = ITEMSIZE[entry.dtype], []
    for chunk in entry.chunks:
        if chunk.numel == 0:
            continue
        item = items[(fqn, chunk.offsets)]  # CK251 checked it is there
        with open(directory / item.file, "rb") as fh:
            record = read_record(fh, directory / item.file, item.offset, item.length)
        for src, dst, n in runs(entry.size, chunk):
            placed.append((dst, Segment(directory / item.file, record.data_offset + src * itemsize, n * itemsize)))
    return list(coalesced(seg for _, seg in sorted(placed, key=lambda p: p[0])))


def _bytes_value(directory: Path, items: Items, fqn: str) -> Any:
    item = items[(fqn, None)]
    with open(directory / item.file, "rb") as fh:
        try:
            return plain_value(read_value_pickle(fh, item.offset, item.length), directory / item.file, fqn)
        except (UnsafePickleError, ValueError) as exc:
            raise _refuse(f"{fqn}: {exc}", "save plain hyperparameters", directory) from None


def _param_groups(directory: Path, meta: DcpMetadata, items: Items) -> list[dict]:
    """Each param group's hyperparameters and ``params`` (its parameters' names), in group order."""
    groups: dict[int, dict] = {}
    for fqn, entry in meta.entries.items():
        if fqn.startswith(GROUPS_PREFIX):
            index, _, key = fqn.removeprefix(GROUPS_PREFIX).partition(".")
            if not index.isdigit() or not key or not isinstance(entry, BytesEntry):
                raise _refuse(f"{fqn}: not a param group's plain value", "save get_state_dict's optimizer", directory)
            groups.setdefault(int(index), {})[key] = _bytes_value(directory, items, fqn)
    if not groups or sorted(groups) != list(range(len(groups))):
        raise _refuse("no optimizer param groups (optim.param_groups.*)", "save get_state_dict's optimizer", directory)
    for g, group in groups.items():
        names = group.get("params")
        if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
            raise _refuse(f"param group {g} names no parameters", "save get_state_dict's optimizer", directory)
    return [groups[g] for g in range(len(groups))]


def _tensor(meta: DcpMetadata, fqn: str, shape, what: str, directory: Path) -> TensorEntry:
    """The fp32 tensor entry ``fqn`` of ``shape`` (None: any); CK410 naming it otherwise."""
    entry = meta.entries.get(fqn)
    if not isinstance(entry, TensorEntry):
        raise _refuse(f"{fqn}: no {what} saved", "save every trained parameter's AdamW state", directory)
    if entry.dtype != "float32" or (shape is not None and entry.size != shape):
        raise _refuse(
            f"{fqn}: {entry.dtype} {list(entry.size)}: DeepSpeed's ZeRO {what} is fp32 in the parameter's shape",
            "save the model and optimizer in fp32 (FSDP2's mixed precision keeps fp32 parameters)",
            directory,
        )
    return entry


def _step(directory: Path, items: Items, fqn: str, entry) -> float:
    if not isinstance(entry, TensorEntry) or entry.size != () or entry.dtype not in _SCALARS:
        raise _refuse(f"{fqn}: not a scalar step", "save torch.optim.AdamW's state", directory)
    item = items[(fqn, ())]
    with open(directory / item.file, "rb") as fh:
        record = read_record(fh, directory / item.file, item.offset, item.length)
        fh.seek(record.data_offset)
        return float(struct.unpack(_SCALARS[entry.dtype], fh.read(ITEMSIZE[entry.dtype]))[0])


def read_dcp_source(directory: Path, meta: DcpMetadata, zero_stage: int) -> DcpSource:
    """The DCP checkpoint in ``directory`` as the ZeRO writer's source for a ``zero_stage`` target; CK410 naming
    what the target cannot hold, before anything is written."""
    model = {fqn.removeprefix(MODEL_PREFIX): e for fqn, e in meta.entries.items() if fqn.startswith(MODEL_PREFIX)}
    for name, entry in model.items():
        if isinstance(entry, BytesEntry):
            raise _refuse(f"model.{name}: saved as bytes; DeepSpeed's module holds tensors", "", directory)
    items: Items = {(i.fqn, i.chunk_offset): i for i in meta.items}
    groups = _param_groups(directory, meta, items)
    trainable = [n for g in groups for n in g["params"]]
    saved = {f.removeprefix(STATE_PREFIX).rsplit(".", 1)[0] for f in meta.entries if f.startswith(STATE_PREFIX)}
    for fqn in meta.entries:
        if fqn.startswith(STATE_PREFIX):
            param, key = fqn.removeprefix(STATE_PREFIX).rsplit(".", 1)
            if param not in trainable or key not in (*MOMENTS, "step"):
                raise _refuse(
                    f"{fqn}: a state besides exp_avg, exp_avg_sq and step (DeepSpeed's ZeRO files hold no other here)",
                    "train with Adam or AdamW without amsgrad",
                    directory,
                )
    sources: dict[str, TensorSource] = {}
    state_sources: dict[str, TensorSource] = {}
    state_names: dict[str, dict[str, str]] = {}
    steps: list[float] = []
    for g, group in enumerate(groups):
        group_steps = set()
        for name in group["params"]:
            if name not in saved:
                raise _refuse(f"{name}: a trained parameter without optimizer state", "save after a step", directory)
            entry = _tensor(meta, MODEL_PREFIX + name, None, "master", directory)
            sources[name] = TensorSource(
                name, entry.size, "float32", _located(directory, items, MODEL_PREFIX + name, entry), "trainable"
            )
            for key in MOMENTS:
                fqn = f"{STATE_PREFIX}{name}.{key}"
                moment = _tensor(meta, fqn, entry.size, key, directory)
                state_sources[f"{name}.{key}"] = TensorSource(
                    f"{name}.{key}", entry.size, "float32", _located(directory, items, fqn, moment), "state"
                )
                state_names.setdefault(name, {})[key] = f"{name}.{key}"
            fqn = f"{STATE_PREFIX}{name}.step"
            group_steps.add(_step(directory, items, fqn, meta.entries.get(fqn)))
        if len(group_steps) != 1:
            raise _refuse(f"param group {g}: its parameters' steps differ ({sorted(group_steps)})", "", directory)
        steps.append(group_steps.pop())
    for name, entry in model.items():
        if name not in sources:
            assert isinstance(entry, TensorEntry)
            sources[name] = TensorSource(
                name, entry.size, entry.dtype, _located(directory, items, MODEL_PREFIX + name, entry), "buffer"
            )
    found = _manifest(groups, sources, steps, zero_stage)
    plan = ModelPlan(directory, sources, {}, list(sources))
    optimizer = json.dumps(found.optimizer.model_dump(mode="json", by_alias=True, exclude_unset=True))
    state_plan = OptimizerStatePlan(state_sources, state_names, {"ckptspec.optimizer": optimizer})
    step = int(steps[0])
    template = _model_states(sources, step, zero_stage)
    return DcpSource(
        found,
        plan,
        state_plan,
        _optimizer(groups, steps, zero_stage, directory),
        _MadeStates(directory / MODEL_FILE, template),
        step,
        len(meta.files),
    )


def _manifest(groups: list[dict], sources: dict[str, TensorSource], steps: list[float], stage: int) -> Manifest:
    """The whole model as one rank of an fp32 ZeRO ``stage`` job: what ``target_layout`` lays out for the target."""
    flat = [
        flat_group(
            [ParamSpec(n, tuple(sources[n].shape), "float32") for n in group["params"]],
            optimizer_group=g,
            partition_count=1,
            zero_stage=stage,
        )
        for g, group in enumerate(groups)
    ]
    extras = [s for s in sources.values() if s.role == "buffer"]
    # the manifest's values are plain and never null (as a DeepSpeed checkpoint's manifest leaves foreach: None out)
    hyper = [
        {k: list(v) if isinstance(v, tuple) else v for k, v in group.items() if k != "params" and v is not None}
        for group in groups
    ]
    return Manifest.model_validate(
        {
            "format": "ckptspec.manifest",
            "format_version": "1.1.0",
            "producer": {
                "tool": "ckptspec",
                "tool_version": __version__,
                "framework": "deepspeed",
                "framework_version": DS_VERSION,
            },
            "layout": {
                "zero_stage": stage,
                "world_size": 1,
                "tensor_parallel_size": 1,
                "pipeline_parallel_size": 1,
                "model_dtype": "float32",
                "master_dtype": "float32",
                "round_robin": False,
                "parameter_alignment": False,
                "tail_padding_saved": False,
            },
            "groups": [g.model_dump(mode="json", exclude_unset=True) for g in flat],
            "frozen": [],
            "buffers": [{"name": s.name, "shape": list(s.shape), "dtype": s.dtype} for s in extras],
            "aliases": [],
            "excluded": [],
            "files": [{"path": MODEL_FILE, "role": "model_states", "ranks": [0], "size": 0, "partitions": []}],
            "optimizer": {
                "class": "unknown",
                "groups": [
                    {"optimizer_group": g, "hyperparameters": h, "step": s}
                    for g, (h, s) in enumerate(zip(hyper, steps))
                ],
                "loss_scaler": {"kind": "LossScaler", "state": {"cur_scale": 1.0, "dynamic": False}},
            },
        }
    )


def _model_states(sources: dict[str, TensorSource], step: int, stage: int) -> dict:
    """The model states an fp32 DeepSpeed job saves, in its order; the writer re-lays and fills them
    (``module`` from the plan, ``param_shapes`` and ``dp_world_size`` for the target)."""
    return {
        "module": collections.OrderedDict((n, None) for n in sources),
        "buffer_names": [n for n, s in sources.items() if s.role == "buffer"],
        "optimizer": None,
        "param_shapes": None,
        "frozen_param_shapes": None,
        "shared_params": {},
        "frozen_param_fragments": None,
        "lr_scheduler": None,
        "data_sampler": None,
        "random_ltd": None,
        "skipped_steps": 0,
        "global_steps": step,
        "dp_world_size": 1,
        "mp_world_size": 1,
        "ds_config": {"zero_optimization": {"stage": stage}},
        "ds_version": DS_VERSION,
    }


def _optimizer(groups: list[dict], steps: list[float], stage: int, directory: Path) -> SourceOptimizer:
    """What DeepSpeedZeroOptimizer's files hold besides the partitions: the param groups' hyperparameters, each
    group's step (a tensor, as torch's AdamW keeps it), a static loss scaler at 1."""
    from . import ds_pickle  # torch: only to write the step tensors

    scalars = {g: {"step": ds_pickle.tensor(_np().array(s, dtype=_np().float32))} for g, s in enumerate(steps)}
    param_groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": []} for group in groups]
    osd: dict[str, Any] = dict.fromkeys(STAGE12_KEYS)
    osd.update(loss_scaler=LossScalerState({"cur_scale": 1.0, "dynamic": False}), dynamic_loss_scale=False)
    osd.update(overflow=False, ds_version=DS_VERSION)
    del osd["clip_grad"]  # the target job's gradient_clipping applies
    top = {"optimizer_state_dict": None, "ds_config": {"zero_optimization": {"stage": stage}}, "ds_version": DS_VERSION}
    moments = dict.fromkeys(range(len(groups)), list(MOMENTS))
    file_name = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    return SourceOptimizer(
        top, osd, param_groups, scalars, moments, stage, path=directory / MODEL_FILE, file_name=file_name
    )


def reshard_dcp(
    directory: str | os.PathLike, output: str | os.PathLike, world_size: int, zero_stage: int | None
) -> ReshardResult:
    """Check the DCP checkpoint in ``directory``, then write it as a DeepSpeed ZeRO ``zero_stage`` checkpoint for
    ``world_size`` fp32 ranks into ``output``; CK410 for what the target cannot hold, nothing written then."""
    source = Path(directory)
    if zero_stage not in STAGES:
        asked = "no --stage" if zero_stage is None else f"--stage {zero_stage}"
        raise _refuse(
            f"{asked} for a DCP checkpoint: ZeRO stage 1 and 2 targets are written (stage 0 and 3 not yet)",
            "give --stage 1 or --stage 2",
            source,
        )
    meta, findings = check_dcp(source)
    if has_errors(findings):
        raise CheckpointInvalid(findings, str(directory))
    with held_new_output(output, "the resharded checkpoint") as out:
        dcp = read_dcp_source(source, meta, zero_stage)
        try:  # CK410 before anything is written
            target = target_layout(dcp.found, world_size, zero_stage, domain=True)
        except ReshardUnsupported as exc:
            raise _refuse(exc.message, exc.hint, source) from None
        changes = ModelChanges(dcp.plan.sources, {}, (), lambda config: config)

        def build(tmp: Path) -> list:
            tag_dir = tmp / f"global_step{dcp.step}"
            tag_dir.mkdir(exist_ok=True)
            files = write_files(
                dcp.found, dcp.plan, dcp.state_plan, target, dcp.states, tag_dir, changes, source=dcp.optimizer
            )
            embed_and_validate(dcp.found, tmp, tag_dir, output)
            return files

        files = build_and_publish(out, build)
    tag = f"global_step{dcp.step}"
    written: list[Path | RemotePath] = [location(output) / tag / f.name for f in files]
    return ReshardResult(location(output), tag, dcp.ranks, world_size, zero_stage, written)
