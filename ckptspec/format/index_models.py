"""Pydantic models of the checkpoint index, ``schema/checkpoint-1.0.schema.json`` and ``-1.1`` (1.1 adds
``extras``, ``aliases`` and ``Shard.locator``: the frozen parameters, buffers and ties of the whole model).

The index (``"format": "ckptspec.checkpoint"``) is the document of a checkpoint that is not
one data-parallel group: tensor- and pipeline-parallel checkpoints (and, on the #17 branch,
MoE, ZeRO stage 0 and universal folders). It embeds one complete ``ckptspec.manifest`` 1.x
document per partition domain (``Domain.manifest``, a ``Manifest``) and adds only what 1.x cannot
say: the topology, which files belong to which domain, pipeline layer files, and the whole model's
parameters with the place of every shard (``docs/spec-checkpoint.md``).

The schema is normative; ``tests/unit/format/test_index.py`` proves both agree on the fixtures.
"""

from __future__ import annotations

from typing import Annotated, Any, Final, Literal

from pydantic import Field, Strict, StringConstraints

from .models import Count, Dtype, Hash, Manifest, Name, Positive, Producer, SemVer, Shape, _Model

INDEX_FORMAT: Final = "ckptspec.checkpoint"
INDEX_VERSION = "1.0.0"
INDEX_EXTRAS_VERSION = "1.1.0"  # what ``generate`` writes when the whole model has frozen parameters, buffers or ties

DomainId = Annotated[str, StringConstraints(strict=True, min_length=1, max_length=256)]
RelPath = Annotated[str, StringConstraints(strict=True, min_length=1, max_length=4096)]


class Coordinate(_Model):
    """A place in the topology; an axis that is absent is not partitioned for this domain."""

    pipeline: Count = None  # type: ignore[assignment]
    tensor: Count = None  # type: ignore[assignment]
    data: Count = None  # type: ignore[assignment]
    expert: Count = None  # type: ignore[assignment]


class Degrees(_Model):
    pipeline: Positive
    tensor: Positive
    data: Positive
    expert: Positive = None  # type: ignore[assignment]


class RankCoordinate(_Model):
    rank: Count
    pipeline: Count
    tensor: Count
    data: Count
    expert: Count = None  # type: ignore[assignment]
    mp_rank: Count = None  # type: ignore[assignment]


class Topology(_Model):
    degrees: Degrees
    degrees_source: Literal["checkpoint_parallel_dimensions", "derived", "engine"]
    model_parallel_size: Positive
    ranks: Annotated[list[RankCoordinate], Field(max_length=1048576)] = None  # type: ignore[assignment]


class MasterLocator(_Model):
    """``numel`` elements of ``dtype`` at ``element_offset`` of zip ``member`` (data at byte
    ``data_offset`` of ``file``): one fp32 master, or one piece of it (a ZeRO partition may cut a
    parameter in two; a parameter's locators, in order, concatenated, are its flat master).
    ``key`` is its path in the pickle, for a reader that unpickles."""

    param: Name
    file: RelPath
    key: Annotated[list[Annotated[str, StringConstraints(strict=True, max_length=4096)] | Count], Field(max_length=64)]
    member: Annotated[str, StringConstraints(strict=True, min_length=1, max_length=4096)]
    data_offset: Count
    member_size: Count
    dtype: Dtype
    element_offset: Count
    numel: Count


class Masters(_Model):
    """Where a domain's fp32 masters are when they are not 1.x flat partitions (stage 0, MoE, universal)."""

    stored_in: Literal["module", "model_states", "optimizer_states", "expert_files", "universal"]
    tensors: Annotated[list[MasterLocator], Field(max_length=10_000_000)]


class Domain(_Model):
    """Optimizer groups partitioned over one process group at one coordinate, as a 1.x manifest
    whose ranks are the domain's ranks (``file_ranks``: file path -> domain rank)."""

    id: DomainId
    coordinate: Coordinate
    process_group: Annotated[str, StringConstraints(strict=True, min_length=1, max_length=256)]
    size: Positive
    members: Annotated[list[Count], Field(max_length=1048576)] = None  # type: ignore[assignment]
    file_ranks: Annotated[dict[RelPath, Count], Field(max_length=1048576)]
    optimizer_groups: Annotated[list[Count], Field(max_length=100000)] = None  # type: ignore[assignment]
    manifest: Manifest
    masters: Masters = None  # type: ignore[assignment]
    replicas: Annotated[list[MasterLocator], Field(max_length=10_000_000)] = None  # type: ignore[assignment]
    configured_zero_stage: Annotated[int, Field(ge=0, le=3, strict=True)] = None  # type: ignore[assignment]


class ExpertFile(_Model):
    """A MoE expert file (``layer_<L>_expert_<E>_mp_rank_XX_model_states.pt``): its keys (already
    global names) -> whole-model names; written by the expert-parallel rank holding E as ``local_expert``."""

    path: RelPath
    moe_layer: Count
    expert: Count
    expert_parallel_rank: Count
    local_expert: Count
    size: Count
    hash: Hash = None  # type: ignore[assignment]
    tensors: Annotated[dict[Name, Name], Field(max_length=1_000_000)]


class LayerFile(_Model):
    """A pipeline layer file (``layer_XX-model_states.pt``): its key -> the stage's parameter name."""

    path: RelPath
    layer: Count
    pipeline: Count
    tensor: Count | None = None
    size: Count
    hash: Hash = None  # type: ignore[assignment]
    tensors: Annotated[dict[Name, Name], Field(max_length=1_000_000)]


