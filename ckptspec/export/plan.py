"""The reconstruction plan: where every output tensor's bytes are in a validated checkpoint's files.

The manifest drives everything: every output tensor is described as a list of byte ranges
(``Segment``) in the shard files:

* trainable parameters (fp32 masters) through the manifest's locators: stage 1/2
  concatenate the ranks' saved partitions of a group *virtually* (a parameter's
  slice ``[offset, offset + numel)`` maps to one or two ranks' bytes), stage 3 takes
  ``[offset, offset + ceil(numel / ws))`` from every rank and trims to ``numel``;
* frozen parameters and buffers through format 1.1's named locators (``files[].tensors``:
  stage-3 fragments concatenated in rank order), or, for a 1.0 manifest, from the
  model-states files: the ``TensorRef`` of ``module`` / ``frozen_param_fragments`` gives the
  storage member and, through the zip directory, the byte range (stage-3 frozen fragments are
  concatenated over ranks and trimmed); aliases are their owner.

A 1.1 manifest's tensor digests travel with each source and are checked as its bytes are read.

Only ``data.pkl`` records and zip directories are read here, through the ``StateCache``
validation filled; the bytes are read by ``arrays``.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from ..checkpoint.states import StateCache, unreadable
from ..checkpoint.torchfile import TensorRef, tensor_byte_range
from ..deepspeed.describe.zero import partition_locators
from ..deepspeed.layout.tag_dir import resolve_tag_dir, scan_tag_dir
from ..errors import InvalidCheckpoint, ReconstructMismatch, ReconstructUnsupported, TorchFileError, TruncatedFile
from ..format.dtypes import ITEMSIZE
from ..format.models import Manifest
from ..format.paths import join_inside
from ..location import RemotePath
from .model_plan import ReconstructionPlan, Segment, TensorSource


def plan_reconstruction(
    checkpoint: str | os.PathLike,
    manifest: Manifest,
    tag: str | None = None,
    *,
    states: StateCache | None = None,
    hashes_in_stream: bool = False,
) -> ReconstructionPlan:
    """Byte ranges of every output tensor. Reads only zip directories and ``data.pkl`` records.

    ``states``: the files validation already read (``validate_checkpoint(..., states=)``);
    a file not read yet is read here, once. ``hashes_in_stream``: validation did not check the
    recorded hashes of the (remote) files; the reader must, as it reads them (``plan.file_hashes``:
    ``ShardReader(plan.file_hashes)``, then ``verify()``), so that each byte is fetched once.
    """
    tag_dir = resolve_tag_dir(checkpoint, tag)
    model_files = _model_files(manifest, tag_dir)
    first_rank = min(model_files)
    states = states if states is not None else StateCache()
    metadata, members = states.state, states.members

    first_model = metadata(model_files[first_rank])
    module = first_model.get("module") if isinstance(first_model, dict) else None
    module = module if isinstance(module, dict) else {}

    sources: dict[str, TensorSource] = {}
    locators = _locators(manifest, tag_dir, states)
    for g, group in enumerate(manifest.groups):
        group_dtype = None  # one scan of the locators per group, not one per param
        for param in group.params:
            group_dtype = group_dtype or _group_dtype(locators, g, param.name)
            sources[param.name] = TensorSource(
                param.name,
                tuple(param.shape),
                group_dtype,
                _param_segments(group, g, param, locators),
                "trainable",
                _sha256(param.digest),
            )

    # Frozen parameters and buffers: the byte ranges the files' own metadata give; with format 1.1's
    # locators, theirs, which must be the same ranges (a file changed since validation: CK401).
    named = _named_locators(manifest, tag_dir)
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
        if frozen.name in named:
            dtype, segments = _same_as_located(named[frozen.name], frozen.numel, frozen.name, tag_dir, dtype, segments)
        sources[frozen.name] = TensorSource(
            frozen.name, tuple(frozen.shape), dtype, segments, "frozen", _sha256(frozen.digest)
        )

    for buffer in manifest.buffers:
        sources[buffer.name] = buffer_source(buffer, model_files[first_rank], states, named.get(buffer.name), tag_dir)

    aliases = {a.name: a.owner for a in manifest.aliases}
    for alias in manifest.aliases:
        owner = sources.get(alias.owner)
        if owner is None or list(owner.shape) != list(alias.shape):
            raise ReconstructMismatch(
                f"alias {alias.name!r} has no owner {alias.owner!r} of shape {list(alias.shape)}", tag_dir
            )

    in_module = [name for name in module if name in sources or name in aliases]
    seen = set(in_module)
    order = in_module + [name for name in [*sources, *aliases] if name not in seen]
    hashes = {}
    if hashes_in_stream and isinstance(tag_dir, RemotePath):
        hashes = {tag_dir / f.path: f.hash for f in manifest.files if f.hash is not None}
    return ReconstructionPlan(tag_dir, sources, aliases, order, hashes, manifest=manifest)


def buffer_source(
    buffer, path: Path | RemotePath, states: StateCache, located=None, tag_dir: Path | RemotePath | None = None
) -> TensorSource:
    """A persistent buffer: ``module[name]`` of the model states ``path`` (with format 1.1's locators
    ``located``, which must give the same bytes)."""
    numel = math.prod(buffer.shape)
    ref = _tensor(states.state(path), "module", buffer.name, path)
    if ref.dtype != buffer.dtype:
        raise ReconstructMismatch(f"buffer {buffer.name!r} is {ref.dtype}, the manifest says {buffer.dtype}", path)
    if list(ref.shape) != list(buffer.shape):
        raise ReconstructMismatch(
            f"buffer {buffer.name!r} has shape {list(ref.shape)}, the manifest says {list(buffer.shape)}", path
        )
    dtype, segments = ref.dtype, _ref_segments(ref, path, states.members(path), numel, buffer.name)
    if located:
        assert tag_dir is not None  # given with the locators (plan_reconstruction)
        dtype, segments = _same_as_located(located, numel, buffer.name, tag_dir, dtype, segments)
    return TensorSource(buffer.name, tuple(buffer.shape), dtype, segments, "buffer", _sha256(buffer.digest))


def _sha256(digest) -> str | None:
    return digest.sha256 if digest is not None else None


def _named_locators(
    manifest: Manifest, tag_dir: Path | RemotePath
) -> dict[str, list[tuple[int, Path | RemotePath, Any]]]:
    """Name -> (rank, file, locator) of format 1.1's named tensor locators, in rank order."""
    found: dict[str, list[tuple[int, Path | RemotePath, Any]]] = {}
    for shard in manifest.files:
        for loc in shard.tensors or ():
            rank = shard.ranks[0] if len(shard.ranks) == 1 else 0
            found.setdefault(loc.name, []).append((rank, _inside(tag_dir, shard.path), loc))
    return {name: sorted(entries, key=lambda e: e[0]) for name, entries in found.items()}


