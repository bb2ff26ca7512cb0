"""The one file of a checkpoint resharded to ZeRO stage 0, from a ZeRO-1/2/3 source, as DeepSpeed 0.19 saves
it (``engine._save_checkpoint``: ``optimizer`` is the optimizer's own ``state_dict()`` when ZeRO is off).

``mp_rank_00_model_states.pt``, whatever the world size (every rank holds everything at stage 0):

* ``module``: every tensor its own storage (a tie, ``shared_params`` of the source: one tensor under both names, the
  alias's entry the owner's very storage, offset, shape and strides, as a stage-0 job's ``module.state_dict()`` holds
  it and ``layout/stage0_names.stage0_ties`` reads it): a trainable parameter's saved low-precision weight (from a
  stage-3 source, whose module holds placeholders, its master cast to the model dtype: what DeepSpeed's step
  writes into it; in fp32 its master, which the weight is at stage 0), a frozen one as saved (from a stage-3
  source: gathered from the ranks' ``frozen_param_fragments``), buffers as saved;
* ``optimizer``: fp32, the client torch optimizer's ``state_dict()`` (the module's weights are the masters);
  bf16/fp16, ``FP16_UnfusedOptimizer.state_dict()`` (``runtime/fp16/unfused_optimizer.py``): the loss scale
  (``dynamic_loss_scale``, ``cur_scale``, ``cur_iter``, and for a dynamic scale ``last_overflow_iter``,
  ``scale_factor``, ``scale_window``: the source's loss scaler's; ``cur_iter`` of a static one, which does not
  count, is ``global_steps``: the unfused optimizer counts every step), the wrapped torch optimizer's
  ``state_dict()`` and ``fp32_groups`` (one full-shape master per trainable parameter; a tie's once, as
  ``module.parameters()`` yields it once). The torch state is
  numbered over the groups' parameters in the model's order, each with its own ``step`` (the source group's),
  ``exp_avg``...; ``param_groups`` as saved, each listing its parameters' numbers;
* ``param_shapes``, ``frozen_param_shapes``, ``shared_params``, ``frozen_param_fragments`` None (ZeRO off),
  ``dp_world_size`` the target's, ``ds_config`` with ``zero_optimization.stage`` 0; LR scheduler, counters and
  client state as saved (the source's embedded manifest dropped).

An AutoTP job at stage 0 saves this file per tensor rank (``mp_rank_XX``): each written from the tensor rank's
shards (``reshard_parallel``), or from an AutoTP merge's or split's (``reshard_tensor.DataParallelTarget``, with its
``ModelChanges``: the module and the model-states entries of the target's tensor degree).

What a stage-0 job of the source's settings would keep elsewhere is refused (``refuse_stage0``, CK410), and so are
frozen parameters its reader could not tell from the trainable ones by their shapes (``refuse_untold_frozen``; fp32:
the shapes of the torch optimizer's per-element state, which lists the trainable parameters only, as a client
optimizer built over them saves it). A bf16
source trained with ``data_types.grad_accum_dtype`` fp32 (ZeRO-2) is written as any bf16 one: DeepSpeed 0.19.8 runs
no dense stage-0 bf16 job with it (``NotImplementedError: unsupported mix of model_dtype and grad_accum_dtype``;
``BF16_Optimizer`` is a stage-0 *pipeline's*), so the target job leaves it out.
Every tensor is written a chunk at a time (``ds_pickle.save_streamed``).
"""

from __future__ import annotations

import collections
import functools
from pathlib import Path
from typing import Any

from ..checkpoint.embedded import CLIENT_STATE_KEY
from ..checkpoint.standins import LossScalerState
from ..checkpoint.states import StateCache
from ..deepspeed.describe.scalars import plain_values
from ..deepspeed.layout.stage0_names import named_by_shapes
from ..errors import ReconstructMismatch, ReshardUnsupported
from ..format.models import Manifest
from . import ds_pickle
from .arrays import ShardReader, iter_chunks
from .model_plan import TensorSource
from .reshard_files import ModelChanges, lazy_reader, tensor_reader
from .reshard_layout import TargetLayout, natural_groups
from .reshard_source import SourceOptimizer, source_optimizer, with_stage

MODEL_FILE = "mp_rank_00_model_states.pt"
ZERO_OFF = ("param_shapes", "frozen_param_shapes", "shared_params", "frozen_param_fragments")
DYNAMIC_KEYS = ("last_overflow_iter", "scale_factor", "scale_window")


def _model_file(found: Manifest) -> str:
    return next(f.path for f in found.files if f.role == "model_states" and 0 in (f.ranks or [0]))


