"""The checkpoint index of a saved tensor- or pipeline-parallel DeepSpeed checkpoint, without DeepSpeed.

One domain per model-parallel rank (its ZeRO data-parallel group), each described by the 1.x
producer (``describe.manifest_from_states``) on that rank's files; then the whole-model view:
AutoTP shards placed by the ``affine_map`` the model states record (``placements.py``), pipeline
parameters found in the layer files. Reads metadata only, never executes pickled code.
"""

from __future__ import annotations

from pathlib import Path

from ..._version import __version__
from ...checkpoint.hashing import file_digest
from ...checkpoint.states import StateCache
from ...checkpoint.torchfile import TensorRef
from ...errors import InvalidCheckpoint, UnsupportedCheckpoint
from ...format.index_models import (
    INDEX_FORMAT,
    INDEX_VERSION,
    CheckpointIndex,
    Coordinate,
    Degrees,
    Domain,
    IndexParameter,
    LayerFile,
    Shard,
    Topology,
)
from ...format.models import Manifest
from ..layout.parallel_files import ParallelFiles, degrees_of, layer_file_name, missing_layer_files, scan_parallel
from ..layout.placements import affine_params, tp_placement
from .zero import manifest_from_states


def domain_id(pipeline: int, tensor: int) -> str:
    return f"pp{pipeline}-tp{tensor}"


def describe(tag_dir: Path, states: StateCache, hash_algorithm: str | None = None) -> CheckpointIndex:
    """The index of a tensor/pipeline-parallel tag directory (its files by model-parallel rank)."""
    return index_from_files(scan_parallel(tag_dir), states, hash_algorithm=hash_algorithm)


def index_from_files(files: ParallelFiles, states: StateCache, *, hash_algorithm: str | None = None) -> CheckpointIndex:
    degrees = degrees_of(files, states)
    if degrees.pipeline > 1 and degrees.tensor > 1:
        raise UnsupportedCheckpoint(
            f"pipeline {degrees.pipeline} x tensor {degrees.tensor} parallelism",
            "pp x tp checkpoints are not described yet: no real one backs the format (DeepSpeed 0.19.8's AutoTP "
            "cannot run inside a PipelineModule)",
            str(files.tag_dir),
        )
    _refuse_outside(files, degrees)
    for mp, shards in sorted(files.by_mp_rank.items()):
        if not shards.model_files:
            raise InvalidCheckpoint(
                "CK203",
                f"no model-states file for model-parallel rank {mp}",
                "restore mp_rank_XX_model_states.pt of that rank from the run that wrote the checkpoint",
                str(files.tag_dir),
            )
    domains: list[Domain] = []
    for mp, shards in sorted(files.by_mp_rank.items()):
        model_path = shards.model_files[min(shards.model_files)]
        if isinstance(model := states.state(model_path), dict) and model.get("param_shapes", []) is None:
            raise UnsupportedCheckpoint(  # DeepSpeed's stage-0 optimizers record no param_shapes
                "model states have 'param_shapes' None (ZeRO stage 0: BF16_Optimizer in a pipeline)",
                "ZeRO stage 0 checkpoints are not described by this ckptspec",
                str(model_path),
            )
        manifest = manifest_from_states(
            shards, states, hash_algorithm=hash_algorithm, pipeline_stage=degrees.pipeline > 1, in_index=True
        )
        # The degrees as the index knows them (derived ones too: older DeepSpeed records none).
        manifest.layout.tensor_parallel_size = degrees.tensor
        manifest.layout.pipeline_parallel_size = degrees.pipeline
        pipeline, tensor = degrees.coordinate(mp)
        domains.append(
            Domain(
                id=domain_id(pipeline, tensor),
                coordinate=Coordinate(pipeline=pipeline, tensor=tensor),
                process_group="data_parallel",
                size=manifest.layout.world_size,
                file_ranks={
                    f.path: f.ranks[0] for f in manifest.files if f.role in ("model_states", "optimizer_states")
                },
                manifest=manifest,
            )
        )
    first = domains[0].manifest
    if degrees.pipeline > 1:
        layer_files, parameters = pipeline_view(files, states, domains, hash_algorithm)
    else:
        layer_files, parameters = [], _tensor_view(files, states, domains, degrees.tensor)
    return CheckpointIndex(
        format=INDEX_FORMAT,
        format_version=INDEX_VERSION,
        producer=first.producer.model_copy(update={"tool_version": __version__}),
        kind="zero",
        topology=Topology(
            degrees=Degrees(pipeline=degrees.pipeline, tensor=degrees.tensor, data=degrees.data),
            degrees_source=degrees.source,
            model_parallel_size=degrees.model_parallel,
        ),
        domains=domains,
        layer_files=layer_files,
        parameters=parameters,
    )


def _refuse_outside(files: ParallelFiles, degrees) -> None:
    """Files the recorded degrees have no place for are refused by name, never described."""
    for mp, shards in sorted(files.by_mp_rank.items()):
        if mp >= degrees.model_parallel:
            path = sorted([*shards.model_files.values(), *shards.optim_files.values()])[0]
            raise UnsupportedCheckpoint(
                f"model-parallel rank {mp} in {path.name}, but the model states record "
                f"{degrees.model_parallel} model-parallel rank(s) ({degrees.source})",
                "a file of another run or layout; remove it",
                str(path),
            )
    if files.layer_files and degrees.pipeline == 1:
        path = files.layer_files[min(files.layer_files)]
        raise UnsupportedCheckpoint(
            f"pipeline layer file {path.name}, but the model states record pipeline degree 1",
            "a file of another run or layout; remove it",
            str(path),
        )


