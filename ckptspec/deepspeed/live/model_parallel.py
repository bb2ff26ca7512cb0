"""The checkpoint index of a live tensor/pipeline-parallel DeepSpeed engine (issue #16).

Each rank describes the ZeRO data-parallel group it belongs to (``zero.engine_layout``: the same
1.x manifest a data-parallel engine gets), its place in the topology as DeepSpeed reports it, and,
under AutoTP, where each of its shards sits in the whole tensor (the ``affine_map`` AutoTP keeps on
every partitioned parameter); one ``all_gather_object`` gives every rank the whole picture. What
only the live engine knows is recorded: the global rank of every coordinate (``topology.ranks``,
each domain's ``members``), and ``degrees_source``/``placement_source`` ``"engine"``.

``index_from_engine`` is collective: call it on every rank. Imports torch and DeepSpeed only when called.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..._version import __version__
from ...errors import EngineLayoutMismatch, UnsupportedEngine
from ...format.index_models import (
    INDEX_FORMAT,
    INDEX_VERSION,
    CheckpointIndex,
    Coordinate,
    Degrees,
    Domain,
    IndexParameter,
    LayerFile,
    RankCoordinate,
    Shard,
    Topology,
)
from ...format.models import Manifest
from ..describe.model_parallel import domain_id, pipeline_parameters
from ..describe.tp_pipeline import tensor_ranks_view
from ..layout.placements import rule_info, tp_placement
from .refusals import refuse_unsaveable
from .zero import engine_layout


def _refuse(engine) -> None:
    refuse_unsaveable(engine)
    if getattr(engine, "has_moe_layers", False) or engine.zero_optimization_stage() == 0:
        raise UnsupportedEngine("MoE and ZeRO stage-0 engines are described by live/masters.py")


def coordinates(engine) -> dict:
    """This rank's place: global rank, (pipeline, tensor, data) coordinate, checkpoint mp rank, degrees."""
    import torch.distributed as dist
    from deepspeed.utils.bwc import (
        bwc_pipeline_parallel_world_size,
        bwc_tensor_model_parallel_rank,
        bwc_tensor_model_parallel_world_size,
    )

    mpu = engine.mpu
    pp, tp = bwc_pipeline_parallel_world_size(mpu), bwc_tensor_model_parallel_world_size(mpu)
    pipeline = 0
    if pp > 1:
        pipeline = (
            mpu.get_pipeline_model_parallel_rank()
            if hasattr(mpu, "get_pipeline_model_parallel_rank")
            else mpu.get_pipe_parallel_rank()
        )
    tensor = bwc_tensor_model_parallel_rank(mpu) if tp > 1 else 0
    data = dist.get_rank(group=engine.optimizer.dp_process_group)
    mp_rank = int(engine.checkpoint_mp_rank)
    if mp_rank != pipeline * tp + tensor:  # DeepSpeed's numbering, which the directory reader relies on
        raise EngineLayoutMismatch(
            f"checkpoint mp rank {mp_rank} is not pipeline {pipeline} x tensor degree {tp} + tensor {tensor}"
        )
    return {
        "rank": dist.get_rank(),
        "pipeline": pipeline,
        "tensor": tensor,
        "data": data,
        "mp_rank": mp_rank,
        "degrees": [pp, tp, int(engine.dp_world_size)],
    }


def _live_params(engine) -> dict:
    return {name: p for name, p in engine.module.named_parameters()}


def _tp_placement(live, name: str, shape: list, tensor: int) -> list:
    """[whole shape, placement] of one parameter's shard on this tensor rank, from AutoTP's live metadata."""
    from deepspeed.module_inject.layers import _get_param_uc_conversion_meta

    meta = _get_param_uc_conversion_meta(live) or {}
    if meta.get("unsupported_reason"):
        raise UnsupportedEngine(f"{name!r}: AutoTP cannot convert it: {meta['unsupported_reason']}")
    amap = meta.get("affine_map")
    if not meta:  # AutoTP left it untouched: identical on every tensor rank (DeepSpeed's own rule)
        return [list(shape), "replicated"]
    if amap is None:
        raise UnsupportedEngine(
            f"{name!r}: AutoTP partitioned it without an affine map; its merge rule is never guessed"
        )
    whole, placement = tp_placement({"": amap}, name, tensor, list(shape), "the live engine")
    return [whole, placement]