def _same_as_located(entries, numel: int, name: str, tag_dir: Path | RemotePath, dtype: str, segments: list[Segment]):
    """The (dtype, segments) of a tensor's 1.1 locators, which must be the files' own."""
    located = _located_segments(entries, numel, name, tag_dir)
    if located != (dtype, segments):
        raise ReconstructMismatch(f"{name!r}: the manifest's locators no longer match the file", tag_dir)
    return located


def _located_segments(entries, numel: int, name: str, tag_dir: Path | RemotePath) -> tuple[str, list[Segment]]:
    """(dtype, segments) of a tensor whose locators hold its real elements back to back (rank order)."""
    dtypes = {loc.dtype for _, _, loc in entries}
    held = sum(loc.numel for _, _, loc in entries)
    if len(dtypes) != 1 or held != numel:
        raise ReconstructMismatch(f"the locators of {name!r} hold {held} elements of {sorted(dtypes)}, not {numel}")
    dtype = dtypes.pop()
    return dtype, [_locator_segment(path, loc, 0, loc.numel) for _, path, loc in entries if loc.numel]


def _inside(tag_dir: Path | RemotePath, relative: str) -> Path | RemotePath:
    """The file a manifest path names; a symbolic link is read where it leads (format/paths.py)."""
    path = join_inside(tag_dir, relative)
    if path is None:  # the rules refuse such a manifest first; a plan of an unvalidated one stops here
        raise InvalidCheckpoint(
            "CK113",
            f"path {relative!r} is not a plain relative path inside the checkpoint",
            "use forward-slash paths relative to the checkpoint directory",
            relative,
        )
    return path


