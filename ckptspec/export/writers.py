"""Write a reconstruction: safetensors or torch files, split into shards like Hugging Face's, plus an index.

The output directory is held for the run (a second writer is refused, CK908), a killed run's
temporaries and half-finished commit are cleaned up first (``ckptspec._fs``), and files of an
output's name that ckptspec did not write are never touched (CK909, ``outputs``). Every file is
written under a temporary name, then all are committed together: the directory holds the earlier
output or the complete new one. Earlier outputs of either format that this run did not rewrite
are removed in the same commit. The manifest is stored once: in the index when there is one, else
in the single file's ``__metadata__``; each file's ``__metadata__`` (and the index, for all of them)
says what its tensors' bytes are (``ckptspec.sources``: fp32 masters, fp32 weights, frozen weights,
buffers). safetensors are written by ``safetensors_writer`` (no torch); ``fmt="torch"`` imports
torch, here only.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._commit import commit, recover
from .._fs import exclusive, fsync, io_point, sweep, temp_file
from ..checkpoint.embedded import SAFETENSORS_KEY as MANIFEST_KEY
from ..checkpoint.embedded import pointer_metadata
from ..errors import ForeignOutput, InputOutputError, ReconstructUnsupported
from ..format.dtypes import output_dtype
from ..location import RemotePath, is_remote, location
from .arrays import ShardReader, read_array, stream
from .model_plan import ModelPlan
from .optimizer_state import optimizer_state_temporary
from .outputs import existing_outputs
from .parallel_write import all_local, fill_parallel
from .safetensors_writer import SAFETENSORS_DTYPES, SafetensorsWriter, TensorEntry

DEFAULT_MAX_SHARD_SIZE = 5 * 1024**3
SAFETENSORS_SINGLE, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
TORCH_SINGLE, TORCH_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
PROVENANCE_KEY = "ckptspec.sources"  # what each written tensor's bytes are (plan.ORIGINS) -> its names
# A manifest larger than this goes into an index even for one file: safetensors readers refuse
# headers over 100 MB, and every reader parses the header before the first tensor.
MAX_HEADER_MANIFEST = 16 * 1024 * 1024


@dataclass
class _Shard:
    filename: str
    names: list[str] = field(default_factory=list)
    nbytes: int = 0


def _refuse_inside(out: Path, tag_dir: Path | RemotePath) -> None:
    """CK906 for an output in the tag directory being read (or below it): the weights are no part of the
    checkpoint, a sidecar would no longer list every file, and `validate` would warn (CK226) ever after."""
    if isinstance(tag_dir, Path) and out.resolve().is_relative_to(tag_dir.resolve()):
        raise InputOutputError(
            "CK906",
            f"the output is inside the checkpoint's own tag directory {tag_dir}: ckptspec does not write into a "
            "checkpoint it reads",
            "write the weights elsewhere: the save directory above the tag directory, or a directory of their own",
            str(out),
        )


def _split(sizes: list[tuple[str, int]], max_shard_size: int) -> list[list[str]]:
    """Hugging Face's greedy split: a new shard when the next tensor would overflow; big tensors alone."""
    shards: list[list[str]] = [[]]
    current = 0
    for name, size in sizes:
        if shards[-1] and current + size > max_shard_size:
            shards.append([])
            current = 0
        shards[-1].append(name)
        current += size
    return shards


def _shard_names(count: int, fmt: str) -> list[str]:
    if count == 1:
        return [SAFETENSORS_SINGLE if fmt == "safetensors" else TORCH_SINGLE]
    stem, ext = ("model", "safetensors") if fmt == "safetensors" else ("pytorch_model", "bin")
    return [f"{stem}-{i:05d}-of-{count:05d}.{ext}" for i in range(1, count + 1)]


@dataclass
class WriteResult:
    output_dir: Path | RemotePath  # a URL's is a RemotePath
    files: list[str]
    tensors: int
    nbytes: int
    index: str | None
    numel: int = 0  # elements of tensor data written (the summary of ``reconstruct``)


