"""The save hook's cost beside DeepSpeed's own save_checkpoint (issue #19: goal at most 10% of the save).

    .venv/bin/python benchmarks/bench_save_hook.py [--tensors 10000 --tensors 100000]

Runs train_hook.py under torchrun (2 ranks, ZeRO-2, bf16, train_many.py's model of N tiny tensors;
at 100k tensors DeepSpeed itself needs about 4 minutes to initialize, step and save twice) and prints
one row per phase: wall seconds (between barriers), rank 0's CPU seconds, and the share of
DeepSpeed's own (warm) ``engine.save_checkpoint``; then the steps of the hook on rank 0.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torchrun

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SAVE = "deepspeed save"


def measure(tensors: int, scratch_root: str | None = None) -> dict:
    scratch = Path(tempfile.mkdtemp(prefix="ckptspec-hook-", dir=scratch_root))
    env = torchrun.environment()
    cmd = torchrun.command(
        HERE / "train_hook.py",
        2,
        f"--tensors={tensors}",
        f"--out={scratch}",
    )
    try:
        done = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
        line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            raise RuntimeError(f"train_hook.py failed (exit {done.returncode}):\n{(done.stdout + done.stderr)[-4000:]}")
        result = json.loads(line[len("RESULT ") :])
        result["load"] = os.getloadavg()[0]
        return result
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def markdown(results: list[dict]) -> str:
    lines = [
        "| tensors | phase | wall s | rank 0 CPU s | CPU share of DeepSpeed's save | goal | load (1 min) |",
        "|---:|---|---:|---:|---:|---|---:|",
    ]
    for r in results:
        save_cpu = r["times"][SAVE]["cpu_rank0"]
        for phase, t in r["times"].items():
            share = t["cpu_rank0"] / save_cpu if save_cpu else 0.0
            goal = ""
            if phase == "manifest_from_engine":
                goal = f"<= 10%: {'met' if share <= 0.10 else 'not met'}"
            lines.append(
                f"| {r['tensors']:,} | {phase} | {t['wall']:.2f} | {t['cpu_rank0']:.2f} | {share:.0%} | {goal} | "
                f"{r['load']:.1f} |"
            )
    lines += ["", "Inside the hook (rank 0, wall s / CPU s, summed over calls):", ""]
    for r in results:
        for hook, parts in r["hook_parts_rank0"].items():
            shown = ", ".join(f"{name} {w:.2f}/{c:.2f}" for name, (w, c) in parts.items())
            lines.append(f"- {r['tensors']:,} tensors, {hook}: {shown}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tensors", type=int, action="append", help="default: 10000 and 100000")
    args = ap.parse_args()
    results = []
    for n in args.tensors or [10_000, 100_000]:
        print(f"  save hook at {n} tensors ...", file=sys.stderr)
        results.append(measure(n))
    print(markdown(results))


if __name__ == "__main__":
    main()
