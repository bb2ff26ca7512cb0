"""``inspect`` and ``diff`` of a checkpoint index (a tensor/pipeline-parallel checkpoint).

Pure computation on a validated ``CheckpointIndex``: the parallel layout (degrees, each domain's
coordinate, ZeRO stage, size, files and parameter totals), the whole model's totals and how its
shards are placed; and, between two checkpoints, whether a job of B's layout can resume from A's
optimizer state: DeepSpeed loads ZeRO optimizer partitions only at the tensor and pipeline degrees
they were saved at (CK508); other changes are found by the 1.x diff of the domains' manifests.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from typing import Any

from ..findings import Finding, finding
from ..format.index_models import CheckpointIndex
from ..format.models import Manifest
from .diff import diff_manifests


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


def _degrees(doc: CheckpointIndex | Manifest) -> tuple[int, int]:
    if isinstance(doc, CheckpointIndex):
        return doc.topology.degrees.pipeline, doc.topology.degrees.tensor
    return doc.layout.pipeline_parallel_size, doc.layout.tensor_parallel_size


def resume_reasons(a: CheckpointIndex | Manifest, b: CheckpointIndex | Manifest) -> list[Finding]:
    """Why a job laid out like B cannot load A's ZeRO optimizer state (empty: it can, as far as the
    degrees go; then the domains' manifests are compared one by one)."""
    (pa, ta), (pb, tb) = _degrees(a), _degrees(b)
    if (pa, ta) != (pb, tb):
        return [
            finding(
                "CK508",
                "$.topology.degrees",
                f"A was saved at pipeline {pa} x tensor {ta}, B runs pipeline {pb} x tensor {tb}",
                "DeepSpeed loads ZeRO optimizer partitions only at the degrees they were saved at: convert A with "
                "ds_to_universal and load it with checkpoint.load_universal (the weights alone: ckptspec reconstruct)",
            )
        ]
    if isinstance(a, CheckpointIndex) and isinstance(b, CheckpointIndex):
        reasons = []
        ids_b = {d.id: d for d in b.domains}
        for d in a.domains:
            if d.id not in ids_b:
                continue
            for reason in diff_manifests(d.manifest, ids_b[d.id].manifest).reasons:
                reasons.append(dataclasses.replace(reason, path=f"$.domains[{d.id!r}]" + reason.path[1:]))
        return reasons
    return []


def diff_indexes(a: CheckpointIndex | Manifest, b: CheckpointIndex | Manifest) -> dict[str, Any]:
    """The JSON-ready diff of two checkpoints of which one at least is model-parallel."""
    reasons = resume_reasons(a, b)
    (pa, ta), (pb, tb) = _degrees(a), _degrees(b)
    return {
        "degrees": {"a": {"pipeline": pa, "tensor": ta}, "b": {"pipeline": pb, "tensor": tb}},
        "resume": {"ok": not reasons, "reasons": [r.to_dict() for r in reasons]},
        "reasons": reasons,
    }
