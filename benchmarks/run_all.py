"""Every benchmark of docs/performance.md, printed as one markdown report.

    .venv/bin/python benchmarks/run_all.py [--runs 3] [--quick]

Sections: manifest validation at 10k/100k/1M parameters (JSON and msgpack, beside a
bare parse), `ckptspec generate` on real DeepSpeed checkpoints with 10k-100k tensors,
reconstruction of a 100M-parameter checkpoint beside DeepSpeed's zero_to_fp32, and
hashing throughput. Inputs are built on first use and cached under benchmarks/.cache/
(the real checkpoints with DeepSpeed on the CPU: allow about half an hour the first
time). ``--quick`` skips the million-parameter manifest and the 100k-tensor checkpoint.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_generate
import bench_reconstruct
import bench_validate

PY = sys.executable
HASH_CODE = """
import sys, time
from ckptspec.checkpoint.hashing import file_digest
paths = sys.argv[2:]
total = 0
t0 = time.perf_counter()
for p in paths:
    file_digest(p, sys.argv[1])
    total += __import__("os").path.getsize(p)
print(total, time.perf_counter() - t0)
"""


def machine() -> str:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor() or "unknown CPU",
    )
    mem_kb = next(
        int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines() if line.startswith("MemTotal")
    )
    versions = subprocess.run(
        [
            PY,
            "-c",
            "import deepspeed, torch, pydantic, jsonschema_rs, jsonschema, msgpack;"
            "print(f'torch {torch.__version__}, deepspeed {deepspeed.__version__}, pydantic {pydantic.__version__}, '"
            "f'jsonschema {jsonschema.__version__}, msgpack {msgpack.version}')",
        ],
        capture_output=True,
        text=True,
        env=dict(os.environ, DS_ACCELERATOR="cpu"),
    ).stdout.strip()
    return (
        f"{cpu}, {os.cpu_count()} CPUs, {mem_kb / 2**20:.0f} GiB RAM, Linux {platform.release()}, "
        f"Python {platform.python_version()}; {versions}"
    )


def hashing_rows(runs: int) -> list[str]:
    files = sorted(str(p) for p in bench_reconstruct.build(2).rglob("*.pt"))
    lines = ["| algorithm | data (GB) | best s | MB/s |", "|---|---:|---:|---:|"]
    for algorithm in ("sha256", "blake2b"):
        timings = []
        for _ in range(runs):
            out = subprocess.run(
                [PY, "-c", HASH_CODE, algorithm, *files], capture_output=True, text=True, check=True
            ).stdout.split()
            timings.append((float(out[1]), int(out[0])))
        seconds, size = min(timings)
        lines.append(f"| {algorithm} | {size / 1e9:.2f} | {seconds:.2f} | {size / 1e6 / seconds:.0f} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    load_before = os.getloadavg()[0]
    out = [f"Machine: {machine()}.", ""]

    sizes = bench_validate.SIZES[:2] if args.quick else bench_validate.SIZES
    out += ["### Validating a manifest", "", bench_validate.markdown(bench_validate.rows(sizes, args.runs)), ""]

    tensors = bench_generate.SIZES[:2] if args.quick else bench_generate.SIZES
    out += [
        "### Generating a manifest from a checkpoint with many tensors",
        "",
        bench_generate.markdown(bench_generate.rows(tensors, runs=args.runs, log=lambda m: print(m, file=sys.stderr))),
        "",
    ]

    rows, notes, _ = bench_reconstruct.measure([2, 3], args.runs)
    out += ["### Reconstructing 100M parameters (2 ranks, bf16)", "", bench_reconstruct.markdown(rows), ""]
    out += [f"- {note}" for note in notes] + [""]

    out += ["### Hashing shard files (ZeRO-2 checkpoint above, from the page cache)", "", *hashing_rows(args.runs), ""]
    out.append(
        f"Load average {load_before:.1f} before and {os.getloadavg()[0]:.1f} after the runs; "
        f"each row is the fastest of {args.runs} runs."
    )
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
