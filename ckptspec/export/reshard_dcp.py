"""``ckptspec reshard DCP_DIR OUT --to deepspeed --world-size N --stage 1|2|3 [--model-dtype bf16]``: an FSDP
checkpoint (torch DCP) as a DeepSpeed ZeRO one.

A DCP directory saved the way FSDP2 users save (``dcp.save({"model": ..., "optim": ...})`` from ``get_state_dict``)
holds every tensor whole-model addressed: ``model.<name>``, ``optim.state.<param>.<state>`` and each param group's
hyperparameters and parameter names as bytes items (``optim.param_groups.<g>.<key>``). Read here as the whole-model
plan the ZeRO writers take (``reshard_files.write_files``, ``reshard_stage3.write_stage3_files``), nothing unpickled
unsafely (the bytes items through the restricted reader, plain values only: ``values.plain_value``):

* the fp32 masters are the parameters the param groups name, whose chunks' bytes (``runs``) are their segments;
  ``exp_avg`` and ``exp_avg_sq`` are located the same way; each group's ``step`` (one per group in DeepSpeed: every
  parameter of a group must hold the same) and hyperparameters are the group's;
* every other model tensor is a frozen parameter, a tie's second name or a buffer (``dcp_roles``), written as a
  DeepSpeed job of the model saves it (stage 3: frozen parameters as rank fragments, parameters as placeholders);
* the model states are what a DeepSpeed job of the target stage and model dtype saves (``dcp_target``:
  ``global_steps`` the step; no LR scheduler, no ``global_samples``: DeepSpeed derives it), the loss scaler static
  at 1, no ``clip_grad`` (the target job's ``gradient_clipping`` applies, as DeepSpeed's loader does for a missing
  one). A bf16 job's weights and frozen parameters are the fp32 values cast to bf16 (its masters stay fp32).

Refused by name (CK410) before anything is written: stage 0, an fp16 target job, masters or moments not fp32, a
state besides ``exp_avg``/``exp_avg_sq``/``step`` (amsgrad's ``max_exp_avg_sq``...), a parameter without state,
steps that differ inside a group, a model entry saved as bytes (``extra_state``).
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..checkpoint.dcp.checks import Where, check_dcp
from ..checkpoint.dcp.metadata import BytesEntry, DcpMetadata, TensorEntry
from ..checkpoint.dcp.records import read_record, read_value_pickle
from ..checkpoint.dcp.values import plain_value
from ..checkpoint.states import StateCache
from ..errors import CheckpointInvalid, ReshardUnsupported, UnsafePickleError
from ..findings import has_errors
from ..format.dtypes import ITEMSIZE
from ..format.models import Manifest
from ..location import RemotePath, location, open_binary, writable
from .dcp_input import MODEL_PREFIX, Items, items_of, located
from .dcp_roles import model_roles
from .dcp_target import MODEL_DTYPES, MODEL_FILE, MOMENTS, dcp_manifest, dcp_optimizer, model_states_template
from .model_plan import ModelPlan, TensorSource
from .optimizer_state import OptimizerStatePlan
from .output_dir import build_and_publish, held_new_output
from .reshard import ReshardResult, embed_and_validate
from .reshard_files import ModelChanges, write_files
from .reshard_layout import target_layout
from .reshard_source import SourceOptimizer
from .reshard_stage3 import write_stage3_files

STATE_PREFIX, GROUPS_PREFIX = "optim.state.", "optim.param_groups."
STAGES = (1, 2, 3)  # the targets written from a DCP checkpoint
_SCALARS = {"float32": "<f", "float64": "<d", "int64": "<q"}  # a step's dtypes


@dataclass
class DcpSource:
    """A DCP checkpoint as the ZeRO writer reads a source (``write_files``)."""

    found: Manifest  # the target's whole-model manifest (one flat group per param group, in its order)
    plan: ModelPlan
    module: dict[str, TensorSource]  # every model tensor whole, a tie's second name with its owner's bytes
    state_plan: OptimizerStatePlan
    optimizer: SourceOptimizer
    states: StateCache  # gives the model states DeepSpeed would have saved, made here
    step: int
    ranks: int  # the saving job's (its .distcp files)


class _MadeStates(StateCache):
    """The writers read a source's decoded model states from a ``StateCache``: here one made, not read."""

    def __init__(self, path: Path | RemotePath, state: dict):
        super().__init__()
        self._path, self._made = path, state

    def state(self, path, *args, **kwargs) -> Any:
        assert str(path) == str(self._path), path
        return self._made

    def members(self, path, *args, **kwargs) -> Any:
        return {}  # every tensor comes from the plan (``ModelChanges.module``), none from a member


