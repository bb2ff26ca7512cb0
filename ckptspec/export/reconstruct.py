"""Consolidated weights from a DeepSpeed ZeRO checkpoint, without DeepSpeed or torch.

The manifest drives everything: the checkpoint is validated first, then every output
tensor is described as a list of byte ranges (``Segment``) in the shard files:

* trainable parameters (fp32 masters) through the manifest's locators: stage 1/2
  concatenate the ranks' saved partitions of a group *virtually* (a parameter's
  slice ``[offset, offset + numel)`` maps to one or two ranks' bytes), stage 3 takes
  ``[offset, offset + ceil(numel / ws))`` from every rank and trims to ``numel``;
* frozen parameters, buffers and aliases from the model-states files: the
  ``TensorRef`` of ``module`` / ``frozen_param_fragments`` gives the storage member
  and, through the zip directory, the byte range (stage-3 frozen fragments are
  concatenated over ranks and trimmed).

Only those bytes are read (never the Adam moments), tensor by tensor, in chunks; a
copy without dtype change goes file-to-file in the kernel (``copy_file_range``). The
output is written as safetensors (``ckptspec.safetensors_writer``) or torch files
under temporary names and renamed into place at the end.

Torch-free: torch ``.pt`` zip members are stored uncompressed, so numpy (only for
dtype conversion) and the standard library suffice. ``framework="torch"`` wraps the
same arrays with ``torch.from_numpy``, so both frameworks give the same bits.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..checkpoint import torchfile
from .._fs import fsync_dir, new_file_mode, temp_file, write_atomic
from ..format.codec import dumps
from ..checkpoint.states import StateCache, unreadable
from ..deepspeed.validate import validate_checkpoint as validate_shards
from ..errors import (
    CheckpointInvalid, CkptspecError, InvalidCheckpoint, ReconstructMismatch, ReconstructUnsupported, TorchFileError,
    TruncatedFile,
)
from ..findings import Finding, has_errors
from ..format.models import Manifest
from ..format.dtypes import FLOATING, ITEMSIZE, output_dtype
from .safetensors_writer import SAFETENSORS_DTYPES, SafetensorsWriter, TensorEntry

__all__ = [
    "DEFAULT_MAX_SHARD_SIZE", "Segment", "TensorSource", "ReconstructionPlan", "CheckpointInvalid",
    "validate_checkpoint", "plan_reconstruction", "load_state_dict", "write_consolidated",
    "reconstruct", "load_consolidated",
]

DEFAULT_MAX_SHARD_SIZE = 5 * 1024**3
CHUNK_BYTES = 16 << 20  # dtype conversion works on at most this many source bytes at once
SAFETENSORS_SINGLE, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
TORCH_SINGLE, TORCH_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
_SHARD_RE = {
    "safetensors": re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$"),
    "torch": re.compile(r"^pytorch_model-\d{5}-of-\d{5}\.bin$"),
}


# --------------------------------------------------------------------------- validation


def validate_checkpoint(checkpoint: str | os.PathLike, manifest: Any = None, tag: str | None = None) -> tuple[Manifest | None, list[Finding]]:
    """Validate the shard files (against ``manifest``, a path or ``Manifest``, if given) before reading.

    Returns ``(manifest, findings)``; the manifest is None when none could be had.
    Raises ``CkptspecError`` when the checkpoint or manifest cannot be read at all.
    """
    if manifest is not None and not isinstance(manifest, Manifest):
        from ..format.validate import validate_file

        report = validate_file(manifest)
        if not report.ok or report.manifest is None:
            return None, list(report.findings)
        manifest = report.manifest
    return validate_shards(checkpoint, manifest=manifest, tag=tag)


# --------------------------------------------------------------------------- plan


@dataclass(frozen=True)
class Segment:
    """``nbytes`` bytes at absolute ``offset`` of ``path``."""

    path: Path
    offset: int
    nbytes: int


@dataclass
class TensorSource:
    """Where one output tensor's bytes are: its segments, concatenated, are the flat tensor."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # dtype of the bytes on disk
    segments: list[Segment]
    role: str  # "trainable" (fp32 master), "frozen" (model dtype), "buffer"

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class ReconstructionPlan:
    manifest: Manifest
    tag_dir: Path
    sources: dict[str, TensorSource]  # owners: trainable, frozen, buffers
    aliases: dict[str, str]  # alias -> owner
    order: list[str]  # every output name (owners and aliases), in the model's state_dict order

    def output_dtype(self, name: str, dtype: str) -> str:
        """Floating tensors are cast to ``dtype``; integer and bool buffers keep theirs."""
        src = self.sources[self.aliases.get(name, name)].dtype
        return dtype if src in FLOATING else src

    def output_nbytes(self, name: str, dtype: str) -> int:
        """Bytes of ``name`` in the output when floating tensors are written as ``dtype``."""
        return self.sources[self.aliases.get(name, name)].numel * ITEMSIZE[self.output_dtype(name, dtype)]

    def total_nbytes(self, dtype: str, untie: bool) -> int:
        """Bytes of tensor data in the output (a tied alias is stored once unless ``untie``)."""
        return sum(self.output_nbytes(n, dtype) for n in self.order if untie or n not in self.aliases)

    @property
    def manifest_sha256(self) -> str:
        # On demand: encoding a 100k-param manifest takes seconds, and metadata() encodes it anyway.
        return manifest_digest(self.manifest)

    def metadata(self, dtype: str, untied: bool) -> dict[str, str]:
        """The string map written to ``__metadata__`` and to the index's ``metadata``."""
        from .._version import __version__

        from ..checkpoint.embedded import safetensors_metadata

        frozen = {s.name: s.dtype for s in self.sources.values() if s.role == "frozen"}
        return {
            # The manifest itself travels with the weights (`ckptspec extract` prints it), with
            # "ckptspec.manifest_sha256", the SHA-256 of those canonical bytes.
            **safetensors_metadata(self.manifest),
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


def manifest_digest(manifest: Manifest) -> str:
    """SHA-256 of the canonical JSON bytes (``ckptspec generate`` output for the same manifest)."""
    return hashlib.sha256(dumps(manifest)).hexdigest()


def plan_reconstruction(checkpoint: str | os.PathLike, manifest: Manifest, tag: str | None = None) -> ReconstructionPlan:
    """Byte ranges of every output tensor. Reads only zip directories and ``data.pkl`` records."""
    from ..deepspeed.describe import resolve_tag_dir, scan_tag_dir

    tag_dir = resolve_tag_dir(checkpoint, tag)
    model_files = _model_files(manifest, tag_dir, scan_tag_dir)
    first_rank = min(model_files)
    states = StateCache()
    metadata, members = states.state, states.members

    first_model = metadata(model_files[first_rank])
    module = first_model.get("module") if isinstance(first_model, dict) else None
    module = module if isinstance(module, dict) else {}

    sources: dict[str, TensorSource] = {}
    locators = _locators(manifest, tag_dir, checkpoint, tag)
    for g, group in enumerate(manifest.groups):
        group_dtype = None  # one scan of the locators per group, not one per param
        for param in group.params:
            group_dtype = group_dtype or _group_dtype(locators, g, param.name)
            sources[param.name] = TensorSource(param.name, tuple(param.shape), group_dtype,
                                               _param_segments(group, g, param, locators), "trainable")

    for frozen in manifest.frozen:
        if frozen.stored_in == "partitioned_fragments":
            # Stage 3: rank r's fragment is [r * share, (r + 1) * share) of the flat param;
            # concatenated over ranks and trimmed to numel (the tail padding is garbage).
            share = -(-frozen.numel // len(model_files))
            segments, dtypes = [], set()
            for r, path in sorted(model_files.items()):
                take = max(0, min(share, frozen.numel - r * share))
                ref = _tensor(metadata(path), "frozen_param_fragments", frozen.name, path)
                dtypes.add(ref.dtype)
                segments += _ref_segments(ref, path, members(path), take, frozen.name, exact=False)
            if len(dtypes) != 1:
                raise ReconstructMismatch(f"the fragments of {frozen.name!r} have dtypes {sorted(dtypes)}", tag_dir)
            dtype = dtypes.pop()
        else:
            path = model_files[first_rank]
            holder = "module" if frozen.stored_in == "module" else "frozen_param_fragments"
            ref = _tensor(metadata(path), holder, frozen.name, path)
            dtype = ref.dtype
            segments = _ref_segments(ref, path, members(path), frozen.numel, frozen.name)
        sources[frozen.name] = TensorSource(frozen.name, tuple(frozen.shape), dtype, segments, "frozen")

    for buffer in manifest.buffers:
        path = model_files[first_rank]
        ref = _tensor(metadata(path), "module", buffer.name, path)
        if ref.dtype != buffer.dtype:
            raise ReconstructMismatch(f"buffer {buffer.name!r} is {ref.dtype}, the manifest says {buffer.dtype}", path)
        sources[buffer.name] = TensorSource(buffer.name, tuple(buffer.shape), ref.dtype,
                                            _ref_segments(ref, path, members(path), math.prod(buffer.shape), buffer.name), "buffer")

    aliases = {a.name: a.owner for a in manifest.aliases}
    for alias in manifest.aliases:
        owner = sources.get(alias.owner)
        if owner is None or list(owner.shape) != list(alias.shape):
            raise ReconstructMismatch(f"alias {alias.name!r} has no owner {alias.owner!r} of shape {list(alias.shape)}", tag_dir)

    in_module = [name for name in module if name in sources or name in aliases]
    seen = set(in_module)
    order = in_module + [name for name in [*sources, *aliases] if name not in seen]
    return ReconstructionPlan(manifest, tag_dir, sources, aliases, order)


def _inside(tag_dir: Path, relative: str) -> Path:
    path = (tag_dir / relative).resolve()
    if not path.is_relative_to(tag_dir.resolve()):
        raise InvalidCheckpoint("CK113", f"file path {relative!r} leaves the checkpoint directory",
                                "use paths relative to the tag directory", relative)
    return path


def _model_files(manifest: Manifest, tag_dir: Path, scan) -> dict[int, Path]:
    files = {shard.ranks[0] if shard.ranks else 0: _inside(tag_dir, shard.path)
             for shard in manifest.files if shard.role == "model_states"}
    if not files:  # a manifest without files (e.g. from the live engine): find them on disk
        files = dict(scan(tag_dir).model_files)
    return files


def _locators(manifest: Manifest, tag_dir: Path, checkpoint, tag) -> dict[tuple[int, int], tuple[Path, Any]]:
    """(group, rank) -> (file, locator); from the manifest, or the directory when it has none."""
    found = {(loc.group, loc.rank): (_inside(tag_dir, shard.path), loc)
             for shard in manifest.files if shard.role == "optimizer_states" for loc in shard.partitions}
    needed = {(g, r) for g, group in enumerate(manifest.groups) for r in range(group.partition_count)}
    if needed - found.keys():
        from ..deepspeed.describe import manifest_from_checkpoint

        disk = manifest_from_checkpoint(checkpoint, tag)
        for shard in disk.files:
            if shard.role == "optimizer_states":
                for loc in shard.partitions:
                    found.setdefault((loc.group, loc.rank), (_inside(tag_dir, shard.path), loc))
    missing = sorted(needed - found.keys())
    if missing:
        g, r = missing[0]
        raise ReconstructMismatch(f"no fp32 partition for group {g} on rank {r} ({len(missing)} missing)", tag_dir)
    return found


def _group_dtype(locators, g: int, name: str) -> str:
    dtypes = {loc.dtype for (group, _), (_, loc) in locators.items() if group == g}
    if len(dtypes) != 1:
        raise ReconstructMismatch(f"{name}: the partitions of group {g} have dtypes {sorted(dtypes)}")
    return dtypes.pop()


def _locator_segment(path: Path, loc, start: int, count: int) -> Segment:
    """``count`` elements from element ``start`` of the locator's partition."""
    item = ITEMSIZE[loc.dtype]
    if start < 0 or start + count > loc.numel:
        raise ReconstructMismatch(f"elements [{start}, {start + count}) fall outside rank {loc.rank}'s "
                        f"{loc.numel}-element partition of group {loc.group}", path)
    return Segment(path, loc.data_offset + (loc.element_offset + start) * item, count * item)


def _param_segments(group, g: int, param, locators) -> list[Segment]:
    segments: list[Segment] = []
    if param.numel == 0:
        return segments
    if group.partitioning == "flat":
        # Virtual concatenation of the ranks' saved partitions: rank r holds the flat
        # range [r * partition_numel, r * partition_numel + saved).
        start, end = param.offset, param.offset + param.numel
        for r in range(group.partition_count):
            path, loc = locators[(g, r)]
            lo = r * group.partition_numel
            hi = lo + loc.numel
            a, b = max(start, lo), min(end, hi)
            if a < b:
                segments.append(_locator_segment(path, loc, a - lo, b - a))
    else:
        # Per-param partitioning: rank r holds [r * share, (r + 1) * share) of the param at
        # `offset` in its flat group; the last shares hold padding, trimmed here.
        share = (param.numel + param.padding) // group.partition_count
        for r in range(group.partition_count):
            take = max(0, min(share, param.numel - r * share))
            if take:
                path, loc = locators[(g, r)]
                segments.append(_locator_segment(path, loc, param.offset, take))
    got = sum(s.nbytes for s in segments) // ITEMSIZE[locators[(g, 0)][1].dtype]
    if got != param.numel:
        raise ReconstructMismatch(f"{param.name}: the partitions hold {got} of its {param.numel} elements")
    return segments


def _tensor(state: Any, holder: str, name: str, path: Path) -> torchfile.TensorRef:
    table = state.get(holder) if isinstance(state, dict) else None
    ref = table.get(name) if isinstance(table, dict) else None
    if not isinstance(ref, torchfile.TensorRef):
        raise ReconstructMismatch(f"{name!r} is not a tensor in '{holder}'", path)
    return ref


def _ref_segments(ref: torchfile.TensorRef, path: Path, members: dict, numel: int, name: str, exact: bool = True) -> list[Segment]:
    """The ``numel`` elements of a contiguous tensor in a torch zip file (its first ``numel`` if not ``exact``)."""
    if (ref.numel != numel) if exact else (ref.numel < numel):
        raise ReconstructMismatch(f"{name!r} holds {ref.numel} elements, {numel} expected", path)
    if numel == 0:
        return []
    if not ref.is_contiguous():
        raise ReconstructUnsupported(f"{name!r} is stored as a non-contiguous view", "save the model with contiguous tensors", path)
    if ref.storage.member not in members:
        raise ReconstructMismatch(f"storage {ref.storage.member} of {name!r} is missing", path)
    try:
        offset, _ = torchfile.tensor_byte_range(ref, members)
    except TorchFileError as exc:
        raise unreadable(TruncatedFile(path, f"{name!r}: {exc.reason}")) from None
    return [Segment(path, offset, numel * ref.storage.itemsize)]


# --------------------------------------------------------------------------- reading and dtype conversion


def _np():
    try:
        import numpy
    except ImportError:  # pragma: no cover - environment problem
        raise ReconstructUnsupported("converting dtypes needs numpy", "pip install numpy") from None
    return numpy


def _np_dtype(dtype: str):
    np = _np()
    table = {"float64": np.float64, "float32": np.float32, "float16": np.float16, "bfloat16": np.uint16,
             "int64": np.int64, "int32": np.int32, "int16": np.int16, "int8": np.int8, "uint8": np.uint8,
             "bool": np.bool_, "complex64": np.complex64, "complex128": np.complex128}
    if dtype not in table:
        raise ReconstructUnsupported(f"tensors of dtype {dtype} cannot be converted without torch",
                           "use --dtype matching the stored dtype, or a float, integer or bool dtype")
    return np.dtype(table[dtype]).newbyteorder("<")


def convert(array, src: str, dst: str):
    """Cast a flat little-endian array of manifest dtype ``src`` to ``dst`` like torch's ``.to()``.

    bfloat16 is carried as uint16 bit patterns (numpy has no bfloat16): widening is
    ``bits << 16``; narrowing rounds to nearest even (NaN -> 0x7FC0, as c10::BFloat16).
    """
    np = _np()
    if src == dst:
        return array
    if src == "bfloat16":
        array = (array.astype(np.uint32) << 16).view(np.float32)
        src = "float32"
        if dst == "float32":
            return array
    if dst == "bfloat16":
        f32 = array if src == "float32" else array.astype(np.float32)
        bits = f32.view(np.uint32)
        rounded = bits >> 16  # in place from here on: one temporary per chunk
        rounded &= 1
        rounded += 0x7FFF
        rounded += bits
        rounded >>= 16
        out = rounded.astype(np.uint16)
        nan = np.isnan(f32)
        if nan.any():
            out[nan] = 0x7FC0
        return out
    with np.errstate(over="ignore"):  # out-of-range values become inf, as in torch
        return array.astype(_np_dtype(dst))


class _Files:
    """Open file descriptors, one per shard file, read with pread (no mmap: RSS stays flat)."""

    def __init__(self):
        self._fds: dict[Path, int] = {}

    def fd(self, path: Path) -> int:
        if path not in self._fds:
            try:
                self._fds[path] = os.open(path, os.O_RDONLY)
            except OSError as exc:
                raise CkptspecError("CK901", f"cannot read: {exc.strerror}", "check the file exists and is readable", str(path)) from None
        return self._fds[path]

    def read_into(self, segment: Segment, out: memoryview) -> None:
        fd, done = self.fd(segment.path), 0
        while done < segment.nbytes:
            n = os.preadv(fd, [out[done:segment.nbytes]], segment.offset + done)
            if n <= 0:
                raise unreadable(TruncatedFile(segment.path, f"file ends before byte {segment.offset + segment.nbytes}"))
            done += n

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> "_Files":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_array(source: TensorSource, dtype: str, files: _Files):
    """The whole tensor as a numpy array of ``dtype`` (bfloat16 as uint16 bits), in its shape."""
    np = _np()
    raw = np.empty(source.numel, dtype=_np_dtype(source.dtype))
    view, pos = memoryview(raw).cast("B"), 0
    for segment in source.segments:
        files.read_into(segment, view[pos:pos + segment.nbytes])
        pos += segment.nbytes
    return convert(raw, source.dtype, dtype).reshape(source.shape)


def _stream(source: TensorSource, dtype: str, writer: SafetensorsWriter, files: _Files, progress) -> None:
    """Append the tensor to ``writer``: a kernel copy when no cast is needed, else chunked casts."""
    if source.dtype == dtype:
        for segment in source.segments:
            writer.copy_range(files.fd(segment.path), segment.offset, segment.nbytes)
            progress(segment.nbytes)
        return
    np = _np()
    item = ITEMSIZE[source.dtype]
    chunk = max(item, CHUNK_BYTES // item * item)
    buffer = np.empty(chunk // item, dtype=_np_dtype(source.dtype))
    view = memoryview(buffer).cast("B")
    for segment in source.segments:
        for start in range(0, segment.nbytes, chunk):
            n = min(chunk, segment.nbytes - start)
            files.read_into(Segment(segment.path, segment.offset + start, n), view[:n])
            out = convert(buffer[: n // item], source.dtype, dtype)
            writer.write(np.ascontiguousarray(out))
            progress(n // item * ITEMSIZE[dtype])


# --------------------------------------------------------------------------- output


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


def write_consolidated(plan: ReconstructionPlan, output_dir: str | os.PathLike, *, dtype: str = "fp32",
                       max_shard_size: int = DEFAULT_MAX_SHARD_SIZE, fmt: str = "safetensors", untie: bool = False,
                       progress: Callable[[int], None] | None = None) -> WriteResult:
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
                raise ReconstructUnsupported(f"{name!r} has dtype {plan.output_dtype(name, dtype)}, which safetensors cannot hold",
                                   "use --format torch")
    groups = _split([(n, size_of[n]) for n in stored], max_shard_size)
    if fmt == "torch" and not untie:
        owner_shard = {n: i for i, names in enumerate(groups) for n in names}
        for alias in (n for n in plan.order if n in plan.aliases):
            groups[owner_shard[plan.aliases[alias]]].append(alias)
    shards = [_Shard(name, names, sum(size_of[n] for n in names if untie or n not in plan.aliases))
              for name, names in zip(_shard_names(len(groups), fmt), groups)]
    metadata = plan.metadata(dtype, untie)
    total = sum(s.nbytes for s in shards)
    index_name = None
    if len(shards) > 1 or fmt == "torch":
        index_name = SAFETENSORS_INDEX if fmt == "safetensors" else TORCH_INDEX

    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    pending: list[tuple[Path, Path]] = []  # (temporary, final)
    try:
        with _Files() as files:
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


def _write_safetensors_shard(plan, shard: _Shard, target: Path, dtype: str, metadata, files: _Files, progress) -> Path:
    entries = []
    for name in shard.names:
        source = plan.sources[plan.aliases.get(name, name)]
        entries.append(TensorEntry(name, plan.output_dtype(name, dtype), tuple(source.shape)))
    writer = SafetensorsWriter(target, entries, metadata)
    try:
        for entry in entries:
            writer.begin(entry.name)
            _stream(plan.sources[plan.aliases.get(entry.name, entry.name)], entry.dtype, writer, files, progress)
        writer.finish()
    except BaseException:
        writer.abort()
        raise
    return writer.tmp_path


def _write_torch_shard(plan, shard: _Shard, target: Path, dtype: str, untie: bool, files: _Files, progress) -> Path:
    import torch

    tensors: dict[str, Any] = {}
    for name in shard.names:
        owner = plan.aliases.get(name, name)
        if name != owner and not untie:
            tensors[name] = tensors[owner]  # same tensor: torch.save stores the storage once
            continue
        out_dtype = plan.output_dtype(name, dtype)
        array = read_array(plan.sources[owner], out_dtype, files)
        tensors[name] = _to_torch(array, out_dtype)
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


def _to_torch(array, dtype: str):
    import torch

    # Not np.ascontiguousarray: it turns 0-d arrays (scalar buffers) into 1-d ones.
    tensor = torch.from_numpy(array if array.flags.c_contiguous else array.copy())
    return tensor.view(torch.bfloat16) if dtype == "bfloat16" else tensor


# --------------------------------------------------------------------------- public API


def _checked_manifest(checkpoint, manifest, tag) -> Manifest:
    found, findings = validate_checkpoint(checkpoint, manifest=manifest, tag=tag)
    if found is None or has_errors(findings):
        raise CheckpointInvalid(findings, str(checkpoint))
    return found


def load_state_dict(checkpoint: str | os.PathLike, framework: str = "torch", *, dtype: Any = "fp32",
                    manifest: Any = None, tag: str | None = None) -> dict[str, Any]:
    """The full state dict of a ZeRO checkpoint: trainable (fp32 masters), frozen, buffers, aliases.

    Validates the checkpoint first (raises ``CheckpointInvalid`` with the findings).
    ``framework="numpy"`` needs only numpy; bfloat16 arrays are then returned as
    ``ml_dtypes.bfloat16`` when ``ml_dtypes`` is installed and refused otherwise.
    Aliases are the same object as their owner, as in the model.
    """
    if framework not in ("torch", "numpy"):
        raise ValueError(f"framework must be 'torch' or 'numpy', not {framework!r}")
    dtype = output_dtype(dtype)
    plan = plan_reconstruction(checkpoint, _checked_manifest(checkpoint, manifest, tag), tag)
    bf16_view = None
    if framework == "numpy" and dtype == "bfloat16":
        try:
            import ml_dtypes
        except ImportError:
            raise ValueError("numpy has no bfloat16: install ml_dtypes, or use dtype='fp32'") from None
        bf16_view = ml_dtypes.bfloat16
    out: dict[str, Any] = {}
    with _Files() as files:
        for name in plan.order:
            if name in plan.aliases:
                continue
            out_dtype = plan.output_dtype(name, dtype)
            array = read_array(plan.sources[name], out_dtype, files)
            if framework == "torch":
                out[name] = _to_torch(array, out_dtype)
            else:
                out[name] = array.view(bf16_view) if out_dtype == "bfloat16" else array
    return {name: out[plan.aliases.get(name, name)] for name in plan.order}


def reconstruct(checkpoint: str | os.PathLike, output_dir: str | os.PathLike, *, manifest: Any = None,
                tag: str | None = None, dtype: str = "fp32", max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
                fmt: str = "safetensors", untie: bool = False, progress: Callable[[int], None] | None = None) -> WriteResult:
    """Validate, then write the consolidated weights to ``output_dir`` (see ``write_consolidated``)."""
    plan = plan_reconstruction(checkpoint, _checked_manifest(checkpoint, manifest, tag), tag)
    return write_consolidated(plan, output_dir, dtype=dtype, max_shard_size=max_shard_size, fmt=fmt,
                              untie=untie, progress=progress)


def load_consolidated(output_dir: str | os.PathLike, framework: str = "torch") -> dict[str, Any]:
    """Read ``reconstruct`` safetensors output back, re-tying aliases recorded in the metadata.

    The result is a state dict that ``module.load_state_dict`` accepts (tied names
    share one tensor), whether or not the output was written with ``--untie``.
    """
    from safetensors import safe_open

    out = Path(output_dir)
    index = out / SAFETENSORS_INDEX
    files = sorted(set(json.loads(index.read_text("utf-8"))["weight_map"].values())) if index.exists() else [SAFETENSORS_SINGLE]
    state: dict[str, Any] = {}
    aliases: dict[str, str] = {}
    for filename in files:
        with safe_open(out / filename, framework="pt" if framework == "torch" else "np") as f:
            aliases.update(json.loads((f.metadata() or {}).get("ckptspec.aliases", "{}")))
            for key in f.keys():
                state[key] = f.get_tensor(key)
    for alias, owner in aliases.items():
        state.setdefault(alias, state[owner])
    return state


def progress_printer(total: int, enabled: bool) -> tuple[Callable[[int], None], Callable[[], None]]:
    """(update, close) for a byte progress bar on stderr; no-ops unless ``enabled``."""
    if not enabled:
        return (lambda n: None), (lambda: None)
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    if tqdm is not None:
        bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="reconstruct", file=sys.stderr, leave=False)
        return bar.update, bar.close
    state = {"done": 0, "shown": -1}

    def update(n: int) -> None:
        state["done"] += n
        percent = int(100 * state["done"] / total) if total else 100
        if percent != state["shown"]:
            state["shown"] = percent
            sys.stderr.write(f"\rreconstruct {percent:3d}% ({state['done'] / 2**20:.0f}/{total / 2**20:.0f} MiB)")
            sys.stderr.flush()

    def close() -> None:
        sys.stderr.write("\r\033[K")
        sys.stderr.flush()

    return update, close
