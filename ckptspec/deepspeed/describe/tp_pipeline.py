"""The whole model of a tensor-parallel pipeline: Megatron-style tensor-parallel layers in a PipelineModule.

DeepSpeed writes such a pipeline (a ``PipeModelDataParallelTopology``) as one ZeRO domain per (stage, tensor
rank), ``mp_rank = stage * tp + tensor``, and one layer file per (layer, tensor rank),
``layer_XX-model_YY-model_states.pt``. Each tensor rank's stages and layer files are a pipeline of their own
(``model_parallel.pipeline_parameters``: which layer file holds which of its stages' parameters); the shards of
one parameter on the tensor ranks are then placed in the whole tensor by the split rules the model states
record (``layout/placements``: AutoTP's affine_map, else the ``universal_checkpoint_info`` pattern lists
Megatron-DeepSpeed saves in its client state). Every parameter is on the same stage on every tensor rank.

A ``TiedLayerSpec``'s module is replicated on every tensor rank (the rules name it replicated): its trainable
parameters are one whole-model parameter (named after its first layer, ``pipeline_params``) whose shards are every
(stage, tensor rank)'s copy, the first layer's stage at tensor rank 0 primary. Frozen parameters and buffers (the
layer-file keys that are no stage's trainable parameter) are the index's extras (``index_extras``): a frozen one
placed by the same rules, a buffer replicated on every tensor rank.

Refused by name (CK202): a tied parameter the rules split, a parameter some tensor rank lacks,
shards whose placements do not give one whole shape. A layer file one tensor rank lacks is CK230.
"""

from __future__ import annotations

from collections.abc import Callable

from ...checkpoint.hashing import file_digest
from ...checkpoint.states import StateCache
from ...checkpoint.torchfile import TensorRef
from ...errors import UnsupportedCheckpoint
from ...format.index_models import Domain, IndexParameter, LayerFile, Shard
from ..layout.parallel_files import ParallelFiles, layer_file_name, missing_layer_files
from ..layout.placements import affine_params, rule_info, rule_placement, tp_placement
from .pipeline_params import pipeline_parameters


def tensor_pipeline_view(
    files: ParallelFiles, states: StateCache, domains: list[Domain], tp: int, hash_algorithm: str | None
) -> tuple[list[LayerFile], list[IndexParameter]]:
    """The layer files and the whole model's trainable parameters of a tensor-parallel pipeline."""
    where = str(files.tag_dir)
    _missing_layers(files, states, tp)
    loaded = {
        tensor: {n: (p.name, _keys(states, p)) for (n, t), p in sorted(files.tensor_layer_files.items()) if t == tensor}
        for tensor in range(tp)
    }

    def rules(own: list[Domain], param: IndexParameter) -> tuple:
        return _rules(files, states, own, param)

    layer_files, parameters = tensor_ranks_view(domains, loaded, tp, where, rules)
    for entry in layer_files:
        assert entry.tensor is not None  # tensor_ranks_view names each layer file's tensor rank
        path = files.tensor_layer_files[entry.layer, entry.tensor]
        entry.size = path.stat().st_size
        if hash_algorithm:
            entry.hash = file_digest(path, hash_algorithm)
    return layer_files, parameters


def tensor_ranks_view(
    domains: list[Domain],
    loaded: dict[int, dict[int, tuple[str, dict[str, list[int]]]]],
    tp: int,
    where: str,
    rules_of: Callable[[list[Domain], IndexParameter], tuple],
) -> tuple[list[LayerFile], list[IndexParameter]]:
    """The rules the files and the live engine (``live.model_parallel``) share: each tensor rank's stages and layer
    files (``loaded[tensor]``: layer -> (file name, shapes by key)) a pipeline of their own, its shards placed by
    ``rules_of(its domains, parameter)`` ((affine map, pattern lists, model-states file) of the parameter's
    domain). The layer files' sizes are the caller's."""
    layer_files: list[LayerFile] = []
    parameters: dict[str, IndexParameter] = {}
    for tensor in range(tp):
        own = [d for d in domains if d.coordinate.tensor == tensor]
        found, params = pipeline_parameters(own, loaded.get(tensor, {}), where, tensor)
        layer_files += found
        for param in params:
            _place(param, tensor, tp, rules_of(own, param), parameters)
    tensor_of = {d.id: d.coordinate.tensor for d in domains}
    for param in parameters.values():
        _check_whole(param, tp, where, tensor_of)
    return sorted(layer_files, key=lambda f: (f.layer, f.tensor)), list(parameters.values())


