"""Reconstruct at scale (issue #19): `ckptspec reconstruct` beside zero_to_fp32 and a plain copy, one run.

    .venv/bin/python benchmarks/bench_scale.py [--checkpoint DIR] [--runs 1] [--no-z2f]

On the largest checkpoint make_scale_checkpoint.py built (default: the biggest ``scale-*`` under
$CKPTSPEC_BENCH_CACHE), each tool runs as its own process, round robin, with the page cache warmed
before every run (the checkpoint is read once into a small buffer):

* **plain copy**, two ways, each of exactly the fp32 master partitions' bytes (each rank's
  ``fp32_flat_groups`` storages, located in the zip) to one file on the output disk, then one
  fsync: ``dd`` appending (``sync FILE``), and the kernel's ``copy_file_range`` into a file sized
  first (a few lines of the standard library, ``KERNEL_COPY``). Which is faster depends on the
  machine and its page cache (here ``dd``'s appends took 1.2 s on one VM and 3.9-6.2 s on
  another, where the kernel copy took 2.1 s): the faster of the two is the I/O limit the
  goal compares with;
* ``ckptspec reconstruct`` (validates, writes fp32 safetensors, fsyncs), with ``--jobs 1`` and
  ``--jobs N`` (all cores), and the same with ``--dtype bf16`` (every tensor cast: CPU work that
  threads can share);
* DeepSpeed's ``zero_to_fp32`` (``convert_zero_checkpoint_to_state_dict``, safetensors, no shard
  planner; it does not fsync).

A row: the fastest run's wall seconds and CPU seconds (user + system), the largest peak RSS over the
runs, the output's MB/s and the 1-minute load average when the row finished. Goals: ckptspec's peak
RSS under 100 MiB and its wall time within 1.5x of the plain copy. Other scripts use ``rows()``
and ``markdown()``.
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from child import run_child
from make_scale_checkpoint import cache_root

PY = sys.executable
Z2F = (
    "from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_state_dict as c; import sys; "
    "c(sys.argv[1], sys.argv[2], max_shard_size=None, safe_serialization=True)"
)
# The byte ranges of every rank's fp32 master partitions, from the zip directory and data.pkl.
RANGES = """
import glob, json, sys
from ckptspec.checkpoint.torchfile import iter_tensor_refs, read_pt_metadata, zip_member_locations
out = []
for f in sorted(glob.glob(sys.argv[1] + '/*/*optim_states.pt')):
    loc = zip_member_locations(f)
    for path, ref in iter_tensor_refs(read_pt_metadata(f)):
        if 'fp32_flat_groups' in path or 'single_partition_of_fp32_groups' in path:
            out.append([f, *loc[ref.storage.member]])
print(json.dumps(out))
"""


# The same ranges copied by the kernel into a file of the final size, then one fsync.
KERNEL_COPY = """
import json, os, sys
ranges, target = json.loads(sys.argv[1]), sys.argv[2]
os.makedirs(os.path.dirname(target), exist_ok=True)
fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
os.ftruncate(fd, sum(size for _, _, size in ranges))
pos = 0
for path, offset, size in ranges:
    src, done = os.open(path, os.O_RDONLY), 0
    while done < size:
        done += os.copy_file_range(src, fd, min(64 << 20, size - done), offset + done, pos + done)
    os.close(src)
    pos += size
os.fsync(fd)
os.close(fd)
"""


def latest_scale_checkpoint() -> Path | None:
    built = [p for p in cache_root().glob("scale-*") if (p / "bench.json").exists()]
    return max(built, key=lambda p: json.loads((p / "bench.json").read_text())["params"], default=None)


def warm(checkpoint: Path) -> None:
    buffer = bytearray(1 << 20)
    for path in checkpoint.rglob("*.pt"):
        with open(path, "rb", buffering=0) as fh:
            while fh.readinto(buffer):
                pass


def master_ranges(checkpoint: Path) -> list[list]:
    """[file, byte offset, size] of every rank's fp32 master partitions, in rank order."""
    return json.loads(
        subprocess.run([PY, "-c", RANGES, str(checkpoint)], capture_output=True, text=True, check=True).stdout
    )


def copy_command(checkpoint: Path, out: Path) -> tuple[list[str], int]:
    ranges = master_ranges(checkpoint)
    target = out / "fp32.bin"
    parts = [
        f"dd if={f} of={target} iflag=skip_bytes,count_bytes skip={offset} count={size} bs=4M "
        "oflag=append conv=notrunc status=none"
        for f, offset, size in ranges
    ]
    # One fsync of the whole file at the end (coreutils `sync FILE`), as ckptspec syncs each output file once.
    command = f"mkdir -p {out} && " + " && ".join(parts) + f" && sync {target}"
    return ["sh", "-c", command], sum(size for _, _, size in ranges)


