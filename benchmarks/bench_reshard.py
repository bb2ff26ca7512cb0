"""``ckptspec reshard`` next to DeepSpeed's ``ds_to_universal`` on the ~100M-parameter ZeRO-2 checkpoint.

    DS_ACCELERATOR=cpu .venv/bin/python benchmarks/bench_reshard.py [--world-size 3] [--layers 4 16] [--keep]

Both run as child processes on the checkpoint of benchmarks/make_big_checkpoint.py (built on first
use, cached; ``$CKPTSPEC_BENCH_CACHE``), each measured by benchmarks/child.py: wall and CPU seconds
and peak RSS. They do not do the same work: ``reshard`` validates the source (reading every tensor
for its digests, when the manifest has them), writes the target's per-rank DeepSpeed files and
validates its output; ``export-universal`` validates the source and writes DeepSpeed's universal folder;
``ds_to_universal`` writes per-parameter files that ``load_universal`` slices
at load time (``--inject_missing_state``: this checkpoint has no ``universal_checkpoint_info``).
``--layers`` picks the model sizes (make_big_checkpoint.py's ``--layers``: 4 is ~100M parameters, 16
~200M; the largest tensors, the embedding and the head, are the same in both): peak RSS that does not
grow from one to the other is peak memory independent of model size. Prints a markdown table, with
the machine's load average before and after (other jobs on a shared machine slow both).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from child import run_child
from make_big_checkpoint import build


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _run(source: Path, size: str, args, env) -> list:
    """reshard, export-universal and ds_to_universal on ``source``: table rows."""
    tag = (source / "latest").read_text().strip()
    work = Path(tempfile.mkdtemp(prefix="bench-reshard-"))  # never inside the (maybe shared) source cache
    rows = []
    try:
        out = work / "resharded"
        r = run_child(
            [sys.executable, "-m", "ckptspec", "reshard", str(source), str(out), "--world-size", str(args.world_size)],
            env,
        )
        rows.append((size, f"ckptspec reshard --world-size {args.world_size}", r, _size(out)))
        shutil.rmtree(out, ignore_errors=True)
        r = run_child(
            [sys.executable, "-m", "ckptspec", "reshard", str(source), str(out), "--world-size", str(args.world_size)]
            + ["--stage", "3"],
            env,
        )
        rows.append((size, f"ckptspec reshard --world-size {args.world_size} --stage 3", r, _size(out)))
        shutil.rmtree(out, ignore_errors=True)
        ours = work / "ours-universal"
        r = run_child([sys.executable, "-m", "ckptspec", "export-universal", str(source), str(ours)], env)
        rows.append((size, "ckptspec export-universal", r, _size(ours)))
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
        rows.append((size, "ds_to_universal --inject_missing_state", r, _size(universal)))
    finally:
        if args.keep:
            print(f"outputs kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-size", type=int, default=3)
    ap.add_argument("--keep", action="store_true", help="keep the outputs (in the printed directory)")
    ap.add_argument("--layers", type=int, nargs="+", default=[4], help="model sizes (make_big_checkpoint.py)")
    args = ap.parse_args()
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    load_before = os.getloadavg()
    rows = []
    for layers in args.layers:
        source = build(2, layers=layers)
        params = json.loads((source / "bench.json").read_text())["params"]
        rows += _run(source, f"{params / 1e6:.0f}M", args, env)
    load_after = os.getloadavg()
    print(f"sources: {', '.join(str(build(2, layers=n)) for n in args.layers)}; {os.cpu_count()} CPUs")
    print(
        f"load average before: {load_before[0]:.1f} {load_before[1]:.1f} {load_before[2]:.1f}; "
        f"after: {load_after[0]:.1f} {load_after[1]:.1f} {load_after[2]:.1f}"
    )
    print()
    print("| model | command | wall s | CPU s | peak RSS MiB | output MiB |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for model, what, r, size in rows:
        print(f"| {model} | {what} | {r['wall']:.1f} | {r['cpu']:.1f} | {r['rss_mib']:.0f} | {size / 2**20:.0f} |")


if __name__ == "__main__":
    main()
