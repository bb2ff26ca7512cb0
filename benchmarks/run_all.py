"""Every benchmark of docs/performance.md, printed as one markdown report.

    CKPTSPEC_BENCH_CACHE=/work/bench-data .venv/bin/python benchmarks/run_all.py [--runs 3] [--only TABLE ...]

Tables (``--only``, repeatable; default all): ``validate`` (manifests of 10k/100k/1M parameters),
``generate`` (real DeepSpeed checkpoints of 10k/100k/250k tensors, and 1M when built: see below),
``identical`` (with ``--reference``), ``reconstruct`` (100M parameters beside zero_to_fp32),
``scale`` (the largest checkpoint of make_scale_checkpoint.py: ckptspec --jobs 1/N beside
zero_to_fp32 and a plain ``dd`` copy with fsync), ``hashing`` (MB/s, 1 and all threads) and
``hook`` (the save hook beside DeepSpeed's own save at 10k and 100k tensors; about 6 minutes).

Every row gives its goal, wall and CPU seconds, peak RSS, the 1-minute load average and the
command that reproduces it. Inputs come from $CKPTSPEC_BENCH_CACHE (default benchmarks/.cache/):
the many-tensor checkpoints are built on first use (make_many_tensors.py: 100k tensors take about
4 minutes), the scale checkpoint never is (make_scale_checkpoint.py; the table is skipped without
one). A DeepSpeed checkpoint of 1M tensors does not fit this 23 GB machine at 2 ranks (each passed
9.6 GiB during ``initialize``); at one rank it builds in about 6 minutes (13.6 GB peak:
``make_many_tensors.py --tensors 1000000 --world-size 1``), and ``generate`` takes the sizes already
built beyond 250k, at 2 ranks or else 1.
``--quick``: one run per row, no 1M manifest, no hook. With the inputs built, the whole set takes
15-20 minutes on a quiet machine (``--only generate --only scale --only hashing --quick`` took
4.5 minutes at load 7).
"""

from __future__ import annotations

import argparse
import compileall
import os
import platform
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_generate
import bench_reconstruct
import bench_save_hook
import bench_scale
import bench_validate
from make_many_tensors import checkpoint_dir

PY = sys.executable
HASH_CODE = """
import os, sys, time
from ckptspec.checkpoint.hashing import file_digests
jobs, paths = int(sys.argv[2]), sys.argv[3:]
t0, c0 = time.perf_counter(), time.process_time()
file_digests(paths, sys.argv[1], jobs)
print(sum(os.path.getsize(p) for p in paths), time.perf_counter() - t0, time.process_time() - c0)
"""
# Issue #19's scaling table: 10k, 100k and 250k tensors are built when missing; 1M only measured when built.
TENSORS = (10_000, 100_000, 250_000)
ONLY_WHEN_BUILT = (500_000, 1_000_000)
TABLES = ("validate", "generate", "identical", "reconstruct", "scale", "hashing", "hook")


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


YARDSTICK_CODE = """import time
t = time.perf_counter()
s = 0
for i in range(10_000_000):
    s += i
print(time.perf_counter() - t)"""
# Memory-bound work (what reading a checkpoint mostly is) drifts apart from the loop above: one hour
# the loop took as long as three hours before while unchanged code that allocates ran 1.5x slower.
YARDSTICK_ALLOC_CODE = """import gc, time
gc.disable()
t = time.perf_counter()
rows = [{"name": str(i), "shape": [i, 8]} for i in range(1_000_000)]
print(time.perf_counter() - t)"""


def yardstick(code: str = YARDSTICK_CODE, runs: int = 5) -> float:
    """Seconds of a fixed piece of Python, fastest of ``runs``: the VMs this page was measured on
    differ by 2x, and these numbers let seconds from two runs be scaled."""
    return min(float(subprocess.run([PY, "-c", code], capture_output=True, text=True).stdout) for _ in range(runs))


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


