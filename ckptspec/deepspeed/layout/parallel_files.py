"""A tensor/pipeline-parallel tag directory: its files by model-parallel rank, its layer files, its degrees.

DeepSpeed 0.19 numbers a checkpoint's model-parallel rank ``mp = pipeline * tp_degree + tensor``
(``PipelineModule``/AutoTP); each mp rank writes the file set of one ZeRO data-parallel group under
``mp_rank_<mp>``, and a pipeline also writes one ``layer_<LL>-model_states.pt`` per layer (with tensor
parallelism, a PipeModelDataParallelTopology's: ``layer_<LL>-model_<TT>-model_states.pt`` per tensor rank). The
degrees come from ``checkpoint_parallel_dimensions`` (DeepSpeed >= 0.19.5) or are derived from
``mp_world_size`` and the names; a split of ``mp_world_size`` the names do not decide is refused,
never defaulted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from ..._fs import is_leftover
from ...checkpoint.states import StateCache
from ...errors import CheckpointInvalid, InvalidCheckpoint, UnsupportedCheckpoint
from ...findings import finding
from ...location import RemotePath
from .names import EXPERT_RE, MODEL_RE, OPTIM_RE, PIPE_LAYER_RE
from .tag_dir import UNIVERSAL_FOLDER, ShardSet, resolve_tag_dir


@dataclass
class ParallelFiles:
    tag_dir: Path | RemotePath
    by_mp_rank: dict[int, ShardSet] = field(default_factory=dict)
    layer_files: dict[int, Path | RemotePath] = field(default_factory=dict)  # layer index -> file
    # a tensor-parallel pipeline's (layer_XX-model_YY-model_states.pt): (layer index, tensor rank) -> file
    tensor_layer_files: dict[tuple[int, int], Path | RemotePath] = field(default_factory=dict)
    other_files: list[Path | RemotePath] = field(default_factory=list)


@dataclass(frozen=True)
class Degrees:
    pipeline: int
    tensor: int
    data: int
    model_parallel: int
    source: Literal["checkpoint_parallel_dimensions", "derived"]

    def coordinate(self, mp_rank: int) -> tuple[int, int]:
        """(pipeline stage, tensor rank) of a checkpoint mp rank."""
        return divmod(mp_rank, self.tensor)


def index_tag_dir(checkpoint, tag: str | None = None) -> Path | RemotePath:
    """The tag directory of a checkpoint read through a checkpoint index: a local one, or a URL's."""
    return resolve_tag_dir(checkpoint, tag)


def scan_parallel(tag_dir: Path | RemotePath) -> ParallelFiles:
    out = ParallelFiles(tag_dir)
    listed: list[Path | RemotePath] = list(tag_dir.iterdir())
    for path in sorted(listed, key=lambda p: p.name):
        name = path.name
        if not path.is_file():
            continue
        if EXPERT_RE.match(name):
            raise UnsupportedCheckpoint(
                f"MoE expert file {name}", "MoE checkpoints are not described by this ckptspec (issue #17)", str(path)
            )
        if m := PIPE_LAYER_RE.match(name):
            if m.group(2) is not None:
                out.tensor_layer_files[int(m.group(1)), int(m.group(2))] = path
            else:
                out.layer_files[int(m.group(1))] = path
        elif m := OPTIM_RE.match(name):
            shards = out.by_mp_rank.setdefault(int(m.group(2)), ShardSet(tag_dir))
            shards.optim_files[int(m.group(1))] = path
        elif m := MODEL_RE.match(name):
            shards = out.by_mp_rank.setdefault(int(m.group(2)), ShardSet(tag_dir))
            shards.model_files[int(m.group(1) or 0)] = path
        elif not name.startswith("ckptspec.") and not is_leftover(name):
            out.other_files.append(path)
    if not any(s.optim_files for s in out.by_mp_rank.values()) and (tag_dir / UNIVERSAL_FOLDER).is_dir():
        raise UnsupportedCheckpoint(  # as directory.scan_tag_dir says it
            f"a DeepSpeed universal checkpoint ({UNIVERSAL_FOLDER}/ folder), not a ZeRO checkpoint",
            "describe the ZeRO checkpoint it was converted from: pass that tag "
            "(DeepSpeed loads this one with checkpoint.load_universal)",
            str(tag_dir / UNIVERSAL_FOLDER),
        )
    if out.layer_files and out.tensor_layer_files:
        path = out.tensor_layer_files[min(out.tensor_layer_files)]
        raise UnsupportedCheckpoint(
            f"layer files of a tensor-parallel pipeline ({path.name}) beside a plain pipeline's "
            f"({out.layer_files[min(out.layer_files)].name})",
            "files of two runs or layouts in one tag directory; remove the other run's",
            str(path),
        )
    if not any(s.model_files for s in out.by_mp_rank.values()):
        raise InvalidCheckpoint(
            "CK203", "no *_model_states.pt file", "is this a DeepSpeed checkpoint tag directory?", str(tag_dir)
        )
    return out


