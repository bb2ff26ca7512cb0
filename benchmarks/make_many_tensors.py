"""Build (once, cached) real DeepSpeed ZeRO checkpoints whose model holds N tiny tensors.

    .venv/bin/python benchmarks/make_many_tensors.py                      # N in 10k 25k 50k 100k, ZeRO-2
    .venv/bin/python benchmarks/make_many_tensors.py --tensors 10000 --stage 3

The scaling benchmark (bench_generate.py) needs checkpoints with as many tensors as a
mixture-of-experts model (~100k) but few bytes: see train_many.py for the model. Each
one is a real DeepSpeed 0.19.x save (torchrun, 2 ranks, gloo on CPU, bf16, one step).
They go to $CKPTSPEC_BENCH_CACHE or benchmarks/.cache/ (git-ignored), keyed by a hash of
train_many.py, built in a temporary directory and renamed into place when complete.
``bench.json`` in each records DeepSpeed's own init/step/save times.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torchrun

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
WORLD_SIZE = 2
SIZES = (10_000, 25_000, 50_000, 100_000)
DEFAULT_TIMEOUT_S = 1800


class BuildTimeout(RuntimeError):
    """DeepSpeed did not finish within the time limit (the checkpoint is not feasible here)."""


def cache_root() -> Path:
    return Path(os.environ.get("CKPTSPEC_BENCH_CACHE", HERE / ".cache"))


def _script_key() -> str:
    # A changed model must not reuse checkpoints built from the old one.
    return hashlib.sha256((HERE / "train_many.py").read_bytes()).hexdigest()[:8]


def checkpoint_dir(n_tensors: int, stage: int, steps: int = 1, world_size: int = WORLD_SIZE) -> Path:
    return cache_root() / f"many{n_tensors}-zero{stage}-ws{world_size}-bf16-s{steps}-{_script_key()}"


def build(
    n_tensors: int,
    stage: int = 2,
    steps: int = 1,
    timeout: float = DEFAULT_TIMEOUT_S,
    quiet: bool = False,
    quadratic_duplicate_check: bool = False,
    world_size: int = WORLD_SIZE,
) -> Path:
    """The save directory of a cached checkpoint with ``n_tensors`` parameter tensors (built if missing).

    Raises ``BuildTimeout`` if DeepSpeed takes longer than ``timeout`` seconds.
    ``quadratic_duplicate_check``: keep DeepSpeed's O(N^2) init check (see train_many.py).
    ``world_size``: ranks; one rank holds about half the memory of two (each rank of a ZeRO-1/2 job holds
    every parameter tensor), which is what lets a million tensors fit in 23 GB."""
    final = checkpoint_dir(n_tensors, stage, steps, world_size)
    if quadratic_duplicate_check:
        final = final.with_name(final.name + "-quadcheck")
    if (final / "bench.json").exists():
        return final
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=root))
    env = torchrun.environment()
    cmd = torchrun.command(
        HERE / "train_many.py",
        world_size,
        "--tensors",
        str(n_tensors),
        "--stage",
        str(stage),
        "--steps",
        str(steps),
        "--out",
        str(tmp / "ckpt"),
    )
    cmd += ["--quadratic-duplicate-check"] if quadratic_duplicate_check else []
    if not quiet:
        print(f"building {final.name} (DeepSpeed, {world_size} ranks) ...", file=sys.stderr)
    t0 = time.monotonic()
    try:
        # Own session, so a timeout can end torchrun and both ranks together.
        proc = subprocess.Popen(
            cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise BuildTimeout(f"{final.name}: DeepSpeed did not finish in {timeout:.0f} s") from None
        if proc.returncode != 0:
            raise RuntimeError(f"DeepSpeed run failed (exit {proc.returncode}):\n{output[-8000:]}")
        info = json.loads((tmp / "ckpt" / "bench.json").read_text())
        info["build_wall_s"] = round(time.monotonic() - t0, 1)  # torchrun start to exit, imports included
        (tmp / "ckpt" / "bench.json").write_text(json.dumps(info, indent=1))
        os.rename(tmp / "ckpt", final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if not quiet:
        print(f"built {final} in {time.monotonic() - t0:.0f} s", file=sys.stderr)
    return final


def build_info(checkpoint: Path) -> dict:
    """What train_many.py recorded: tensor counts and DeepSpeed's phase times."""
    return json.loads((checkpoint / "bench.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tensors", type=int, action="append", help=f"default: {' '.join(map(str, SIZES))}")
    ap.add_argument("--stage", type=int, choices=[1, 2, 3], action="append", help="default: 2")
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--world-size", type=int, default=WORLD_SIZE, help=f"ranks (default {WORLD_SIZE})")
    ap.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per DeepSpeed run")
    ap.add_argument(
        "--quadratic-duplicate-check",
        action="store_true",
        help="keep DeepSpeed's O(N^2) duplicate-param check in initialize (see train_many.py)",
    )
    args = ap.parse_args()
    for stage in args.stage or [2]:
        for n in args.tensors or SIZES:
            try:
                path = build(
                    n,
                    stage,
                    args.steps,
                    args.timeout,
                    quadratic_duplicate_check=args.quadratic_duplicate_check,
                    world_size=args.world_size,
                )
            except BuildTimeout as exc:
                print(f"skipped: {exc}", file=sys.stderr)
                continue
            info = build_info(path)
            print(path, json.dumps(info["deepspeed_times"]), f"build {info['build_wall_s']} s")


if __name__ == "__main__":
    main()