def source_osd(found: Manifest, plan, states: StateCache) -> dict:
    """Source rank 0's decoded ``optimizer_state_dict`` (its loss scaler: what ``refuse_stage0`` reads)."""
    first = next(f.path for f in found.files if f.role == "optimizer_states" and 0 in f.ranks)
    return states.state(plan.tag_dir / first)["optimizer_state_dict"]


def module_order(found: Manifest, plan, states: StateCache) -> list[str]:
    """The module's parameter names in order, as source rank 0's model states save them (buffers left out)."""
    saved = states.state(plan.tag_dir / _model_file(found))
    buffers = set(saved.get("buffer_names") or [])
    return [name for name in saved.get("module") or {} if name not in buffers]


def refuse_stage0(found: Manifest, source_osd: dict, module_order: list[str] | None = None, ties: bool = False) -> None:
    """CK410, by name, for a stage-0 target this writer does not write, or whose files could not be described.
    ``module_order``: the module's parameter names in order (a data-parallel source's, an AutoTP source's
    tensor rank 0's), which frozen parameters are written by (``refuse_untold_frozen``); without it they are refused.
    ``ties``: the caller writes a tie (a data-parallel source's: ``stage0_module`` pickles it as one tensor under both
    names, the optimizer holds it once); without it a tie is refused."""
    if found.excluded:
        raise ReshardUnsupported(
            "a stage-0 target of a checkpoint that records frozen parameters it excluded (exclude_frozen_parameters): "
            "not written yet (a stage-0 checkpoint's module holds every frozen parameter)",
            "reshard to stage 1, 2 or 3",
        )
    if found.aliases and not ties:
        tied = ", ".join(f"{a.name} of {a.owner}" for a in found.aliases)
        raise ReshardUnsupported(
            f"tied parameters ({tied}) of a tensor-, pipeline- or expert-parallel checkpoint are not written for a "
            "stage-0 job yet (a data-parallel checkpoint's are: one tensor under both names)",
            "reshard to stage 1, 2 or 3",
        )
    if found.frozen and module_order is None:
        raise ReshardUnsupported(
            f"frozen parameters ({', '.join(f.name for f in found.frozen)}) of a tensor-, pipeline- or "
            "expert-parallel checkpoint are not written for a stage-0 job yet",
            "reshard to stage 1, 2 or 3",
        )
    if found.frozen:
        refuse_untold_frozen(found, module_order or [])
    hyper = found.optimizer.groups[0].hyperparameters if found.optimizer and found.optimizer.groups else {}
    if "bias_correction" in (hyper or {}):
        raise ReshardUnsupported(
            "the optimizer is DeepSpeed's FusedAdam/FusedLamb (its param groups have bias_correction): at stage 0 "
            "DeepSpeed wraps it in FP16_Optimizer (fp32_groups_flat) and keeps its step per group, which reshard "
            "does not write yet",
            "reshard to stage 1, 2 or 3",
        )
    if not isinstance(source_osd.get("loss_scaler"), LossScalerState) and found.layout.model_dtype != "float32":
        raise ReshardUnsupported("the source saved no loss scaler", "regenerate the source's manifest")


def refuse_untold_frozen(found: Manifest, module_order: list[str]) -> None:
    """CK410 for frozen parameters a stage-0 file could not tell from the trainable ones: its ``fp32_groups`` name no
    parameter, and its reader names them by the one order-keeping choice of module parameters with their shapes
    (``layout/stage0_names.frozen_apart``); written only where that choice is the trainable parameters in the order the
    stage-0 optimizer holds them. An fp32 job keeps no masters apart from the module: there the shapes are those of the
    torch optimizer's per-element state (``stage0_names.client_moments``), so a group without any is refused too."""
    frozen = [f.name for f in found.frozen]
    if found.layout.model_dtype == "float32":
        stepped = {found.groups[loc.group].optimizer_group for f in found.files for loc in f.state_partitions or ()}
        bare = [g for g, params in natural_groups(found) if params and g not in stepped]
        if bare:
            raise ReshardUnsupported(
                f"frozen parameters ({', '.join(frozen)}) for an fp32 stage-0 job whose optimizer keeps no "
                f"per-element state of group {', '.join(map(str, bare))}: its module is its masters, and the written "
                "file's reader tells the frozen ones apart by the shapes of that state",
                "reshard to stage 1, 2 or 3",
            )
    shapes = {p.name: tuple(p.shape) for g in found.groups for p in g.params}
    shapes.update({f.name: tuple(f.shape) for f in found.frozen})
    trained = [p.name for _, params in natural_groups(found) for p in params]
    named = named_by_shapes([shapes[n] for n in trained], [(n, shapes[n]) for n in module_order if n in shapes])
    if named != trained:
        raise ReshardUnsupported(
            f"frozen parameters ({', '.join(frozen)}) that a stage-0 file could not tell from the trainable ones: "
            "its masters name no parameter and are matched to the module's parameters by their shapes, in order, "
            "which here does not give the trainable ones alone",
            "reshard to stage 1, 2 or 3",
        )


