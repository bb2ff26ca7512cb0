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
    # A PipelineModule's files: layer files, a stage's model states without the module (one stage too)
    pipe_module = degrees.pipeline > 1 or bool(files.layer_files)
    domains: list[Domain] = []
    recorded: dict[str, str] | None = None  # tensor rank 0's ties (``zero.proven_ties``)
    for mp, shards in sorted(files.by_mp_rank.items()):
        model_path = shards.model_files[min(shards.model_files)]
        if isinstance(model := states.state(model_path), dict) and model.get("param_shapes", []) is None:
            raise UnsupportedCheckpoint(  # DeepSpeed's stage-0 optimizers record no param_shapes
                "model states have 'param_shapes' None (ZeRO stage 0: BF16_Optimizer in a pipeline)",
                "ZeRO stage 0 checkpoints are not described by this ckptspec",
                str(model_path),
            )
        manifest = manifest_from_states(
            shards,
            states,
            hash_algorithm=hash_algorithm,
            pipeline_stage=pipe_module,
            in_index=True,
            recorded_ties=recorded,
        )
        if degrees.tensor > 1 and degrees.pipeline == 1 and recorded is None:
            recorded = {a.name: a.owner for a in manifest.aliases}
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
    if pipe_module:
        layer_files, parameters = pipeline_view(files, states, domains, hash_algorithm)
    else:
        layer_files, parameters = [], tensor_view(files, states, domains, degrees.tensor)
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


def _trainable(manifest: Manifest) -> list:
    return [p for g in manifest.groups for p in g.params]


def _refuse_untrainable(manifest: Manifest, domain: Domain, sections=("frozen", "buffers", "aliases")) -> None:
    """What the whole-model view of a pipeline cannot place is refused by name: a stage's frozen parameters
    and buffers outside its layer files (frozen_param_fragments at ZeRO-2), ties inside one stage."""
    for section in sections:
        items = getattr(manifest, section)
        if items:
            raise UnsupportedCheckpoint(
                f"{section} ({items[0].name!r}, ...) in model-parallel domain {domain.id}",
                "the checkpoint index describes every tensor of tensor-parallel checkpoints, and the layer files "
                f"of pipelines (TiedLayerSpec ties included); {section} in a pipeline stage's model states are not "
                "described yet",
            )


def tensor_view(files: ParallelFiles, states: StateCache, domains: list[Domain], tp: int) -> list[IndexParameter]:
    by_name: dict[str, IndexParameter] = {}
    for domain in domains:
        tensor = domain.coordinate.tensor
        model_path = next(f.path for f in domain.manifest.files if f.role == "model_states")
        amap = affine_params(states.state(files.tag_dir / model_path))
        # Frozen parameters and buffers are the domain manifest's (index 1.0 has no role for them in
        # ``parameters``): a reader places them by the same affine_map (export/compose_extras.py).
        # One without a merge rule is refused here, before a document says more than can be read.
        placed = {
            f.name: untrainable_placement(amap, f.name, tensor, list(f.shape), model_path, buffer=False)[1]
            for f in domain.manifest.frozen
        }
        for param in _trainable(domain.manifest):
            whole, placement = tp_placement(amap, param.name, tensor, list(param.shape), model_path)
            placed[param.name] = placement
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
        _check_ties(domain, amap, placed, model_path)
    for entry in by_name.values():
        if all(s.placement == "replicated" for s in entry.shards):
            for s in entry.shards:
                s.primary = s is entry.shards[0]
    return list(by_name.values())


