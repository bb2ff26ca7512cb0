"""The files of a checkpoint whose index locates masters (#17: stage 0, MoE, universal folders).

A domain with ``masters`` is not checked by the 1.x checks (its manifest locates no partition);
``check_masters_domain`` checks its files (CK206 missing, CK208 size, CK209 hash, CK210 saved under another
file's name: two tensor ranks' stage-0 model states swapped) and every master
and replica locator against the zip directory and the pickle (CK221). The whole set's checks
(registered into ``INDEX_CHECKS``, run after the domains'):

* CK240: an expert file the index lists is missing;
* CK241: an expert file is not the one the index names (size, hash, or keys of another expert or save);
* CK242: an optimizer file's ``partition_count`` contradicts the size of the domain of that group;
* CK243: a copy DeepSpeed saved of a master (stage-0 MoE) differs from the master.

Metadata, plus one ``pread`` per master and copy for CK243; never executes pickled code.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ....checkpoint.hashing import file_digest
from ....checkpoint.states import StateCache
from ....checkpoint.torchfile import TensorRef
from ....findings import Finding, finding, json_path
from ....format.dtypes import ITEMSIZE
from ....format.index_models import Domain, MasterLocator
from ....format.paths import join_inside
from ....location import RemotePath, read_range
from ...layout.masters import value_at
from ...layout.names import OPTIM_RE
from ..domain.files import SAVED_AS_HINT, saved_as
from .context import IndexContext, check

_EXPERT_ID = re.compile(r"\.deepspeed_experts\.(\d+)\.")


def _locator_problem(tag_dir: Path | RemotePath, loc: MasterLocator, states: StateCache) -> str | None:
    """Why ``loc`` does not point at bytes of the tensor at its ``key``, or None."""
    path = join_inside(tag_dir, loc.file)
    if path is None or not path.is_file():
        return None  # the file's own finding
    members = states.members(path)
    if members.get(loc.member) != (loc.data_offset, loc.member_size):
        return f"member {loc.member} at {loc.data_offset} ({loc.member_size} bytes) is not in the file's zip directory"
    loaded = states.load(path)
    ref = value_at(loaded.state, loc.key) if loaded.error is None else None
    if not isinstance(ref, TensorRef):
        return f"{'/'.join(map(str, loc.key)) or 'the file'} is not a tensor"
    start = ref.storage_offset
    if ref.storage.member != loc.member or ref.dtype != loc.dtype or not ref.is_contiguous():
        return f"{'/'.join(map(str, loc.key))} is {ref.dtype} in {ref.storage.member}, not {loc.dtype} in {loc.member}"
    if not (start <= loc.element_offset and loc.element_offset + loc.numel <= start + ref.numel):
        return f"elements [{loc.element_offset}, {loc.element_offset + loc.numel}) are outside the tensor"
    return None


def check_masters_domain(
    domain: Domain,
    i: int,
    tag_dir: Path | RemotePath,
    states: StateCache,
    *,
    verify_hashes: bool = True,
    verify_digests=None,
) -> list[Finding]:
    """The files of a domain whose index locates its masters, each locator, and (``verify_digests``,
    default ``verify_hashes``) the digests its 1.1 manifest records of each master and moment (CK222)."""
    # The locators first (their findings come last): the bytes they read are then kept when a remote
    # file's hash reads it whole (which keeps none of it), so that each byte is fetched once.
    located = _locator_findings(domain, i, tag_dir, states)
    # The digests too, before the hashes; reported only when nothing else is wrong. From a URL whose files
    # all have recorded hashes, the hashes (every byte, fetched once) are the check, and the digests are
    # checked as the tensors are read (arrays.py): reading the ranges here as well would fetch them twice.
    want = verify_hashes if verify_digests is None else verify_digests
    if verify_digests is None and isinstance(tag_dir, RemotePath):
        want = want and not all(f.hash is not None for f in domain.manifest.files)
    digests = _digests(domain, i, tag_dir, states) if want and not located else None
    out = []
    for j, f in enumerate(domain.manifest.files):
        at = json_path("domains", i, "manifest", "files", j)
        path = join_inside(tag_dir, f.path)
        if path is None or not path.is_file():
            out.append(finding("CK206", at, "file is missing", "restore it from the run that wrote it", file=f.path))
        elif path.stat().st_size != f.size:
            out.append(
                finding("CK208", at, f"size {path.stat().st_size}, the index says {f.size}", "restore it", file=f.path)
            )
        elif verify_hashes and f.hash is not None and file_digest(path, f.hash.algorithm).digest != f.hash.digest:
            out.append(finding("CK209", at, "content hash differs from the index's", "restore it", file=f.path))
        elif (saved := _saved_as(path, f.path, states)) is not None:  # two tensor ranks' stage-0 files swapped...
            message = f"the file was saved as {saved} (the name recorded inside it), not as {path.name}"
            out.append(
                finding(
                    "CK210",
                    json_path("domains", i, "manifest", "files", j, "path"),
                    message,
                    SAVED_AS_HINT,
                    file=f.path,
                    rank=min(f.ranks) if f.ranks else None,
                )
            )
    out += located
    if not out and digests:
        out += digests
    return out


def _saved_as(path: Path | RemotePath, name: str, states: StateCache) -> str | None:
    """CK210's rule for a file of a domain whose index locates its masters (``domain.files.saved_as``)."""
    loaded = states.load(path)
    return None if loaded.error is not None else saved_as(name, loaded.state)


