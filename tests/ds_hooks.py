"""Hooks run inside real DeepSpeed jobs by tests/dsharness/train.py (on every rank)."""

import json

import torch.distributed as dist


def record_engine_manifest(engine, out_dir, spec):
    """Write the live engine's manifest from every rank, to prove all ranks agree."""
    from ckptspec.deepspeed import manifest_from_engine

    manifest = manifest_from_engine(engine, exclude_frozen_parameters=spec["exclude_frozen"])
    (out_dir / f"engine_manifest.rank{dist.get_rank()}.json").write_text(json.dumps(manifest.to_dict(), sort_keys=True))
