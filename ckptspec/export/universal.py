"""``ckptspec export-universal``: DeepSpeed's universal checkpoint folder, written from the manifest.

The folder is what DeepSpeed 0.19's ``ds_to_universal`` writes as its ``--output_folder`` and what a job
with ``checkpoint.load_universal: true`` reads (``runtime/base_optimizer.py``
``load_hp_checkpoint_state_from_checkpoint_dir``, ``checkpoint/universal_checkpoint.py``):

* ``zero/<param>/fp32.pt``, ``exp_avg.pt``, ``exp_avg_sq.pt`` (every per-element state): ``{"param": the
  whole tensor in fp32 in the parameter's shape, "cat_dim": 0}``; ``zero/<param>/step.pt``: the group's
  step as saved (a ``BF16_Optimizer`` checkpoint's masters too: its partitions' tail padding is no parameter's).
  Written for every trainable parameter (a tie's name too, with its owner's values; a name
  several parts hold, a pipeline's ``TiedLayerSpec`` module, once); frozen parameters get ``fp32.pt`` alone, as
  ``ds_to_universal`` writes the module's values, and a pipeline's, in its layer files, none. DeepSpeed's
  universal loader reads neither: it restores trainable parameters only.
* ``zero/optimizer_state.pt``: the optimizer's global state (loss scaler, ``dynamic_loss_scale``,
  ``overflow``, ``clip_grad`` when saved, ``ds_version``...) and ``param_groups`` (the hyperparameters).
* ``mp_rank_00_model_states.pt``: the source's (rank 0) model-states file, copied: DeepSpeed reads its
  counters, LR scheduler and client state from it (not the weights).

Positions come from the manifest (round robin, alignment, stage-3 sub-groups), never from
``param_slice_mappings``, so the values are the saved ones where ``ds_to_universal`` reads DeepSpeed's
mappings. Each file is written as its bytes are read and cast, a chunk at a time (``ds_pickle.save_streamed``):
peak memory does not grow with the model, nor with its largest parameter.
"""

from __future__ import annotations

import functools
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from .. import split
from ..checkpoint.states import StateCache
from ..errors import ReshardUnsupported
from ..format.models import Manifest
from ..location import RemotePath, location, open_binary
from . import ds_pickle
from .arrays import ShardReader, iter_chunks, read_array
from .model_plan import TensorSource
from .optimizer_state import plan_optimizer_state
from .output_dir import build_and_publish, held_new_output
from .plan import plan_reconstruction
from .reshard import validated_source
from .reshard_files import tensor_reader
from .reshard_source import source_optimizer

# DeepSpeedZeroOptimizer's per-rank entries ds_to_universal leaves out of optimizer_state.pt
SHARDED = ("base_optimizer_state", "param_slice_mappings", "single_partition_of_fp32_groups")
STAGE3_KEYS = ("loss_scaler", "dynamic_loss_scale", "overflow", "zero_stage", "partition_count")


@dataclass
class UniversalResult:
    output: Path | RemotePath  # a URL's is a RemotePath
    tag: str
    params: int


def export_universal(
    checkpoint: str | os.PathLike,
    output: str | os.PathLike,
    *,
    tag: str | None = None,
    manifest: Manifest | str | os.PathLike | None = None,
) -> UniversalResult:
    """Validate ``checkpoint``, then write its universal folder (``ds_to_universal``'s output) as ``output``."""
    with held_new_output(output, "the universal checkpoint") as out:
        found, states = validated_source(checkpoint, manifest, tag)
        try:
            _refuse(found)
        except ReshardUnsupported as exc:
            raise ReshardUnsupported(exc.message, exc.hint, str(checkpoint)) from None
        plan = plan_reconstruction(checkpoint, found, tag, states=states)
        state_plan = plan_optimizer_state(plan)
        count = build_and_publish(out, lambda tmp: _write(found, plan, state_plan, states, tmp))
    return UniversalResult(location(output), plan.tag_dir.name, count)


def _refuse(found: Manifest) -> None:
    layout = found.layout
    if layout.zero_stage not in (1, 2, 3):
        raise ReshardUnsupported(f"ZeRO stage {layout.zero_stage} checkpoints are not supported", "use stage 1, 2 or 3")
    if layout.tensor_parallel_size != 1 or layout.pipeline_parallel_size != 1:
        raise ReshardUnsupported(
            "the checkpoint is tensor- or pipeline-parallel; export-universal writes data-parallel checkpoints only",
            "use DeepSpeed's ds_to_universal",
        )
    if found.optimizer is None or not any(f.state_partitions for f in found.files):
        raise ReshardUnsupported(
            "the manifest locates no optimizer state (format 1.0)",
            "use a format 1.1 manifest: `ckptspec generate CHECKPOINT` describes the files anew",
        )


def _write(found: Manifest, plan, state_plan, states: StateCache, out: Path) -> int:
    first = next(f.path for f in found.files if f.role == "optimizer_states" and 0 in f.ranks)
    source = source_optimizer(found, states.state(plan.tag_dir / first))
    source.path = plan.tag_dir / first
    return write_folder([(found, plan, state_plan, source)], states, out)


