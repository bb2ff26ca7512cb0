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
from ..layout.parallel_files import ParallelFiles, degrees_of, scan_parallel
from ..layout.placements import affine_params, tp_placement, untrainable_placement
from .index_extras import with_extras
from .pipeline_params import pipeline_parameters, trainable
from .tp_pipeline import tensor_pipeline_view
from .zero import manifest_from_states


def domain_id(pipeline: int, tensor: int) -> str:
    return f"pp{pipeline}-tp{tensor}"


def describe(tag_dir: Path, states: StateCache, hash_algorithm: str | None = None) -> CheckpointIndex:
    """The index of a tensor/pipeline-parallel tag directory (its files by model-parallel rank)."""
    return index_from_files(scan_parallel(tag_dir), states, hash_algorithm=hash_algorithm)


def index_from_files(files: ParallelFiles, states: StateCache, *, hash_algorithm: str | None = None) -> CheckpointIndex:
    degrees = degrees_of(files, states)
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
    pipe_module = degrees.pipeline > 1 or bool(files.layer_files) or bool(files.tensor_layer_files)
    domains: list[Domain] = []
    recorded: dict[str, str] | None = None  # tensor rank 0's ties (``zero.proven_ties``)
    for mp, shards in sorted(files.by_mp_rank.items()):
        model_path = shards.model_files[min(shards.model_files)]
        if isinstance(model := states.state(model_path), dict) and model.get("param_shapes", []) is None:
            raise UnsupportedCheckpoint(  # DeepSpeed's stage-0 optimizers record no param_shapes
                "model states have 'param_shapes' None (a ZeRO stage-0 pipeline), and their optimizer is neither "
                "BF16_Optimizer's partitions, the torch optimizer's own state nor FP16_UnfusedOptimizer's "
                f"({_keys(model.get('optimizer'))})",
                "stage-0 pipelines of bf16 (BF16_Optimizer), fp32 (the torch optimizer) and fp16 with a client torch "
                "optimizer (FP16_UnfusedOptimizer) are described; this optimizer's (fp16 FP16_Optimizer with a "
                "FusedAdam) is not yet",
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
    if pipe_module and degrees.tensor > 1:
        layer_files, parameters = tensor_pipeline_view(files, states, domains, degrees.tensor, hash_algorithm)
    elif pipe_module:
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


def _keys(optimizer) -> str:
    return f"optimizer keys {sorted(map(str, optimizer))}" if isinstance(optimizer, dict) else "no optimizer dict"


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
        for param in trainable(domain.manifest):
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
