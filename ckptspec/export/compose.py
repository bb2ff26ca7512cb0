"""The whole model of a tensor/pipeline-parallel checkpoint, from its validated index.

Each domain is an ordinary 1.x manifest: ``plan_reconstruction`` gives every local parameter's
bytes (its fp32 master) in the domain's files. A whole-model parameter is then one ``TensorSource``
composed from its shards' byte ranges as the index places them (``compose_plan.py``), so the 1.x
writers write the whole model as they write any plan (safetensors or torch files, sharding, the
optimizer state; atomic). The non-primary replicas are read and compared with the primary first
(they must be equal, bit for bit: CK401 otherwise). A domain whose index locates its masters (#17)
adds the buffers and ties it names; the frozen parameters, buffers and ties of the others are
placed by the index (1.1's ``extras`` and ``aliases``), or derived as ``generate`` derives them
(``compose_extras.py``). ``ckptspec.load_state_dict`` reads
the same plan. No DeepSpeed, no pickle; torch only for ``--format torch``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..checkpoint.states import StateCache
from ..deepspeed.check.checkpoint_index import validate_index_checkpoint
from ..deepspeed.layout.tag_dir import resolve_tag_dir
from ..errors import CheckpointInvalid, ReconstructMismatch
from ..findings import has_errors
from ..format.index_models import CheckpointIndex
from ..format.models import Hash
from ..location import RemotePath, read_range
from .arrays import ShardReader, _np, read_array
from .compose_extras import extras_of
from .compose_masters import master_sources, named_extras
from .compose_plan import IndexReconstructionPlan, replicas, whole_plan
from .model_plan import ReconstructionPlan
from .plan import plan_reconstruction


def validated_index_plan(checkpoint: str | os.PathLike, index: Any = None, tag: str | None = None):
    """Validate the whole set (index rules, every domain's files, the index's checks), then plan the
    whole model (``compose_plan.IndexReconstructionPlan``)."""
    if isinstance(index, (str, os.PathLike)):
        from ..format.index_validate import validate_index_file

        index = validate_index_file(index)
        if not index.ok:
            raise CheckpointInvalid(index.findings, str(checkpoint))
    states = StateCache()
    tag_dir = resolve_tag_dir(checkpoint, tag)
    # A remote file's recorded hash is checked by the reader, from the bytes it fetches once (as 1.x does).
    in_stream = isinstance(tag_dir, RemotePath)
    found, findings = validate_index_checkpoint(
        checkpoint, index, tag, states=states, verify_hashes=not in_stream, verify_digests=False
    )
    if found is None or has_errors(findings):
        raise CheckpointInvalid(findings, str(checkpoint))
    plan = index_plan(found, tag_dir, states)
    plan.warnings = findings  # no error among them: the warnings (CK224, CK226, CK236), for the caller to show
    return plan


def index_plan(index: CheckpointIndex, tag_dir: Path | RemotePath, states: StateCache) -> IndexReconstructionPlan:
    """The whole model of a checkpoint index validated already (here, or by another rank: ``dcp_open``),
    from its domains' files (their metadata only: ``states``, what validation read, or read now)."""
    domain_plans = {d.id: domain_plan(tag_dir, d, states) for d in index.domains}
    extras, aliases = extras_of(index, tag_dir, domain_plans, states)
    plan = whole_plan(index, tag_dir, domain_plans, extras, aliases)
    if isinstance(tag_dir, RemotePath):
        plan.file_hashes = recorded_hashes(index, tag_dir)
    plan.states = states
    return plan


def recorded_hashes(index: CheckpointIndex, tag_dir: RemotePath) -> dict[RemotePath, Hash]:
    """Every file's recorded hash (the domains' files, the layer and expert files), by its location."""
    listed = [(f.path, f.hash) for d in index.domains for f in d.manifest.files]
    listed += [(f.path, f.hash) for f in index.layer_files]
    listed += [(f.path, f.hash) for f in index.expert_files or []]
    return {tag_dir / path: digest for path, digest in listed if digest is not None}


def domain_plan(tag_dir, domain, states: StateCache) -> ReconstructionPlan:
    """Where a domain's masters are: located by the index (#17: stage 0, MoE, universal folders), or
    in its ZeRO partitions, as its 1.x manifest says."""
    if domain.masters is not None:
        sources = master_sources(tag_dir, domain)
        buffers, aliases = named_extras(tag_dir, domain, sources, states)
        order = [*sources, *buffers, *aliases]
        return ReconstructionPlan(tag_dir, {**sources, **buffers}, aliases, order, manifest=domain.manifest)
    return plan_reconstruction(tag_dir, domain.manifest, states=states)


def check_replicas(plan: IndexReconstructionPlan, files: ShardReader) -> None:
    """Every non-primary copy of a replicated parameter's master, frozen parameter or buffer equals the
    primary, bit for bit (CK401)."""
    compared = [
        (param, copies) for param in plan.index.parameters if len(copies := replicas(param, plan.domain_plans)) > 1
    ]
    replicated = [
        (name, shards)
        for name, shards in plan.extra_shards.items()
        if len(shards) > 1 and all(s.placement == "replicated" for s, _ in shards)
    ]
    segments = [seg for _, copies in compared for _, source in copies for seg in source.segments]
    segments += [seg for _, shards in replicated for _, source in shards for seg in source.segments]
    # A remote copy's bytes are kept (``read_range``, within the budget of kept bytes) and compared from
    # there, outside ``files``: the writer then takes the primaries from memory, and the reader that checks
    # a file's recorded hash takes the other copies, so no byte is fetched twice.
    remote = [seg for seg in segments if isinstance(seg.path, RemotePath)]
    for seg in remote:
        read_range(seg.path, seg.offset, seg.nbytes)
    if remote:
        with ShardReader() as kept:
            _compare_replicas(plan, compared, replicated, kept)
    else:
        _compare_replicas(plan, compared, replicated, files)


def _compare_replicas(plan: IndexReconstructionPlan, compared, replicated, files: ShardReader) -> None:
    np = _np()
    files.plan(seg for _, copies in compared for _, source in copies for seg in source.segments)
    for param, copies in compared:
        primary = read_array(copies[0][1], "float32", files).view(np.uint32)
        for shard, source in copies[1:]:
            if not np.array_equal(read_array(source, "float32", files).view(np.uint32), primary):
                raise ReconstructMismatch(
                    f"replicated parameter {param.name!r} differs between domains ({shard.domain}: {shard.local_name})",
                    plan.tag_dir,
                )
    for name, shards in replicated:
        first = read_array(shards[0][1], shards[0][1].dtype, files).tobytes()
        for shard, source in shards[1:]:
            if read_array(source, source.dtype, files).tobytes() != first:
                raise ReconstructMismatch(
                    f"replicated {source.role} {name!r} differs between domains "
                    f"({shard.domain}, {shards[0][0].domain})",
                    plan.tag_dir,
                )
