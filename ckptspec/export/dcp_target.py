"""What a DeepSpeed ZeRO job of the target saves besides its tensors, made for an FSDP checkpoint (``reshard_dcp``):
the whole-model manifest the ZeRO writers lay out, the model states and the optimizer entries (hyperparameters,
steps, loss scaler), for an fp32 or bf16 job (fp32 masters either way)."""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any, cast

from .._version import __version__
from ..checkpoint.standins import LossScalerState
from ..format.dtypes import Dtype
from ..format.models import Manifest
from ..format.partition import ParamSpec, flat_group
from ..location import RemotePath
from .arrays import _np
from .dcp_roles import ModelRoles
from .model_plan import TensorSource
from .reshard_files import STAGE12_KEYS
from .reshard_source import SourceOptimizer

MOMENTS = ("exp_avg", "exp_avg_sq")  # AdamW's per-element states, as DeepSpeed keeps them per group
MODEL_DTYPES = {"float32": "", "bfloat16": "bf16_"}  # the target job's model dtype -> its optimizer files' prefix
DS_VERSION = "0.19.8"  # the DeepSpeed release whose files the writers reproduce (its loader needs a ds_version)
MODEL_FILE = "mp_rank_00_model_states.pt"


def dcp_manifest(
    groups: list[dict], sources: dict[str, TensorSource], roles: ModelRoles, steps: list[float], stage: int, dtype: str
) -> Manifest:
    """The whole model as one rank of a ZeRO job of model ``dtype`` (fp32 masters): what ``target_layout`` lays out
    for the target (a stage-3 target's sub-groups are cut from the flat groups of a stage-2 one). The job casts
    its parameters, frozen ones included, to its model dtype; its buffers keep theirs."""
    stage = min(stage, 2)
    flat = [
        flat_group(
            [ParamSpec(n, tuple(sources[n].shape), cast(Dtype, dtype)) for n in group["params"]],
            optimizer_group=g,
            partition_count=1,
            zero_stage=stage,
        )
        for g, group in enumerate(groups)
    ]
    extras = [sources[n] for n in roles.buffers]
    frozen = [sources[n] for n in roles.frozen]
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
                "model_dtype": dtype,
                "master_dtype": "float32",
                "round_robin": False,
                "parameter_alignment": False,
                "tail_padding_saved": False,
            },
            "groups": [g.model_dump(mode="json", exclude_unset=True) for g in flat],
            "frozen": [
                {"name": s.name, "shape": list(s.shape), "numel": s.numel, "dtype": dtype, "stored_in": "module"}
                for s in frozen
            ],
            "buffers": [{"name": s.name, "shape": list(s.shape), "dtype": s.dtype} for s in extras],
            "aliases": [{"name": a, "owner": o, "shape": list(sources[o].shape)} for a, o in roles.aliases.items()],
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


def _ds_config(stage: int, dtype: str) -> dict:
    """What the target job's ds_config says of its layout, as its files record it."""
    config: dict = {"zero_optimization": {"stage": stage}}
    if dtype == "bfloat16":
        config["bf16"] = {"enabled": True}
    return config


def model_states_template(names: list[str], roles: ModelRoles, step: int, stage: int, dtype: str) -> dict:
    """The model states an fp32 DeepSpeed job saves, in its order; the writer re-lays and fills them
    (``module`` from the plan, ``param_shapes``, the frozen parameters and ``dp_world_size`` for the target)."""
    return {
        "module": collections.OrderedDict((n, None) for n in names),
        "buffer_names": list(roles.buffers),
        "optimizer": None,
        "param_shapes": None,
        "frozen_param_shapes": None,
        "shared_params": dict(roles.aliases),
        "frozen_param_fragments": None,
        "lr_scheduler": None,
        "data_sampler": None,
        "random_ltd": None,
        "skipped_steps": 0,
        "global_steps": step,
        "dp_world_size": 1,
        "mp_world_size": 1,
        "ds_config": _ds_config(stage, dtype),
        "ds_version": DS_VERSION,
    }


def dcp_optimizer(
    groups: list[dict], steps: list[float], stage: int, dtype: str, directory: Path | RemotePath
) -> SourceOptimizer:
    """What DeepSpeedZeroOptimizer's files hold besides the partitions: the param groups' hyperparameters, each
    group's step (a tensor, as torch's AdamW keeps it), a static loss scaler at 1."""
    from . import ds_pickle  # torch: only to write the step tensors

    scalars = {g: {"step": ds_pickle.tensor(_np().array(s, dtype=_np().float32))} for g, s in enumerate(steps)}
    param_groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": []} for group in groups]
    osd: dict[str, Any] = dict.fromkeys(STAGE12_KEYS)
    osd.update(loss_scaler=LossScalerState({"cur_scale": 1.0, "dynamic": False}), dynamic_loss_scale=False)
    osd.update(overflow=False, ds_version=DS_VERSION)
    del osd["clip_grad"]  # the target job's gradient_clipping applies
    top = {"optimizer_state_dict": None, "ds_config": _ds_config(stage, dtype), "ds_version": DS_VERSION}
    moments = dict.fromkeys(range(len(groups)), list(MOMENTS))
    file_name = f"{MODEL_DTYPES[dtype]}zero_pp_rank_0_mp_rank_00_optim_states.pt"
    return SourceOptimizer(
        top, osd, param_groups, scalars, moments, stage, path=directory / MODEL_FILE, file_name=file_name
    )
