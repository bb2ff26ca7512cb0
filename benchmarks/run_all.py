"""Every benchmark of docs/performance.md, printed as one markdown report.

    .venv/bin/python benchmarks/run_all.py [--runs 3] [--quick] [--reference /work/main/.venv/bin/ckptspec]

Sections: manifest validation at 10k/100k/1M parameters (JSON and msgpack, beside a
bare parse), `ckptspec generate` on real DeepSpeed checkpoints with 10k-100k tensors,
reconstruction of a 100M-parameter checkpoint beside DeepSpeed's zero_to_fp32, and
hashing throughput. Inputs are built on first use and cached under benchmarks/.cache/
(the real checkpoints with DeepSpeed on the CPU: allow about half an hour the first
time; the 1M-tensor checkpoint about 20 minutes more). ``--quick`` skips the million-parameter
manifest and the 1M-tensor checkpoint, runs each command once and leaves out reconstruct at 10k-100k
tensors: under 5 minutes once the inputs are built.
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
import os, sys, time
from ckptspec.checkpoint.hashing import file_digests
jobs, paths = int(sys.argv[2]), sys.argv[3:]
t0, c0 = time.perf_counter(), time.process_time()
file_digests(paths, sys.argv[1], jobs)
print(sum(os.path.getsize(p) for p in paths), time.perf_counter() - t0, time.process_time() - c0)
"""
# Issue #19's scaling table: 10k, 100k and 1M tensors (1M: DeepSpeed needs about 20 minutes to build it).
TENSORS = (10_000, 100_000, 1_000_000)


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
    cmd = f"python -c HASH_CODE ALGORITHM JOBS {len(files)} *.pt files of {bench_reconstruct.build(2).name}"
    lines = [
        "| algorithm | threads | data (GB) | best wall s | CPU s | MB/s | load (1 min) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for algorithm in ("sha256", "blake2b"):
        for jobs in (1, os.cpu_count() or 1):
            timings = []
            for _ in range(runs):
                out = subprocess.run(
                    [PY, "-c", HASH_CODE, algorithm, str(jobs), *files], capture_output=True, text=True, check=True
                ).stdout.split()
                timings.append((float(out[1]), float(out[2]), int(out[0])))
            seconds, cpu, size = min(timings)
            lines.append(
                f"| {algorithm} | {jobs} | {size / 1e9:.2f} | {seconds:.2f} | {cpu:.2f} | {size / 1e6 / seconds:.0f} | "
                f"{os.getloadavg()[0]:.1f} |"
            )
    return [
        *lines,
        "",
        f"Command: `{cmd}` (`HASH_CODE` in benchmarks/run_all.py: `file_digests(paths, algorithm, jobs)`).",
    ]


def identical_rows(reference: str, sizes) -> list[str]:
    out = subprocess.run(
        [PY, str(HERE / "check_identical.py"), "--reference", reference, "--hash", "--many", *map(str, sizes)],
        capture_output=True,
        text=True,
    )
    return [
        out.stdout.strip(),
        "",
        f"Command: `benchmarks/check_identical.py --reference {reference} --hash --many {' '.join(map(str, sizes))}`",
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="no 1M-tensor checkpoint or manifest, one run per row")
    ap.add_argument(
        "--reference",
        help="another build's ckptspec executable (e.g. main's): compare generate's bytes with it (check_identical.py)",
    )
    ap.add_argument("--build-timeout", type=float, default=3600, help="seconds DeepSpeed may take per checkpoint")
    args = ap.parse_args(argv)
    if args.quick:
        args.runs = 1
    load_before = os.getloadavg()[0]
    out = [f"Machine: {machine()}.", ""]

    sizes = bench_validate.SIZES[:2] if args.quick else bench_validate.SIZES
    out += ["### Validating a manifest", "", bench_validate.markdown(bench_validate.rows(sizes, args.runs)), ""]

    tensors = TENSORS[:2] if args.quick else TENSORS
    commands = ("generate", "validate") if args.quick else ("generate", "validate", "reconstruct")
    generated = bench_generate.rows(
        tensors,
        runs=args.runs,
        commands=commands,
        build_timeout=args.build_timeout,
        log=lambda m: print(m, file=sys.stderr),
    )
    out += ["### Generating a manifest from a checkpoint with many tensors", "", bench_generate.markdown(generated), ""]
    if args.reference:
        out += ["### The same bytes as the reference build", "", *identical_rows(args.reference, tensors[:2]), ""]

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
