"""Which layer file holds which of a pipeline's stage parameters: the rules ``model_parallel.pipeline_view`` (the
files), ``live.model_parallel`` (the live engine) and ``tp_pipeline`` (each tensor rank of a tensor-parallel
pipeline) share.
"""

from __future__ import annotations

from typing import Any

from ...errors import UnsupportedCheckpoint
from ...format.index_models import Domain, IndexParameter, LayerFile, Shard
from ...format.models import Manifest
from ..layout.parallel_files import layer_file_name, missing_layer_files

TIED_PREFIX = "tied_modules."  # a PipelineModule's TiedLayerSpec modules: tied_modules.<key>.<attribute>


def trainable(manifest: Manifest) -> list:
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


def pipeline_parameters(
    domains: list[Domain], layers: dict[int, tuple[str, dict[str, list[int]]]], where: str, tensor: int | None = None
) -> tuple[list[LayerFile], list[IndexParameter]]:
    """The layer files (``size`` 0: the caller's) and the whole model's trainable parameters of a pipeline
    whose stages are ``domains``, from each layer file's name and tensor shapes by key (``layers``; the
    files, or the live engine's layers). ``where``: the checkpoint, or the engine, for messages. ``tensor``: the
    tensor rank whose stages and layer files these are, in a tensor-parallel pipeline (``tp_pipeline.py``).

    A layer file's key ``k`` of layer ``L`` is the stage's parameter ``L.k``, or the stage's
    ``tied_modules.<key>.k`` (a ``TiedLayerSpec``'s module, which every stage running it trains and
    saves in each of its layer files), or else a frozen parameter or buffer of the stage (the file's
    key set is the index's, CK230; readers take it from the file): the tied module's
    ``tied_modules.<key>.k`` in a layer file of a tie (its file holds that module's whole state dict),
    else ``L.k``. A tied module's whole-model name is
    ``<first layer>.<attribute>``, its stages' masters replicated shards (the first layer's stage
    primary); a reader names its other layers' keys as ties of it.
    """
    by_stage: dict[int, dict[str, tuple[Domain, Any]]] = {}
    for domain in domains:
        _refuse_untrainable(domain.manifest, domain)
        by_stage[domain.coordinate.pipeline] = {p.name: (domain, p) for p in trainable(domain.manifest)}
    stages_of = {layer: _stages_of(layer, shapes, by_stage, rel) for layer, (rel, shapes) in layers.items()}
    layer_files: list[LayerFile] = []
    where_held: dict[tuple[int, str], tuple[str, str, int]] = {}  # (stage, local name) -> (file, key, layer)
    for layer, (rel, shapes) in sorted(layers.items()):
        stage = _stage_of(layer, stages_of, rel, shapes, by_stage)
        tie = _layer_tie(layer, shapes, by_stage[stage], rel)
        tensors = {key: _local_name(layer, key, shape, by_stage[stage], tie, rel) for key, shape in shapes.items()}
        for key, name in tensors.items():
            if name in by_stage[stage]:
                where_held.setdefault((stage, name), (rel, key, layer))
        layer_files.append(LayerFile(path=rel, layer=layer, pipeline=stage, tensor=tensor, size=0, tensors=tensors))
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
                shard.layer_file, shard.layer_key = layer_file_name(name, tensor), name.split(".", 1)[-1]
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
    training = [s for s in range(low, high + 1) if s in by_stage and len(_ties_of(shapes, by_stage[s])) == 1]
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


def _ties_of(shapes: dict, stage_names: dict) -> set[str]:
    """The stage's tied modules (``tied_modules.<key>.``) whose trained parameters a layer file's keys may be."""
    return {
        ".".join(n.split(".", 2)[:2]) + "." for key, shape in shapes.items() for n in _tied(key, shape, stage_names)
    }


def _layer_tie(layer: int, shapes: dict, stage_names: dict, rel: str) -> str | None:
    """The ``tied_modules.<key>.`` prefix of the layer's module if it is a ``TiedLayerSpec``'s (none of its keys is
    the stage's ``L.k``, some are one tied module's trained parameters), else None; several tied modules: refused."""
    if any(f"{layer}.{key}" in stage_names for key in shapes):
        return None
    ties = _ties_of(shapes, stage_names)
    if len(ties) > 1:
        raise UnsupportedCheckpoint(
            f"{rel} holds {sorted(shapes)}, which may be the parameters of any of the tied modules {sorted(ties)}",
            "which TiedLayerSpec a layer runs is not in the files; it is not described",
            rel,
        )
    return next(iter(ties), None)


def _local_name(layer: int, key: str, shape: list[int], stage_names: dict, tie: str | None, rel: str) -> str:
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
    if tied:
        return tied[0]
    return f"{tie}{key}" if tie else f"{layer}.{key}"  # a frozen parameter or buffer of the tied module or the stage
