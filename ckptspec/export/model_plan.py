"""The plan types: where every tensor of the whole model is, as byte ranges of a checkpoint's files.

``TensorSource`` locates one output tensor (its ``Segment``s, concatenated, are the flat tensor);
``ModelPlan`` is the whole model's table of them, as the writers, ``load_state_dict`` and ``ckptspec.open``
read it: ``ReconstructionPlan`` for a plain ZeRO checkpoint (``plan.plan_reconstruction``, from its
manifest), ``compose_plan.IndexReconstructionPlan`` for one described by a checkpoint index.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import overload

from .._version import __version__
from ..checkpoint.embedded import safetensors_metadata
from ..format.dtypes import FLOATING, ITEMSIZE
from ..format.models import Hash, Manifest
from ..location import RemotePath


@dataclass(frozen=True)
class Segment:
    """``nbytes`` bytes at absolute ``offset`` of ``path``."""

    path: Path | RemotePath
    offset: int
    nbytes: int


# Where an output tensor's bytes come from, as the output's metadata says (``ckptspec.sources``,
# docs/reconstruct.md): each role's default, and what a checkpoint index locates apart.
ORIGINS = {
    "trainable": "optimizer_fp32_master",  # the fp32 copy the optimizer keeps and steps
    "frozen": "frozen_weight",  # a frozen parameter's saved weight (model dtype): no master exists
    "buffer": "buffer",
    "state": "optimizer_state",
}
MODULE_FP32_WEIGHT = "module_fp32_weight"  # the fp32 weights of a run without mixed precision: the masters
UNIVERSAL_FP32 = "universal_fp32"  # zero/<name>/fp32.pt of a universal folder


def coalesced(segments: Iterable[Segment]) -> Iterator[Segment]:
    """``segments`` with each run of adjacent ranges of one file made one range."""
    held: Segment | None = None
    for seg in segments:
        if held is not None and seg.path == held.path and seg.offset == held.offset + held.nbytes:
            held = Segment(held.path, held.offset, held.nbytes + seg.nbytes)
            continue
        if held is not None:
            yield held
        held = seg
    if held is not None:
        yield held


class LazySegments(Sequence[Segment]):
    """Segments made each time they are iterated, never held: a tensor split along an inner axis is one segment per
    row (millions in a large model; held, they grew the memory of an AutoTP merge and split with the model)."""

    def __iter__(self) -> Iterator[Segment]:
        raise NotImplementedError

    def __len__(self) -> int:
        return sum(1 for _ in self)

    @overload
    def __getitem__(self, i: int) -> Segment: ...
    @overload
    def __getitem__(self, i: slice) -> list[Segment]: ...
    def __getitem__(self, i):
        return list(self)[i]  # rare (a plan's first file); iteration is the way to read them


class RunSegments(LazySegments):
    """The segments of runs of ``source``'s flat tensor (``runs()``: (element start, count), ascending): a tensor
    rank's shard of a whole tensor (``reshard_tensor_split``)."""

    def __init__(self, source: TensorSource, runs: Callable[[], Iterable[tuple[int, int]]]):
        self.source, self.runs = source, runs

    def __iter__(self) -> Iterator[Segment]:
        item = ITEMSIZE[self.source.dtype]
        segments = iter(self.source.segments)
        seg, first, end = None, 0, 0  # the source segment holding elements [first, end)
        for pos, count in self.runs():
            while count > 0:
                while seg is None or pos >= end:
                    seg = next(segments)
                    first, end = end, end + seg.nbytes // item
                take = min(count, end - pos)
                yield Segment(seg.path, seg.offset + (pos - first) * item, take * item)
                pos, count = pos + take, count - take