def _check_ties(domain: Domain, amap, placed: dict, model_path: str) -> None:
    """A tie of a tensor-parallel domain (``shared_params``: one weight under two names) is described as the
    domain manifest's alias, the same on every tensor rank, when AutoTP left the weight whole: its owner
    ``"replicated"``, and the alias too where the affine_map names it. AutoTP 0.19.8 cannot train a split
    tied weight (``deepspeed.initialize`` fails, or the other use is sliced with it): refused, never guessed."""
    for alias in domain.manifest.aliases:
        own = untrainable_placement(
            amap, alias.name, domain.coordinate.tensor, list(alias.shape), model_path, buffer=True
        )
        if placed.get(alias.owner) != "replicated" or own[1] != "replicated":
            raise UnsupportedCheckpoint(
                f"tie {alias.name!r} -> {alias.owner!r} in model-parallel domain {domain.id}: the affine_map "
                "splits the tied weight",
                "ckptspec describes ties of weights AutoTP leaves whole; a split tied weight has no merge rule",
                model_path,
            )


TIED_PREFIX = "tied_modules."  # a PipelineModule's TiedLayerSpec modules: tied_modules.<key>.<attribute>


def pipeline_view(
    files: ParallelFiles, states: StateCache, domains: list[Domain], hash_algorithm: str | None
) -> tuple[list[LayerFile], list[IndexParameter]]:
    """The layer files and the whole model's trainable parameters of a pipeline, from its files
    (``pipeline_parameters``: the rules, which the live engine's producer shares)."""
    loaded: dict[int, tuple[str, dict[str, list[int]]]] = {}
    for layer, path in sorted(files.layer_files.items()):
        state = states.state(path)
        rel = path.name  # a layer file lies in the tag directory itself
        if not isinstance(state, dict) or not all(isinstance(v, TensorRef) for v in state.values()):
            raise UnsupportedCheckpoint("a pipeline layer file that is not a dict of tensors", "restore it", rel)
        loaded[layer] = (rel, {key: list(ref.shape) for key, ref in state.items()})
    layer_files, parameters = pipeline_parameters(domains, loaded, str(files.tag_dir))
    for entry in layer_files:
        path = files.layer_files[entry.layer]
        entry.size = path.stat().st_size
        if hash_algorithm:
            entry.hash = file_digest(path, hash_algorithm)
    return layer_files, parameters


