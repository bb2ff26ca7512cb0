"""``ckptspec reconstruct DCP_DIR OUT``: a torch DCP checkpoint's model weights as one safetensors file, at flat memory.

The checkpoint is checked first (``checkpoint.dcp.checks``: any error finding, nothing is written). Every tensor
entry under ``model.`` is written under its name without that prefix (a tie's two names both, as torch's
``dcp_to_torch_save`` writes them), at its saved dtype. A Megatron-core ``torch_dist`` save (``metadata.json``) has
no ``model.`` prefix: every tensor not under ``optimizer.`` is written under its Megatron key, as Megatron's
``dist_checkpointing.load`` of the whole tensor returns it (a model's layers stacked on a leading axis). Each chunk's
bytes are located in their ``.distcp`` file (the item's ``torch.save`` record, read through the restricted reader:
``checkpoint.dcp.records``) and copied into the output in the whole tensor's order, a contiguous run at a time (a
whole row block for FSDP2's dim-0 shards), in the kernel where it can: no tensor is ever held in memory, whatever
its size. A checkpoint at a URL is read through ``location``: the records' few bytes, then each run in range
requests, a few in flight (``ShardReader``), never a whole file. Standard library only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..checkpoint.dcp.checks import Where, check_dcp
from ..checkpoint.dcp.megatron import is_model_key
from ..checkpoint.dcp.metadata import DcpMetadata, Item, TensorEntry
from ..checkpoint.dcp.records import read_record
from ..checkpoint.dcp.runs import runs
from ..errors import CheckpointInvalid, ReconstructUnsupported
from ..findings import Finding, has_errors
from ..format.dtypes import ITEMSIZE
from ..location import location, open_binary, writable
from .arrays import ShardReader
from .dcp_optimizer import plan_dcp_optimizer
from .model_plan import Segment, coalesced
from .optimizer_state import OPTIMIZER_FILE
from .output_dir import build_and_publish, held_new_output
from .safetensors_writer import SAFETENSORS_DTYPES, SafetensorsWriter
from .safetensors_writer import TensorEntry as OutputEntry

MODEL_PREFIX = "model."  # get_state_dict's model state, saved as {"model": ..., "optim": ...}
OUTPUT_NAME = "model.safetensors"


@dataclass(frozen=True)
class DcpReconstruction:
    output_dir: Path
    files: list[str]
    tensors: int
    nbytes: int
    findings: list[Finding]  # warnings of the checks (errors stop the run)


def model_entries(meta: DcpMetadata) -> dict[str, TensorEntry]:
    """The model's tensors, by their name in the output (``model.`` dropped; a Megatron save's as they are), in the
    save's order."""
    if meta.megatron is not None:
        return {fqn: e for fqn, e in meta.entries.items() if is_model_key(fqn) and isinstance(e, TensorEntry)}
    return {
        fqn.removeprefix(MODEL_PREFIX): e
        for fqn, e in meta.entries.items()
        if fqn.startswith(MODEL_PREFIX) and isinstance(e, TensorEntry)
    }


Items = dict[tuple[str, tuple[int, ...] | None], Item]  # (fqn, chunk offsets; None for bytes) -> its storage item


def items_of(meta: DcpMetadata) -> Items:
    return {(i.fqn, i.chunk_offset): i for i in meta.items}


def located(directory: Where, items: Items, fqn: str, entry: TensorEntry) -> list[Segment]:
    """The tensor's flat bytes as segments: each chunk's runs of the whole tensor, in the whole tensor's order
    (the chunks cover it exactly once, CK250), the runs that follow each other in one file joined."""
    itemsize, placed = ITEMSIZE[entry.dtype], []
    for chunk in entry.chunks:
        if chunk.numel == 0:
            continue
        item = items[(fqn, chunk.offsets)]  # CK251 checked it is there
        with open_binary(directory / item.file) as fh:  # a URL: the record's few bytes, kept by the checks' read
            record = read_record(fh, directory / item.file, item.offset, item.length)
        for src, dst, n in runs(entry.size, chunk):
            placed.append((dst, Segment(directory / item.file, record.data_offset + src * itemsize, n * itemsize)))
    return list(coalesced(seg for _, seg in sorted(placed, key=lambda p: p[0])))


