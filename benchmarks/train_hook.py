"""The save hook's cost at scale (issue #19): ckptspec's work inside a save, beside DeepSpeed's own save.

Run under torchrun by bench_save_hook.py:

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 benchmarks/train_hook.py --tensors 10000 --out DIR

train_many.py's model (N tiny tensors, ZeRO-2, bf16, one step; its module is imported, so its
checkpoints' cache key is unaffected), then, every phase timed between barriers on every rank:
``engine.save_checkpoint`` twice (DeepSpeed alone: the second is the warm one the hook is compared
with), ``manifest_from_engine`` (the layout, the hook's own CPU work), and
``ckptspec.deepspeed.save_checkpoint`` with ``hash=False`` and with ``hash=True`` (the whole hook:
layout, DeepSpeed's save, describing the written files, gathering, validating and writing the
sidecar). Rank 0 prints one JSON line with every phase's wall seconds and its own CPU seconds.
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_many import DIM, build_model, param_groups, use_linear_duplicate_check


def instrument(parts: dict) -> None:
    """Time (wall, CPU) the steps of ckptspec's save hook on this rank, summed over calls."""
    from ckptspec.deepspeed.save import protocol
    from ckptspec.deepspeed.save import zero as hook

    def wrap(name, module=hook):
        fn = getattr(module, name)

        def timed(*a, **k):
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                return fn(*a, **k)
            finally:
                wall, cpu = parts.setdefault(name, [0.0, 0.0])
                parts[name] = [round(wall + time.perf_counter() - t0, 3), round(cpu + time.process_time() - c0, 3)]

        setattr(module, name, timed)

    for name in (
        "manifest_from_engine",
        "save_staged",
        "_describe_own_files",
        "_with_digests",
        "validate_manifest",
        "client_state_value",
    ):
        wrap(name)
    wrap("publish_on_rank_0", protocol)  # the protocol's publish step calls it


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tensors", type=int, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--profile", action="store_true", help="print rank 0's cProfile of the hash=False hook")
    args = ap.parse_args()

    import deepspeed
    import torch
    import torch.distributed as dist

    from ckptspec.deepspeed import save_checkpoint
    from ckptspec.deepspeed.live.zero import manifest_from_engine

    torch.manual_seed(0)
    deepspeed.init_distributed()
    use_linear_duplicate_check()
    model = build_model(args.tensors)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**6,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2},
    }
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(param_groups(model), lr=1e-3), config=config
    )
    g = torch.Generator().manual_seed(dist.get_rank())
    loss = engine(torch.randn(2, DIM, generator=g).to(torch.bfloat16))
    engine.backward(loss)
    engine.step()

    times = {}
    parts: dict[str, list[float]] = {}
    instrument(parts)

    breakdown = {}

    def timed(name, fn):
        parts.clear()
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        result = fn()
        dist.barrier()
        times[name] = {"wall": round(time.perf_counter() - t0, 3), "cpu_rank0": round(time.process_time() - c0, 3)}
        if name.startswith("ckptspec"):
            breakdown[name] = dict(parts)
        return result

    timed("deepspeed save (first)", lambda: engine.save_checkpoint(str(args.out / "ds"), tag="a"))
    timed("deepspeed save", lambda: engine.save_checkpoint(str(args.out / "ds"), tag="b"))
    timed("manifest_from_engine", lambda: manifest_from_engine(engine))
    hook = lambda: save_checkpoint(engine, str(args.out / "ck"), "a", hash=False)  # noqa: E731
    if args.profile and dist.get_rank() == 0:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        timed("ckptspec save_checkpoint hash=False", lambda: prof.runcall(hook))
        pstats.Stats(prof, stream=sys.stderr).sort_stats("cumulative").print_stats(45)
    else:
        timed("ckptspec save_checkpoint hash=False", hook)
    timed("ckptspec save_checkpoint hash=True", lambda: save_checkpoint(engine, str(args.out / "ck"), "b", hash=True))
    if dist.get_rank() == 0:
        print(
            "RESULT " + json.dumps({"tensors": args.tensors, "times": times, "hook_parts_rank0": breakdown}), flush=True
        )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