class Split(_Model):
    axis: Count
    offset: Count
    length: Count


class SplitPlacement(_Model):
    split: Split


# (offset, strides): a JSON array of two items. Strict mode refuses a list where a tuple is typed, so the
# tuple alone is lax (a list becomes the tuple); its items stay strict (no bool, float or string).
OffsetStrides = Annotated[
    tuple[Annotated[Count, Strict()], Annotated[list[Annotated[Count, Strict()]], Field(max_length=64)]], Strict(False)
]


class Piece(_Model):
    """DeepSpeed's affine piece: ``shape`` elements at ``source`` (offset, strides) of the whole
    tensor are at ``dest`` (offset, strides) of the shard."""

    shape: Shape
    source: OffsetStrides
    dest: OffsetStrides


class PiecesPlacement(_Model):
    pieces: Annotated[list[Piece], Field(min_length=1, max_length=100000)]


Placement = Literal["replicated", "whole"] | SplitPlacement | PiecesPlacement


class ShardLocator(_Model):
    """(1.1) ``numel`` elements of ``dtype`` at ``element_offset`` of zip ``member`` of the shard's
    ``layer_file`` (data at byte ``data_offset``): a tensor no domain manifest locates."""

    member: Annotated[str, StringConstraints(strict=True, min_length=1, max_length=4096)]
    data_offset: Count
    member_size: Count
    dtype: Dtype
    element_offset: Count
    numel: Count


class Shard(_Model):
    domain: DomainId
    local_name: Name
    local_shape: Shape
    placement: Placement
    primary: bool = None  # type: ignore[assignment]
    layer_file: RelPath = None  # type: ignore[assignment]
    layer_key: Name = None  # type: ignore[assignment]
    locator: ShardLocator = None  # type: ignore[assignment]


class IndexParameter(_Model):
    """One tensor of the whole (tp1/pp1) model and where each of its shards is."""

    name: Name
    shape: Shape
    dtype: Dtype
    role: Literal["trainable"]
    shards: Annotated[list[Shard], Field(min_length=1, max_length=1048576)]
    placement_source: Literal[
        "affine_map", "universal_checkpoint_info", "pipeline_layer", "none", "engine", "moe_expert"
    ]


class IndexExtra(_Model):
    """(1.1) A frozen parameter or persistent buffer of the whole model, its shards placed as a parameter's:
    each is its domain manifest's frozen parameter or buffer ``local_name``, or located by ``locator``."""

    name: Name
    shape: Shape
    dtype: Dtype
    role: Literal["frozen", "buffer"]
    shards: Annotated[list[Shard], Field(min_length=1, max_length=1048576)]
    placement_source: Literal["affine_map", "pipeline_layer", "engine"]


class CheckpointIndex(_Model):
    format: Literal["ckptspec.checkpoint"]
    format_version: SemVer
    producer: Producer
    kind: Literal["zero", "universal"]
    topology: Topology
    domains: Annotated[list[Domain], Field(min_length=1, max_length=1048576)]
    layer_files: Annotated[list[LayerFile], Field(max_length=1_000_000)]
    parameters: Annotated[list[IndexParameter], Field(max_length=10_000_000)]
    expert_files: Annotated[list[ExpertFile], Field(max_length=1_000_000)] = None  # type: ignore[assignment]
    extras: Annotated[list[IndexExtra], Field(max_length=10_000_000)] = None  # type: ignore[assignment]
    aliases: Annotated[dict[Name, Name], Field(max_length=1_000_000)] = None  # type: ignore[assignment]

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready document: optional fields absent, unknown fields kept."""
        return self.model_dump(mode="json", exclude_unset=True, by_alias=True)

    def domain(self, domain_id: str) -> Domain:
        return next(d for d in self.domains if d.id == domain_id)

    @classmethod
    def from_manifest(cls, manifest: Manifest) -> CheckpointIndex:
        """A plain ZeRO checkpoint's manifest as the checkpoint index of one domain: its data-parallel
        group (``pp0-tp0``, as the model-parallel producer names it), holding every trainable parameter
        whole. ``ckptspec.open`` reads both documents through it: one view of every kind."""
        layout = manifest.layout
        domain = Domain(
            id="pp0-tp0",
            coordinate=Coordinate(pipeline=0, tensor=0),
            process_group="data_parallel",
            size=layout.world_size,
            file_ranks={f.path: f.ranks[0] for f in manifest.files if f.role in ("model_states", "optimizer_states")},
            manifest=manifest,
        )
        parameters = [
            IndexParameter(
                name=p.name,
                shape=list(p.shape),
                dtype=p.dtype,
                role="trainable",
                shards=[Shard(domain=domain.id, local_name=p.name, local_shape=list(p.shape), placement="whole")],
                placement_source="none",
            )
            for group in manifest.groups
            for p in group.params
        ]
        return cls(
            format=INDEX_FORMAT,
            format_version=INDEX_VERSION,
            producer=manifest.producer,
            kind="zero",
            topology=Topology(
                degrees=Degrees(pipeline=1, tensor=1, data=layout.world_size),
                degrees_source="derived",
                model_parallel_size=1,
            ),
            domains=[domain],
            layer_files=[],
            parameters=parameters,
        )
