"""What a reshard copies from the source's optimizer-state file, whatever ZeRO stage wrote it.

DeepSpeed's stage 1/2 optimizer (``DeepSpeedZeroOptimizer``) keeps the torch optimizer's state per
optimizer group under ``base_optimizer_state``; stage 3 (``DeepSpeedZeroOptimizer_Stage3``) keeps it
per *sub-group* under ``optimizer_state_dict``, each param group listing its sub-groups. Both hold the
same things a target needs besides the tensors: the hyperparameters, each group's scalar state
(``step``), the loss scaler. ``SourceOptimizer`` reads them from source rank 0's decoded file as
stand-ins (``ds_pickle.from_standins`` turns them into what torch.save writes).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..format.models import Manifest
from ..location import RemotePath


@dataclass
class SourceOptimizer:
    top: dict  # the file's top-level dict (optimizer_state_dict, ds_config, ds_version)
    osd: dict  # its optimizer_state_dict: loss scaler, dynamic_loss_scale, overflow (clip_grad at stage 1/2)
    param_groups: list  # the torch optimizer's param groups, one per optimizer group ("params" to replace)
    group_scalars: dict[int, dict]  # optimizer group -> its non-tensor-partition state (step), as saved
    state_keys: dict[int, list[str]]  # optimizer group -> the per-element states the manifest locates
    zero_stage: int
    # made for a source without a ZeRO-1/2 optimizer file (``reshard_stage0_source``): the file its tensors are
    # read from, and the name of target rank 0's optimizer file
    path: Path | RemotePath | None = None
    file_name: str | None = None

    @property
    def ds_version(self) -> Any:
        return self.osd.get("ds_version", self.top.get("ds_version"))


def source_optimizer(manifest: Manifest, template: dict) -> SourceOptimizer:
    """``template``: source rank 0's decoded optimizer-state file."""
    keys: dict[int, set[str]] = {}
    for f in manifest.files:
        for loc in f.state_partitions or ():
            keys.setdefault(manifest.groups[loc.group].optimizer_group, set()).add(loc.state)
    state_keys = {g: sorted(k) for g, k in keys.items()}
    osd = template["optimizer_state_dict"]
    if manifest.layout.zero_stage == 3:
        inner = osd["optimizer_state_dict"]
        param_groups = inner["param_groups"]
        # each param group's first sub-group holds its step (every sub-group steps together)
        states = {g: inner["state"][pg["params"][0]] for g, pg in enumerate(param_groups) if pg["params"]}
    else:
        base = osd["base_optimizer_state"]
        param_groups = base["param_groups"]
        states = dict(enumerate(base["state"][g] for g in range(len(param_groups))))
    scalars = {g: {k: v for k, v in s.items() if k not in state_keys.get(g, ())} for g, s in states.items()}
    return SourceOptimizer(template, osd, param_groups, scalars, state_keys, manifest.layout.zero_stage)


def with_stage(config: Any, stage: int, sub_group_size: int | None = None) -> Any:
    """``ds_config`` as saved with ``zero_optimization.stage`` (and a stage-3 ``sub_group_size``) set."""
    config = copy.deepcopy(config) if isinstance(config, dict) else config
    if isinstance(config, dict):
        zero = config.setdefault("zero_optimization", {})
        zero["stage"] = stage
        if stage == 3 and sub_group_size is not None:
            zero["sub_group_size"] = sub_group_size
    return config
