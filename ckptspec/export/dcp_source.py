"""The torch-free half of the DCP reader (``dcp_reader.DeepSpeedReader``): a checkpoint validated once, and the
byte ranges of a box of a tensor.

Validated once: one process (rank 0 of the loading job) opens the checkpoint as ``ckptspec.open`` does (every
kind: the document's rules, every file, ``check_copies``) and makes the DCP plan (``plan_dcp``: CK402), and gives
a *verdict*, plain data the others receive (``deepspeed/load/verdict.py``, the broadcast): the document it
validated and the tag it read, or the error with its findings. Each other process plans the same checkpoint from
that document (the files' metadata only, no validation again) or raises the same error, before any tensor is read.

A box (``storage_offsets``, ``lengths`` of a DCP read item) of a whole row-major tensor is a set of runs of its
flat elements; each run is located in the tensor's segments (``model_plan.RunSegments``: a run that a ZeRO
partition boundary cuts becomes a segment in each file), and adjacent byte ranges of one file are one read.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Iterator, Sequence
from typing import Any

from ..deepspeed.kinds import Kind, kind_of_index
from ..deepspeed.layout.tag_dir import resolve_tag_dir
from ..deepspeed.load.verdict import raised
from ..location import is_remote, location
from .checkpoint import Checkpoint, open_checkpoint
from .dcp import DcpPlan, plan_dcp
from .model_plan import RunSegments, Segment, TensorSource, coalesced


def validated(checkpoint: str | os.PathLike, manifest: Any = None, tag: str | None = None):
    """Open and validate the checkpoint (``ckptspec.open``), its DCP plan made (CK402) and its replicated copies
    compared (CK401): the checkpoint, its plan, and the verdict the other ranks plan from."""
    opened = open_checkpoint(checkpoint, document=manifest, tag=tag)
    dcp_plan = plan_dcp(opened)
    opened.check_copies()
    root = location(os.fspath(checkpoint))
    # The tag this process read, so that a 'latest' moved since (a job saving again) is not another rank's.
    pinned = None if str(opened.tag_dir) == str(root) else opened.tag_dir.name
    return opened, dcp_plan, {"document": opened.document.to_dict(), "tag": pinned}


def planned(checkpoint: str | os.PathLike, verdict: dict[str, Any]) -> tuple[Checkpoint, DcpPlan]:
    """The checkpoint another process validated (``verdict``), planned here from the document it validated;
    its error raised again when it failed."""
    if "error" in verdict:
        raise raised(verdict["error"], os.fspath(checkpoint))
    from ..format.documents import validate
    from ..format.index_models import CheckpointIndex
    from ..format.models import Manifest

    document = validate(verdict["document"]).manifest  # the document's own rules: no file is read
    assert isinstance(document, (Manifest, CheckpointIndex)), "a validated DeepSpeed document"
    tag = verdict["tag"]
    if isinstance(document, CheckpointIndex):
        from ..checkpoint.states import StateCache
        from .compose import index_plan

        plan = index_plan(document, resolve_tag_dir(checkpoint, tag), StateCache())
        opened = Checkpoint(os.fspath(checkpoint), kind_of_index(document), document, plan, [])
    else:
        from .plan import plan_reconstruction

        zero = plan_reconstruction(checkpoint, document, tag, hashes_in_stream=is_remote(checkpoint))
        opened = Checkpoint(os.fspath(checkpoint), Kind.ZERO, document, zero, [])
    opened._copies_checked = True  # by the process that validated it
    return opened, plan_dcp(opened)


def element_runs(shape: Sequence[int], offsets: Sequence[int], lengths: Sequence[int]) -> Iterator[tuple[int, int]]:
    """The elements of the box ``offsets`` + ``lengths`` of a row-major tensor of ``shape``, as ascending runs
    (flat start, count); the innermost dimensions the box covers whole make one run with the first it cuts."""
    if not shape:
        yield 0, 1
        return
    if any(n == 0 for n in lengths):
        return
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    k = len(shape) - 1
    while k > 0 and offsets[k] == 0 and lengths[k] == shape[k]:
        k -= 1
    count = lengths[k] * strides[k]
    for index in itertools.product(*(range(o, o + n) for o, n in zip(offsets[:k], lengths[:k]))):
        yield sum(i * s for i, s in zip(index, strides)) + offsets[k] * strides[k], count


def box_segments(source: TensorSource, offsets: Sequence[int], lengths: Sequence[int]) -> Iterator[Segment]:
    """The byte ranges of the box, in the box's row-major order: stitched across the segments (partitions,
    shards) the tensor is stored in, adjacent ranges of one file coalesced into one read."""
    return coalesced(RunSegments(source, lambda: element_runs(source.shape, offsets, lengths)))


def whole(shape: Sequence[int], offsets: Sequence[int], lengths: Sequence[int]) -> bool:
    """Whether the box is the whole tensor (its recorded digest can then be checked)."""
    return all(o == 0 for o in offsets) and list(lengths) == list(shape)
