"""``ckptspec reshard`` split over 1, 2 and 3 torchrun processes (issue #40 item 3) on the ~100M-parameter checkpoint.

    DS_ACCELERATOR=cpu .venv/bin/python benchmarks/bench_reshard_split.py [--world-size 3] [--nproc 1 2 3] [--layers 4]

The ZeRO-2 bf16 checkpoint of benchmarks/make_big_checkpoint.py (2 ranks; built on first use, cached) resharded
to ``--world-size`` ranks, once as one plain process and once under ``torchrun --nproc_per_node N`` for each N
(gloo on 127.0.0.1; the processes share the work: each writes every N-th file). Per run: wall and CPU seconds
of the whole process tree, the peak RSS of its largest process (benchmarks/child.py), and per rank the files it
wrote and the checkpoint bytes it read (what the command prints: tensor ranges read for its files, its share of
the digests and file hashes before and after the write, and rank 0's commit). Every split output is compared
with the one-process output byte for byte. Prints a markdown table and the load average (a shared machine
slows every run; CPU seconds compare better than wall).
"""

from __future__ import annotations

import argparse
import filecmp
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from child import load_line, run_child
from make_big_checkpoint import build
from torchrun import command


def _same_tree(a: Path, b: Path) -> bool:
    files_a = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    files_b = sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    return files_a == files_b and all(filecmp.cmp(a / f, b / f, shallow=False) for f in files_a)


def _ranks(out: str) -> list[tuple[int, int]]:
    return [(int(f), int(r)) for f, r in re.findall(r"rank \d+ of \d+: wrote (\d+) files, read (\d+) checkpoint", out)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-size", type=int, default=3)
    ap.add_argument("--nproc", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--layers", type=int, default=4, help="model size (make_big_checkpoint.py)")
    args = ap.parse_args()
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    source = build(2, layers=args.layers)
    size = sum(p.stat().st_size for p in source.rglob("*") if p.is_file())
    start = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="bench-split-"))
    reshard = ["ckptspec", "reshard", str(source)]
    rows = []
    try:
        one = work / "one"
        r = run_child([sys.executable, "-m", *reshard, str(one), "--world-size", str(args.world_size)], env)
        rows.append(("one process (no torchrun)", r, [], True))
        for n in args.nproc:
            out = work / f"split{n}"
            r = run_child(command("-m", n, *reshard, str(out), "--world-size", str(args.world_size)), env)
            rows.append((f"torchrun --nproc_per_node {n}", r, _ranks(r["out"]), _same_tree(one, out)))
            shutil.rmtree(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"source: {source} ({size / 2**20:.0f} MiB), resharded to {args.world_size} ranks")
    print(load_line(start))
    print()
    print("| run | wall s | CPU s | peak RSS MiB (largest process) | per rank: files, MiB read | same bytes |")
    print("| --- | ---: | ---: | ---: | --- | --- |")
    for what, r, ranks, same in rows:
        shares = "; ".join(f"{files}, {read / 2**20:.0f}" for files, read in ranks) or "-"
        print(
            f"| {what} | {r['wall']:.1f} | {r['cpu']:.1f} | {r['rss_mib']:.0f} | {shares} | {'yes' if same else 'NO'} |"
        )


if __name__ == "__main__":
    main()
