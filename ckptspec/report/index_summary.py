"""``inspect`` of a checkpoint index (``diff`` of any kinds: ``diff_kinds.py``).

Pure computation on a validated ``CheckpointIndex``: the parallel layout (degrees, each domain's
coordinate, ZeRO stage, size, files and parameter totals), the whole model's totals and how its
shards are placed.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

from ..format.index_models import CheckpointIndex

SUMMARY_VERSION = "1.0"  # of this shape (docs/cli.md, inspect --format json of a checkpoint index)


def _placement_kind(placement: Any) -> str:
    return placement if isinstance(placement, str) else ("split" if hasattr(placement, "split") else "pieces")


def summarize_index(index: CheckpointIndex) -> dict[str, Any]:
    deg = index.topology.degrees
    domains = []
    for d in index.domains:
        params = [p for g in d.manifest.groups for p in g.params]
        domains.append(
            {
                "id": d.id,
                "coordinate": d.coordinate.model_dump(exclude_unset=True),
                "process_group": d.process_group,
                "size": d.size,
                "zero_stage": d.manifest.layout.zero_stage
                if d.configured_zero_stage is None
                else d.configured_zero_stage,
                "optimizer": d.manifest.layout.optimizer,
                "parameters": len(params),
                "numel": sum(p.numel for p in params),
                "files": len(d.manifest.files),
            }
        )
        if d.masters is not None:  # #17: where the masters are, and how many saved copies of them
            domains[-1].update(masters=d.masters.stored_in, replicas=len(d.replicas or []))
    placements = Counter(_placement_kind(s.placement) for p in index.parameters for s in p.shards[:1])
    return {
        "summary_version": SUMMARY_VERSION,
        "document": "ckptspec.checkpoint",
        "format_version": index.format_version,
        "kind": index.kind,
        "degrees": deg.model_dump(exclude_unset=True),
        "degrees_source": index.topology.degrees_source,
        "domains": domains,
        "layer_files": len(index.layer_files),
        "expert_files": len(index.expert_files or []),
        "parameters": len(index.parameters),
        "numel": sum(math.prod(p.shape) for p in index.parameters),
        "placements": dict(sorted(placements.items())),
    }