def rows(checkpoint: Path, runs: int = 1, z2f: bool = True, jobs=None, log=print) -> list[dict]:
    jobs = jobs or (1, os.cpu_count() or 1)
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    env.pop("CKPTSPEC_DEBUG", None)
    info = json.loads((checkpoint / "bench.json").read_text())
    scratch = Path(tempfile.mkdtemp(prefix="ckptspec-scale-", dir=os.environ.get("CKPTSPEC_BENCH_SCRATCH")))
    try:
        copy_cmd, fp32_bytes = copy_command(checkpoint, scratch / "copy")
        kernel_cmd = [PY, "-c", KERNEL_COPY, json.dumps(master_ranges(checkpoint)), str(scratch / "kcopy" / "fp32.bin")]
        tools: list[tuple[str, list[str], Path]] = [
            ("plain copy (dd + fsync)", copy_cmd, scratch / "copy"),
            ("plain copy (copy_file_range + fsync)", kernel_cmd, scratch / "kcopy"),
        ]
        for options in ([], ["--dtype", "bf16"]):  # a plain copy, and a cast (where threads can pay)
            for n in dict.fromkeys(jobs):
                out = scratch / f"ckptspec-j{n}{'-'.join(options)}"
                cmd = [PY, "-m", "ckptspec", "reconstruct", str(checkpoint), str(out), "--quiet", "--jobs", str(n)]
                tools.append((" ".join(["ckptspec reconstruct", *options, f"--jobs {n}"]), cmd + options, out))
        if z2f:
            tools.append(
                ("zero_to_fp32 (safetensors)", [PY, "-c", Z2F, str(checkpoint), str(scratch / "z2f")], scratch / "z2f")
            )
        results: dict[str, list[dict]] = {}
        for _ in range(runs):
            for name, cmd, out in tools:
                shutil.rmtree(out, ignore_errors=True)
                warm(checkpoint)
                log(f"  {name} ...")
                r = run_child(cmd, env)
                r["load"] = os.getloadavg()[0]
                r["out_bytes"] = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
                results.setdefault(name, []).append(r)
                shutil.rmtree(out, ignore_errors=True)
        table = []
        for name, cmd, _ in tools:
            best = min(results[name], key=lambda r: r["wall"])
            if name.startswith("plain copy (copy_file_range"):
                shown = "python -c KERNEL_COPY RANGES $OUT/kcopy/fp32.bin (benchmarks/bench_scale.py)"
            else:
                shown = " ".join(cmd if name.startswith("plain") else ["python", *cmd[1:]])
                shown = shown.replace(str(scratch), "$OUT")
            if len(shown) > 200:
                shown = shown[:200] + " ..."
            table.append(
                {
                    "tool": name,
                    "wall": best["wall"],
                    "cpu": best["cpu"],
                    "rss_mib": max(r["rss_mib"] for r in results[name]),
                    "load": best["load"],
                    "mb_s": best["out_bytes"] / 1e6 / best["wall"],
                    "out_bytes": best["out_bytes"],
                    "cmd": shown,
                }
            )
        copy_wall = min(row["wall"] for row in table if row["tool"].startswith("plain copy"))
        for row in table:
            row["x_copy"] = row["wall"] / copy_wall
            if row["tool"].startswith("ckptspec") and "--dtype" not in row["tool"]:
                row["goal"] = (
                    f"RSS < 100 MiB: {'met' if row['rss_mib'] < 100 else 'not met'}; "
                    f"<= 1.5x copy: {'met' if row['x_copy'] <= 1.5 else 'not met'}"
                )
        for row in table:
            row.update(
                checkpoint=str(checkpoint),
                params=info["params"],
                shard_bytes=info.get("shard_bytes"),
                fp32_bytes=fp32_bytes,
            )
        return table
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def markdown(table: list[dict]) -> str:
    head = table[0]
    lines = [
        f"{head['params'] / 1e9:.2f}B parameters, {head['shard_bytes'] / 1e9:.1f} GB of shard files, "
        f"{head['fp32_bytes'] / 1e9:.2f} GB of fp32 masters (`{head['checkpoint']}`).",
        "",
        "| tool | wall s | CPU s | peak RSS MiB | output MB/s | x fastest plain copy | load (1 min) | goal |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    lines += [
        f"| {r['tool']} | {r['wall']:.1f} | {r['cpu']:.1f} | {r['rss_mib']:.0f} | {r['mb_s']:.0f} | "
        f"{r['x_copy']:.2f} | {r['load']:.1f} | {r.get('goal', '')} |"
        for r in table
    ]
    lines += ["", "Commands:", ""] + [f"- {r['tool']}: `{r['cmd']}`" for r in table]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", type=Path, help="default: the largest scale-* checkpoint built")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--no-z2f", action="store_true", help="leave out zero_to_fp32 (it holds the checkpoint in memory)")
    ap.add_argument("--jobs", type=int, action="append", help="ckptspec --jobs values (default: 1 and all cores)")
    args = ap.parse_args()
    checkpoint = args.checkpoint or latest_scale_checkpoint()
    if checkpoint is None:
        sys.exit("no scale-* checkpoint: build one with benchmarks/make_scale_checkpoint.py")
    table = rows(
        checkpoint,
        args.runs,
        not args.no_z2f,
        tuple(args.jobs or (1, os.cpu_count() or 1)),
        log=lambda m: print(m, file=sys.stderr),
    )
    print(markdown(table))


if __name__ == "__main__":
    main()
