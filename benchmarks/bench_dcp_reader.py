"""A DeepSpeed checkpoint loaded into FSDP2 in place (ckptspec's DCP reader) against a copy (``ckptspec export
--format dcp``, then ``dcp.load`` of the copy), on the ~100M-parameter ZeRO-2 benchmark checkpoint, world size 2.

    .venv/bin/python benchmarks/bench_dcp_reader.py [--runs 1] [--world-size 2]

Builds (once, cached; make_big_checkpoint.py, $CKPTSPEC_BENCH_CACHE) the checkpoint, warms the page cache, then
runs as separate processes: the export (the copy's extra step: wall, peak RSS, the disk it takes) and two torchrun
FSDP2 jobs (fsdp2_load_big.py), one per way in. Per rank: the load's wall time, the bytes the process read during
the load (``rchar``), the rank's share (its local shards of every parameter and both Adam moments, in bytes: what
the load must fill) and its peak RSS before and after the load (the model is built whole before ``fully_shard``,
so the peak before the load is the job's floor). Each number is the best (wall) or largest (RSS, bytes) of
``--runs`` runs. Prints markdown tables. Imports nothing heavy (a child's ``ru_maxrss`` starts at its parent's).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torchrun
from bench_reconstruct import warm
from child import load_line, run_child
from make_big_checkpoint import build

PY = sys.executable
HERE = Path(__file__).resolve().parent


def _du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _warm_all(path: Path) -> None:
    """Read every file once (bench_reconstruct.warm reads ``*.pt`` only; the copy's files are ``.distcp``)."""
    buffer = bytearray(1 << 20)
    for file in (p for p in path.rglob("*") if p.is_file()):
        with open(file, "rb", buffering=0) as fh:
            while fh.readinto(buffer):
                pass


def _job(source: list[str], world_size: int, report: Path, env: dict) -> tuple[dict, list[dict]]:
    cmd = torchrun.command(HERE / "fsdp2_load_big.py", world_size, *source, "--report", str(report))
    outer = run_child(cmd, env)
    return outer, json.loads(report.read_text())


def _best(runs: list[list[dict]]) -> list[dict]:
    """Per rank: the fastest load, the most bytes read, the largest peaks, over the runs."""
    out = []
    for ranks in zip(*runs):
        row = dict(ranks[0])
        row["wall_s"] = min(r["wall_s"] for r in ranks)
        for key in ("rchar", "peak_rss_before_mib", "peak_rss_mib"):
            row[key] = max(r[key] for r in ranks)
        out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--world-size", type=int, default=2)
    args = ap.parse_args()
    env = torchrun.environment()
    env.pop("CKPTSPEC_DEBUG", None)
    start = os.getloadavg()
    ckpt = build(2)
    size = warm(ckpt)
    scratch = Path(tempfile.mkdtemp(prefix="ckptspec-bench-dcp-reader-"))
    try:
        copy = scratch / "dcp"
        exports = []
        for _ in range(args.runs):
            shutil.rmtree(copy, ignore_errors=True)
            exports.append(run_child([PY, "-m", "ckptspec", "export", str(ckpt), str(copy), "-q"], env))
        extra_disk = _du(copy)
        _warm_all(copy)
        jobs = {}
        for name, source in (("reader (in place)", ["--reader", str(ckpt)]), ("copy", ["--copy", str(copy)])):
            outers, ranks = [], []
            for i in range(args.runs):
                outer, per_rank = _job(source, args.world_size, scratch / f"{i}-{len(jobs)}.json", env)
                outers.append(outer)
                ranks.append(per_rank)
            jobs[name] = (min(o["wall"] for o in outers), _best(ranks))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    print(f"{ckpt.name}: {size / 1e9:.2f} GB; FSDP2 world size {args.world_size}; {args.runs} run(s) each")
    print(load_line(start) + "\n")
    print("| step | wall (s) | peak RSS (MiB) | extra disk (MiB) |")
    print("| --- | ---: | ---: | ---: |")
    print(
        f"| ckptspec export --format dcp (the copy) | {min(e['wall'] for e in exports):.1f} | "
        f"{max(e['rss_mib'] for e in exports):.0f} | {extra_disk / 2**20:.0f} |"
    )
    for name, (outer, _) in jobs.items():
        print(f"| FSDP2 job, {name} (whole torchrun) | {outer:.1f} | - | {0 if 'reader' in name else '-'} |")
    print("\n| load | rank | load wall (s) | read (MiB) | share (MiB) | read / share | peak RSS before, after (MiB) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for name, (_, ranks) in jobs.items():
        for r in ranks:
            read, share = r["rchar"], r["share_bytes"]
            print(
                f"| {name} | {r['rank']} | {r['wall_s']:.1f} | {read / 2**20:.0f} | {share / 2**20:.0f} | "
                f"{read / share:.3f} | {r['peak_rss_before_mib']:.0f}, {r['peak_rss_mib']:.0f} |"
            )
    counted = [r for _, ranks in jobs.values() for r in ranks if r["bytes_read"] is not None]
    own = ", ".join(f"rank {r['rank']} {r['bytes_read']:,} B" for r in counted)
    print(f"\nthe reader's own count (bytes_read): {own}")


if __name__ == "__main__":
    main()
