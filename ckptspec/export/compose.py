"""The whole model of a tensor/pipeline-parallel checkpoint, from its validated index.

Each domain is an ordinary 1.x manifest: ``plan_reconstruction`` gives every local parameter's
bytes (its fp32 master) in the domain's files. A whole-model parameter is then composed from its
shards as the index places them: a ``whole`` (pipeline) or primary ``replicated`` shard is the
tensor; ``split`` shards are blocks along one axis; ``pieces`` are DeepSpeed's strided affine
pieces. The non-primary replicas are read and compared with the primary (they must be equal, bit
for bit: CK401 otherwise). One parameter is in memory at a time (plus its shards); the output is
written like any reconstruction (atomic, ``safetensors_writer``). No DeepSpeed, no torch, no pickle.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._fs import commit, exclusive, recover, sweep
from ..checkpoint.states import StateCache
from ..deepspeed.directory import resolve_tag_dir
from ..deepspeed.validate_index import validate_index_checkpoint
from ..errors import CheckpointInvalid, ForeignOutput, ReconstructMismatch
from ..findings import has_errors
from ..format.dtypes import output_dtype
from ..format.index_models import CheckpointIndex, IndexParameter
from .arrays import ShardReader, _np, convert, read_array
from .compose_masters import master_sources
from .outputs import existing_outputs
from .plan import TensorSource, plan_reconstruction
from .safetensors_writer import SafetensorsWriter, TensorEntry
from .writers import SAFETENSORS_SINGLE, WriteResult


@dataclass
class IndexPlan:
    index: CheckpointIndex
    tag_dir: Path
    sources: dict[tuple[str, str], TensorSource]  # (domain id, local name) -> its master's bytes


def validated_index_plan(checkpoint: str | os.PathLike, index: Any = None, tag: str | None = None) -> IndexPlan:
    """Validate the whole set (index rules, every domain's files, the index's checks), then plan."""
    if isinstance(index, (str, os.PathLike)):
        from ..format.index_validate import validate_index_file

        index = validate_index_file(index)
        if not index.ok:
            raise CheckpointInvalid(index.findings, str(checkpoint))
    states = StateCache()
    found, findings = validate_index_checkpoint(checkpoint, index, tag, states=states, verify_digests=False)
    if found is None or has_errors(findings):
        raise CheckpointInvalid(findings, str(checkpoint))
    tag_dir = resolve_tag_dir(checkpoint, tag)
    sources = {}
    for domain in found.domains:
        if domain.masters is not None:  # #17: stage 0, MoE, universal folders
            sources.update({(domain.id, name): s for name, s in master_sources(tag_dir, domain).items()})
            continue
        plan = plan_reconstruction(tag_dir, domain.manifest, states=states)
        for name, source in plan.sources.items():
            sources[(domain.id, name)] = source
    return IndexPlan(found, tag_dir, sources)


def _compose(plan: IndexPlan, param: IndexParameter, files: ShardReader):
    """The whole parameter as float32 (its masters composed)."""
    np = _np()
    shards = [(s, read_array(plan.sources[(s.domain, s.local_name)], "float32", files)) for s in param.shards]
    first = shards[0][1]
    placement = shards[0][0].placement
    if placement in ("whole", "replicated"):
        primary = next(a for s, a in shards if s.primary or len(shards) == 1)
        for s, array in shards:
            if not np.array_equal(array.view(np.uint32), primary.view(np.uint32)):
                raise ReconstructMismatch(
                    f"replicated parameter {param.name!r} differs between domains ({s.domain}: {s.local_name})",
                    plan.tag_dir,
                )
        return primary
    out = np.empty(param.shape, dtype=first.dtype)
    written = np.zeros(param.shape, dtype=bool)
    for shard, array in shards:
        if hasattr(shard.placement, "split"):
            split = shard.placement.split
            index = [slice(None)] * len(param.shape)
            index[split.axis] = slice(split.offset, split.offset + split.length)
            out[tuple(index)] = array
            written[tuple(index)] = True
            continue
        item = out.itemsize
        for piece in shard.placement.pieces:
            (src_off, src_strides), (dst_off, dst_strides) = piece.source, piece.dest
            flat_out, flat_in, flat_w = out.reshape(-1), array.reshape(-1), written.reshape(-1)
            target = np.lib.stride_tricks.as_strided(
                flat_out[src_off:], piece.shape, [s * item for s in src_strides], writeable=True
            )
            mark = np.lib.stride_tricks.as_strided(flat_w[src_off:], piece.shape, list(src_strides), writeable=True)
            target[...] = np.lib.stride_tricks.as_strided(
                flat_in[dst_off:], piece.shape, [s * flat_in.itemsize for s in dst_strides]
            )
            mark[...] = True
    if not written.all():
        raise ReconstructMismatch(f"the shards of {param.name!r} leave elements unset", plan.tag_dir)
    return out


def iter_whole(plan: IndexPlan, dtype: str = "float32") -> Iterator[tuple[IndexParameter, Any]]:
    """(parameter, array in ``dtype``; bfloat16 as uint16 bits) of every whole-model parameter, in order."""
    with ShardReader() as files:
        for param in plan.index.parameters:
            whole = _compose(plan, param, files)
            yield param, convert(whole.reshape(-1), "float32", dtype).reshape(param.shape)


def load_index_state_dict(
    checkpoint: str | os.PathLike, framework: str = "torch", *, dtype: Any = "fp32", index: Any = None, tag=None
) -> dict[str, Any]:
    """The whole model's state dict (fp32 masters, or ``dtype``) of a tensor/pipeline-parallel checkpoint."""
    from .writers import to_torch

    dtype = output_dtype(dtype)
    plan = validated_index_plan(checkpoint, index, tag)
    out = {}
    for param, array in iter_whole(plan, dtype):
        if framework == "torch":
            out[param.name] = to_torch(array, dtype)
        elif dtype == "bfloat16":
            import ml_dtypes  # as load_state_dict: numpy has no bfloat16

            out[param.name] = array.view(ml_dtypes.bfloat16)
        else:
            out[param.name] = array
    return out