def _model_files(manifest: Manifest, tag_dir: Path | RemotePath) -> dict[int, Path | RemotePath]:
    files = {
        shard.ranks[0] if shard.ranks else 0: _inside(tag_dir, shard.path)
        for shard in manifest.files
        if shard.role == "model_states"
    }
    if not files:  # a manifest without files (e.g. from the live engine): find them on disk
        files = dict(scan_tag_dir(tag_dir).model_files)
    return files


def _locators(
    manifest: Manifest, tag_dir: Path | RemotePath, states: StateCache
) -> dict[tuple[int, int], tuple[Path | RemotePath, Any]]:
    """(group, rank) -> (file, locator); from the manifest, or the optimizer files when it has none."""
    found = {
        (loc.group, loc.rank): (_inside(tag_dir, shard.path), loc)
        for shard in manifest.files
        if shard.role == "optimizer_states"
        for loc in shard.partitions
    }
    needed = {(g, r) for g, group in enumerate(manifest.groups) for r in range(group.partition_count)}
    if needed - found.keys():
        for rank, path in scan_tag_dir(tag_dir).optim_files.items():
            for loc in partition_locators(path, rank, manifest.layout.zero_stage, states):
                found.setdefault((loc.group, loc.rank), (_inside(tag_dir, path.name), loc))
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
    """``count`` elements from element ``start`` of the locator's partition (or tensor)."""
    item = ITEMSIZE[loc.dtype]
    if start < 0 or start + count > loc.numel:
        raise ReconstructMismatch(
            f"elements [{start}, {start + count}) fall outside the {loc.numel} elements located at "
            f"{loc.member} (byte {loc.data_offset})",
            path,
        )
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


def _tensor(state: Any, holder: str, name: str, path: Path | RemotePath) -> TensorRef:
    table = state.get(holder) if isinstance(state, dict) else None
    ref = table.get(name) if isinstance(table, dict) else None
    if not isinstance(ref, TensorRef):
        raise ReconstructMismatch(f"{name!r} is not a tensor in '{holder}'", path)
    return ref


def ref_source(name: str, ref: TensorRef, path: Path | RemotePath, states: StateCache, role: str) -> TensorSource:
    """A whole tensor saved as it is (a ``TensorRef`` of ``path``'s pickle: a pipeline layer file's)."""
    segments = _ref_segments(ref, path, states.members(path), math.prod(ref.shape), name)
    return TensorSource(name, tuple(ref.shape), ref.dtype, segments, role)


def _ref_segments(
    ref: TensorRef, path: Path | RemotePath, members: dict, numel: int, name: str, exact: bool = True
) -> list[Segment]:
    """The ``numel`` elements of a contiguous tensor in a torch zip file (its first ``numel`` if not ``exact``)."""
    if (ref.numel != numel) if exact else (ref.numel < numel):
        raise ReconstructMismatch(f"{name!r} holds {ref.numel} elements, {numel} expected", path)
    if numel == 0:
        return []
    if not ref.is_contiguous():
        raise ReconstructUnsupported(
            f"{name!r} is stored as a non-contiguous view", "save the model with contiguous tensors", path
        )
    if ref.storage.member not in members:
        raise ReconstructMismatch(f"storage {ref.storage.member} of {name!r} is missing", path)
    try:
        offset, _ = tensor_byte_range(ref, members)
    except TorchFileError as exc:
        raise unreadable(TruncatedFile(path, f"{name!r}: {exc.reason}")) from None
    return [Segment(path, offset, numel * ref.storage.itemsize)]