def write_stage0_files(
    found: Manifest,
    plan,
    state_plan,
    target: TargetLayout,
    states: StateCache,
    tag_dir: Path,
    changes: ModelChanges | None = None,
    mp_rank: int | None = None,
    source: SourceOptimizer | None = None,
) -> list[Path]:
    """``changes``: an AutoTP merge's or split's (``reshard_tensor``): the module's tensors and the entries a job of
    the target's tensor degree saves otherwise; ``found`` and ``plan`` are then that model's, read from tensor rank 0's
    files. ``mp_rank``: the tensor rank whose model states these are (``mp_rank_XX_model_states.pt``: an AutoTP
    job's, one per tensor rank). ``source``: the optimizer entries of a source without ZeRO optimizer files (an AutoTP
    stage-0 one: ``reshard_tensor_stage0``), read from ``source.path``; else source rank 0's optimizer file's."""
    src_dir = plan.tag_dir
    if source is None:
        first = src_dir / next(f.path for f in found.files if f.role == "optimizer_states" and 0 in f.ranks)
        source = source_optimizer(found, states.state(first))
    else:
        assert source.path is not None  # reshard_stage0_source.stage0_optimizer's: the model states it read
        first = source.path
    model = src_dir / _model_file(found)
    model_state = states.state(model)
    with ShardReader() as files:
        read_optim = tensor_reader(first, states, files)  # the scalars only (step): read small
        read_model = lazy_reader(model, states, files)  # nothing read until written
        whole = changes.module if changes is not None else None
        module = stage0_module(found, plan.sources, model_state["module"], read_model, files, whole)
        groups = [(g, [p.name for p in params]) for g, params in natural_groups(found)]
        masters, torch_state = torch_optimizer(
            groups, plan.sources, state_plan.states, state_plan.sources, source, read_optim, files
        )
        optimizer = stage0_wrapper(found, source.osd, model_state, masters, torch_state)
        doc = stage0_model_states(model_state, module, optimizer, target.world_size, read_model, changes)
        path = tag_dir / (MODEL_FILE if mp_rank is None else f"mp_rank_{mp_rank:02d}_model_states.pt")
        ds_pickle.save_streamed(doc, path, shapes_as_tuples=True)  # torch.save's bytes, a chunk at a time
    return [path]


def stage0_wrapper(found: Manifest, osd: dict, model_state: dict, masters: list, torch_state: dict) -> Any:
    """What a stage-0 job's optimizer ``state_dict()`` is: fp32, the client torch optimizer's; bf16/fp16,
    FP16_UnfusedOptimizer's (the loss scale from the source's ``osd``, ``fp32_groups`` the ``masters``)."""
    if found.layout.model_dtype == "float32":  # no mixed precision: the client optimizer itself
        return torch_state
    return {**_loss_scale(osd, model_state), "optimizer_state_dict": torch_state, "fp32_groups": masters}


def stage0_model_states(model_state: dict, module, optimizer, world_size: int, read, changes=None) -> dict:
    """The source's model states as a stage-0 job of ``world_size`` ranks saves them: ``module`` and ``optimizer``
    given, the ZeRO entries None, ``zero_optimization.stage`` 0, the rest as saved (the source's manifest dropped);
    ``changes`` (``ModelChanges``): the entries a job of another tensor degree saves otherwise."""
    doc: dict[str, Any] = {}
    for key, value in model_state.items():
        if key == CLIENT_STATE_KEY or (changes is not None and key in changes.drop_keys):
            continue  # the source's manifest (the output is described by its checkpoint index); an AutoTP entry
        if key == "module":
            doc[key] = module
        elif key == "optimizer":
            doc[key] = optimizer
        elif key in ZERO_OFF:
            doc[key] = None
        elif key == "dp_world_size":
            doc[key] = world_size
        elif key == "ds_config":
            doc[key] = with_stage(value if changes is None else changes.config(value), 0)
        elif changes is not None and key in changes.set_keys:
            doc[key] = changes.set_keys[key]
        else:
            doc[key] = ds_pickle.from_standins(value, read)
    if changes is not None:  # an AutoTP job's entries a data-parallel source lacks: saved last, as DeepSpeed does
        doc.update({k: v for k, v in changes.set_keys.items() if k not in doc})
    return doc


