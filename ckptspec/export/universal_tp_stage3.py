"""``ckptspec export-universal`` of an AutoTP checkpoint saved at ZeRO stage 3: the folder DeepSpeed 0.19's
``ds_to_universal`` writes for it (its stage-3 path, tensor-parallel merge), file for file.

* ``zero/<param>/fp32.pt``, ``exp_avg.pt``, ``exp_avg_sq.pt``: ``{"param": the whole tensor in fp32}``, every
  tensor rank's shard put together as the checkpoint index places them (``reshard_tensor.whole_model``, as the
  merge; replicated copies compared first, CK401). No ``cat_dim`` and no ``step.pt``: ``ds_to_universal``'s
  stage-3 extraction writes neither, and DeepSpeed's stage-3 universal loader (``stage3.py``
  ``load_hp_checkpoint_state_from_checkpoint_dir_stage3``) takes the step from ``optimizer_state.pt``.
* ``zero/optimizer_state.pt``: the first optimizer file's (data rank 0, tensor rank 0) ``optimizer_state_dict``
  as saved, with ``param_groups`` beside it (the inner optimizer's): the loader reads the step of its sub-group 0
  and the hyperparameters of its first group from there.
* every ``zero_pp_rank_D_mp_rank_TT_model_states.pt`` copied under its own name: a stage-3 job loading a universal
  folder looks for ``zero_pp_rank_0_mp_rank_*_model_states.pt`` (``engine._get_all_ckpt_names``), so this folder
  loads at stage 3, and a stage 1/2 job finds no model states in it (as in ``ds_to_universal``'s).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from ..checkpoint.states import StateCache
from ..errors import ReshardUnsupported
from ..format.index_models import CheckpointIndex
from . import ds_pickle
from .arrays import ShardReader
from .compose import domain_plan
from .reshard_files import tensor_reader
from .reshard_tensor import whole_model


def is_tp_stage3(index: CheckpointIndex) -> bool:
    return index.topology.degrees.tensor > 1 and all(d.manifest.layout.zero_stage == 3 for d in index.domains)


def tp_stage3_part(index: CheckpointIndex, src_dir: Path, states: StateCache) -> tuple:
    """(tensor rank 0's manifest, the whole model's plan, its optimizer-state plan, the first optimizer file, every
    model-states file); CK410 for what is not written."""
    _refuse(index)
    plans = {d.id: domain_plan(src_dir, d, states) for d in index.domains}
    manifest, whole, _, _ = whole_model(index, src_dir, plans, states)  # replicated copies compared: CK401
    first = next(d for d in index.domains if d.coordinate.tensor == 0)
    optim = next(f.path for f in first.manifest.files if f.role == "optimizer_states" and 0 in f.ranks)
    models = sorted({src_dir / f.path for d in index.domains for f in d.manifest.files if f.role == "model_states"})
    return manifest, whole, whole.optimizer_state_plan(), src_dir / optim, models


def _refuse(index: CheckpointIndex) -> None:
    degrees = index.topology.degrees
    if degrees.pipeline > 1 or index.expert_files:
        raise ReshardUnsupported(
            f"a ZeRO-3 checkpoint both tensor-parallel and pipeline- or expert-parallel (pp {degrees.pipeline}) is "
            "not exported as a universal folder yet",
            "AutoTP ZeRO-3 checkpoints (pp 1, no experts) are",
        )
    for d in index.domains:
        if d.masters is not None:
            raise ReshardUnsupported(
                f"domain {d.id} locates its masters apart from its ZeRO-3 partition files: not read here yet",
                "use DeepSpeed's ds_to_universal",
            )


def write_tp_stage3(part: tuple, states: StateCache, out: Path) -> int:
    """``part``'s folder (``tp_stage3_part``) in ``out``; the number of parameters written."""
    from .universal import copy_model_files, write_params

    manifest, whole, state_plan, optim, models = part
    zero = out / "zero"
    zero.mkdir(exist_ok=True)  # every rank of a torchrun split
    no_step = SimpleNamespace(group_scalars={})  # the step lives in optimizer_state.pt only
    bare: dict[str, dict] = {name: {} for name in whole.sources}  # no cat_dim, as ds_to_universal's stage-3 merge
    with ShardReader() as files:
        read = tensor_reader(optim, states, files)
        count = write_params(manifest, whole, state_plan, no_step, read, files, zero, bare, set())
        ds_pickle.save(_optimizer_state(states.state(optim), read), zero / "optimizer_state.pt")
    copy_model_files(models, out)  # under their own names
    return count


def _optimizer_state(saved: dict, read) -> dict:
    """The first optimizer file's ``optimizer_state_dict`` as saved, the inner optimizer's ``param_groups`` beside."""
    out = ds_pickle.from_standins(saved["optimizer_state_dict"], read)
    out["param_groups"] = out["optimizer_state_dict"]["param_groups"]
    return out