def model_fqn(meta: DcpMetadata, name: str) -> str:
    """The DCP key of the model tensor ``model_entries`` names ``name``."""
    return name if meta.megatron is not None else MODEL_PREFIX + name


def _write(source: Where, meta: DcpMetadata, path: Path, tensors: dict[str, tuple[str, TensorEntry]], metadata) -> int:
    """``tensors`` (output name -> its DCP fqn and entry) copied from their chunks' records into the safetensors
    file ``path``, tensor after tensor: a local file's runs in the kernel, a URL's fetched in range requests, a few
    ahead (``ShardReader``); its bytes of tensor data."""
    items = items_of(meta)
    entries = [OutputEntry(name, e.dtype, e.size) for name, (_, e) in tensors.items()]
    segments = {name: located(source, items, fqn, e) for name, (fqn, e) in tensors.items()}
    writer = SafetensorsWriter(path, entries, metadata)
    reader = ShardReader()
    try:
        reader.plan([seg for segs in segments.values() for seg in segs])
        for name, segs in segments.items():
            writer.begin(name)
            for seg in segs:
                reader.copy(seg, writer)
        writer.finish()
        os.replace(writer.tmp_path, path)
    except BaseException:
        writer.abort()
        raise
    finally:
        reader.close()
    return sum(e.nbytes for e in entries)


def reconstruct_dcp(
    directory: str | os.PathLike, output: str | os.PathLike, optimizer_state: bool = False
) -> DcpReconstruction:
    """Check the DCP checkpoint in ``directory``, then write its model weights to ``output/model.safetensors``
    (and with ``optimizer_state`` its optimizer state to ``output/optimizer.safetensors``: ``dcp_optimizer``)."""
    writable(output, "the reconstruction")  # before anything is fetched: an object store stages and uploads
    source = location(directory)  # a URL: ranged reads (docs/remote.md)
    meta, findings = check_dcp(source)
    if has_errors(findings):
        raise CheckpointInvalid(findings, str(directory))
    tensors = model_entries(meta)
    if not tensors:
        raise ReconstructUnsupported(
            "no model tensors: no entry's name starts with 'model.'",
            "save with dcp.save({'model': model_state_dict, ...}) (get_state_dict's model state)",
            source,
        )
    if optimizer_state and meta.megatron is not None:
        raise ReconstructUnsupported(
            "--optimizer-state of a Megatron-core torch_dist checkpoint: its optimizer.* layout is not read yet",
            "reconstruct the model weights (without --optimizer-state)",
            source,
        )
    optimizer = plan_dcp_optimizer(source, meta, tensors) if optimizer_state else None
    moments = optimizer.tensors if optimizer is not None else {}
    for name, entry in [*tensors.items(), *((n, e) for n, (_, e) in moments.items())]:
        if entry.dtype not in SAFETENSORS_DTYPES:
            raise ReconstructUnsupported(f"{name}: dtype {entry.dtype} has no safetensors code", "", source)
    with held_new_output(output, "the reconstruction") as out:

        def build(tmp: Path) -> int:
            named = {name: (model_fqn(meta, name), e) for name, e in tensors.items()}
            nbytes = _write(source, meta, tmp / OUTPUT_NAME, named, {"format": "pt"})
            if optimizer is not None:  # one more file of the same commit
                nbytes += _write(source, meta, tmp / OPTIMIZER_FILE, moments, optimizer.metadata)
            return nbytes

        nbytes = build_and_publish(out, build)
    files = [OUTPUT_NAME] + ([OPTIMIZER_FILE] if optimizer is not None else [])
    return DcpReconstruction(out, files, len(tensors) + len(moments), nbytes, findings)
