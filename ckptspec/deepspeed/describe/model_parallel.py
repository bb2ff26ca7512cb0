"""The checkpoint index of a saved tensor- or pipeline-parallel DeepSpeed checkpoint, without DeepSpeed.

One domain per model-parallel rank (its ZeRO data-parallel group), each described by the 1.x
producer (``describe.manifest_from_states``) on that rank's files; then the whole-model view:
AutoTP shards placed by the ``affine_map`` the model states record (``placements.py``), pipeline
parameters found in the layer files; the frozen parameters, buffers and ties of the whole model
(index 1.1's ``extras`` and ``aliases``, when it has any) by ``index_extras.py``. Reads metadata only,
never executes pickled code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

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
from ..layout.placements import affine_params, tp_placement, untrainable_placement
from .index_extras import with_extras
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
    index = CheckpointIndex(
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
    return with_extras(index, files.tag_dir, states)


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


def _refuse_untrainable(manifest: Manifest, domain: Domain, sections=("frozen", "buffers", "aliases")) -> None:
    """What the whole-model view cannot place yet is refused by name: ties (and, in a pipeline stage,
    frozen parameters and buffers, which its layer files hold)."""
    for section in sections:
        items = getattr(manifest, section)
        if items:
            raise UnsupportedCheckpoint(
                f"{section} ({items[0].name!r}, ...) in model-parallel domain {domain.id}",
                "the checkpoint index describes the trainable parameters, frozen parameters and buffers of "
                f"tensor-parallel checkpoints and the trainable parameters of pipelines; {section} there are not "
                "described yet",
            )


def _tensor_view(files: ParallelFiles, states: StateCache, domains: list[Domain], tp: int) -> list[IndexParameter]:
    by_name: dict[str, IndexParameter] = {}
    for domain in domains:
        _refuse_untrainable(domain.manifest, domain, ("aliases",))
        tensor = domain.coordinate.tensor
        model_path = next(f.path for f in domain.manifest.files if f.role == "model_states")
        amap = affine_params(states.state(files.tag_dir / model_path))
        # Frozen parameters and buffers are the domain manifest's (index 1.0 has no role for them in
        # ``parameters``): a reader places them by the same affine_map (export/compose_extras.py).
        # One without a merge rule is refused here, before a document says more than can be read.
        for frozen in domain.manifest.frozen:
            untrainable_placement(amap, frozen.name, tensor, list(frozen.shape), model_path, buffer=False)
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


TIED_PREFIX = "tied_modules."  # a PipelineModule's TiedLayerSpec modules: tied_modules.<key>.<attribute>


def pipeline_view(
    files: ParallelFiles, states: StateCache, domains: list[Domain], hash_algorithm: str | None
) -> tuple[list[LayerFile], list[IndexParameter]]:
    """The layer files and the whole model's trainable parameters of a pipeline.

    A layer file's key ``k`` of layer ``L`` is the stage's parameter ``L.k``, or the stage's
    ``tied_modules.<key>.k`` (a ``TiedLayerSpec``'s module, which every stage running it trains and
    saves in each of its layer files), or else a frozen parameter or buffer of the stage (the file's
    key set is the index's, CK230; readers take it from the file). A tied module's whole-model name is
    ``<first layer>.<attribute>``, its stages' masters replicated shards (the first layer's stage
    primary); a reader names its other layers' keys as ties of it.
    """
    by_stage: dict[int, dict[str, tuple[Domain, Any]]] = {}
    for domain in domains:
        _refuse_untrainable(domain.manifest, domain)
        by_stage[domain.coordinate.pipeline] = {p.name: (domain, p) for p in _trainable(domain.manifest)}
    loaded = {}
    for layer, path in sorted(files.layer_files.items()):
        state = states.state(path)
        rel = path.name  # a layer file lies in the tag directory itself
        if not isinstance(state, dict) or not all(isinstance(v, TensorRef) for v in state.values()):
            raise UnsupportedCheckpoint("a pipeline layer file that is not a dict of tensors", "restore it", rel)
        loaded[layer] = (path, rel, state)
    stages_of = {layer: _stages_of(layer, state, by_stage, rel) for layer, (_, rel, state) in loaded.items()}
    layer_files: list[LayerFile] = []
    where: dict[tuple[int, str], tuple[str, str, int]] = {}  # (stage, local name) -> (file, key, layer): the first
    for layer, (path, rel, state) in loaded.items():
        stage = _stage_of(layer, stages_of, rel, state, by_stage)
        tensors = {key: _local_name(layer, key, ref, by_stage[stage], rel) for key, ref in state.items()}
        for key, name in tensors.items():
            if name in by_stage[stage]:
                where.setdefault((stage, name), (rel, key, layer))
        entry = LayerFile(path=rel, layer=layer, pipeline=stage, tensor=None, size=path.stat().st_size, tensors=tensors)
        if hash_algorithm:
            entry.hash = file_digest(path, hash_algorithm)
        layer_files.append(entry)
    missing: dict[str, list[str]] = {}  # a layer file the optimizer's parameters name, not here -> its parameters
    parameters: dict[str, IndexParameter] = {}
    for stage, names in sorted(by_stage.items()):
        for name, (domain, param) in names.items():
            shard = Shard(domain=domain.id, local_name=name, local_shape=list(param.shape), placement="whole")
            found = where.get((stage, name))
            if found is not None:
                shard.layer_file, shard.layer_key, _ = found
            elif name.startswith(TIED_PREFIX):
                raise UnsupportedCheckpoint(
                    f"stage {stage} trains the tied {name!r}, and none of its layer files holds it",
                    "restore the stage's layer files of this save",
                    str(files.tag_dir),
                )
            else:  # the layer file DeepSpeed writes for it
                shard.layer_file, shard.layer_key = layer_file_name(name), name.split(".", 1)[-1]
                missing.setdefault(shard.layer_file, []).append(name)
            whole = name
            if name.startswith(TIED_PREFIX):  # named after its first layer, over every stage that trains it
                first = min(where[(s, name)][2] for s in by_stage if (s, name) in where)
                whole = f"{first}.{name.split('.', 2)[2]}"
            known = parameters.get(whole)
            if known is None:
                parameters[whole] = IndexParameter(
                    name=whole,
                    shape=list(param.shape),
                    dtype=param.dtype,
                    role="trainable",
                    shards=[shard],
                    placement_source="pipeline_layer",
                )
                continue
            if known.shape != list(param.shape):
                raise UnsupportedCheckpoint(
                    f"the tied {name!r} has shape {list(param.shape)} on stage {stage}, {known.shape} on another",
                    "the stages' files come from different saves or models",
                    str(files.tag_dir),
                )
            known.shards.append(shard)
    if missing:
        raise missing_layer_files(missing, files.tag_dir)
    for tied in parameters.values():
        if len(tied.shards) > 1:  # a tie over stages: one copy each, the first layer's stage primary
            first_file = loaded[int(tied.name.split(".", 1)[0])][1]
            for s in tied.shards:
                s.placement, s.primary = "replicated", s.layer_file == first_file
    return layer_files, list(parameters.values())


def _stages_of(layer: int, state: dict, by_stage: dict, rel: str) -> set[int]:
    """The stages that train one of the layer's own ``<layer>.<key>`` names (a tied module is every stage's)."""
    stages = {s for key in state for s, names in by_stage.items() if f"{layer}.{key}" in names}
    if len(stages) > 1:
        raise UnsupportedCheckpoint(f"{rel} holds parameters of stages {sorted(stages)}", "restore it", rel)
    return stages


def _stage_of(layer: int, stages_of: dict[int, set[int]], rel: str, state: dict, by_stage: dict) -> int:
    """A layer's stage: the one that trains its parameters; a layer without any of its own (no parameters,
    or a tied module's only) lies between the stages of the layers around it (stages are contiguous)."""
    if stages_of[layer]:
        return next(iter(stages_of[layer]))
    before = [next(iter(s)) for n, s in sorted(stages_of.items()) if n < layer and s]
    after = [next(iter(s)) for n, s in sorted(stages_of.items()) if n > layer and s]
    low = before[-1] if before else 0
    high = after[0] if after else max(by_stage)
    if state and low != high:
        raise UnsupportedCheckpoint(
            f"{rel} holds no parameter of its own that a stage trains ({sorted(state)}: a tied module's, frozen "
            f"or buffers) and lies between stages {low} and {high}",
            "the stage of such a layer at a stage boundary cannot be told from the files; it is not described",
            rel,
        )
    return low


def _local_name(layer: int, key: str, ref: TensorRef, stage_names: dict, rel: str) -> str:
    """The stage's name of a layer file's tensor (module docstring of ``pipeline_view``)."""
    if f"{layer}.{key}" in stage_names:
        return f"{layer}.{key}"
    tied = [n for n in stage_names if n.startswith(TIED_PREFIX) and n.split(".", 2)[2] == key]
    tied = [n for n in tied if list(stage_names[n][1].shape) == list(ref.shape)]
    if len(tied) > 1:
        raise UnsupportedCheckpoint(
            f"{rel} holds {key!r}, which may be any of the tied {tied}",
            "which TiedLayerSpec a layer runs is not in the files; it is not described",
            rel,
        )
    return tied[0] if tied else f"{layer}.{key}"  # else a frozen parameter or buffer of the stage