def write_consolidated(
    plan: ModelPlan,
    output_dir: str | os.PathLike,
    *,
    dtype: str = "fp32",
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    fmt: str = "safetensors",
    untie: bool = False,
    progress: Callable[[int], None] | None = None,
    optimizer_state: bool = False,
    jobs: int = 1,
) -> WriteResult:
    """Write the consolidated state dict; every file appears (by rename) only once all are complete.

    With ``optimizer_state``, ``optimizer.safetensors`` is one more file of the same commit (its
    bytes are not counted by ``progress``, which counts the weights). ``jobs`` > 1 fills each
    safetensors file from that many threads (local checkpoints; ``parallel_write``).
    """
    if jobs < 1:
        raise ValueError(f"jobs must be at least 1, not {jobs}")
    dtype = output_dtype(dtype)
    if fmt not in ("safetensors", "torch"):
        raise ValueError(f"unknown output format {fmt!r}")
    if is_remote(output_dir):  # built locally, then uploaded with its index (or single file) last
        from .output_dir import reconstruct_to_url

        local = reconstruct_to_url(
            str(output_dir),
            plan.tag_dir,
            lambda out: write_consolidated(
                plan,
                out,
                dtype=dtype,
                max_shard_size=max_shard_size,
                fmt=fmt,
                untie=untie,
                progress=progress,
                optimizer_state=optimizer_state,
                jobs=jobs,
            ),
        )
        local.output_dir = location(output_dir)
        return local
    out = Path(output_dir)
    _refuse_inside(out, plan.tag_dir)
    progress = progress or (lambda n: None)
    # Tied aliases: safetensors stores the owner once (the tie is in the metadata); torch files
    # keep every name, an alias sharing its owner's storage. --untie writes copies in both.
    stored = [n for n in plan.order if untie or n not in plan.aliases]
    size_of = {n: plan.output_nbytes(n, dtype) for n in plan.order}
    if fmt == "safetensors":
        for name in stored:
            if plan.output_dtype(name, dtype) not in SAFETENSORS_DTYPES:
                raise ReconstructUnsupported(
                    f"{name!r} has dtype {plan.output_dtype(name, dtype)}, which safetensors cannot hold",
                    "use --format torch",
                )
    groups = _split([(n, size_of[n]) for n in stored], max_shard_size)
    if fmt == "torch" and not untie:
        owner_shard = {n: i for i, names in enumerate(groups) for n in names}
        for alias in (n for n in plan.order if n in plan.aliases):
            groups[owner_shard[plan.aliases[alias]]].append(alias)
    shards = [
        _Shard(name, names, sum(size_of[n] for n in names if untie or n not in plan.aliases))
        for name, names in zip(_shard_names(len(groups), fmt), groups)
    ]
    metadata = plan.metadata(dtype, untie)
    # The manifest travels with the weights (a checkpoint index's whole-model plan carries none yet).
    manifest_meta = plan.document_metadata()
    total = sum(s.nbytes for s in shards)
    index_name = None
    if len(shards) > 1 or fmt == "torch" or len(manifest_meta.get(MANIFEST_KEY, "")) > MAX_HEADER_MANIFEST:
        index_name = SAFETENSORS_INDEX if fmt == "safetensors" else TORCH_INDEX
    # The manifest once: in the index when there is one (the shards name it), else in the file.
    shard_meta = {
        **metadata,
        **(pointer_metadata(manifest_meta, index_name) if index_name and manifest_meta else manifest_meta),
    }

    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    with exclusive(out):
        recover(out)  # a killed run's half-finished commit: finish it, then look at what is there
        sweep(out)
        existing = existing_outputs(out)
        if existing.foreign:
            raise ForeignOutput(str(out / existing.foreign[0]), existing.foreign[0])
        pending: list[tuple[Path, Path]] = []  # (temporary, final)
        try:
            with ShardReader(plan.file_hashes) as files:
                for shard in shards:
                    target = out / shard.filename
                    if fmt == "safetensors":
                        meta = {**shard_meta, PROVENANCE_KEY: plan.provenance(shard.names)}
                        tmp = _write_safetensors_shard(plan, shard, target, dtype, meta, files, progress, jobs)
                    else:
                        tmp = _write_torch_shard(plan, shard, target, dtype, untie, files, progress)
                    pending.append((tmp, target))
                if optimizer_state:
                    pending.append(optimizer_state_temporary(plan, out, files, lambda n: None))
                files.verify()  # remote files' hashes, from the bytes read once (before anything is committed)
            if index_name:
                weight_map = {n: s.filename for s in shards for n in s.names}
                provenance = {PROVENANCE_KEY: plan.provenance(list(weight_map))}
                index = {
                    "metadata": {"total_size": total, **metadata, **provenance, **manifest_meta},
                    "weight_map": weight_map,
                }
                pending.append((_write_temp(out / index_name, json.dumps(index, indent=2) + "\n"), out / index_name))
        except BaseException:
            for tmp, _ in pending:
                tmp.unlink(missing_ok=True)
            if created:
                with contextlib.suppress(OSError):
                    out.rmdir()  # only if still empty
            raise
        written = {final.name for _, final in pending}
        commit(out, pending, [out / name for name in sorted(existing.ours - written)])
    names = [s.filename for s in shards] + ([pending[len(shards)][1].name] if optimizer_state else [])
    tensors = len({n for s in shards for n in s.names})
    return WriteResult(out, names, tensors, total, index_name, plan.total_numel(untie))


