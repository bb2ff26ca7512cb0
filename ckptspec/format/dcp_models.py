"""Pydantic models of the torch DCP document, ``schema/dcp-1.0.schema.json`` (``"format": "ckptspec.dcp"``).

The document describes a ``torch.distributed.checkpoint`` directory so that a reader needs neither torch nor its
``.metadata`` pickle: every tensor (name, dtype, whole shape) with its chunks, where each chunk's bytes are, the
bytes items (pickles: listed, never read as pickles), the files with their sizes (docs/spec-dcp.md).

The schema is normative; ``tests/unit/format/test_dcp_corpus.py`` proves both agree.
"""

from __future__ import annotations

from typing import Annotated, Any, Final, Literal

from pydantic import Field, StringConstraints

from .models import Count, Dtype, Hash, Name, Positive, Producer, SemVer, Shape, _Model

DCP_FORMAT: Final = "ckptspec.dcp"
DCP_VERSION = "1.0.0"

FileName = Annotated[str, StringConstraints(strict=True, min_length=1, max_length=4096)]
Sha256 = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]


class ChunkDigest(_Model):
    sha256: Sha256


class DcpFile(_Model):
    path: FileName
    size: Count
    hash: Hash = None  # type: ignore[assignment]  # absent, never null


class DcpChunk(_Model):
    """A saved piece of a tensor (``offsets``, ``sizes`` in the whole tensor) and its storage item: ``length`` bytes
    at ``offset`` of ``file`` hold its ``torch.save`` record, whose row-major elements start at ``data_offset``."""

    offsets: Shape
    sizes: Shape
    file: FileName
    offset: Count
    length: Count
    data_offset: Count
    digest: ChunkDigest = None  # type: ignore[assignment]


class DcpTensor(_Model):
    name: Name
    dtype: Dtype
    shape: Shape
    chunks: Annotated[list[DcpChunk], Field(max_length=1048576)]


class BytesItem(_Model):
    """A ``BytesStorage`` value: a ``torch.save`` pickle of any object, ``length`` bytes at ``offset`` of ``file``."""

    name: Name
    file: FileName
    offset: Count
    length: Count


class MetadataFile(_Model):
    size: Count
    hash: Hash = None  # type: ignore[assignment]
    version: Annotated[str, StringConstraints(min_length=1, max_length=256)] = None  # type: ignore[assignment]


class DcpDocument(_Model):
    format: Literal["ckptspec.dcp"]
    format_version: SemVer
    producer: Producer
    world_size: Positive = None  # type: ignore[assignment]
    metadata: MetadataFile
    files: Annotated[list[DcpFile], Field(max_length=1_000_000)]
    tensors: Annotated[list[DcpTensor], Field(max_length=10_000_000)]
    bytes: Annotated[list[BytesItem], Field(max_length=1_000_000)]

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready document: optional fields absent, unknown fields kept."""
        return self.model_dump(mode="json", exclude_unset=True, by_alias=True)
