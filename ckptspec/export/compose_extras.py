"""The frozen parameters, persistent buffers and ties of a tensor- or pipeline-parallel checkpoint's
whole model, as sources the whole plan composes.

A checkpoint index 1.1 places them (``extras``, ``aliases``: docs/spec-checkpoint.md#extras); a 1.0
document has no place for them, and they are derived from the files by the same function ``generate``
writes them with (``deepspeed/describe/index_extras.py``: AutoTP's ``affine_map``, the layer files,
``buffer_names``), so that every reader, Python's and Node's, follows the same placements. Each shard
is then a source: its domain's frozen parameter or buffer as the domain manifest's plan locates it
(the module, ``frozen_param_fragments``), or the range a shard's ``locator`` gives in its layer file,
which must be where the file's zip directory and pickle put that key (CK401 otherwise). Replicated
copies are compared with the primary before anything is written (``compose.check_replicas``).
No torch, no pickle.
"""

from __future__ import annotations

import math
from pathlib import Path

from ..checkpoint.states import StateCache
from ..checkpoint.torchfile import TensorRef
from ..deepspeed.describe.index_extras import index_extras
from ..errors import ReconstructMismatch
from ..format.dtypes import ITEMSIZE
from ..format.index_models import CheckpointIndex, IndexExtra, Shard
from ..format.paths import join_inside
from ..location import RemotePath
from .model_plan import ReconstructionPlan, Segment, TensorSource

EXTRA_ROLES = ("frozen", "buffer")
Extras = dict[str, tuple[list[int], list[tuple[Shard, TensorSource]]]]


def extras_of(
    index: CheckpointIndex, tag_dir: Path | RemotePath, domain_plans: dict[str, ReconstructionPlan], states: StateCache
) -> tuple[Extras, dict[str, str]]:
    """(name -> (whole shape, its shards with their sources) of every frozen parameter and buffer, tie -> owner):
    the document's (1.1), or derived from the files (a 1.0 index, or a 1.1 one that does not describe them)."""
    if index.extras is not None:
        extras, aliases = index.extras, dict(index.aliases or {})
    else:
        extras, aliases = index_extras(index, tag_dir, states)
    out: Extras = {}
    for extra in extras:
        shards = [(shard, _source(extra, shard, tag_dir, domain_plans, states)) for shard in extra.shards]
        out[extra.name] = (list(extra.shape), shards)
    return out, aliases


def _source(
    extra: IndexExtra,
    shard: Shard,
    tag_dir: Path | RemotePath,
    domain_plans: dict[str, ReconstructionPlan],
    states: StateCache,
) -> TensorSource:
    loc = shard.locator
    if loc is None:
        source = domain_plans[shard.domain].sources.get(shard.local_name)
        if source is None or source.role != extra.role:
            raise ReconstructMismatch(f"domain {shard.domain} locates no {extra.role} {shard.local_name!r}", tag_dir)
        return source
    path = join_inside(tag_dir, shard.layer_file)
    if path is None:  # the index rules refuse such a path first
        raise ReconstructMismatch(f"{shard.layer_file!r} is outside the checkpoint", tag_dir)
    ref = states.state(path).get(shard.layer_key)
    held = states.members(path).get(loc.member)
    if (
        not isinstance(ref, TensorRef)
        or held != (loc.data_offset, loc.member_size)
        or (ref.storage.member, ref.storage_offset, ref.numel, ref.dtype)
        != (loc.member, loc.element_offset, loc.numel, loc.dtype)
        or loc.numel != math.prod(shard.local_shape)
    ):
        raise ReconstructMismatch(
            f"the index locates {extra.name!r} in {shard.layer_file}: {loc.member} at byte {loc.data_offset}, "
            "not where the file holds its key",
            tag_dir,
        )
    item = ITEMSIZE[loc.dtype]
    segments = [Segment(path, loc.data_offset + loc.element_offset * item, loc.numel * item)] if loc.numel else []
    return TensorSource(extra.name, tuple(shard.local_shape), loc.dtype, segments, extra.role)
