"""Pydantic models that mirror ``schema/manifest-1.1.schema.json``, the latest format.

The JSON Schema is normative; these models are the Python view of it and
``tests/unit/format/test_agreement.py`` proves both give the same verdict. Format 1.1 is 1.0 plus
OPTIONAL fields only, so the same models read a 1.0 document (whose schema, checked first,
refuses 1.1's fields in it: ``validate.py``). Optional fields
are absent rather than null, exactly as in the schema, so they are typed
without ``None`` and dumped with ``exclude_unset`` (unknown fields, even null ones, are kept).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

from .dtypes import Dtype

INT64_MAX = 2**63 - 1

# Strict (the config): an int refuses True and 3.0, a str refuses bytes. JSON Schema counts 3.0
# as an integer: ``integral.integral_floats`` turns it into 3 where a document is loaded.
Count = Annotated[int, Field(ge=0, le=INT64_MAX)]
Positive = Annotated[int, Field(ge=1, le=1048576)]
Name = Annotated[str, StringConstraints(min_length=1, max_length=1024)]
Shape = Annotated[list[Count], Field(max_length=64)]
SemVer = Annotated[
    str,
    StringConstraints(pattern=r"^(0|[1-9][0-9]{0,5})\.(0|[1-9][0-9]{0,5})\.(0|[1-9][0-9]{0,5})$"),
]
Timestamp = Annotated[
    str,
    StringConstraints(
        max_length=64,
        pattern=r"^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]{1,9})?(Z|[+-][0-9]{2}:[0-9]{2})$",
    ),
]


# Non-empty text of at most N characters (the schema's minLength 1, maxLength N).
Text256 = Annotated[str, StringConstraints(min_length=1, max_length=256)]
Text1024 = Annotated[str, StringConstraints(min_length=1, max_length=1024)]
Text4096 = Annotated[str, StringConstraints(min_length=1, max_length=4096)]


class _Model(BaseModel):
    """Base: strict types, unknown keys refused, and no Python validator: every constraint is in
    the types, so pydantic-core checks a document without a Python call per object.

    A document with a newer minor format version may carry fields this reader does not know:
    ``tolerant(Manifest)`` (``tolerant.py``) reads it, keeping them (and dumping them back).
    """

    model_config = ConfigDict(extra="forbid", strict=True)


# A JSON number: int or float, never a boolean (strict); the codec refuses NaN and infinity.
Number = float | int
NonNegative = Annotated[float | int, Field(ge=0)]
Scalar = Number | bool | Annotated[str, StringConstraints(max_length=65536)]
Value = Scalar | Annotated[list[Scalar], Field(max_length=1024)]
Values = Annotated[dict[Annotated[str, StringConstraints(min_length=1, max_length=256)], Value], Field(max_length=1024)]
StateName = Annotated[str, StringConstraints(min_length=1, max_length=256)]


Sha256 = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]


class Digest(_Model):
    """One property per algorithm, at least one: this format knows sha256 alone, so it is required
    (a newer minor's algorithms: ``TolerantDigest``)."""

    sha256: Sha256


class TolerantDigest(Digest):
    """A newer minor's digest: another algorithm may stand in for sha256, but one must be named."""

    model_config = ConfigDict(extra="allow")
    sha256: Sha256 = None  # type: ignore[assignment]

    @model_validator(mode="after")
    def _one_at_least(self) -> TolerantDigest:
        if not self.model_fields_set and not self.model_extra:
            raise ValueError("a digest names at least one algorithm")
        return self


class Producer(_Model):
    tool: Text256
    tool_version: Text256
    framework: Text256
    framework_version: Text256
    created: Timestamp = None  # type: ignore[assignment]  # absent, never null
    metadata: Annotated[
        dict[
            Annotated[str, StringConstraints(max_length=1024)],
            Annotated[str, StringConstraints(max_length=65536)],
        ],
        Field(max_length=1024),
    ] = None  # type: ignore[assignment]


class Layout(_Model):
    zero_stage: Annotated[int, Field(ge=0, le=3)]
    world_size: Positive
    tensor_parallel_size: Positive
    pipeline_parallel_size: Positive
    model_parallel_size: Positive = None  # type: ignore[assignment]
    model_dtype: Dtype
    master_dtype: Dtype
    round_robin: bool
    parameter_alignment: bool
    tail_padding_saved: bool
    optimizer: Text256 = None  # type: ignore[assignment]  # absent, never null
    sub_group_size: Count = None  # type: ignore[assignment]
    exclude_frozen_parameters: bool = None  # type: ignore[assignment]
    byte_order: Literal["little"] = None  # type: ignore[assignment]


class Param(_Model):
    name: Name
    shape: Shape
    numel: Count
    dtype: Dtype
    offset: Count
    padding: Count
    digest: Digest = None  # type: ignore[assignment]
    model_digest: Digest = None  # type: ignore[assignment]
    state_digests: Annotated[dict[StateName, Digest], Field(max_length=1024)] = None  # type: ignore[assignment]


class Group(_Model):
    optimizer_group: Count
    partitioning: Literal["flat", "per_param"]
    partition_count: Positive
    alignment: Positive
    padded_numel: Count
    partition_numel: Count
    saved_numels: Annotated[list[Count], Field(min_length=1, max_length=1048576)]
    params: Annotated[list[Param], Field(max_length=10_000_000)]


class FrozenParam(_Model):
    name: Name
    shape: Shape
    numel: Count
    dtype: Dtype
    stored_in: Literal["module", "fragments", "partitioned_fragments"]
    digest: Digest = None  # type: ignore[assignment]


class Buffer(_Model):
    name: Name
    shape: Shape
    dtype: Dtype
    digest: Digest = None  # type: ignore[assignment]


class Alias(_Model):
    name: Name
    owner: Name
    shape: Shape


class ExcludedParam(_Model):
    name: Name
    reason: Text1024


class Hash(_Model):
    algorithm: Literal["sha256", "blake2b"]
    digest: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$|^[0-9a-f]{128}$")]


class Locator(_Model):
    group: Count
    rank: Count
    member: Text4096
    data_offset: Count
    member_size: Count
    dtype: Dtype
    element_offset: Count
    numel: Count


class TensorLocator(_Model):
    name: Name
    member: Text4096
    data_offset: Count
    member_size: Count
    dtype: Dtype
    element_offset: Count
    numel: Count


class ModelWeightsLocator(_Model):
    group: Count
    member: Text4096
    data_offset: Count
    member_size: Count
    dtype: Dtype
    element_offset: Count
    numel: Count


class StateLocator(_Model):
    group: Count
    rank: Count
    state: StateName
    member: Text4096
    data_offset: Count
    member_size: Count
    dtype: Dtype
    element_offset: Count
    numel: Count


class ShardFile(_Model):
    path: Text4096
    role: Literal["model_states", "optimizer_states", "other"]
    ranks: Annotated[list[Count], Field(max_length=1048576)]
    size: Count
    hash: Hash = None  # type: ignore[assignment]
    partitions: Annotated[list[Locator], Field(max_length=1_000_000)]
    tensors: Annotated[list[TensorLocator], Field(max_length=10_000_000)] = None  # type: ignore[assignment]
    model_weights: Annotated[list[ModelWeightsLocator], Field(max_length=1_000_000)] = None  # type: ignore[assignment]
    state_partitions: Annotated[list[StateLocator], Field(max_length=10_000_000)] = None  # type: ignore[assignment]


class LossScaler(_Model):
    kind: Text256
    state: Values


class OptimizerGroup(_Model):
    optimizer_group: Count
    hyperparameters: Values
    step: NonNegative


class Optimizer(_Model):
    model_config = ConfigDict(populate_by_name=True)  # "class" is a Python keyword: the field is class_

    class_: Text256 = Field(alias="class")
    groups: Annotated[list[OptimizerGroup], Field(max_length=1_000_000)]
    loss_scaler: LossScaler = None  # type: ignore[assignment]
    clip_grad: NonNegative = None  # type: ignore[assignment]


class Save(_Model):
    global_steps: Count
    global_samples: Count
    skipped_steps: Count
    id: Text256 = None  # type: ignore[assignment]  # absent, never null


class Manifest(_Model):
    format: Literal["ckptspec.manifest"]
    format_version: SemVer
    producer: Producer
    layout: Layout
    groups: Annotated[list[Group], Field(max_length=1_000_000)]
    frozen: Annotated[list[FrozenParam], Field(max_length=10_000_000)]
    buffers: Annotated[list[Buffer], Field(max_length=10_000_000)]
    aliases: Annotated[list[Alias], Field(max_length=10_000_000)]
    excluded: Annotated[list[ExcludedParam], Field(max_length=10_000_000)]
    files: Annotated[list[ShardFile], Field(max_length=1_000_000)]
    optimizer: Optimizer = None  # type: ignore[assignment]
    save: Save = None  # type: ignore[assignment]

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready document: optional fields absent, unknown fields kept."""
        return self.model_dump(mode="json", exclude_unset=True, by_alias=True)
