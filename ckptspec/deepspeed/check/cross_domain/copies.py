"""CK237: the copies a checkpoint holds of one tensor are the same bytes, before anything reads one of them.

The index records a tensor held in several files as shards placed ``replicated`` (one ``primary``): a
tensor-parallel parameter every tensor rank keeps whole (a bias, a norm), a pipeline tie each stage running it
keeps, a replicated frozen parameter or buffer (``extras``, or derived from the files as ``generate`` derives
them). ``reconstruct`` and ``reshard`` take one copy and compare the others first (CK401); ``validate`` compares
them here, so that a checkpoint whose copies differ is invalid before any reconstruction:

* a parameter: its fp32 master and each optimizer state (Adam's moments), as each domain's 1.1 locators place
  them (``covered_tensors``), or the master the index locates (stage 0);
* a frozen parameter or buffer: the range its shard's ``locator`` gives in its layer file, or its entry in its
  domain's saved module.

A copy the document does not locate (a 1.0 domain, ZeRO-3's fragments) is not compared here. The copies are
read whole, so only when ``validate`` reads data (``verify_hashes``, its default; not with ``--no-hash``,
which reads metadata and a few elements only): no more bytes than hashing the files they sit in.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

from ....checkpoint.torchfile import TensorRef, tensor_byte_range
from ....errors import CkptspecError
from ....findings import Finding, finding, json_path
from ....format.dtypes import ITEMSIZE
from ....format.index_models import Domain, Shard
from ....format.paths import join_inside
from ....location import RemotePath, read_range
from ...describe.digests import covered_tensors
from ...describe.index_extras import index_extras
from .context import IndexContext, check

Ranges = list[tuple[str, int, int]]  # (file as listed, absolute offset, bytes), in order
_CHUNK = 16 << 20  # a large copy (a tied embedding's moments) is compared this many bytes at a time


@check("CK237")
def copies_agree(ctx: IndexContext) -> Iterator[Finding]:
    """Every non-primary copy of a replicated tensor (master and optimizer states, frozen parameter, buffer)
    equals the primary's bytes."""
    if not ctx.verify_hashes:
        return  # --no-hash: metadata and sampled elements only (module docstring)
    replicated = [
        (j, param, shards) for j, param in enumerate(ctx.index.parameters) if (shards := _replicated(param.shards))
    ]
    holding = {s.domain for _, _, shards in replicated for s in shards}
    located = {d.id: _located(d) for d in ctx.index.domains if d.id in holding}  # only where a copy is
    for j, param, shards in replicated:
        for what in sorted({w for s in shards for w in located[s.domain].get(s.local_name, {})}):
            copies = [(s.domain, located[s.domain].get(s.local_name, {}).get(what)) for s in shards]
            yield from _differing(ctx, json_path("parameters", j), param.name, what, copies)
    extras = ctx.index.extras if ctx.index.extras is not None else _derived_extras(ctx)
    for j, extra in enumerate(extras):
        at = json_path("extras", j) if ctx.index.extras is not None else "$"
        copies = [(s.domain, _extra_ranges(ctx, s.domain, s.local_name, s)) for s in _replicated(extra.shards)]
        yield from _differing(ctx, at, extra.name, extra.role, copies)
    yield from _stage0_buffers(ctx)


def _stage0_buffers(ctx: IndexContext) -> Iterator[Finding]:
    """AutoTP at stage 0 (every domain's masters located by the index): each tensor rank's model states hold
    every buffer whole, named in its domain's manifest; the first domain's copy is the one a reader takes."""
    domains = ctx.index.domains
    if ctx.index.topology.degrees.tensor < 2 or any(d.masters is None for d in domains):
        return
    for name in dict.fromkeys(b.name for d in domains for b in d.manifest.buffers):
        held = [d for d in domains if any(b.name == name for b in d.manifest.buffers)]
        copies = [(d.id, _extra_ranges(ctx, d.id, name, None)) for d in held]
        yield from _differing(ctx, "$", name, "buffer", copies)


def _replicated(shards: list[Shard]) -> list[Shard]:
    """A tensor's copies, the primary first; none unless every shard is a whole copy."""
    if len(shards) < 2 or not all(s.placement == "replicated" for s in shards):
        return []
    return sorted(shards, key=lambda s: not s.primary)


