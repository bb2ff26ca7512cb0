"""Which kind of DeepSpeed checkpoint: one vocabulary for tag directories and live engines.

The kind decides the document (a plain ZeRO checkpoint has a format 1.x manifest, every other kind a
checkpoint index) and which producer describes it: ``describe`` dispatches on ``kind_of_dir``, the
save hook and ``index_from_engine`` on ``kind_of_engine``. File names and engine attributes only:
no torch, no DeepSpeed import (a stage-0 pipeline is told by its model states' metadata).
"""

from __future__ import annotations

import enum
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..checkpoint.states import StateCache
from ..location import RemotePath
from .layout.masters import EXPERT_FILE_RE, EXPP_RE, MODEL_FILE
from .layout.names import MODEL_RE, OPTIM_RE, PIPE_LAYER_RE
from .layout.pipeline_torch_optimizer import is_torch_optimizer_state, is_unfused_state
from .layout.tag_dir import UNIVERSAL_FOLDER

if TYPE_CHECKING:  # the models load pydantic: `generate` asks the kind before it needs them
    from ..format.index_models import CheckpointIndex


class Kind(enum.StrEnum):
    ZERO = "zero"  # ZeRO stage 1-3, one model-parallel rank: a format 1.x manifest
    MODEL_PARALLEL = "model_parallel"  # tensor and/or pipeline parallel at ZeRO 1-3
    MOE = "moe"  # DeepSpeed's native MoE layers (expert files)
    STAGE0 = "stage0"  # ZeRO stage 0: fp32 masters in the optimizer file
    PIPELINE_STAGE0 = "pipeline_stage0"  # a pipeline at ZeRO stage 0 (BF16_Optimizer)
    UNIVERSAL = "universal"  # ds_to_universal's folder

    @property
    def label(self) -> str:
        """The kind as a user names it, in messages."""
        return _LABELS[self]

    @property
    def needs_index(self) -> bool:
        """Described by a checkpoint index, not a format 1.x manifest."""
        return self is not Kind.ZERO

    @property
    def masters_kind(self) -> str | None:
        """The kinds whose index locates the fp32 masters of a live engine (issue #17), else None."""
        return self.value if self in (Kind.MOE, Kind.STAGE0, Kind.PIPELINE_STAGE0) else None


_LABELS = {
    Kind.ZERO: "ZeRO data-parallel",
    Kind.MODEL_PARALLEL: "tensor/pipeline-parallel",
    Kind.MOE: "MoE",
    Kind.STAGE0: "ZeRO stage-0",
    Kind.PIPELINE_STAGE0: "ZeRO stage-0 pipeline",
    Kind.UNIVERSAL: "universal",
}


def kind_of_index(index: CheckpointIndex) -> Kind:
    """The kind of the checkpoint a checkpoint index describes, from the index alone."""
    if index.kind == "universal":
        return Kind.UNIVERSAL
    if index.expert_files:
        return Kind.MOE
    if any(d.masters is not None for d in index.domains):
        return Kind.PIPELINE_STAGE0 if index.layer_files else Kind.STAGE0
    degrees = index.topology.degrees
    one = degrees.tensor == degrees.pipeline == len(index.domains) == 1 and not index.layer_files
    return Kind.ZERO if one else Kind.MODEL_PARALLEL  # a PipelineModule at one stage has layer files


def kind_of_dir(tag_dir: Path | RemotePath) -> Kind:
    """The kind of a tag directory, from its file names (and a stage-0 pipeline's model states).

    A URL is told by the same names: its listing (an S3 list, an HTTP index page) is asked once."""
    found = _index_kind(tag_dir)
    if found is not None:
        return Kind(found)
    return Kind.MODEL_PARALLEL if is_model_parallel(tag_dir) else Kind.ZERO


def kind_of_engine(engine) -> Kind:
    """The kind of the checkpoint a live engine saves (its attributes only: no collective, no import)."""
    found = _masters_kind(engine)
    if found is not None:
        return Kind(found)
    return Kind.MODEL_PARALLEL if _is_model_parallel_engine(engine) else Kind.ZERO


