"""``ckptspec reshard`` next to DeepSpeed's ``ds_to_universal`` on the ~100M-parameter ZeRO-2 checkpoint.

    DS_ACCELERATOR=cpu .venv/bin/python benchmarks/bench_reshard.py [--world-size 3] [--keep]

Both run as child processes on the checkpoint of benchmarks/make_big_checkpoint.py (built on first
use, cached; ``$CKPTSPEC_BENCH_CACHE``), each measured by benchmarks/child.py: wall and CPU seconds
and peak RSS. They do not do the same work: ``reshard`` validates the source (reading every tensor
for its digests, when the manifest has them), writes the target's per-rank DeepSpeed files and
validates its output; ``export-universal`` validates the source and writes DeepSpeed's universal folder;
``ds_to_universal`` writes per-parameter files that ``load_universal`` slices
at load time (``--inject_missing_state``: this checkpoint has no ``universal_checkpoint_info``).
Prints a markdown table, with the machine's load average before and after (other jobs on a shared
machine slow both).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from child import run_child
from make_big_checkpoint import build, checkpoint_dir


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-size", type=int, default=3)
    ap.add_argument("--keep", action="store_true", help="keep the outputs (in the printed directory)")
    args = ap.parse_args()
    source = checkpoint_dir(2)
    if not (source / "bench.json").exists():
        build(2)
    tag = (source / "latest").read_text().strip()
    work = Path(tempfile.mkdtemp(prefix="bench-reshard-"))  # never inside the (maybe shared) source cache
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    load_before = os.getloadavg()
    rows = []
    try:
        out = work / "resharded"
        r = run_child(
            [sys.executable, "-m", "ckptspec", "reshard", str(source), str(out), "--world-size", str(args.world_size)],
            env,
        )
        rows.append((f"ckptspec reshard --world-size {args.world_size}", r, _size(out)))
        shutil.rmtree(out, ignore_errors=True)
        ours = work / "ours-universal"
        r = run_child([sys.executable, "-m", "ckptspec", "export-universal", str(source), str(ours)], env)
        rows.append(("ckptspec export-universal", r, _size(ours)))
        shutil.rmtree(ours, ignore_errors=True)
        universal = work / "universal"
        universal.mkdir()
        r = run_child(
            [
                sys.executable,
                "-m",
                "deepspeed.checkpoint.ds_to_universal",
                "--input_folder",
                str(source / tag),
                "--output_folder",
                str(universal / f"{tag}_universal"),
                "--inject_missing_state",
            ],
            env,
        )
        rows.append(("ds_to_universal --inject_missing_state", r, _size(universal)))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    load_after = os.getloadavg()
    print(f"source: {source} ({_size(source) / 2**20:.0f} MiB), {os.cpu_count()} CPUs")
    print(
        f"load average before: {load_before[0]:.1f} {load_before[1]:.1f} {load_before[2]:.1f}; "
        f"after: {load_after[0]:.1f} {load_after[1]:.1f} {load_after[2]:.1f}"
    )
    print()
    print("| command | wall s | CPU s | peak RSS MiB | output MiB |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for what, r, size in rows:
        print(f"| {what} | {r['wall']:.1f} | {r['cpu']:.1f} | {r['rss_mib']:.0f} | {size / 2**20:.0f} |")
    if args.keep:
        print(f"\noutputs kept in {work}")


if __name__ == "__main__":
    main()
