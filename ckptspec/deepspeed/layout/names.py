"""DeepSpeed's file names: which file holds what for which rank, and the order ckptspec lists files in.

DeepSpeed 0.15-0.19 name a ZeRO tag directory's files (``live/zero.py``):

* ``mp_rank_00_model_states.pt``: stage 1/2, the one model-states file;
* ``zero_pp_rank_<r>_mp_rank_00_model_states.pt``: stage 3, one per data-parallel rank;
* ``[bf16_|fp16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt``: one per data-parallel rank.

and, in a tensor/pipeline-parallel checkpoint (described by a checkpoint index, ``parallel_files.py``),
the same names with ``mp_rank_<m>`` for model-parallel rank ``m`` and a pipeline's layer files
``layer_<LL>-model_states.pt`` (Megatron's ``layer_<LL>-model_<TT>-model_states.pt`` under pp x tp).
MoE expert files are recognized only to be refused.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import PurePosixPath
from typing import Literal

OPTIM_RE = re.compile(r"^(?:bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
MODEL_RE = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
EXPERT_RE = re.compile(
    r"^((?:layer_\d+_)?expert_\d+_mp_rank_\d+_model_states|expp_rank_\d+_mp_rank_\d+_optim_states)\.pt$"
)  # expert_E_mp_rank_XX: DeepSpeed's older name (MoE layer id -1), still loaded
PIPE_LAYER_RE = re.compile(r"^layer_(\d+)(?:-model_(\d+))?-model_states\.pt$")

# Manifest files are listed model states first, then optimizer states, each by rank, then the rest.
ROLE_ORDER = {"model_states": 0, "optimizer_states": 1, "other": 2}


def _base(name: str) -> str:
    return PurePosixPath(name).name


def role_of(name: str) -> tuple[Literal["model_states", "optimizer_states", "other"], list[int]]:
    """(manifest role, ranks) of a file by its name; the stage-1/2 model states belong to rank 0."""
    base = _base(name)
    if m := OPTIM_RE.match(base):
        return "optimizer_states", [int(m.group(1))]
    if m := MODEL_RE.match(base):
        return "model_states", [int(m.group(1) or 0)]
    return "other", []


def rank_of(name: str) -> int | None:
    """The data-parallel rank a file name spells out (None for the stage-1/2 model states and others)."""
    base = _base(name)
    if m := OPTIM_RE.match(base):
        return int(m.group(1))
    if (m := MODEL_RE.match(base)) and m.group(1) is not None:
        return int(m.group(1))
    return None


def file_order(role: str, ranks: list[int], path: str) -> tuple:
    """Sort key of a manifest file entry: role, then rank, then path."""
    return (ROLE_ORDER.get(role, 2), list(ranks) if role != "other" else [], path)


def optim_prefix(names: Iterable[str], model_dtype: str) -> str:
    """The optimizer files' name prefix: as the files present spell it, else DeepSpeed's
    default for the model dtype (``bf16_`` for bfloat16)."""
    for name in names:
        base = _base(name)
        if m := OPTIM_RE.match(base):
            return base[: m.start(1)].removesuffix("zero_pp_rank_")
    return "bf16_" if model_dtype == "bfloat16" else ""


def expected_name(role: str, rank: int, zero_stage: int, prefix: str = "", mp_rank: int = 0) -> str:
    """The name DeepSpeed gives the ``role`` file of data-parallel ``rank`` of model-parallel rank ``mp_rank``."""
    if role == "optimizer_states":
        return f"{prefix}zero_pp_rank_{rank}_mp_rank_{mp_rank:02d}_optim_states.pt"
    if zero_stage == 3:
        return f"zero_pp_rank_{rank}_mp_rank_{mp_rank:02d}_model_states.pt"
    return f"mp_rank_{mp_rank:02d}_model_states.pt"


def mp_rank_of(name: str) -> int | None:
    """The model-parallel rank a model- or optimizer-states file name spells out."""
    base = _base(name)
    if (m := OPTIM_RE.match(base)) or (m := MODEL_RE.match(base)):
        return int(m.group(2))
    return None