def _refuse(message: str, hint: str, where) -> ReshardUnsupported:
    return ReshardUnsupported(message, hint, os.fspath(where))


def _bytes_value(directory: Where, items: Items, fqn: str) -> Any:
    item = items[(fqn, None)]
    with open_binary(directory / item.file) as fh:
        try:
            return plain_value(read_value_pickle(fh, item.offset, item.length), directory / item.file, fqn)
        except (UnsafePickleError, ValueError) as exc:
            raise _refuse(f"{fqn}: {exc}", "save plain hyperparameters", directory) from None


def _param_groups(directory: Where, meta: DcpMetadata, items: Items) -> list[dict]:
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


def _tensor(meta: DcpMetadata, fqn: str, shape, what: str, directory: Where) -> TensorEntry:
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


def _step(directory: Where, items: Items, fqn: str, entry) -> float:
    if not isinstance(entry, TensorEntry) or entry.size != () or entry.dtype not in _SCALARS:
        raise _refuse(f"{fqn}: not a scalar step", "save torch.optim.AdamW's state", directory)
    item = items[(fqn, ())]
    with open_binary(directory / item.file) as fh:
        record = read_record(fh, directory / item.file, item.offset, item.length)
        fh.seek(record.data_offset)
        return float(struct.unpack(_SCALARS[entry.dtype], fh.read(ITEMSIZE[entry.dtype]))[0])


def read_dcp_source(directory: Where, meta: DcpMetadata, zero_stage: int, model_dtype: str = "float32") -> DcpSource:
    """The DCP checkpoint in ``directory`` as the ZeRO writer's source for a ``zero_stage`` target; CK410 naming
    what the target cannot hold, before anything is written."""
    model = {fqn.removeprefix(MODEL_PREFIX): e for fqn, e in meta.entries.items() if fqn.startswith(MODEL_PREFIX)}
    for name, entry in model.items():
        if isinstance(entry, BytesEntry):
            raise _refuse(f"model.{name}: saved as bytes; DeepSpeed's module holds tensors", "", directory)
    items = items_of(meta)
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
                name, entry.size, "float32", located(directory, items, MODEL_PREFIX + name, entry), "trainable"
            )
            for key in MOMENTS:
                fqn = f"{STATE_PREFIX}{name}.{key}"
                moment = _tensor(meta, fqn, entry.size, key, directory)
                state_sources[f"{name}.{key}"] = TensorSource(
                    f"{name}.{key}", entry.size, "float32", located(directory, items, fqn, moment), "state"
                )
                state_names.setdefault(name, {})[key] = f"{name}.{key}"
            fqn = f"{STATE_PREFIX}{name}.step"
            group_steps.add(_step(directory, items, fqn, meta.entries.get(fqn)))
        if len(group_steps) != 1:
            raise _refuse(f"param group {g}: its parameters' steps differ ({sorted(group_steps)})", "", directory)
        steps.append(group_steps.pop())
    others = {
        name: TensorSource(name, e.size, e.dtype, located(directory, items, MODEL_PREFIX + name, e), "buffer")
        for name, e in model.items()
        if name not in sources and isinstance(e, TensorEntry)
    }
    roles = model_roles({n: e for n, e in model.items() if isinstance(e, TensorEntry)}, dict(sources), others)
    if zero_stage == 3 and roles.unsure:
        raise _refuse(
            f"{', '.join(roles.unsure)}: saved whole by one rank, as FSDP saves a buffer or (on one rank) a frozen "
            "parameter; a ZeRO-3 target keeps them apart",
            "reshard to --stage 1 or 2 (their module holds both alike), or from a save of two ranks or more",
            directory,
        )
    for name in roles.frozen:
        old = others[name]
        others[name] = TensorSource(name, old.shape, old.dtype, old.segments, "frozen")
    # a tie's second name is its owner's parameter (cast and placed as its owner)
    module = {name: others.get(name) or sources[name] for name in model}
    module.update((alias, sources[owner]) for alias, owner in roles.aliases.items())
    sources.update((name, s) for name, s in others.items() if name not in roles.aliases)
    found = dcp_manifest(groups, sources, roles, steps, zero_stage, model_dtype)
    plan = ModelPlan(directory, sources, roles.aliases, list(model))
    optimizer = json.dumps(found.optimizer.model_dump(mode="json", by_alias=True, exclude_unset=True))
    state_plan = OptimizerStatePlan(state_sources, state_names, {"ckptspec.optimizer": optimizer})
    step = int(steps[0])
    template = model_states_template(list(model), roles, step, zero_stage, model_dtype)
    return DcpSource(
        found,
        plan,
        module,
        state_plan,
        dcp_optimizer(groups, steps, zero_stage, model_dtype, directory),
        _MadeStates(directory / MODEL_FILE, template),
        step,
        len(meta.files),
    )


