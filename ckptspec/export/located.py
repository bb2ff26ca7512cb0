"""The fp32 masters of stage-0, stage-0 MoE and universal checkpoints, read from their files.

``ckptspec.deepspeed.masters`` says where each parameter's master is (one tensor per parameter);
this reads those bytes through the same ``read_array`` as every reconstruction: no torch, no
pickle, no DeepSpeed.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..checkpoint.states import StateCache
from ..deepspeed.masters import MasterTensor, stage0_masters, stage0_replicas, universal_masters
from ..errors import ReconstructMismatch
from .arrays import ShardReader, read_array
from .plan import Segment, TensorSource


def _source(folder: Path, master: MasterTensor) -> TensorSource:
    segments = [Segment(folder / path, offset, nbytes) for path, offset, nbytes in master.segments]
    return TensorSource(master.name, master.shape, master.dtype, segments, "trainable")


def read_masters(folder: str | os.PathLike, masters: dict[str, MasterTensor], dtype: str = "float32") -> dict[str, Any]:
    """name -> numpy array of ``dtype`` (bfloat16 as uint16 bits), in the parameter's shape."""
    folder = Path(folder)
    with ShardReader() as files:
        return {name: read_array(_source(folder, m), dtype, files) for name, m in masters.items()}


def load_stage0_masters(tag_dir: str | os.PathLike, states: StateCache | None = None) -> dict[str, Any]:
    """Every fp32 master of a stage-0 (dense or native MoE) tag directory, by whole-model name."""
    return read_masters(tag_dir, stage0_masters(Path(tag_dir), states))


def load_universal_masters(folder: str | os.PathLike, states: StateCache | None = None) -> dict[str, Any]:
    """Every ``zero/<name>/fp32.pt`` of a universal folder, in the parameter's shape."""
    return read_masters(folder, universal_masters(Path(folder), states))


def load_moe_zero_masters(tag_dir: str | os.PathLike, states: StateCache | None = None) -> dict[str, Any]:
    """Every fp32 master of a native-MoE stage-1/2 tag directory (every expert), by global name."""
    from ..deepspeed.moe_masters import moe_zero_masters

    return read_masters(tag_dir, moe_zero_masters(Path(tag_dir), states))


def check_stage0_replicas(tag_dir: str | os.PathLike, states: StateCache | None = None) -> int:
    """Compare every copy DeepSpeed saved of a stage-0 MoE master with the master (CK401 naming the
    parameter and the file of the copy that differs); returns the number of copies compared."""
    folder = Path(tag_dir)
    pairs = stage0_replicas(folder, states)
    with ShardReader() as files:
        for master, copy in pairs:
            a = read_array(_source(folder, master), master.dtype, files)
            b = read_array(_source(folder, copy), copy.dtype, files)
            if a.tobytes() != b.tobytes():
                raise ReconstructMismatch(
                    f"the copy of {master.name!r}'s master in {copy.segments[0][0]} differs from "
                    f"{master.segments[0][0]}'s",
                    folder / copy.segments[0][0],
                )
    return len(pairs)
