"""Pydantic models of the checkpoint index, ``schema/checkpoint-1.0.schema.json``.

The index (``"format": "ckptspec.checkpoint"``) is the document of a checkpoint that is not
one data-parallel group: tensor- and pipeline-parallel checkpoints (and, on the #17 branch,
MoE, ZeRO stage 0 and universal folders). It embeds one complete ``ckptspec.manifest`` 1.x
document per partition domain (``Domain.manifest``, a ``Manifest``) and adds only what 1.x cannot
say: the topology, which files belong to which domain, pipeline layer files, and the whole model's
parameters with the place of every shard (``docs/spec-checkpoint.md``).

The schema is normative; ``tests/format/test_index.py`` proves both agree on the fixtures.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, StringConstraints

from .models import Count, Dtype, Hash, Manifest, Name, Positive, Producer, SemVer, Shape, _Model

INDEX_FORMAT = "ckptspec.checkpoint"
INDEX_VERSION = "1.0.0"

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


class Piece(_Model):
    """DeepSpeed's affine piece: ``shape`` elements at ``source`` (offset, strides) of the whole
    tensor are at ``dest`` (offset, strides) of the shard."""

    shape: Shape
    source: tuple[Count, Annotated[list[Count], Field(max_length=64)]]
    dest: tuple[Count, Annotated[list[Count], Field(max_length=64)]]


class PiecesPlacement(_Model):
    pieces: Annotated[list[Piece], Field(min_length=1, max_length=100000)]


Placement = Literal["replicated", "whole"] | SplitPlacement | PiecesPlacement


class Shard(_Model):
    domain: DomainId
    local_name: Name
    local_shape: Shape
    placement: Placement
    primary: bool = None  # type: ignore[assignment]
    layer_file: RelPath = None  # type: ignore[assignment]
    layer_key: Name = None  # type: ignore[assignment]


class IndexParameter(_Model):
    """One tensor of the whole (tp1/pp1) model and where each of its shards is."""

    name: Name
    shape: Shape
    dtype: Dtype
    role: Literal["trainable"]
    shards: Annotated[list[Shard], Field(min_length=1, max_length=1048576)]
    placement_source: Literal["affine_map", "universal_checkpoint_info", "pipeline_layer", "none", "engine"]


class CheckpointIndex(_Model):
    format: Literal["ckptspec.checkpoint"]
    format_version: SemVer
    producer: Producer
    kind: Literal["zero"]
    topology: Topology
    domains: Annotated[list[Domain], Field(min_length=1, max_length=1048576)]
    layer_files: Annotated[list[LayerFile], Field(max_length=1_000_000)]
    parameters: Annotated[list[IndexParameter], Field(max_length=10_000_000)]

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready document: optional fields absent, unknown fields kept."""
        return self.model_dump(mode="json", exclude_unset=True, by_alias=True)

    def domain(self, domain_id: str) -> Domain:
        return next(d for d in self.domains if d.id == domain_id)
