"""Write a reconstruction: safetensors or torch files, split into shards like Hugging Face's, plus an index.

Every file is written under a temporary name and renamed into place only once all are
complete; shards an earlier run left in the directory are removed. safetensors are written
by ``safetensors_writer`` (no torch); ``fmt="torch"`` imports torch, here only.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._fs import fsync_dir, new_file_mode, temp_file, write_atomic
from ..errors import ReconstructUnsupported
from ..format.dtypes import output_dtype
from .arrays import ShardReader, read_array, stream
from .plan import ReconstructionPlan
from .safetensors_writer import SAFETENSORS_DTYPES, SafetensorsWriter, TensorEntry

DEFAULT_MAX_SHARD_SIZE = 5 * 1024**3
SAFETENSORS_SINGLE, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
TORCH_SINGLE, TORCH_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
_SHARD_RE = {
    "safetensors": re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$"),
    "torch": re.compile(r"^pytorch_model-\d{5}-of-\d{5}\.bin$"),
}


@dataclass
class _Shard:
    filename: str
    names: list[str] = field(default_factory=list)
    nbytes: int = 0


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
    output_dir: Path
    files: list[str]
    tensors: int
    nbytes: int
    index: str | None


def write_consolidated(
    plan: ReconstructionPlan,
    output_dir: str | os.PathLike,
    *,
    dtype: str = "fp32",
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    fmt: str = "safetensors",
    untie: bool = False,
    progress: Callable[[int], None] | None = None,
) -> WriteResult:
    """Write the consolidated state dict; every file appears (by rename) only once all are complete."""
    dtype = output_dtype(dtype)
    if fmt not in ("safetensors", "torch"):
        raise ValueError(f"unknown output format {fmt!r}")
    out = Path(output_dir)
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
    total = sum(s.nbytes for s in shards)
    index_name = None
    if len(shards) > 1 or fmt == "torch":
        index_name = SAFETENSORS_INDEX if fmt == "safetensors" else TORCH_INDEX

    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    pending: list[tuple[Path, Path]] = []  # (temporary, final)
    try:
        with ShardReader() as files:
            for shard in shards:
                target = out / shard.filename
                if fmt == "safetensors":
                    tmp = _write_safetensors_shard(plan, shard, target, dtype, metadata, files, progress)
                else:
                    tmp = _write_torch_shard(plan, shard, target, dtype, untie, files, progress)
                pending.append((tmp, target))
        if index_name:
            weight_map = {n: s.filename for s in shards for n in s.names}
            index = {"metadata": {"total_size": total, **metadata}, "weight_map": weight_map}
            tmp_index = out / f".{index_name}.pending"
            write_atomic(tmp_index, (json.dumps(index, indent=2, sort_keys=False) + "\n").encode("utf-8"))
            os.chmod(tmp_index, new_file_mode())
            pending.append((tmp_index, out / index_name))
    except BaseException:
        for tmp, _ in pending:
            tmp.unlink(missing_ok=True)
        if created:
            with contextlib.suppress(OSError):
                out.rmdir()  # only if still empty
        raise
    for tmp, final in pending:
        os.replace(tmp, final)
    _remove_stale(out, fmt, {s.filename for s in shards}, index_name)
    fsync_dir(out)  # make the renames durable too
    return WriteResult(out, [s.filename for s in shards], len({n for s in shards for n in s.names}), total, index_name)


def _remove_stale(out: Path, fmt: str, written: set[str], index_name: str | None) -> None:
    """Shards of an earlier run into the same directory that this run did not overwrite."""
    single = SAFETENSORS_SINGLE if fmt == "safetensors" else TORCH_SINGLE
    index = SAFETENSORS_INDEX if fmt == "safetensors" else TORCH_INDEX
    for path in out.iterdir():
        name = path.name
        stale = _SHARD_RE[fmt].match(name) or name == single or (name == index and index_name is None)
        if stale and name not in written and path.is_file():
            path.unlink()


def _write_safetensors_shard(
    plan, shard: _Shard, target: Path, dtype: str, metadata, files: ShardReader, progress
) -> Path:
    entries = []
    for name in shard.names:
        source = plan.sources[plan.aliases.get(name, name)]
        entries.append(TensorEntry(name, plan.output_dtype(name, dtype), tuple(source.shape)))
    writer = SafetensorsWriter(target, entries, metadata)
    try:
        for entry in entries:
            writer.begin(entry.name)
            stream(plan.sources[plan.aliases.get(entry.name, entry.name)], entry.dtype, writer, files, progress)
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
            torch.save(tensors, fh)
            fh.flush()
            os.fsync(fh.fileno())
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