def pipeline_parameters(
    domains: list[Domain], layers: dict[int, tuple[str, dict[str, list[int]]]], where: str
) -> tuple[list[LayerFile], list[IndexParameter]]:
    """The layer files (``size`` 0: the caller's) and the whole model's trainable parameters of a pipeline
    whose stages are ``domains``, from each layer file's name and tensor shapes by key (``layers``; the
    files, or the live engine's layers). ``where``: the checkpoint, or the engine, for messages.

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
    stages_of = {layer: _stages_of(layer, shapes, by_stage, rel) for layer, (rel, shapes) in layers.items()}
    layer_files: list[LayerFile] = []
    where_held: dict[tuple[int, str], tuple[str, str, int]] = {}  # (stage, local name) -> (file, key, layer)
    for layer, (rel, shapes) in sorted(layers.items()):
        stage = _stage_of(layer, stages_of, rel, shapes, by_stage)
        tensors = {key: _local_name(layer, key, shape, by_stage[stage], rel) for key, shape in shapes.items()}
        for key, name in tensors.items():
            if name in by_stage[stage]:
                where_held.setdefault((stage, name), (rel, key, layer))
        layer_files.append(LayerFile(path=rel, layer=layer, pipeline=stage, tensor=None, size=0, tensors=tensors))
    missing: dict[str, list[str]] = {}  # a layer file the optimizer's parameters name, not here -> its parameters
    parameters: dict[str, IndexParameter] = {}
    for stage, names in sorted(by_stage.items()):
        for name, (domain, param) in names.items():
            shard = Shard(domain=domain.id, local_name=name, local_shape=list(param.shape), placement="whole")
            found = where_held.get((stage, name))
            if found is not None:
                shard.layer_file, shard.layer_key, _ = found
            elif name.startswith(TIED_PREFIX):
                raise UnsupportedCheckpoint(
                    f"stage {stage} trains the tied {name!r}, and none of its layer files holds it",
                    "restore the stage's layer files of this save",
                    where,
                )
            else:  # the layer file DeepSpeed writes for it
                shard.layer_file, shard.layer_key = layer_file_name(name), name.split(".", 1)[-1]
                missing.setdefault(shard.layer_file, []).append(name)
            whole = name
            if name.startswith(TIED_PREFIX):  # named after its first layer, over every stage that trains it
                first = min(where_held[(s, name)][2] for s in by_stage if (s, name) in where_held)
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
                    where,
                )
            known.shards.append(shard)
    if missing:
        raise missing_layer_files(missing, where)
    for tied in parameters.values():
        if len(tied.shards) > 1:  # a tie over stages: one copy each, the first layer's stage primary
            first_file = layers[int(tied.name.split(".", 1)[0])][0]
            for s in tied.shards:
                s.placement, s.primary = "replicated", s.layer_file == first_file
    return layer_files, list(parameters.values())


def _stages_of(layer: int, shapes: dict, by_stage: dict, rel: str) -> set[int]:
    """The stages that train one of the layer's own ``<layer>.<key>`` names (a tied module is every stage's)."""
    stages = {s for key in shapes for s, names in by_stage.items() if f"{layer}.{key}" in names}
    if len(stages) > 1:
        raise UnsupportedCheckpoint(f"{rel} holds parameters of stages {sorted(stages)}", "restore it", rel)
    return stages


def _stage_of(layer: int, stages_of: dict[int, set[int]], rel: str, shapes: dict, by_stage: dict) -> int:
    """A layer's stage: the one that trains its parameters; a layer without any of its own (no parameters,
    or a tied module's only) lies between the stages of the layers around it (stages are contiguous). At a
    boundary, a tied module's layer is on the one of those stages that trains the tie: DeepSpeed builds a
    ``TiedLayerSpec``'s module, and trains it, on each stage that runs one of its layers."""
    if stages_of[layer]:
        return next(iter(stages_of[layer]))
    before = [next(iter(s)) for n, s in sorted(stages_of.items()) if n < layer and s]
    after = [next(iter(s)) for n, s in sorted(stages_of.items()) if n > layer and s]
    low = before[-1] if before else 0
    high = after[0] if after else max(by_stage)
    if not shapes or low == high:
        return low
    training = [
        s
        for s in range(low, high + 1)
        if s in by_stage and all(len(_tied(key, shape, by_stage[s])) == 1 for key, shape in shapes.items())
    ]
    if len(training) != 1:
        raise UnsupportedCheckpoint(
            f"{rel} holds no parameter of its own that a stage trains ({sorted(shapes)}: a tied module's, frozen "
            f"or buffers) and lies between stages {low} and {high}, "
            f"{'both' if training else 'neither'} of which train(s) a tied module of these keys",
            "the stage of such a layer at a stage boundary cannot be told from the files; it is not described",
            rel,
        )
    return training[0]


def _tied(key: str, shape: list[int], stage_names: dict) -> list[str]:
    """The stage's tied modules' parameters (``tied_modules.<key>.<attribute>``) a layer file's ``key`` of
    ``shape`` may be."""
    tied = [n for n in stage_names if n.startswith(TIED_PREFIX) and n.split(".", 2)[2] == key]
    return [n for n in tied if list(stage_names[n][1].shape) == list(shape)]


def _local_name(layer: int, key: str, shape: list[int], stage_names: dict, rel: str) -> str:
    """The stage's name of a layer file's tensor (the docstring of ``pipeline_parameters``)."""
    if f"{layer}.{key}" in stage_names:
        return f"{layer}.{key}"
    tied = _tied(key, shape, stage_names)
    if len(tied) > 1:
        raise UnsupportedCheckpoint(
            f"{rel} holds {key!r}, which may be any of the tied {tied}",
            "which TiedLayerSpec a layer runs is not in the files; it is not described",
            rel,
        )
    return tied[0] if tied else f"{layer}.{key}"  # else a frozen parameter or buffer of the stage
