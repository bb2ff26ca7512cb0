"""Build (once, cached) real ~100M-parameter DeepSpeed ZeRO checkpoints for the benchmarks.

    .venv/bin/python benchmarks/make_big_checkpoint.py            # ZeRO-2 and ZeRO-3, 2 ranks, bf16
    .venv/bin/python benchmarks/make_big_checkpoint.py --stage 2
    .venv/bin/python benchmarks/make_big_checkpoint.py --stage 2 --tp 2                       # AutoTP tp2 x dp1
    .venv/bin/python benchmarks/make_big_checkpoint.py --stage 2 --layers 2 --experts 2 --ep 2  # MoE ep2

Each checkpoint is ~1.4 GB on disk (bf16 weights + fp32 masters + two Adam moments).
They go to $CKPTSPEC_BENCH_CACHE or benchmarks/.cache/ (git-ignored; never commit it),
built in a temporary directory and renamed into place when complete.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torchrun

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
WORLD_SIZE = 2
NEEDED_BYTES = 4 * 1024**3  # one checkpoint plus headroom for the outputs


def cache_root() -> Path:
    return Path(os.environ.get("CKPTSPEC_BENCH_CACHE", HERE / ".cache"))


def checkpoint_dir(stage: int, layers: int = 4, tp: int = 1, experts: int = 0, ep: int = 1) -> Path:
    """``layers``: train_big.py's layer count (4: ~100M parameters; each layer adds 8.4M, the largest
    tensors, the 32.8M embedding and head, stay the same); ``tp``, ``experts``, ``ep``: train_big.py's
    AutoTP degree and MoE experts per layer and expert-parallel degree (each layer adds 8.4M per expert)."""
    suffix = "" if layers == 4 else f"-l{layers}"
    suffix += f"-tp{tp}" if tp > 1 else ""
    suffix += f"-moe{experts}ep{ep}" if experts else ""
    return cache_root() / f"big-zero{stage}-ws{WORLD_SIZE}-bf16{suffix}"


def build(stage: int, quiet: bool = False, layers: int = 4, tp: int = 1, experts: int = 0, ep: int = 1) -> Path:
    final = checkpoint_dir(stage, layers, tp, experts, ep)
    if (final / "bench.json").exists():
        return final
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(root).free
    if free < NEEDED_BYTES:
        sys.exit(
            f"only {free / 2**30:.1f} GiB free under {root}; the benchmark needs ~{NEEDED_BYTES / 2**30:.0f} GiB "
            "per stage"
        )
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=root))
    env = torchrun.environment()
    cmd = torchrun.command(
        HERE / "train_big.py",
        WORLD_SIZE,
        "--stage",
        str(stage),
        "--out",
        str(tmp / "ckpt"),
        "--layers",
        str(layers),
        "--tp",
        str(tp),
        "--experts",
        str(experts),
        "--ep",
        str(ep),
    )
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"DeepSpeed run failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-8000:]}")
        os.rename(tmp / "ckpt", final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if not quiet:
        print(f"built {final} in {time.monotonic() - t0:.0f} s", file=sys.stderr)
    return final


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage", type=int, choices=[2, 3], action="append", help="default: 2 and 3")
    ap.add_argument("--layers", type=int, default=4, help="train_big.py's layers (4: ~100M parameters)")
    ap.add_argument("--tp", type=int, default=1, help="AutoTP degree (ZeRO-1/2)")
    ap.add_argument("--experts", type=int, default=0, help="MoE experts per layer (0: no MoE)")
    ap.add_argument("--ep", type=int, default=1, help="with --experts: expert-parallel degree")
    args = ap.parse_args()
    for stage in args.stage or [2, 3]:
        print(build(stage, layers=args.layers, tp=args.tp, experts=args.experts, ep=args.ep))


if __name__ == "__main__":
    main()
