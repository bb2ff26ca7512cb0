"""Hooks a "train" task runs after saving (spec ``"hooks": [name, ...]``), on every rank.

Each is called as ``hook(engine, out_dir, spec)``. Hooks run ckptspec code inside the job, so a
task with hooks is keyed on ckptspec's sources too (tests/_harness/cache.py).
"""

import json


def engine_manifest(engine, out_dir, spec):
    """The live engine's manifest from every rank (``engine_manifest.rank<N>.json``), to prove all ranks agree."""
    import torch.distributed as dist

    from ckptspec.deepspeed import manifest_from_engine

    manifest = manifest_from_engine(engine, exclude_frozen_parameters=spec["exclude_frozen"])
    (out_dir / f"engine_manifest.rank{dist.get_rank()}.json").write_text(json.dumps(manifest.to_dict(), sort_keys=True))


def load_back(engine, out_dir, spec):
    """Prove ``engine.load_checkpoint`` still works on a checkpoint saved by ckptspec.

    Moves the weights with one more training step, loads the checkpoint back and
    records (per rank, in ``load_back.rank<N>.json``) whether the fp32 master weights
    are again exactly those saved (``live_fp32.pt``), and what client state came back.
    """
    import torch
    import torch.distributed as dist

    from _harness.job.model import SEQ, VOCAB, live_fp32

    rank = dist.get_rank()
    saved = torch.load(out_dir / "live_fp32.pt", weights_only=True)
    g = torch.Generator().manual_seed(spec["seed"] + 77 + rank)
    tokens = torch.randint(0, VOCAB, (spec["micro_batch"], SEQ), generator=g)
    targets = torch.randint(0, VOCAB, (spec["micro_batch"], SEQ), generator=g)
    loss = engine(tokens, targets)
    engine.backward(loss)
    engine.step()
    moved = live_fp32(engine, engine.module, spec["stage"])

    # A checkpoint saved with exclude_frozen_parameters has no frozen weights: DeepSpeed needs non-strict loading.
    load_path, client_state = engine.load_checkpoint(str(out_dir), load_module_strict=not spec["exclude_frozen"])
    after = live_fp32(engine, engine.module, spec["stage"])

    def same(a, b):
        return sorted(a) == sorted(b) and all(torch.equal(a[n].view(torch.int32), b[n].view(torch.int32)) for n in a)

    embedded = (client_state or {}).get("ckptspec_manifest")
    result = {
        "load_path": str(load_path),
        "moved_before_load": not same(moved, saved),
        "restored": same(after, saved),
        "client_state_keys": sorted(client_state or {}),
        "embedded_type": type(embedded).__name__,
        "embedded": json.loads(embedded) if isinstance(embedded, str) else None,
    }
    (out_dir / f"load_back.rank{rank}.json").write_text(json.dumps(result, sort_keys=True))