def _locator_findings(domain: Domain, i: int, tag_dir: Path | RemotePath, states: StateCache) -> list[Finding]:
    out = []
    for field, locs in (("masters", domain.masters.tensors), ("replicas", domain.replicas or [])):
        for j, loc in enumerate(locs):
            problem = _locator_problem(tag_dir, loc, states)
            if problem:
                out.append(
                    finding(
                        "CK221",
                        json_path("domains", i, field, *(["tensors"] if field == "masters" else []), j),
                        f"master of {loc.param!r}: {problem}",
                        "regenerate the index from the files (ckptspec generate), or restore the files it describes",
                        file=loc.file,
                    )
                )
    return out


def _digests(domain: Domain, i: int, tag_dir: Path | RemotePath, states: StateCache) -> list[Finding]:
    """CK222 for each recorded digest (``generate --hash``) the located bytes do not have."""
    from ...describe.masters_digests import master_ranges, moment_ranges, sha256_of
    from ...layout.universal_moments import universal_moment_ranges

    params = [(g, k, p) for g, group in enumerate(domain.manifest.groups) for k, p in enumerate(group.params)]
    if not any(p.digest is not None or p.state_digests for _, _, p in params):
        return []
    masters = master_ranges(domain)
    moments: dict | None = {}
    if any(p.state_digests for _, _, p in params):
        universal = domain.masters is not None and domain.masters.stored_in == "universal"
        moments = (universal_moment_ranges if universal else moment_ranges)(tag_dir, states, domain)
    out = []
    for g, k, p in params:
        wanted: list[tuple[tuple, Any, list | None]] = [(("digest",), p.digest, masters.get(p.name))]
        wanted += [
            (("state_digests", s), d, (moments or {}).get(p.name, {}).get(s))
            for s, d in (p.state_digests or {}).items()
        ]
        for where, digest, ranges in wanted:
            if digest is None:
                continue
            at = json_path("domains", i, "manifest", "groups", g, "params", k, *where)
            actual = sha256_of(tag_dir, ranges) if ranges else None
            if actual != digest.sha256:
                files = sorted({r[0] for r in ranges or ()})
                out.append(
                    finding(
                        "CK222",
                        at,
                        f"sha256 of {p.name!r}'s elements is {(actual or 'unlocated')[:16]}..., the index records "
                        f"{digest.sha256[:16]}...",
                        "the tensor's bytes changed after the index was written (bit rot, a partial copy, another "
                        "save); restore the file",
                        file=files[0] if len(files) == 1 else None,
                    )
                )
    return out


@check("CK240")
def expert_file_missing(ctx: IndexContext) -> Iterator[Finding]:
    """Every expert file the index lists is there."""
    for i, ef in enumerate(ctx.index.expert_files or []):
        path = join_inside(ctx.tag_dir, ef.path)
        if path is None or not path.is_file():
            yield finding(
                "CK240",
                json_path("expert_files", i),
                f"expert file of MoE layer {ef.moe_layer}, expert {ef.expert} (expert-parallel rank "
                f"{ef.expert_parallel_rank}) is missing",
                "restore it from the run that wrote the checkpoint; that expert's weights are lost without it",
                file=ef.path,
            )