def reconstruct_index(
    checkpoint: str | os.PathLike, output_dir: str | os.PathLike, *, index: Any = None, tag=None, dtype: str = "fp32"
) -> WriteResult:
    """Validate, then write the whole model as one ``model.safetensors`` (atomically)."""
    dtype = output_dtype(dtype)
    plan = validated_index_plan(checkpoint, index, tag)
    out = Path(output_dir)
    entries = [TensorEntry(p.name, dtype, tuple(p.shape)) for p in plan.index.parameters]
    metadata = {
        "format": "pt",
        "ckptspec.index_format_version": plan.index.format_version,
        "ckptspec.tag": plan.tag_dir.name,
        "ckptspec.dtype": dtype,
        "ckptspec.parallel": f"pp{plan.index.topology.degrees.pipeline}-tp{plan.index.topology.degrees.tensor}"
        f"-dp{plan.index.topology.degrees.data}",
    }
    out.mkdir(parents=True, exist_ok=True)
    with exclusive(out):
        recover(out)
        sweep(out)
        existing = existing_outputs(out)
        if existing.foreign:
            raise ForeignOutput(str(out / existing.foreign[0]), existing.foreign[0])
        writer = SafetensorsWriter(out / SAFETENSORS_SINGLE, entries, metadata)
        try:
            for param, array in iter_whole(plan, dtype):
                writer.begin(param.name)
                writer.write(_np().ascontiguousarray(array))
            writer.finish()
        except BaseException:
            writer.abort()
            raise
        commit(
            out,
            [(writer.tmp_path, out / SAFETENSORS_SINGLE)],
            [out / n for n in sorted(existing.ours - {SAFETENSORS_SINGLE})],
        )
    total = sum(e.nbytes for e in entries)
    return WriteResult(out, [SAFETENSORS_SINGLE], len(entries), total, None)
