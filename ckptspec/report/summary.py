"""A readable summary of a validated manifest (``ckptspec inspect``).

Pure computation: a ``Manifest`` in, a plain JSON-ready dict out. Rendering (rich
tables) lives in ``ckptspec.cli.render``; loading a manifest or checkpoint in
``ckptspec.cli.inspect``. The dict's shape is the ``--format json`` output and is
documented in docs/cli.md; ``SUMMARY_VERSION`` changes when it does.
"""

from __future__ import annotations

import math
from typing import Any

from ..format.models import Manifest

SUMMARY_VERSION = "1.0"
DEFAULT_TOP = 10


def numel(shape: list[int]) -> int:
    return math.prod(shape)


def _tensors(manifest: Manifest) -> list[dict[str, Any]]:
    """Every named tensor a reconstruction yields, with its role (excluded ones are not saved)."""
    out = []
    for g, group in enumerate(manifest.groups):
        out += [
            {
                "name": p.name,
                "role": "trainable",
                "shape": list(p.shape),
                "numel": p.numel,
                "dtype": p.dtype,
                "group": g,
            }
            for p in group.params
        ]
    out += [
        {"name": f.name, "role": "frozen", "shape": list(f.shape), "numel": f.numel, "dtype": f.dtype}
        for f in manifest.frozen
    ]
    owner_dtype = {t["name"]: t["dtype"] for t in out}
    out += [
        {
            "name": a.name,
            "role": "alias",
            "shape": list(a.shape),
            "numel": numel(a.shape),
            "dtype": owner_dtype.get(a.owner, manifest.layout.model_dtype),
            "owner": a.owner,
        }
        for a in manifest.aliases
    ]
    out += [
        {"name": b.name, "role": "buffer", "shape": list(b.shape), "numel": numel(b.shape), "dtype": b.dtype}
        for b in manifest.buffers
    ]
    return out


def _groups(manifest: Manifest) -> list[dict[str, Any]]:
    return [
        {
            "index": g,
            "optimizer_group": group.optimizer_group,
            "partitioning": group.partitioning,
            "params": len(group.params),
            "numel": sum(p.numel for p in group.params),
            "padded_numel": group.padded_numel,
            "partition_count": group.partition_count,
            "partition_numel": group.partition_numel,
        }
        for g, group in enumerate(manifest.groups)
    ]


def _ranks(manifest: Manifest) -> list[dict[str, Any]]:
    """Per data-parallel rank: the master elements it saved and the files that hold its state."""
    out = []
    for rank in range(manifest.layout.world_size):
        files = [f for f in manifest.files if rank in f.ranks]
        out.append(
            {
                "rank": rank,
                "master_numel": sum(g.saved_numels[rank] for g in manifest.groups if rank < len(g.saved_numels)),
                "files": len(files),
                "bytes": sum(f.size for f in files),
            }
        )
    return out


def summarize(manifest: Manifest, *, top: int = DEFAULT_TOP) -> dict[str, Any]:
    """The summary of ``manifest`` (already validated): layout, totals, groups, tensors, files."""
    layout = manifest.layout
    tensors = _tensors(manifest)
    by_role: dict[str, list[dict]] = {
        role: [t for t in tensors if t["role"] == role] for role in ("trainable", "frozen", "alias", "buffer")
    }
    padded = sum(g.padded_numel for g in manifest.groups)
    trainable_numel = sum(t["numel"] for t in by_role["trainable"])
    # Largest first; ties by name so the order never depends on the manifest's order.
    largest = sorted((t for t in tensors if t["role"] != "alias"), key=lambda t: (-t["numel"], t["name"]))[
        : max(top, 0)
    ]
    return {
        "summary_version": SUMMARY_VERSION,
        "format_version": manifest.format_version,
        "producer": {
            k: getattr(manifest.producer, k) for k in ("tool", "tool_version", "framework", "framework_version")
        },
        "layout": {
            "zero_stage": layout.zero_stage,
            "world_size": layout.world_size,
            "model_dtype": layout.model_dtype,
            "master_dtype": layout.master_dtype,
            # Optional fields are None when absent (models.py).
            "optimizer": layout.optimizer,
            "round_robin": layout.round_robin,
            "parameter_alignment": layout.parameter_alignment,
            "sub_group_size": layout.sub_group_size,
            "exclude_frozen_parameters": layout.exclude_frozen_parameters,
        },
        "totals": {
            "trainable": len(by_role["trainable"]),
            "trainable_numel": trainable_numel,
            "frozen": len(by_role["frozen"]),
            "frozen_numel": sum(t["numel"] for t in by_role["frozen"]),
            "aliases": len(by_role["alias"]),
            "alias_numel": sum(t["numel"] for t in by_role["alias"]),
            "buffers": len(by_role["buffer"]),
            "buffer_numel": sum(t["numel"] for t in by_role["buffer"]),
            "excluded": len(manifest.excluded),
            "tensors": len(tensors),
            "tensor_numel": sum(t["numel"] for t in tensors),
            "padded_numel": padded,
            "padding_numel": padded - trainable_numel,
            "files": len(manifest.files),
            "file_bytes": sum(f.size for f in manifest.files),
        },
        "groups": _groups(manifest),
        "largest": largest,
        "aliases": [{"name": a.name, "owner": a.owner, "shape": list(a.shape)} for a in manifest.aliases],
        "frozen": [
            {"name": f.name, "shape": list(f.shape), "numel": f.numel, "dtype": f.dtype, "stored_in": f.stored_in}
            for f in manifest.frozen
        ],
        "buffers": [
            {"name": b.name, "shape": list(b.shape), "numel": numel(b.shape), "dtype": b.dtype}
            for b in manifest.buffers
        ],
        "excluded": [{"name": e.name, "reason": e.reason} for e in manifest.excluded],
        "files": [
            {
                "path": f.path,
                "role": f.role,
                "ranks": list(f.ranks),
                "size": f.size,
                "hash": f.hash.algorithm if f.hash is not None else None,
            }
            for f in manifest.files
        ],
        "ranks": _ranks(manifest),
    }


__all__ = ["summarize", "SUMMARY_VERSION", "DEFAULT_TOP"]
