"""Wall time and peak memory of `ckptspec export --format dcp` on the ~100M-parameter benchmark checkpoint.

    .venv/bin/python benchmarks/bench_export_dcp.py [--runs 3] [--stage 2 --stage 3]

Builds (once, cached; see make_big_checkpoint.py, $CKPTSPEC_BENCH_CACHE) the real ~100M-parameter
ZeRO checkpoints (2 ranks, bf16), warms the page cache, then runs as separate processes on the
same files: ``python -c pass`` (the floor of a child's RSS), ``ckptspec export --format dcp``
(validation, then the DCP directory: fp32 masters, frozen parameters, buffers, Adam's moments and
step, param groups) and, for comparison, ``ckptspec reconstruct --optimizer-state`` (the same
tensors into safetensors). Each row is the fastest of ``--runs`` runs (wall clock) with the largest
peak RSS (``ru_maxrss``) over the runs, and the 1-minute load average seen before the runs (the
machine may be shared: wall times under load are upper bounds; RSS does not depend on it).
Prints one markdown table. This script imports nothing heavy (a child's ``ru_maxrss`` starts at
its parent's peak).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_reconstruct import warm
from child import run_child
from make_big_checkpoint import build

PY = sys.executable
FLOOR = "import numpy, torch, torch.distributed.checkpoint, pydantic"


def _largest(checkpoint: Path) -> str:
    """The largest tensor of the export (fp32): about what a one-tensor-at-a-time writer holds at most."""
    import json
    import subprocess

    text = subprocess.run([PY, "-m", "ckptspec", "generate", str(checkpoint), "-o", "-"], capture_output=True).stdout
    params = [p for g in json.loads(text)["groups"] for p in g["params"]]
    big = max(params, key=lambda p: p["numel"])
    return f"{big['name']} {big['shape']} ({big['numel'] * 4 / 2**20:.0f} MiB in fp32)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--stage", type=int, action="append", choices=[2, 3])
    args = ap.parse_args()
    stages = args.stage or [2]
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    env.pop("CKPTSPEC_DEBUG", None)
    scratch = Path(tempfile.mkdtemp(prefix="ckptspec-bench-dcp-"))
    rows = []
    try:
        jobs = [
            ("python -c pass (floor)", "-", [PY, "-c", "pass"], None),
            ("import torch.distributed.checkpoint (the export's floor)", "-", [PY, "-c", FLOOR], None),
        ]
        largest = "?"
        for stage in stages:
            ckpt = build(stage)
            largest = _largest(ckpt)  # before warming: this child's RSS is not measured
            size = warm(ckpt)
            label = f"ZeRO-{stage} ({size / 1e9:.2f} GB)"
            out = scratch / f"dcp-{stage}"
            jobs.append(
                (
                    "ckptspec export --format dcp",
                    label,
                    [PY, "-m", "ckptspec", "export", str(ckpt), str(out), "-q"],
                    out,
                )
            )
            out2 = scratch / f"st-{stage}"
            jobs.append(
                (
                    "ckptspec reconstruct --optimizer-state",
                    label,
                    [PY, "-m", "ckptspec", "reconstruct", str(ckpt), str(out2), "--optimizer-state", "-q"],
                    out2,
                )
            )
        for tool, label, cmd, out in jobs:
            walls, rss, loads = [], [], []
            for _ in range(args.runs):
                if out is not None:
                    shutil.rmtree(out, ignore_errors=True)
                loads.append(os.getloadavg()[0])
                result = run_child(cmd, env)
                walls.append(result["wall"])
                rss.append(result["rss_mib"])
            written = sum(p.stat().st_size for p in out.rglob("*") if p.is_file()) if out is not None else 0
            rows.append((tool, label, min(walls), max(rss), written / 2**20, max(loads)))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"{args.runs} runs each, {os.cpu_count()} CPUs; the largest output tensor: {largest}\n")
    print("| tool | checkpoint | wall (s, best) | peak RSS (MiB, max) | output (MiB) | load avg (1 min, max) |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for tool, label, wall, rss, written, load in rows:
        print(f"| {tool} | {label} | {wall:.1f} | {rss:.0f} | {written:.0f} | {load:.1f} |")


if __name__ == "__main__":
    main()