def write_folder(
    parts: list, states: StateCache, out: Path, model_files: list | None = None, entries: dict | None = None
) -> int:
    """The folder of ``parts``: (manifest, plan, optimizer-state plan, ``SourceOptimizer`` with its ``path``) of
    each part of the model (a pipeline's stages; one part otherwise). The first part's optimizer entries are
    written as ``zero/optimizer_state.pt``; every part's model-states file is copied (or ``model_files``: an
    AutoTP model, one part, has one per tensor rank). ``entries``: parameter -> the entries its files hold beside
    ``param`` (default ``cat_dim`` 0; a MoE expert's: ``universal_moe``)."""
    zero = out / "zero"
    zero.mkdir(exist_ok=True)  # every rank of a torchrun split
    count = 0
    written: set[str] = set()  # a pipeline's tied module, on several stages: written from the first
    with ShardReader() as files:
        readers = [tensor_reader(source.path, states, files) for _, _, _, source in parts]
        for (found, plan, state_plan, source), read in zip(parts, readers):
            count += write_params(found, plan, state_plan, source, read, files, zero, entries or {}, written)
        ds_pickle.save(_optimizer_state(parts[0][3], readers[0]), zero / "optimizer_state.pt")
    if model_files is None:
        model_files = [plan.tag_dir / model_file(found) for found, plan, _, _ in parts]
    # a stage-3 source's name has a zero_pp_rank_0_ prefix: the folder's has none
    copy_model_files(model_files, out, lambda name: name[name.index("mp_rank_") :])
    return count


def copy_model_files(model_files: list, out: Path, folder_name=lambda name: name) -> None:
    """Each of ``model_files`` copied as saved into ``out`` under ``folder_name(its name)``, by the rank of a torchrun
    split that claims it (a checkpoint at a URL too: its ranged reads)."""
    for model in model_files:
        copy = out / folder_name(model.name)
        if not split.current().claims(copy):  # another rank of a torchrun split copies it
            continue
        with open_binary(model) as src, open(copy, "wb") as dst:
            shutil.copyfileobj(src, dst)
            split.count_read(dst.tell())


def model_file(found: Manifest) -> str:
    return next(f.path for f in found.files if f.role == "model_states" and 0 in (f.ranks or [0]))


def write_params(
    found: Manifest,
    plan,
    state_plan,
    source,
    read,
    files: ShardReader,
    zero: Path,
    entries: dict[str, dict],
    written: set[str],
) -> int:
    """``zero/<param>/`` of every trainable and frozen parameter of ``plan`` (a tie's name too) not in ``written``
    (an earlier part's), added to it."""
    group_of = {p.name: g.optimizer_group for g in found.groups for p in g.params}
    aliases: dict[str, list[str]] = {}
    for a in found.aliases:
        aliases.setdefault(a.owner, []).append(a.name)
    count = 0
    for name, src in plan.sources.items():
        if src.role not in ("trainable", "frozen") or name in written:
            continue
        written.add(name)
        tensors = {"fp32": src}
        if src.role == "trainable":
            for key, state_name in sorted(state_plan.states.get(name, {}).items()):
                tensors[key] = state_plan.sources[state_name]
        scalars = source.group_scalars.get(group_of.get(name, -1), {}) if src.role == "trainable" else {}
        for target in [name, *aliases.get(name, [])]:
            folder = zero / target
            folder.mkdir(exist_ok=True)  # every rank of a torchrun split
            for key, tensor in tensors.items():
                # the whole tensor in fp32, read and cast a chunk at a time as it is written
                lazy = ds_pickle.Lazy("float32", tuple(tensor.shape), _chunks(tensor, files))
                param = ds_pickle.View(lazy, lazy.shape, 0, _stride(tensor, files))
                saved = {"param": param, **entries.get(name, {"cat_dim": 0})}
                ds_pickle.save_streamed(saved, folder / f"{key}.pt", shapes_as_tuples=True)
            if "step" in scalars:
                ds_pickle.save(ds_pickle.from_standins(scalars["step"], read), folder / "step.pt")
            count += 1
    return count


def _chunks(tensor: TensorSource, files: ShardReader):
    """``Lazy``'s producer: ``tensor``'s elements cast to fp32, its digest checked (CK222) at the end."""
    return functools.partial(iter_chunks, tensor.segments, tensor.dtype, "float32", files, tensor)


def _stride(tensor: TensorSource, files: ShardReader) -> tuple[int, ...] | None:
    """The contiguous stride, except for an empty tensor: the one torch gives the numpy array this
    file was first written from (numpy's strides of an empty array vary; kept so the bytes do not)."""
    if tensor.numel:
        return None
    return tuple(ds_pickle.tensor(read_array(tensor, "float32", files).copy()).stride())


def _optimizer_state(source, read) -> dict:
    if source.zero_stage == 3:
        keys = [k for k in STAGE3_KEYS if k in source.osd]
        out = {k: ds_pickle.from_standins(source.osd[k], read) for k in keys}
        out["ds_version"] = ds_pickle.from_standins(source.ds_version, read)
    else:
        out = {k: ds_pickle.from_standins(v, read) for k, v in source.osd.items() if k not in SHARDED}
    param_groups = ds_pickle.from_standins(source.param_groups, read)
    for g, pg in enumerate(param_groups):
        pg["params"] = [g]
    out["param_groups"] = param_groups
    return out