def reshard_dcp(
    directory: str | os.PathLike,
    output: str | os.PathLike,
    world_size: int,
    zero_stage: int | None,
    sub_group_size: int | None = None,
    model_dtype: str = "float32",
) -> ReshardResult:
    """Check the DCP checkpoint in ``directory``, then write it as a DeepSpeed ZeRO ``zero_stage`` checkpoint for
    ``world_size`` ranks of ``model_dtype`` (fp32 masters) into ``output`` (stage 3: sub-groups of the target's
    ``sub_group_size``, DeepSpeed's default if None); CK410 for what the target cannot hold, nothing written then."""
    writable(output, "the resharded checkpoint")  # before anything is fetched: an object store stages and uploads
    source = location(directory)  # a URL: ranged reads (docs/remote.md)
    if zero_stage not in STAGES:
        asked = "no --stage" if zero_stage is None else f"--stage {zero_stage}"
        raise _refuse(
            f"{asked} for a DCP checkpoint: ZeRO stage 1, 2 and 3 targets are written (stage 0 not yet)",
            "give --stage 1, 2 or 3",
            source,
        )
    if model_dtype not in MODEL_DTYPES:
        raise _refuse(
            f"a {model_dtype} target job (--model-dtype): fp32 and bf16 ones are written (an fp16 job's dynamic loss "
            "scaler is not)",
            "give --model-dtype fp32 or bf16",
            source,
        )
    if sub_group_size is not None and zero_stage != 3:
        raise _refuse(f"--sub-group-size: a stage-3 option, not for --stage {zero_stage}", "leave it out", source)
    meta, findings = check_dcp(source)
    if has_errors(findings):
        raise CheckpointInvalid(findings, str(directory))
    with held_new_output(output, "the resharded checkpoint") as out:
        dcp = read_dcp_source(source, meta, zero_stage, model_dtype)
        try:  # CK410 before anything is written
            target = target_layout(dcp.found, world_size, zero_stage, sub_group_size, domain=True)
        except ReshardUnsupported as exc:
            raise _refuse(exc.message, exc.hint, source) from None
        changes = ModelChanges(dcp.module, {}, (), lambda config: config)

        def build(tmp: Path) -> list:
            tag_dir = tmp / f"global_step{dcp.step}"
            tag_dir.mkdir(exist_ok=True)
            if zero_stage == 3:
                files = write_stage3_files(
                    dcp.found,
                    dcp.plan,
                    dcp.state_plan,
                    target,
                    dcp.states,
                    tag_dir,
                    sub_group_size,
                    changes,
                    source=dcp.optimizer,
                )
            else:
                files = write_files(
                    dcp.found, dcp.plan, dcp.state_plan, target, dcp.states, tag_dir, changes, source=dcp.optimizer
                )
            embed_and_validate(dcp.found, tmp, tag_dir, output)
            return files

        files = build_and_publish(out, build)
    tag = f"global_step{dcp.step}"
    written: list[Path | RemotePath] = [location(output) / tag / f.name for f in files]
    return ReshardResult(location(output), tag, dcp.ranks, world_size, zero_stage, written)
