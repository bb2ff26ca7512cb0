"""What writing a reconstruction to S3 (moto) costs beside writing it to a local directory: wall, CPU, peak RSS,
for real DeepSpeed checkpoints of two sizes (peak RSS should not grow with the model: docs/remote.md).

    .venv/bin/python benchmarks/bench_remote_output.py [--layers 1 --layers 4] [--checkpoint DIR]

Builds (once, cached; make_big_checkpoint.py) 2-rank bf16 ZeRO-2 checkpoints of train_big.py's model with
``--layers`` blocks, starts moto's S3 server (tests/_harness/servers.py), then runs ``ckptspec reconstruct`` as its
own process (benchmarks/child.py) into a local directory and into ``s3://`` (and ``reshard --world-size 1``, whose
output holds the optimizer state too), and compares the uploaded objects with
the local files byte for byte (read back by a child process, so that this one's peak RSS stays low). The machine may
be shared: the load average is printed with the table.
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
sys.path.insert(0, str(HERE.parent / "tests"))
from _harness.servers import start_s3
from child import load_line, run_child
from make_big_checkpoint import build

CLI = [sys.executable, "-m", "ckptspec"]
# In a child: every object below the URL equals the local file of its name (streamed, 8 MiB at a time).
COMPARE = """
import sys, hashlib, pathlib, s3fs
fs = s3fs.S3FileSystem()
base, local = sys.argv[1].removeprefix("s3://"), pathlib.Path(sys.argv[2])
def sha(fh):
    h = hashlib.sha256()
    while piece := fh.read(8 << 20):
        h.update(piece)
    return h.hexdigest()
remote = {n[len(base) + 1:]: sha(fs.open(n, "rb")) for n in fs.find(base)}
files = {p.relative_to(local).as_posix(): sha(open(p, "rb")) for p in local.rglob("*") if p.is_file()}
print(remote == files)
"""
# What importing the S3 backend costs a process that does nothing else: the floor of every S3 row.
IMPORTS = "import s3fs, ckptspec.cli"
MAKE_BUCKET = "import boto3, sys; boto3.client('s3', endpoint_url=sys.argv[1]).create_bucket(Bucket='out')"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, action="append", help="train_big.py's layers (default: 1 and 4)")
    parser.add_argument("--checkpoint", type=Path, action="append", default=[], help="another save directory")
    args = parser.parse_args()
    start_load = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="ckptspec-bench-remote-output-"))
    s3 = start_s3(work / "moto")
    env = {**os.environ, **s3.env}
    rows = []
    try:
        run_child([sys.executable, "-c", MAKE_BUCKET, s3.endpoint], env)
        floor = run_child([sys.executable, "-c", IMPORTS], env)
        floor["load"] = os.getloadavg()[0]
        rows.append(("", "(`import s3fs, ckptspec.cli` only)", floor))
        checkpoints = [(d.name, d) for d in args.checkpoint]
        checkpoints += [(f"{layers} layers", build(2, layers=layers)) for layers in args.layers or [1, 4]]
        for n, (name, save_dir) in enumerate(checkpoints):
            for command in (["reconstruct"], ["reshard", "--world-size", "1"]):
                local = work / f"local-{n}-{command[0]}"
                url = f"s3://out/{n}-{command[0]}"
                for where, target in (("local", str(local)), ("S3 (moto)", url)):
                    result = run_child(CLI + [command[0], str(save_dir), target, *command[1:]], env)
                    result["load"] = os.getloadavg()[0]
                    rows.append((name, f"`{command[0]}` to {where}", result))
                    print(
                        f"{name} {command[0]} {where}: {result['wall']:.1f} s, {result['rss_mib']:.1f} MiB",
                        file=sys.stderr,
                    )
                size = sum(p.stat().st_size for p in local.rglob("*") if p.is_file())
                same = run_child([sys.executable, "-c", COMPARE, url, str(local)], env)["out"].strip().splitlines()[-1]
                rows.append((name, f"`{command[0]}` output: {size:,} bytes; objects identical to local: {same}", None))
                shutil.rmtree(local)
    finally:
        s3.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(load_line(start_load) + "\n")
    print("| checkpoint | command | wall s | CPU s | load (1 min) | peak RSS MiB |")
    print("|---:|---|---:|---:|---:|---:|")
    for name, where, result in rows:
        if result is None:
            print(f"| {name} | {where} | | | | |")
            continue
        print(
            f"| {name} | {where} | {result['wall']:.1f} | {result['cpu']:.1f} | {result['load']:.1f} "
            f"| {result['rss_mib']:.1f} |"
        )


if __name__ == "__main__":
    main()
