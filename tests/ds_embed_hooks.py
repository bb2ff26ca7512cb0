"""Hooks for real DeepSpeed jobs of tests/test_embed.py (run on every rank by tests/dsharness/train.py).

A ``ds_*.py`` file, so the harness cache key changes with it (tests/dsharness/build.py).
"""

import json

import torch
import torch.distributed as dist


def load_back(engine, out_dir, spec):
    """Prove ``engine.load_checkpoint`` still works on a checkpoint saved by ckptspec.

    Moves the weights with one more training step, loads the checkpoint back and
    records (per rank, in ``load_back.rank<N>.json``) whether the fp32 master weights
    are again exactly those saved (``live_fp32.pt``), and what client state came back.
    """
    from dsharness.train import SEQ, VOCAB, live_fp32

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