def described_by_index(checkpoint: Any, document: Any = None, tag: str | None = None) -> bool:
    """Whether a checkpoint is read through a checkpoint index (else a format 1.x manifest): the one
    place every command and public function asks, before it reads anything else. A document given
    (a model, the report of a validated one, or a file) decides by its ``format``; else the tag
    directory's file names do (``needs_index``). A tag directory that cannot be resolved is left to
    the 1.x path, which names the problem (CK901, CK201)."""
    from ..errors import CkptspecError
    from ..format.index_models import CheckpointIndex
    from ..format.index_validate import IndexReport, is_index

    if document is not None:
        if isinstance(document, (CheckpointIndex, IndexReport)):
            return True
        if not isinstance(document, (str, os.PathLike)):
            return False  # a Manifest or its Report
        from ..format.codec import read_document

        try:
            return is_index(read_document(document)[0])
        except CkptspecError:
            return False  # the 1.x path reports the unreadable file
    from .layout.tag_dir import resolve_tag_dir

    try:
        return needs_index(resolve_tag_dir(checkpoint, tag))
    except CkptspecError:
        return False


def needs_index(tag_dir: Path | RemotePath) -> bool:
    """``kind_of_dir(tag_dir).needs_index`` without reading a pickle for a model-parallel directory (the
    CLI asks this before anything else; ``kind_of_dir`` tells a stage-0 pipeline by its model states)."""
    return is_model_parallel(tag_dir) or _index_kind(tag_dir) is not None


def is_model_parallel(tag_dir: Path | RemotePath) -> bool:
    """The directory holds files of a model-parallel rank other than 0, or pipeline layer files."""
    for path in tag_dir.iterdir():
        name = path.name
        if PIPE_LAYER_RE.match(name):
            return True
        m = OPTIM_RE.match(name) or MODEL_RE.match(name)
        if m and int(m.group(2)) != 0:
            return True
    return False


def _index_kind(tag_dir: Path | RemotePath) -> str | None:
    """``"universal"``, ``"moe"``, ``"stage0"`` or ``"pipeline_stage0"`` for a tag directory
    ``describe`` locates masters for, else None. File names only (and the pipeline stage-0 check):
    ``generate`` asks before it imports the models."""
    if not tag_dir.is_dir():
        return None
    names = [p.name for p in tag_dir.iterdir()]
    if any(PIPE_LAYER_RE.match(n) for n in names):
        return "pipeline_stage0" if is_pipeline_stage0(tag_dir, StateCache()) else None
    if any(OPTIM_RE.match(n) and not n.endswith("mp_rank_00_optim_states.pt") for n in names):
        return None  # a model-parallel rank other than 0: the tensor/pipeline index
    if any(EXPERT_FILE_RE.match(n) or EXPP_RE.match(n) for n in names):
        return "moe"
    if any(OPTIM_RE.match(n) for n in names):
        return None  # an ordinary ZeRO checkpoint: format 1.x
    if (tag_dir / UNIVERSAL_FOLDER).is_dir():
        return "universal"
    if MODEL_FILE in names:
        return "stage0"
    return None


def is_pipeline_stage0(tag_dir: Path | RemotePath, states: StateCache) -> bool:
    """Layer files, and model states with ``param_shapes`` None and BF16_Optimizer's partitions, or (fp32, no
    optimizer-state files) the torch optimizer's own state per parameter."""
    model = tag_dir / "mp_rank_00_model_states.pt"
    if not model.is_file() or not any(tag_dir.glob("layer_*-model_states.pt")):
        return False
    state = states.state(model)
    optimizer = state.get("optimizer") if isinstance(state, dict) else None
    if state.get("param_shapes", []) is not None or not isinstance(optimizer, dict):
        return False
    if is_torch_optimizer_state(optimizer) or is_unfused_state(optimizer):  # fp32, or fp16 (FP16_UnfusedOptimizer)
        return not any(OPTIM_RE.match(p.name) for p in tag_dir.iterdir())
    return "param_slice_mappings" in optimizer


def _masters_kind(engine) -> str | None:
    """``"moe"``, ``"pipeline_stage0"`` or ``"stage0"`` for an engine whose masters the index locates, else None."""
    if getattr(engine, "has_moe_layers", False):
        return "moe"
    stage = getattr(engine, "zero_optimization_stage", None)
    if not callable(stage) or stage() != 0:
        return None
    return "pipeline_stage0" if type(engine).__name__ == "PipelineEngine" else "stage0"


def _is_model_parallel_engine(engine) -> bool:
    """Tensor or pipeline parallelism: the engine's checkpoint needs an index, not a manifest."""
    return int(getattr(engine, "mp_world_size", 1) or 1) > 1 or type(engine).__name__ == "PipelineEngine"