def _built_beyond() -> list:
    """The sizes past TENSORS already built: N (2 ranks), else (N, 1) (one rank: how 1M tensors fit)."""
    found = []
    for n in ONLY_WHEN_BUILT:
        if (checkpoint_dir(n, 2) / "bench.json").exists():
            found.append(n)
        elif (checkpoint_dir(n, 2, world_size=1) / "bench.json").exists():
            found.append((n, 1))
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="one run per row, no 1M manifest, no save hook")
    ap.add_argument("--only", choices=TABLES, action="append", help="tables to print (default: all)")
    ap.add_argument(
        "--reference",
        help="another build's ckptspec executable (e.g. main's): compare generate's bytes with it (check_identical.py)",
    )
    ap.add_argument("--build-timeout", type=float, default=3600, help="seconds DeepSpeed may take per checkpoint")
    args = ap.parse_args(argv)
    # Every command is measured as installed, its modules' bytecode cached: compile ckptspec's now, and
    # let the children write the rest (a sandbox's PYTHONDONTWRITEBYTECODE=1 recompiled ~90 modules each run).
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    compileall.compile_dir(str(HERE.parent / "ckptspec"), quiet=1)
    if args.quick:
        args.runs = 1
    tables = args.only or [t for t in TABLES if not (args.quick and t == "hook")]
    load_before = os.getloadavg()
    log = lambda m: print(m, file=sys.stderr)  # noqa: E731
    out = [f"Machine: {machine()}.", "", f"Load average before the runs: {_loads(load_before)}.", ""]
    out += [
        f"Yardsticks: {yardstick():.2f} s for a pure-Python loop of 10M additions (`YARDSTICK_CODE`), "
        f"{yardstick(YARDSTICK_ALLOC_CODE):.2f} s to build 1M small dicts (`YARDSTICK_ALLOC_CODE`).",
        "",
    ]

    if "validate" in tables:
        sizes = bench_validate.SIZES[:2] if args.quick else bench_validate.SIZES
        out += ["### Validating a manifest", "", bench_validate.markdown(bench_validate.rows(sizes, args.runs)), ""]

    tensors = [*TENSORS, *_built_beyond()]
    if "generate" in tables:
        generated = bench_generate.rows(
            tensors, runs=args.runs, commands=("generate", "validate"), build_timeout=args.build_timeout, log=log
        )
        out += ["### Generating a manifest from a checkpoint with many tensors", ""]
        out += [bench_generate.markdown(generated), ""]
    if "identical" in tables and args.reference:
        out += ["### The same bytes as the reference build", "", *identical_rows(args.reference, tensors[:2]), ""]

    if "reconstruct" in tables:
        rows, notes, _ = bench_reconstruct.measure([2, 3], args.runs)
        out += ["### Reconstructing 100M parameters (2 ranks, bf16)", "", bench_reconstruct.markdown(rows), ""]
        out += [f"- {note}" for note in notes] + [""]

    if "scale" in tables:
        out += ["### Reconstructing the largest checkpoint this machine holds", ""]
        checkpoint = bench_scale.latest_scale_checkpoint()
        if checkpoint is None:
            out += ["(skipped: no checkpoint; build one with `benchmarks/make_scale_checkpoint.py`)", ""]
        else:
            runs = 1 if args.quick else 2
            out += [bench_scale.markdown(bench_scale.rows(checkpoint, runs, log=log)), ""]
            out += [f"Command: `benchmarks/bench_scale.py --checkpoint {checkpoint} --runs {runs}`", ""]

    if "hashing" in tables:
        out += ["### Hashing shard files (ZeRO-2 checkpoint above, from the page cache)", ""]
        out += [*hashing_rows(args.runs), ""]

    if "hook" in tables:
        results = [bench_save_hook.measure(n) for n in (10_000, 100_000) if not log(f"  save hook at {n} ...")]
        out += ["### The save hook beside DeepSpeed's save_checkpoint", "", bench_save_hook.markdown(results), ""]
        out += ["Command: `benchmarks/bench_save_hook.py --tensors 10000 --tensors 100000`", ""]

    out.append(
        f"Load average {_loads(load_before)} before and {_loads(os.getloadavg())} after the runs; "
        f"each row is the fastest of its runs."
    )
    print("\n".join(out))
    return 0


def _loads(loads) -> str:
    return "/".join(f"{x:.1f}" for x in loads) + " (1/5/15 min)"


if __name__ == "__main__":
    sys.exit(main())