def _tp_placements(engine, manifest: Manifest, tensor: int) -> dict[str, list]:
    """Local name -> [whole shape, placement] of every trainable parameter, from AutoTP's live metadata.
    A frozen parameter needs a merge rule too (the directory producer's, ``untrainable_placement``); a tie
    must be of a weight AutoTP left whole (it splits a parameter, not each of its names)."""
    live = _live_params(engine)
    out = {p.name: _tp_placement(live[p.name], p.name, p.shape, tensor) for g in manifest.groups for p in g.params}
    frozen = {f.name: _tp_placement(live[f.name], f.name, f.shape, tensor) for f in manifest.frozen}
    for alias in manifest.aliases:
        owner = out.get(alias.owner) or frozen.get(alias.owner)
        if owner is None or owner[1] != "replicated":
            raise UnsupportedEngine(
                f"tie {alias.name!r} -> {alias.owner!r}: AutoTP splits the weight; a split tied weight is not "
                "described (DeepSpeed 0.19.8's AutoTP cannot train one either)"
            )
    return out


def _pipeline_layers(engine) -> dict:
    """Layer index -> (layer file name, its state-dict key -> shape) for this stage's layers, DeepSpeed's naming."""
    module = engine.module
    out = {}
    for local, layer in enumerate(module.forward_funcs):
        if hasattr(layer, "state_dict"):
            shapes = {key: list(t.shape) for key, t in sorted(layer.state_dict().items())}
            out[module._local_start + local] = (module.ckpt_layer_path("", local), shapes)
    return out


def as_pipeline_stage(manifest: Manifest) -> None:
    """A stage's manifest as the directory producer reads it: the stage's model states hold no module, its
    frozen parameters and buffers are keys of its layer files (the index lists them there)."""
    if manifest.aliases:
        raise UnsupportedEngine(
            f"a tie inside one pipeline stage ({manifest.aliases[0].name!r} -> {manifest.aliases[0].owner!r}) is "
            "not described; a TiedLayerSpec's module is"
        )
    if manifest.frozen and manifest.layout.zero_stage >= 2:
        raise UnsupportedEngine(
            f"frozen parameters ({manifest.frozen[0].name!r}, ...) in a pipeline at ZeRO stage "
            f"{manifest.layout.zero_stage}: DeepSpeed saves them in frozen_param_fragments beside the layer "
            "files; not described yet"
        )
    manifest.frozen, manifest.buffers = [], []


def _tensor_pipeline(engine) -> bool:
    """A ``PipelineEngine`` of more model-parallel ranks than stages: tensor-parallel layers in its stages."""
    return type(engine).__name__ == "PipelineEngine" and int(engine.mp_world_size) > int(engine.num_stages)


def split_rules(client_state: dict | None) -> dict:
    """A tensor-parallel pipeline's split rules: the ``universal_checkpoint_info`` pattern lists of the client state
    DeepSpeed saves into every model-states file (Megatron-DeepSpeed's), which the directory producer reads back
    (``describe/tp_pipeline.py``). Megatron-style layers carry no rule DeepSpeed knows: none given is refused."""
    info = rule_info(client_state or {})
    if info is None:
        raise UnsupportedEngine(
            "a tensor x pipeline-parallel engine (Megatron-style tensor-parallel layers in a PipelineModule) saved "
            "without its split rules: pass them as Megatron-DeepSpeed does, client_state={'universal_checkpoint_info': "
            "{'parameter_with_row_parallelism_patterns': [...], 'tp_replicated_parameter_patterns': [...]}}; "
            "ckptspec never guesses how tensor-parallel shards compose"
        )
    return info


def local_description(engine, exclude_frozen_parameters: bool = False, client_state: dict | None = None) -> dict:
    """What this rank knows (JSON-ready, for the gather). ``client_state``: what the save hands DeepSpeed (a
    tensor-parallel pipeline's split rules, ``split_rules``)."""
    _refuse(engine)
    rules = split_rules(client_state) if _tensor_pipeline(engine) else None  # refused before anything else is read
    coords = coordinates(engine)
    pp, tp, _ = coords["degrees"]
    manifest = engine_layout(engine, exclude_frozen_parameters)
    manifest.layout.tensor_parallel_size, manifest.layout.pipeline_parallel_size = tp, pp
    if pp > 1:
        as_pipeline_stage(manifest)
    return {
        **coords,
        "manifest": manifest.to_dict(),
        "placements": _tp_placements(engine, manifest, coords["tensor"]) if tp > 1 and pp == 1 else None,
        "rules": rules,
        "layers": {str(k): v for k, v in _pipeline_layers(engine).items()} if pp > 1 else None,
    }