def _located(domain: Domain) -> dict[str, dict[str, Ranges]]:
    """local name -> ("master" or an optimizer state) -> its byte ranges, as the domain's document locates them."""
    out: dict[str, dict[str, Ranges]] = {}
    if domain.masters is not None:  # stage 0, MoE, universal: the masters the index locates
        for loc in domain.masters.tensors:
            item = ITEMSIZE[loc.dtype]
            span = (loc.file, loc.data_offset + loc.element_offset * item, loc.numel * item)
            out.setdefault(loc.param, {}).setdefault("master", []).append(span)
        return out
    groups = domain.manifest.groups
    for covered in covered_tensors(domain.manifest):
        if covered.where[0] != "groups":
            continue  # frozen parameters and buffers: extras
        g, i = covered.where[1], covered.where[3]
        field = covered.where[4:]
        what = "master" if field == ("digest",) else field[1] if field[0] == "state_digests" else None
        if what is not None:
            out.setdefault(groups[g].params[i].name, {})[what] = list(covered.ranges)
    return out


def _derived_extras(ctx: IndexContext):
    try:
        return index_extras(ctx.index, ctx.tag_dir, ctx.states)[0]
    except (CkptspecError, OSError, ValueError):
        return []  # files the extras are read from are the other checks' findings


def _extra_ranges(ctx: IndexContext, domain_id: str, local_name: str, shard: Shard | None) -> Ranges | None:
    """Where a frozen parameter's or buffer's copy is: its layer file's range (``shard.locator``), or its entry
    ``local_name`` in domain ``domain_id``'s saved module."""
    loc = shard.locator if shard is not None else None
    if loc is not None and shard is not None and shard.layer_file is not None:
        item = ITEMSIZE[loc.dtype]
        return [(shard.layer_file, loc.data_offset + loc.element_offset * item, loc.numel * item)]
    domain = _domain(ctx, domain_id)
    model = next((f.path for f in domain.manifest.files if f.role == "model_states"), None)
    path = join_inside(ctx.tag_dir, model) if model is not None else None
    if model is None or path is None or not path.is_file():
        return None
    loaded = ctx.states.load(path)
    module = loaded.state.get("module") if loaded.error is None and isinstance(loaded.state, dict) else None
    ref = module.get(local_name) if isinstance(module, dict) else None
    if not isinstance(ref, TensorRef) or ref.numel == 0 or not ref.is_contiguous():
        return None  # ZeRO-3's placeholders (its frozen fragments are not compared here)
    try:
        offset, nbytes = tensor_byte_range(ref, ctx.states.members(path))
    except (CkptspecError, ValueError):
        return None
    return [(model, offset, nbytes)]


def _differing(
    ctx: IndexContext, at: str, name: str, what: str, copies: list[tuple[str, Ranges | None]]
) -> Iterator[Finding]:
    """The finding of each copy (domain, its ranges; the primary first) whose bytes are not the primary's;
    copies the document does not locate are not compared."""
    known = [(d, r) for d, r in copies if r]
    if len(known) < 2 or not copies[0][1]:
        return  # nothing to compare with the primary's copy
    (first, primary), rest = known[0], known[1:]
    want = _digest_or_none(ctx.tag_dir, primary)
    for domain, ranges in rest:
        if want is None or _same(ctx.tag_dir, want, sum(n for _, _, n in primary), ranges):
            continue
        yield finding(
            "CK237",
            at,
            f"the copy of {name!r} ({what}) in {ranges[0][0]} (domain {domain}) differs from the one in "
            f"{primary[0][0]} (domain {first}); a reader takes one of them",
            "every tensor-parallel rank and pipeline stage saves the same values of a replicated tensor: a file of "
            "another save or a corrupted one; restore the files of one save",
            file=ranges[0][0],
            rank=_domain(ctx, domain).file_ranks.get(ranges[0][0]),  # a layer file is no domain rank's
        )


def _domain(ctx: IndexContext, domain_id: str) -> Domain:
    return next(d for d in ctx.index.domains if d.id == domain_id)


def _same(tag_dir: Path | RemotePath, want: bytes, size: int, ranges: Ranges) -> bool:
    """The bytes of ``ranges``, concatenated, are ``size`` bytes of digest ``want``; unreadable ones are other
    checks' findings (a missing or cut file)."""
    if sum(n for _, _, n in ranges) != size:
        return False
    found = _digest_or_none(tag_dir, ranges)
    return found is None or found == want


def _digest_or_none(tag_dir: Path | RemotePath, ranges: Ranges) -> bytes | None:
    try:
        return _digest(tag_dir, ranges)
    except OSError:
        return None


def _digest(tag_dir: Path | RemotePath, ranges: Ranges) -> bytes:
    """SHA-256 of the ranges' bytes, read ``_CHUNK`` at a time: a tied embedding's moments are never held whole."""
    digest = hashlib.sha256()
    for path, offset, nbytes in ranges:
        for start in range(offset, offset + nbytes, _CHUNK):
            data = read_range(tag_dir / path, start, min(_CHUNK, offset + nbytes - start))
            if len(data) < min(_CHUNK, offset + nbytes - start):
                raise OSError(f"{path} ends before byte {offset + nbytes}")
            digest.update(data)
    return digest.digest()
