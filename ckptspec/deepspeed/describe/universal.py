"""DeepSpeed's universal checkpoint folder (``ds_to_universal``): its checkpoint index, ``kind: "universal"``,
one domain over ``zero/<name>/fp32.pt``, the source's buffers and ties from its copied model states; with
``--hash`` each master's digest and its moments' (``zero/<name>/exp_avg.pt`` ...)."""

from __future__ import annotations

from pathlib import Path

from ...checkpoint.states import StateCache
from ...errors import UnsupportedCheckpoint
from ...format.index_models import CheckpointIndex, Coordinate, Domain
from ...format.models import Alias, Digest
from ...location import RemotePath, relative_name, walk
from ..layout.masters import MasterTensor
from ..layout.names import MODEL_RE
from ..layout.tag_dir import UNIVERSAL_FOLDER
from .index_builder import IndexBuilder


def describe(folder: Path, states: StateCache, hash_algorithm: str | None = None) -> CheckpointIndex:
    """The index of a universal folder: one ``universal`` domain over ``zero/<name>/fp32.pt``."""
    from ..layout.masters import universal_masters

    b = IndexBuilder(folder, states, hash_algorithm)
    found = universal_masters(folder, states)
    buffers = b.buffers()
    aliases = _universal_ties(b, found)
    # ds_to_universal writes zero/<name>/fp32.pt for a buffer (cast to fp32) and a tied alias (its module
    # weight widened, not the owner's master): the module's buffer is the buffer, the owner's master the tie's.
    skip = {x.name for x in buffers} | set(aliases)
    masters = [m for n, m in found.items() if n not in skip]
    # location.walk: a folder at a URL is listed as a local one
    files = [
        b.file(f"{UNIVERSAL_FOLDER}/{rel}", "other", []) for rel in sorted(_files_below(folder / UNIVERSAL_FOLDER))
    ]
    copies = sorted(p.name for p in folder.iterdir() if MODEL_RE.match(p.name))
    # Copies of the source's model states: the source's shards (tensor parallel), not this folder's tensors.
    files += [b.file(rel, "other", []) for rel in copies]
    domain = b.domain(
        "universal",
        Coordinate(),
        "universal",
        masters,
        "universal",
        files,
        stage=_source_stage(b),
    )
    domain.manifest.buffers = buffers
    if hash_algorithm:  # generate --hash: each moment's digest beside its master's (index_builder's)
        _add_state_digests(folder, states, domain)
    domain.manifest.aliases = [Alias(name=a, owner=o, shape=list(found[o].shape)) for a, o in aliases.items()]
    index = b.index("universal", [domain])
    # The degrees of the source the copied model states record (the folder itself is the whole model).
    dims = b.model.get("checkpoint_parallel_dimensions")
    if isinstance(dims, dict) and "pp_degree" in dims and "tp_degree" in dims:
        pp, tp = int(dims["pp_degree"]), int(dims["tp_degree"])
        index.topology.degrees.pipeline, index.topology.degrees.tensor = pp, tp
        index.topology.model_parallel_size = pp * tp
        index.topology.degrees_source = "checkpoint_parallel_dimensions"
    return index


def _add_state_digests(folder: Path, states: StateCache, domain: Domain) -> None:
    """``state_digests`` of every parameter whose moments the folder holds (``layout/universal_moments.py``)."""
    from ..layout.universal_moments import universal_moment_ranges
    from .masters_digests import sha256_of

    moments = universal_moment_ranges(folder, states, domain) or {}
    for group in domain.manifest.groups:
        for p in group.params:
            if moments.get(p.name):
                p.state_digests = {k: Digest(sha256=sha256_of(folder, r)) for k, r in sorted(moments[p.name].items())}


def _universal_ties(b: IndexBuilder, found: dict[str, MasterTensor]) -> dict[str, str]:
    """alias -> owner of the source's ties (``shared_params`` of the copied model states)."""
    shared = b.model.get("shared_params")
    out = {}
    for alias, owner in sorted(shared.items()) if isinstance(shared, dict) else []:
        if owner not in found or (alias in found and found[alias].shape != found[owner].shape):
            raise UnsupportedCheckpoint(
                f"tied {alias!r} -> {owner!r}: the owner has no fp32.pt of the alias's shape",
                "a universal folder of another model or converter: not described",
                f"{UNIVERSAL_FOLDER}/{owner}",
            )
        out[alias] = owner
    return out


def _source_stage(b: IndexBuilder) -> int:
    """The stage of the checkpoint ``ds_to_universal`` converted (stage 3 keeps per-rank model states)."""
    names = [p.name for p in b.folder.iterdir() if MODEL_RE.match(p.name)]
    return 3 if any(n.startswith("zero_pp_rank_") for n in names) else int(b.model.get("zero_stage", 0) or 0)


def _files_below(top: Path | RemotePath) -> list[str]:
    """Every file below ``top``, as a posix path relative to it."""
    names = [relative_name(str(root / name), top) for root, _dirs, files in walk(top) for name in files]
    return [name for name in names if name is not None]