def assemble(
    described: list[dict],
    files_of: Callable[[dict], list] | None = None,
    layer_files_of: Callable[[list[LayerFile]], list[LayerFile]] | None = None,
) -> CheckpointIndex:
    """The index from every rank's ``local_description`` (in rank order). ``files_of(domain description)``
    gives a domain's described files (the save hook); without it the domains list no files.
    ``layer_files_of``: the pipeline's layer files (named as the directory producer names their tensors,
    ``pipeline_parameters``) with their sizes and hashes (the save hook); without it none."""
    pp, tp, dp = described[0]["degrees"]
    if any(d["degrees"] != [pp, tp, dp] for d in described):
        raise EngineLayoutMismatch("the ranks report different parallel degrees")
    by_coord: dict[tuple[int, int], list[dict]] = {}
    for d in sorted(described, key=lambda d: (d["mp_rank"], d["data"])):
        by_coord.setdefault((d["pipeline"], d["tensor"]), []).append(d)
    domains: list[Domain] = []
    parameters: dict[str, IndexParameter] = {}
    # (tensor rank, layer number) -> (its file, its tensors' shapes): every rank's "layers"
    layers: dict[tuple[int, int], Any] = {}
    for (pipeline, tensor), members in sorted(by_coord.items(), key=lambda kv: kv[1][0]["mp_rank"]):
        first = members[0]
        if any(m["manifest"] != first["manifest"] for m in members):
            raise EngineLayoutMismatch(f"the data-parallel ranks of pipeline {pipeline}, tensor {tensor} disagree")
        manifest = Manifest.model_validate(first["manifest"])
        if files_of is not None:
            manifest.files = files_of(first)
        dom = Domain(
            id=domain_id(pipeline, tensor),
            coordinate=Coordinate(pipeline=pipeline, tensor=tensor),
            process_group="data_parallel",
            size=manifest.layout.world_size,
            members=[m["rank"] for m in members],
            file_ranks={f.path: f.ranks[0] for f in manifest.files if f.role in ("model_states", "optimizer_states")},
            manifest=manifest,
        )
        domains.append(dom)
        layers.update({(tensor, int(k)): v for k, v in (first["layers"] or {}).items()})
        if first["placements"] is None:  # a pipeline stage: placed below, as the directory producer places it
            continue
        for group in manifest.groups:
            for param in group.params:
                shard = Shard(domain=dom.id, local_name=param.name, local_shape=list(param.shape), placement="whole")
                whole, shard.placement = first["placements"][param.name]
                entry = parameters.get(param.name)
                if entry is None:
                    parameters[param.name] = IndexParameter(
                        name=param.name,
                        shape=whole,
                        dtype=param.dtype,
                        role="trainable",
                        shards=[shard],
                        placement_source="engine",
                    )
                elif entry.shape != whole:
                    raise EngineLayoutMismatch(f"{param.name!r}: tensor ranks give whole shapes {entry.shape}, {whole}")
                else:
                    entry.shards.append(shard)
    for entry in parameters.values():
        if all(s.placement == "replicated" for s in entry.shards):
            for s in entry.shards:
                s.primary = s is entry.shards[0]
    layer_files: list[LayerFile] = []
    if pp > 1:
        layer_files, in_layers = _pipeline_view(described, domains, layers, tp)
        parameters = {p.name: p for p in in_layers}
        layer_files = layer_files_of(layer_files) if layer_files_of is not None else []
    first_manifest = domains[0].manifest
    return CheckpointIndex(
        format=INDEX_FORMAT,
        format_version=INDEX_VERSION,
        producer=first_manifest.producer.model_copy(update={"tool_version": __version__}),
        kind="zero",
        topology=Topology(
            degrees=Degrees(pipeline=pp, tensor=tp, data=dp),
            degrees_source="engine",
            model_parallel_size=pp * tp,
            ranks=[
                RankCoordinate(
                    rank=d["rank"], pipeline=d["pipeline"], tensor=d["tensor"], data=d["data"], mp_rank=d["mp_rank"]
                )
                for d in sorted(described, key=lambda d: d["rank"])
            ],
        ),
        domains=domains,
        layer_files=layer_files,
        parameters=list(parameters.values()),
    )


def _pipeline_view(
    described: list[dict], domains: list[Domain], layers: dict[tuple[int, int], Any], tp: int
) -> tuple[list[LayerFile], list[IndexParameter]]:
    """A pipeline's layer files and whole-model parameters, by the directory producer's rules: one pipeline
    (``pipeline_parameters``), or each tensor rank's (``tensor_ranks_view``), its shards placed by the split rules
    of its domain (``split_rules``: the client state its model states hold)."""
    where = "the live engine"
    if tp == 1:
        return pipeline_parameters(domains, {layer: v for (_, layer), v in layers.items()}, where)
    rules = {domain_id(d["pipeline"], d["tensor"]): d["rules"] for d in described}
    loaded: dict[int, dict] = {}
    for (tensor, layer), value in layers.items():
        loaded.setdefault(tensor, {})[layer] = value
    return tensor_ranks_view(domains, loaded, tp, where, lambda _, p: (None, rules[p.shards[0].domain], where))
