"""``ckptspec reshard --stage 0`` of a data-parallel ZeRO stage-0 checkpoint: its file for a stage-0 job of another
world size (DeepSpeed issue #2031, "Reshape ZeroStage=0 FP16 Checkpoint").

A data-parallel stage-0 job partitions nothing: every rank holds the whole model, its masters and its optimizer
state, and rank 0 saves them all in ``mp_rank_00_model_states.pt``, whatever the world size. DeepSpeed 0.19.8's
``engine._load_checkpoint`` reads that file at any world size: only ZeRO's loader (``_load_zero_checkpoint``) compares
the saved ``dp_world_size`` with the job's, and a stage-0 job never calls it (a stage-0 job of 3 ranks loads a 2-rank
save as is and holds the saving job's masters and moments: tests/export/test_reshard_stage0_world.py). What records
the layout is ``dp_world_size``, which the checkpoint index reads as the data degree; so the output is the source's
model states with ``dp_world_size`` the target's and every other entry as saved, whichever wrapper saved the optimizer
(the client torch optimizer in fp32, ``FP16_UnfusedOptimizer``, or ``FP16_Optimizer`` for DeepSpeed's FusedAdam, a
dynamic loss scale with its counters included). The source's embedded manifest is dropped: a checkpoint index,
generated from the written file, describes the output.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..checkpoint.embedded import CLIENT_STATE_KEY
from ..checkpoint.states import StateCache
from ..errors import ReshardUnsupported
from ..format.index_models import CheckpointIndex
from ..location import RemotePath
from . import ds_pickle
from .arrays import ShardReader
from .reshard_files import lazy_reader


def keeps_dense_stage0(index: CheckpointIndex, zero_stage: int | None) -> bool:
    """A data-parallel stage-0 checkpoint (no tensor, pipeline or expert degree) for a stage-0 job: ``--stage 0``,
    or no ``--stage`` (the checkpoint's own)."""
    degrees = index.topology.degrees
    dense = degrees.tensor == 1 and degrees.pipeline == 1 and not index.expert_files and not index.layer_files
    return dense and zero_stage in (None, 0) and all(d.configured_zero_stage == 0 for d in index.domains)


@dataclass(frozen=True)
class Stage0WorldWrite:
    """The source's model-states file, written for a stage-0 job of ``world_size`` ranks."""

    model_file: Path | RemotePath  # the source's mp_rank_00_model_states.pt
    world_size: int
    zero_stage: int = 0

    def write(self, states: StateCache, tag_dir: Path) -> list[Path]:
        saved = states.state(self.model_file)
        path = tag_dir / self.model_file.name
        with ShardReader() as files:
            read = lazy_reader(self.model_file, states, files)  # each storage read when written, sharing kept
            doc = {
                key: self.world_size if key == "dp_world_size" else ds_pickle.from_standins(value, read)
                for key, value in saved.items()
                if key != CLIENT_STATE_KEY  # the source's manifest: the output's index is generated from its file
            }
            ds_pickle.save_streamed(doc, path, shapes_as_tuples=True)  # torch.save's bytes, a chunk at a time
        return [path]


def plan_stage0_world(
    index: CheckpointIndex, tag_dir: Path | RemotePath, world_size: int, sub_group_size: int | None
) -> Stage0WorldWrite:
    """The write of ``index``'s one model-states file for ``world_size`` ranks; CK410 before anything is written."""
    if sub_group_size is not None:
        raise ReshardUnsupported(
            f"--sub-group-size {sub_group_size} for a stage-0 target: a ZeRO-3 target's", "leave it out"
        )
    (domain,) = index.domains  # keeps_dense_stage0: one data-parallel domain
    model_file = next(f.path for f in domain.manifest.files if f.role == "model_states")
    return Stage0WorldWrite(tag_dir / model_file, world_size)