@dataclass
class TensorSource:
    """Where one output tensor's bytes are: its segments, concatenated, are the flat tensor."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # dtype of the bytes on disk
    segments: list[Segment] | LazySegments  # LazySegments: made as they are read (a shard's, a composed tensor's)
    role: str  # "trainable" (fp32 master), "frozen" (model dtype), "buffer", "state" (optimizer state)
    digest: str | None = None  # sha256 of the bytes of the segments (format 1.1), checked while they are read
    origin: str = ""  # what the bytes are (ORIGINS): the role's default unless a producer says otherwise

    def __post_init__(self) -> None:
        self.origin = self.origin or ORIGINS.get(self.role, self.role)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class ModelPlan:
    """Where every tensor of the whole model is, for the writers: the plan of a plain ZeRO checkpoint
    (``ReconstructionPlan``, from its manifest) or of one described by a checkpoint index
    (``compose_plan.IndexReconstructionPlan``, composed from its domains' plans)."""

    tag_dir: Path | RemotePath
    sources: dict[str, TensorSource]  # owners: trainable, frozen, buffers
    aliases: dict[str, str]  # alias -> owner
    order: list[str]  # every output name (owners and aliases), in the model's state_dict order
    # Remote files whose recorded hash the reader checks while it reads them (``ShardReader.verify``),
    # so that each byte is fetched once; validation left them to it (``hashes_in_stream``).
    file_hashes: dict[RemotePath, Hash] = field(default_factory=dict)

    def metadata(self, dtype: str, untied: bool) -> dict[str, str]:
        """The string map written to ``__metadata__`` and to the index's ``metadata``."""
        raise NotImplementedError

    def document_metadata(self) -> dict[str, str]:
        """The document that travels with the weights, as safetensors metadata (``ckptspec extract``)."""
        return {}

    def output_dtype(self, name: str, dtype: str) -> str:
        """Floating tensors are cast to ``dtype``; integer and bool buffers keep theirs."""
        src = self.sources[self.aliases.get(name, name)].dtype
        return dtype if src in FLOATING else src

    def output_nbytes(self, name: str, dtype: str) -> int:
        """Bytes of ``name`` in the output when floating tensors are written as ``dtype``."""
        return self.sources[self.aliases.get(name, name)].numel * ITEMSIZE[self.output_dtype(name, dtype)]

    def stored(self, untie: bool) -> list[str]:
        """The names whose data the output holds: a tied alias is stored once (as its owner) unless ``untie``."""
        return [n for n in self.order if untie or n not in self.aliases]

    def total_nbytes(self, dtype: str, untie: bool) -> int:
        """Bytes of tensor data in the output."""
        return sum(self.output_nbytes(n, dtype) for n in self.stored(untie))

    def total_numel(self, untie: bool) -> int:
        """Elements of tensor data in the output (what the summary of ``reconstruct`` counts)."""
        return sum(self.sources[self.aliases.get(n, n)].numel for n in self.stored(untie))

    def provenance(self, names: list[str]) -> str:
        """``ckptspec.sources`` of a file holding ``names``: what each tensor's bytes are (ORIGINS) ->
        its names; a tied alias written as its own tensor is its owner's bytes."""
        out: dict[str, list[str]] = {}
        for name in names:
            out.setdefault(self.sources[self.aliases.get(name, name)].origin, []).append(name)
        return json.dumps({origin: sorted(found) for origin, found in sorted(out.items())}, separators=(",", ":"))


@dataclass
class ReconstructionPlan(ModelPlan):
    """The plan of a plain ZeRO checkpoint (one data-parallel group), from its manifest."""

    manifest: Manifest = field(kw_only=True)

    def document_metadata(self) -> dict[str, str]:
        return safetensors_metadata(self.manifest)

    def metadata(self, dtype: str, untied: bool) -> dict[str, str]:
        """The string map written to ``__metadata__`` and to the index's ``metadata``."""
        frozen = {s.name: s.dtype for s in self.sources.values() if s.role == "frozen"}
        # The manifest itself travels with the weights too (`ckptspec extract` prints it): the
        # writer adds it once, to the index or the single file (checkpoint.embedded.safetensors_metadata).
        return {
            "format": "pt",
            "ckptspec.format_version": self.manifest.format_version,
            "ckptspec.tool_version": __version__,
            "ckptspec.zero_stage": str(self.manifest.layout.zero_stage),
            "ckptspec.tag": self.tag_dir.name,
            "ckptspec.dtype": dtype,
            "ckptspec.aliases": json.dumps(self.aliases, sort_keys=True),
            "ckptspec.untied": "true" if untied else "false",
            "ckptspec.frozen_source": json.dumps(frozen, sort_keys=True),
        }