def tensor_rank_files(files: ParallelFiles, degrees: Degrees, tensor: int) -> ParallelFiles:
    """Tensor rank ``tensor``'s stages and layer files of a tensor-parallel pipeline, as a pipeline of their own
    (its layer files under ``layer_files``); a pipeline without tensor parallelism is its own."""
    if degrees.tensor == 1:
        return files
    return ParallelFiles(
        files.tag_dir,
        by_mp_rank={mp: s for mp, s in files.by_mp_rank.items() if degrees.coordinate(mp)[1] == tensor},
        layer_files={layer: p for (layer, t), p in files.tensor_layer_files.items() if t == tensor},
    )


def layer_file_name(param: str, tensor: int | None = None) -> str:
    """The layer file DeepSpeed writes a pipeline parameter ``<layer>.<key>`` into (tensor rank ``tensor``'s
    in a tensor-parallel pipeline: the topology's ``model`` coordinate in the name)."""
    layer = param.split(".", 1)[0]
    if not layer.isdigit():
        return layer
    return (
        f"layer_{int(layer):02d}-model_{tensor:02d}-model_states.pt"
        if tensor is not None
        else (f"layer_{int(layer):02d}-model_states.pt")
    )


def missing_layer_files(missing: dict[str, list[str]], tag_dir) -> CheckpointInvalid:
    """CK230 for each layer file (-> the trainable parameters it holds) that is not in the tag directory."""
    return CheckpointInvalid(
        [
            finding(
                "CK230",
                "$.layer_files",
                f"pipeline layer file of {', '.join(names[:3])}{' ...' if len(names) > 3 else ''} is missing",
                "restore it from the run that wrote the checkpoint; the layer's weights are lost without it",
                file=rel,
            )
            for rel, names in sorted(missing.items())
        ],
        str(tag_dir),
    )


def degrees_of(files: ParallelFiles, states: StateCache) -> Degrees:
    """The degrees the model states record, else derived from ``mp_world_size`` and the file names."""
    mp0 = min(mp for mp, s in files.by_mp_rank.items() if s.model_files)
    path = files.by_mp_rank[mp0].model_files[min(files.by_mp_rank[mp0].model_files)]
    first = states.state(path)
    if not isinstance(first, dict):
        raise UnsupportedCheckpoint("model states are not a dict", "is this a DeepSpeed checkpoint?", str(path))
    dims = first.get("checkpoint_parallel_dimensions")
    mp_world = first.get("mp_world_size")
    dp_world = int(first.get("dp_world_size") or 1)
    if isinstance(dims, dict) and "pp_degree" in dims and "tp_degree" in dims:
        pp, tp = int(dims["pp_degree"]), int(dims["tp_degree"])
        return Degrees(pp, tp, dp_world, pp * tp, "checkpoint_parallel_dimensions")
    if not isinstance(mp_world, int) or mp_world < 1:
        raise UnsupportedCheckpoint(
            "neither checkpoint_parallel_dimensions nor mp_world_size in the model states",
            "the tensor and pipeline degrees cannot be known; they are never assumed to be 1",
            str(path),
        )
    # DeepSpeed < 0.19.5: a pipeline writes layer files and no module; AutoTP writes the module.
    if files.layer_files and first.get("module") is None:
        return Degrees(mp_world, 1, dp_world, mp_world, "derived")
    if not files.layer_files and first.get("module") is not None:
        return Degrees(1, mp_world, dp_world, mp_world, "derived")
    raise UnsupportedCheckpoint(
        f"mp_world_size {mp_world} without checkpoint_parallel_dimensions, and the file names do not tell "
        "its split into pipeline x tensor",
        "save with DeepSpeed >= 0.19.5 (which records the degrees), or describe the checkpoint from the live engine",
        str(path),
    )