def _write_temp(target: Path, text: str) -> Path:
    """``text`` in a finished temporary file beside ``target`` (fsynced, not yet renamed)."""
    fd, tmp = temp_file(target)
    try:
        with os.fdopen(fd, "wb") as fh:
            io_point("write")
            fh.write(text.encode("utf-8"))
            fh.flush()
            fsync(fh.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def _write_safetensors_shard(
    plan, shard: _Shard, target: Path, dtype: str, metadata, files: ShardReader, progress, jobs: int = 1
) -> Path:
    entries = []
    for name in shard.names:
        source = plan.sources[plan.aliases.get(name, name)]
        entries.append(TensorEntry(name, plan.output_dtype(name, dtype), tuple(source.shape)))
    sources = [plan.sources[plan.aliases.get(entry.name, entry.name)] for entry in entries]
    parallel = jobs > 1 and all_local(sources)
    if not parallel:
        files.plan(seg for source in sources for seg in source.segments)
    writer = SafetensorsWriter(target, entries, metadata)
    try:
        if parallel:
            fill_parallel(writer, sources, [entry.dtype for entry in entries], jobs, progress)
        else:
            for entry, source in zip(entries, sources):
                writer.begin(entry.name)
                stream(source, entry.dtype, writer, files, progress)
        writer.finish()
    except BaseException:
        writer.abort()
        raise
    return writer.tmp_path


def _write_torch_shard(
    plan, shard: _Shard, target: Path, dtype: str, untie: bool, files: ShardReader, progress
) -> Path:
    import torch

    tensors: dict[str, Any] = {}
    read = [n for n in shard.names if untie or n not in plan.aliases]  # a tied alias is its owner's tensor
    files.plan(seg for name in read for seg in plan.sources[plan.aliases.get(name, name)].segments)
    for name in shard.names:
        owner = plan.aliases.get(name, name)
        if name != owner and not untie:
            tensors[name] = tensors[owner]  # same tensor: torch.save stores the storage once
            continue
        out_dtype = plan.output_dtype(name, dtype)
        array = read_array(plan.sources[owner], out_dtype, files)
        tensors[name] = to_torch(array, out_dtype)
        progress(array.nbytes)
    fd, tmp = temp_file(target)
    try:
        with os.fdopen(fd, "wb") as fh:
            io_point("write")
            torch.save(tensors, fh)
            fh.flush()
            fsync(fh.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def torch_available() -> bool:
    """Whether ``fmt="torch"`` can run here."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def to_torch(array, dtype: str):
    import torch

    # Not np.ascontiguousarray: it turns 0-d arrays (scalar buffers) into 1-d ones.
    tensor = torch.from_numpy(array if array.flags.c_contiguous else array.copy())
    return tensor.view(torch.bfloat16) if dtype == "bfloat16" else tensor