def _lazy(source: TensorSource, dtype: str, files: ShardReader) -> ds_pickle.Lazy:
    """``source`` whole in ``dtype``, read (and its digest checked) a chunk at a time when written."""
    chunks = functools.partial(iter_chunks, source.segments, source.dtype, dtype, files, source)
    return ds_pickle.Lazy(dtype, tuple(source.shape), chunks)


def stage0_module(
    found: Manifest, masters: dict, saved: dict, read, files: ShardReader, whole: dict | None = None
) -> collections.OrderedDict:
    """The module with every tensor in a storage of its own, as a stage-0 job's ``module.state_dict()``: a tie's
    second name (``found.aliases``) a ``View`` of the owner's ``Lazy`` whole, which ``ds_pickle.save_streamed`` writes
    once, the two entries the same storage, offset, shape and strides (one tensor under both names, two tensor
    records, as torch.save pickles the two detached views ``state_dict()`` gives); ``whole``: an AutoTP merge's module
    tensors by name (the saved ones are tensor shards)."""
    dtype = found.layout.model_dtype
    aliases = {a.name: a.owner for a in found.aliases}
    out: collections.OrderedDict = collections.OrderedDict()
    for name, ref in saved.items():
        if name in aliases:
            continue
        master = masters.get(name)
        if master is not None and master.role == "trainable" and (found.layout.zero_stage == 3 or dtype == "float32"):
            # stage 3 saves placeholders: the master cast; in fp32 the weights are the masters at stage 0
            out[name] = _lazy(master, dtype, files)
            continue
        if master is not None and master.role == "frozen" and found.layout.zero_stage == 3 and whole is None:
            out[name] = _lazy(master, dtype, files)  # gathered from the ranks' frozen_param_fragments
            continue
        # the saved weight (a view into a flat buffer at stage 1/2), a buffer; merged ones whole
        located = read.located(name, ref) if whole is None else whole[name]
        if located is None:
            raise ReconstructMismatch(f"{name}: the saved module tensor is not contiguous")
        out[name] = _lazy(located, located.dtype, files)
    for name in saved:
        if name in aliases:  # a view of the owner's whole storage: the tie a stage-0 reader finds (stage0_ties)
            owner = out[aliases[name]]
            out[name] = ds_pickle.View(owner, owner.shape)
    return collections.OrderedDict((name, out[name]) for name in saved)


def torch_optimizer(
    groups: list, masters: dict, states: dict, moments: dict, source, read, files: ShardReader
) -> tuple[list, dict]:
    """(fp32_groups, the torch optimizer's ``state_dict()``) over ``groups`` (each optimizer group's parameter names
    in model order): ``masters`` by name; ``states``: name -> state -> the name of its bytes in ``moments``."""
    out, state, param_groups = [], {}, ds_pickle.from_standins(source.param_groups, read)
    index = 0
    for g, names in groups:
        group_masters, numbers = [], []
        for name in names:
            entry: dict[str, Any] = {}
            for key, value in source.group_scalars.get(g, {}).items():  # step: the group's, a copy per param
                entry[key] = ds_pickle.copied(ds_pickle.from_standins(value, read))
            for key in source.state_keys.get(g, ()):
                moment = moments[states[name][key]]
                entry[key] = _lazy(moment, moment.dtype, files)
            state[index] = entry
            numbers.append(index)
            group_masters.append(_lazy(masters[name], "float32", files))
            index += 1
        param_groups[g]["params"] = numbers
        out.append(group_masters)
    return out, {"state": state, "param_groups": param_groups}


def _loss_scale(osd: dict, model_state: dict) -> dict:
    """``FP16_UnfusedOptimizer``'s loss-scale entries from the source's loss scaler (``refuse_stage0``: saved)."""
    scaler = plain_values(osd["loss_scaler"].state)
    dynamic = bool(osd.get("dynamic_loss_scale", scaler.get("dynamic", False)))
    out: dict[str, Any] = {
        "dynamic_loss_scale": dynamic,
        "cur_scale": scaler["cur_scale"],
        # a static scaler counts no iterations; the unfused optimizer counts every step, skipped or not
        "cur_iter": scaler["cur_iter"] if "cur_iter" in scaler else model_state["global_steps"],
    }
    if dynamic:
        out.update({k: scaler[k] for k in DYNAMIC_KEYS})
    return out
