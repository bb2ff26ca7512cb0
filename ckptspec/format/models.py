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

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationInfo,
    model_validator,
)

INT64_MAX = 2**63 - 1


def _integral(value: Any) -> Any:
    # JSON Schema counts 3.0 as an integer but never true/"3"; mirror that exactly.
    if isinstance(value, bool):
        raise ValueError("expected an integer, got a boolean")
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if not isinstance(value, int):
        raise ValueError("expected an integer")
    return value


Count = Annotated[int, BeforeValidator(_integral), Field(ge=0, le=INT64_MAX)]
Positive = Annotated[int, BeforeValidator(_integral), Field(ge=1, le=1048576)]
Name = Annotated[str, StringConstraints(strict=True, min_length=1, max_length=1024)]
Shape = Annotated[list[Count], Field(max_length=64)]
Dtype = Literal[
    "float64",
    "float32",
    "float16",
    "bfloat16",
    "float8_e4m3fn",
    "float8_e5m2",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint8",
    "bool",
    "complex64",
    "complex128",
]
SemVer = Annotated[
    str,
    StringConstraints(strict=True, pattern=r"^(0|[1-9][0-9]{0,5})\.(0|[1-9][0-9]{0,5})\.(0|[1-9][0-9]{0,5})$"),
]
Timestamp = Annotated[
    str,
    StringConstraints(
        strict=True,
        max_length=64,
        pattern=r"^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]{1,9})?(Z|[+-][0-9]{2}:[0-9]{2})$",
    ),
]


def _text(max_length: int) -> Any:
    return Annotated[str, StringConstraints(strict=True, min_length=1, max_length=max_length)]


_FIELD_NAMES: dict[type, frozenset[str]] = {}


def _field_names(cls: type[BaseModel]) -> frozenset[str]:
    # Cached: pydantic's model_fields is a property that costs ~10 us per call, once per
    # validated object (1 s for a 100k-parameter manifest).
    names = _FIELD_NAMES.get(cls)
    if names is None:
        # By alias too: Optimizer's "class" (a Python keyword) is the field class_.
        names = _FIELD_NAMES[cls] = frozenset(cls.model_fields) | {
            f.alias for f in cls.model_fields.values() if f.alias
        }
    return names


class _Model(BaseModel):
    """Base: strict types; unknown keys refused unless the reader allows them.

    A document with a newer minor format version may carry fields this reader does
    not know; ``load`` then passes ``context={"allow_unknown": True}`` so they are
    kept (and dumped back) instead of refused.
    """

    model_config = ConfigDict(extra="allow", strict=True, frozen=False)

    @model_validator(mode="before")
    @classmethod
    def _refuse_unknown_keys(cls, data: Any, info: ValidationInfo) -> Any:
        if isinstance(data, dict) and not (info.context or {}).get("allow_unknown"):
            unknown = data.keys() - _field_names(cls)
            if unknown:
                raise ValueError(f"unknown field(s): {', '.join(sorted(map(str, unknown)))}")
        return data


def _finite(value: Any) -> Any:
    # A JSON number: int or float (never a boolean, NaN or infinity: the codec refuses those).
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError("expected a number")
    return value


Number = Annotated[float | int, BeforeValidator(_finite)]
NonNegative = Annotated[float | int, BeforeValidator(_finite), Field(ge=0)]
Scalar = Number | bool | Annotated[str, StringConstraints(strict=True, max_length=65536)]
Value = Scalar | Annotated[list[Scalar], Field(max_length=1024)]
Values = Annotated[
    dict[Annotated[str, StringConstraints(strict=True, min_length=1, max_length=256)], Value], Field(max_length=1024)
]
StateName = Annotated[str, StringConstraints(strict=True, min_length=1, max_length=256)]


class Digest(_Model):
    sha256: Annotated[str, StringConstraints(strict=True, pattern=r"^[0-9a-f]{64}$")] = None  # type: ignore[assignment]

    @model_validator(mode="after")
    def _one_at_least(self) -> Digest:
        if not self.model_fields_set and not self.model_extra:
            raise ValueError("a digest names at least one algorithm")
        return self


class Producer(_Model):
    tool: _text(256)
    tool_version: _text(256)
    framework: _text(256)
    framework_version: _text(256)
    created: Timestamp = None  # type: ignore[assignment]  # absent, never null
    metadata: Annotated[
        dict[
            Annotated[str, StringConstraints(strict=True, max_length=1024)],
            Annotated[str, StringConstraints(strict=True, max_length=65536)],
        ],
        Field(max_length=1024),
    ] = None  # type: ignore[assignment]


class Layout(_Model):
    zero_stage: Annotated[int, BeforeValidator(_integral), Field(ge=0, le=3)]
    world_size: Positive
    tensor_parallel_size: Positive
    pipeline_parallel_size: Positive
    model_parallel_size: Positive = None  # type: ignore[assignment]
    model_dtype: Dtype
    master_dtype: Dtype
    round_robin: bool
    parameter_alignment: bool
    tail_padding_saved: bool
    optimizer: _text(256) = None  # type: ignore[valid-type]
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
    reason: _text(1024)


class Hash(_Model):
    algorithm: Literal["sha256", "blake2b"]
    digest: Annotated[str, StringConstraints(strict=True, pattern=r"^[0-9a-f]{64}$|^[0-9a-f]{128}$")]


class Locator(_Model):
    group: Count
    rank: Count
    member: _text(4096)
    data_offset: Count
    member_size: Count
    dtype: Dtype
    element_offset: Count
    numel: Count


class TensorLocator(_Model):
    name: Name
    member: _text(4096)
    data_offset: Count
    member_size: Count
    dtype: Dtype
    element_offset: Count
    numel: Count


class ModelWeightsLocator(_Model):
    group: Count
    member: _text(4096)
    data_offset: Count
    member_size: Count
    dtype: Dtype
    element_offset: Count
    numel: Count


class StateLocator(_Model):
    group: Count
    rank: Count
    state: StateName
    member: _text(4096)
    data_offset: Count
    member_size: Count
    dtype: Dtype
    element_offset: Count
    numel: Count


class ShardFile(_Model):
    path: _text(4096)
    role: Literal["model_states", "optimizer_states", "other"]
    ranks: Annotated[list[Count], Field(max_length=1048576)]
    size: Count
    hash: Hash = None  # type: ignore[assignment]
    partitions: Annotated[list[Locator], Field(max_length=1_000_000)]
    tensors: Annotated[list[TensorLocator], Field(max_length=10_000_000)] = None  # type: ignore[assignment]
    model_weights: Annotated[list[ModelWeightsLocator], Field(max_length=1_000_000)] = None  # type: ignore[assignment]
    state_partitions: Annotated[list[StateLocator], Field(max_length=10_000_000)] = None  # type: ignore[assignment]


class LossScaler(_Model):
    kind: _text(256)
    state: Values


class OptimizerGroup(_Model):
    optimizer_group: Count
    hyperparameters: Values
    step: NonNegative


class Optimizer(_Model):
    model_config = ConfigDict(populate_by_name=True)  # "class" is a Python keyword: the field is class_

    class_: _text(256) = Field(alias="class")
    groups: Annotated[list[OptimizerGroup], Field(max_length=1_000_000)]
    loss_scaler: LossScaler = None  # type: ignore[assignment]
    clip_grad: NonNegative = None  # type: ignore[assignment]


class Save(_Model):
    global_steps: Count
    global_samples: Count
    skipped_steps: Count
    id: _text(256) = None  # type: ignore[valid-type]


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
        from .manifest_dict import manifest_dict  # it reads these models

        return manifest_dict(self)