def _trainable(manifest: Manifest) -> list:
    return [p for g in manifest.groups for p in g.params]


def _refuse_untrainable(manifest: Manifest, domain: Domain) -> None:
    """Frozen parameters, buffers and ties are not in the whole-model view yet: refused by name."""
    for section in ("frozen", "buffers", "aliases"):
        items = getattr(manifest, section)
        if items:
            raise UnsupportedCheckpoint(
                f"{section} ({items[0].name!r}, ...) in model-parallel domain {domain.id}",
                "the checkpoint index describes the trainable parameters of tensor/pipeline-parallel checkpoints; "
                f"{section} there are not described yet",
            )


def _tensor_view(files: ParallelFiles, states: StateCache, domains: list[Domain], tp: int) -> list[IndexParameter]:
    by_name: dict[str, IndexParameter] = {}
    for domain in domains:
        _refuse_untrainable(domain.manifest, domain)
        tensor = domain.coordinate.tensor
        model_path = next(f.path for f in domain.manifest.files if f.role == "model_states")
        amap = affine_params(states.state(files.tag_dir / model_path))
        for param in _trainable(domain.manifest):
            whole, placement = tp_placement(amap, param.name, tensor, list(param.shape), model_path)
            shard = Shard(domain=domain.id, local_name=param.name, local_shape=list(param.shape), placement=placement)
            entry = by_name.get(param.name)
            if entry is None:
                entry = by_name[param.name] = IndexParameter(
                    name=param.name,
                    shape=whole,
                    dtype=param.dtype,
                    role="trainable",
                    shards=[shard],
                    placement_source="affine_map",
                )
                continue
            elif entry.shape != whole:
                raise UnsupportedCheckpoint(
                    f"{param.name!r}: tensor rank {tensor}'s affine_map gives whole shape {whole}, another rank's "
                    f"{entry.shape}",
                    "the mp ranks' model states come from different saves or models",
                    model_path,
                )
            entry.shards.append(shard)
    for entry in by_name.values():
        if all(s.placement == "replicated" for s in entry.shards):
            for s in entry.shards:
                s.primary = s is entry.shards[0]
    return list(by_name.values())


def pipeline_view(
    files: ParallelFiles, states: StateCache, domains: list[Domain], hash_algorithm: str | None
) -> tuple[list[LayerFile], list[IndexParameter]]:
    stage_of_name = {}
    for domain in domains:
        _refuse_untrainable(domain.manifest, domain)
        for param in _trainable(domain.manifest):
            stage_of_name[param.name] = (domain, param)
    layer_files: list[LayerFile] = []
    where: dict[str, tuple[str, str]] = {}  # parameter name -> (layer file, key)
    stage = 0
    for layer, path in sorted(files.layer_files.items()):
        state = states.state(path)
        rel = path.name  # a layer file lies in the tag directory itself
        if not isinstance(state, dict) or not all(isinstance(v, TensorRef) for v in state.values()):
            raise UnsupportedCheckpoint("a pipeline layer file that is not a dict of tensors", "restore it", rel)
        tensors = {}
        for key in state:
            name = f"{layer}.{key}"
            if name not in stage_of_name:
                raise UnsupportedCheckpoint(
                    f"{rel} holds {key!r}, which is no trainable parameter of any stage ({name!r})",
                    "frozen parameters, buffers and tied layers in pipeline layer files are not described yet",
                    rel,
                )
            tensors[key] = name
            where[name] = (rel, key)
        stages = {stage_of_name[n][0].coordinate.pipeline for n in tensors.values()}
        if len(stages) > 1:
            raise UnsupportedCheckpoint(f"{rel} holds parameters of stages {sorted(stages)}", "restore it", rel)
        # A layer without parameters belongs to the stage of the layer before it (stages are contiguous).
        stage = stages.pop() if stages else stage
        entry = LayerFile(path=rel, layer=layer, pipeline=stage, tensor=None, size=path.stat().st_size, tensors=tensors)
        if hash_algorithm:
            entry.hash = file_digest(path, hash_algorithm)
        layer_files.append(entry)
    missing: dict[str, list[str]] = {}  # a layer file the optimizer's parameters name, not here -> its parameters
    parameters = []
    for name, (domain, param) in stage_of_name.items():
        shard = Shard(domain=domain.id, local_name=name, local_shape=list(param.shape), placement="whole")
        if name in where:
            shard.layer_file, shard.layer_key = where[name]
        else:  # the layer file DeepSpeed writes for it
            shard.layer_file, shard.layer_key = layer_file_name(name), name.split(".", 1)[-1]
            missing.setdefault(shard.layer_file, []).append(name)
        parameters.append(
            IndexParameter(
                name=name,
                shape=list(param.shape),
                dtype=param.dtype,
                role="trainable",
                shards=[shard],
                placement_source="pipeline_layer",
            )
        )
    if missing:
        raise missing_layer_files(missing, files.tag_dir)
    return layer_files, parameters