@check("CK241")
def expert_file_other(ctx: IndexContext) -> Iterator[Finding]:
    """Each expert file is the one the index names: its size and hash, its keys, every key naming its expert."""
    for i, ef in enumerate(ctx.index.expert_files or []):
        path = join_inside(ctx.tag_dir, ef.path)
        if path is None or not path.is_file():
            continue  # CK240
        loaded = ctx.states.load(path)
        state = loaded.state if loaded.error is None else None
        keys = sorted(state) if isinstance(state, dict) else []
        others = sorted({int(m.group(1)) for k in keys if (m := _EXPERT_ID.search(k))} - {ef.expert})
        why = None
        if path.stat().st_size != ef.size or (
            ctx.verify_hashes and ef.hash is not None and file_digest(path, ef.hash.algorithm).digest != ef.hash.digest
        ):
            why = "changed since the index was written (size or hash)"
        elif others:
            why = f"holds the tensors of expert {others[0]}, not of expert {ef.expert}"
        elif keys != sorted(ef.tensors):
            why = f"holds {keys[:3]}...; the index says {sorted(ef.tensors)[:3]}..."
        if why:
            yield finding(
                "CK241",
                json_path("expert_files", i),
                f"expert file of expert {ef.expert} {why}",
                "an expert file of another expert or save: restore the file of this save",
                file=ef.path,
            )


@check("CK242")
def partition_counts(ctx: IndexContext) -> Iterator[Finding]:
    """Every ZeRO optimizer file's ``partition_count[g]`` is the size of the domain owning group g."""
    sizes: dict[int, set[int]] = {}
    for d in ctx.index.domains:
        if d.masters is not None and d.configured_zero_stage in (1, 2):
            for g in d.optimizer_groups or []:
                sizes.setdefault(g, set()).add(d.size)
    if not sizes:
        return
    files = sorted({f.path for d in ctx.index.domains for f in d.manifest.files if OPTIM_RE.match(f.path)})
    for rel in files:
        path = join_inside(ctx.tag_dir, rel)
        if path is None or not path.is_file():
            continue
        loaded = ctx.states.load(path)
        osd = loaded.state.get("optimizer_state_dict") if isinstance(loaded.state, dict) else None
        counts = osd.get("partition_count") if isinstance(osd, dict) else None
        for g, want in sorted(sizes.items()):
            got = counts[g] if isinstance(counts, list) and g < len(counts) else None
            if got not in want:
                m = OPTIM_RE.match(Path(rel).name)
                yield finding(
                    "CK242",
                    "$",
                    f"optimizer group {g} has partition_count {got}; its domain has {sorted(want)[0]} rank(s)",
                    "dense groups are partitioned over the data-parallel group, expert groups over the "
                    "expert-data-parallel group: a file of another run or layout",
                    file=rel,
                    rank=int(m.group(1)) if m else None,
                )


def _read(tag_dir: Path | RemotePath, locs: list[MasterLocator]) -> bytes | None:
    out = []
    for loc in locs:
        item = ITEMSIZE[loc.dtype]
        try:
            out.append(read_range(tag_dir / loc.file, loc.data_offset + loc.element_offset * item, loc.numel * item))
        except OSError:
            return None
    return b"".join(out)


@check("CK243")
def replicas_equal(ctx: IndexContext) -> Iterator[Finding]:
    """Each copy DeepSpeed saved of a master (the dense masters in every ``expp_rank`` file and in
    ``mp_rank_00``) equals the master, bit for bit: which copy a reader takes must not matter."""
    for i, d in enumerate(ctx.index.domains):
        if d.masters is None or not d.replicas:
            continue
        by_param: dict[str, list[MasterLocator]] = {}
        for loc in d.masters.tensors:
            by_param.setdefault(loc.param, []).append(loc)
        for j, copy in enumerate(d.replicas):
            master = _read(ctx.tag_dir, by_param.get(copy.param, []))
            data = _read(ctx.tag_dir, [copy])
            if master is not None and data is not None and master != data:
                yield finding(
                    "CK243",
                    json_path("domains", i, "replicas", j),
                    f"the copy of {copy.param!r}'s master differs from the master in {by_param[copy.param][0].file}",
                    "every copy of a stage-0 master is saved from the same values: a file of another save or "
                    "a corrupted one",
                    file=copy.file,
                )
