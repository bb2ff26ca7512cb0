"""``ckptspec reconstruct DCP_DIR OUT``: a torch DCP checkpoint's model weights as one safetensors file, at flat memory.

The checkpoint is checked first (``checkpoint.dcp.checks``: any error finding, nothing is written). Every tensor
entry under ``model.`` is written under its name without that prefix (a tie's two names both, as torch's
``dcp_to_torch_save`` writes them), at its saved dtype. A Megatron-core ``torch_dist`` save (``metadata.json``) has
no ``model.`` prefix: every tensor not under ``optimizer.`` is written under its Megatron key, as Megatron's
``dist_checkpointing.load`` of the whole tensor returns it (a model's layers stacked on a leading axis). Each
chunk's bytes are located in their ``.distcp`` file (the item's ``torch.save`` record, read through the restricted
reader: ``checkpoint.dcp.records``) and copied into the tensor's place in the output, a contiguous run at a time (a
whole row block for FSDP2's dim-0 shards), in the kernel where it can: no tensor is ever held in memory, whatever
its size. Standard library only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..checkpoint.dcp.checks import check_dcp
from ..checkpoint.dcp.megatron import is_model_key
from ..checkpoint.dcp.metadata import DcpMetadata, TensorEntry
from ..checkpoint.dcp.records import read_record
from ..checkpoint.dcp.runs import runs
from ..errors import CheckpointInvalid, ReconstructUnsupported
from ..findings import Finding, has_errors
from ..format.dtypes import ITEMSIZE
from .dcp_optimizer import plan_dcp_optimizer
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


def model_fqn(meta: DcpMetadata, name: str) -> str:
    """The DCP key of the model tensor ``model_entries`` names ``name``."""
    return name if meta.megatron is not None else MODEL_PREFIX + name


def _write(source: Path, meta: DcpMetadata, path: Path, tensors: dict[str, tuple[str, TensorEntry]], metadata) -> int:
    """``tensors`` (output name -> its DCP fqn and entry) copied run by run from their chunks' records into the
    safetensors file ``path``; its bytes of tensor data."""
    items = {(i.fqn, i.chunk_offset): i for i in meta.items}
    entries = [OutputEntry(name, e.dtype, e.size) for name, (_, e) in tensors.items()]
    writer = SafetensorsWriter(path, entries, metadata)
    try:
        regions = writer.regions()
        handles: dict[str, int] = {}
        try:
            for (fqn, entry), region in zip(tensors.values(), regions):
                itemsize = ITEMSIZE[entry.dtype]
                for chunk in entry.chunks:
                    item = items[(fqn, chunk.offsets)]  # CK251 checked it is there
                    fd = handles.get(item.file)
                    if fd is None:
                        fd = handles[item.file] = os.open(source / item.file, os.O_RDONLY)
                    with os.fdopen(os.dup(fd), "rb") as fh:
                        record = read_record(fh, source / item.file, item.offset, item.length)
                    for src, dst, n in runs(entry.size, chunk):
                        part = region.part(dst * itemsize, n * itemsize)
                        part.copy_range(fd, record.data_offset + src * itemsize, n * itemsize)
                region.pos = region.end  # its parts filled it: the chunks cover it exactly once (CK250)
        finally:
            for fd in handles.values():
                os.close(fd)
        writer.regions_done(regions)
        writer.finish()
        os.replace(writer.tmp_path, path)
    except BaseException:
        writer.abort()
        raise
    return sum(e.nbytes for e in entries)


def reconstruct_dcp(
    directory: str | os.PathLike, output: str | os.PathLike, optimizer_state: bool = False
) -> DcpReconstruction:
    """Check the DCP checkpoint in ``directory``, then write its model weights to ``output/model.safetensors``
    (and with ``optimizer_state`` its optimizer state to ``output/optimizer.safetensors``: ``dcp_optimizer``)."""
    source = Path(directory)
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