def _keys(states: StateCache, path) -> dict[str, list[int]]:
    state = states.state(path)
    if not isinstance(state, dict) or not all(isinstance(v, TensorRef) for v in state.values()):
        raise UnsupportedCheckpoint("a pipeline layer file that is not a dict of tensors", "restore it", path.name)
    return {key: list(ref.shape) for key, ref in state.items()}


def _missing_layers(files: ParallelFiles, states: StateCache, tp: int) -> None:
    """CK230 for a layer file one tensor rank lacks where another has one (DeepSpeed writes one per torch module
    and tensor rank), naming the tensors the other rank's holds."""
    missing: dict[str, list[str]] = {}
    for (layer, _), path in sorted(files.tensor_layer_files.items()):
        for tensor in range(tp):
            if (layer, tensor) not in files.tensor_layer_files:
                keys = [f"{layer}.{key}" for key in _keys(states, path)] or [f"{layer}."]
                missing.setdefault(layer_file_name(f"{layer}.", tensor), keys)
    if missing:
        raise missing_layer_files(missing, str(files.tag_dir))


def _rules(files: ParallelFiles, states: StateCache, domains: list[Domain], param: IndexParameter):
    """(affine map, pattern lists, model-states file) of the domain holding ``param``'s shard."""
    domain = next(d for d in domains if d.id == param.shards[0].domain)
    model = next(f.path for f in domain.manifest.files if f.role == "model_states")
    state = states.state(files.tag_dir / model)
    return affine_params(state), rule_info(state), model


def _place(param: IndexParameter, tensor: int, tp: int, rules, parameters: dict[str, IndexParameter]) -> None:
    """Tensor rank ``tensor``'s shards of ``param`` (its stage's, placed "whole" in its pipeline; a tie's, one per
    stage running it) placed in the whole tensor, added to the whole model's parameter of that name."""
    amap, info, model = rules
    shards = []
    for shard in param.shards:
        if amap is not None:
            whole, placement = tp_placement(amap, param.name, tensor, shard.local_shape, model)
            source = "affine_map"
        else:
            whole, placement = rule_placement(info, param.name, tensor, tp, shard.local_shape, model)
            source = "universal_checkpoint_info"
        if len(param.shards) > 1 and placement != "replicated":
            raise UnsupportedCheckpoint(
                f"the tied {param.name!r} is split over the tensor ranks ({placement})",
                "a TiedLayerSpec's module is described replicated on every tensor rank only",
                model,
            )
        shards.append(Shard.model_validate({**shard.model_dump(exclude_unset=True), "placement": placement}))
    known = parameters.get(param.name)
    if known is None:
        parameters[param.name] = param.model_copy(update={"shape": whole, "placement_source": source, "shards": shards})
        return
    if known.shape != whole or known.dtype != param.dtype:
        raise UnsupportedCheckpoint(
            f"{param.name!r}: tensor rank {tensor} gives whole shape {whole} ({param.dtype}), another rank "
            f"{known.shape} ({known.dtype})",
            "the mp ranks' files come from different saves or models",
            model,
        )
    known.shards += shards


def _check_whole(param: IndexParameter, tp: int, where: str, tensor_of: dict[str, int]) -> None:
    """Every tensor rank holds a shard (a tie's: one on each stage running it); a replicated parameter's primary is
    tensor rank 0's (a tie's: on its first layer's stage)."""
    held = [tensor_of[s.domain] for s in param.shards]
    if sorted(set(held)) != list(range(tp)) or len({held.count(t) for t in range(tp)}) != 1:
        raise UnsupportedCheckpoint(
            f"{param.name!r} has shards on {len(set(held))} of {tp} tensor ranks",
            "every tensor rank of a stage trains each of its parameters; restore the files of one save",
            where,
        )
    if all(s.placement == "replicated" for s in param.shards):
        first = next(s for s, t in zip(param.shards, held) if t == 0 and s.primary is not False)
        for s in param.shards:
            s.primary = s is first
