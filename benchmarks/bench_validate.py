"""Whole-process time and peak memory of `ckptspec validate MANIFEST` beside a bare parse.

    .venv/bin/python benchmarks/bench_validate.py                   # 10k, 100k, 1M parameters
    .venv/bin/python benchmarks/bench_validate.py --params 100000 --runs 5

For each size, the synthetic manifest (``synthetic.py``: valid, ZeRO-2, 8 ranks) is
written once as canonical JSON and msgpack, then each command runs as its own process:

* ``json.load``: ``python -c "import json,sys; json.load(open(sys.argv[1]))" FILE``,
  the yardstick of issue #8 (goal: validate within 3x of it at 100k parameters);
* ``msgpack.unpackb``: the same for the msgpack file;
* ``ckptspec validate FILE``: schema (fast path) and every semantic rule.

Each row is the fastest wall time of ``--runs`` runs and the largest peak RSS; CPU is
the user + system seconds of the fastest run (steadier than wall time on a loaded
machine). This script imports nothing heavy, so the children's ``ru_maxrss`` is their own.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from child import run_child

PY = sys.executable
CKPTSPEC = [PY, "-m", "ckptspec"]
JSON_LOAD = [PY, "-c", "import json,sys; json.load(open(sys.argv[1]))"]
MSGPACK_LOAD = [PY, "-c", "import msgpack,sys; msgpack.unpackb(open(sys.argv[1],'rb').read())"]
SIZES = (10_000, 100_000, 1_000_000)


def best(cmd: list[str], runs: int) -> dict:
    results = [run_child(cmd) for _ in range(runs)]
    fastest = min(results, key=lambda r: r["wall"])
    return {"wall_s": fastest["wall"], "cpu_s": fastest["cpu"], "rss_mib": max(r["rss_mib"] for r in results)}


def manifest_file(n_params: int, encoding: str) -> Path:
    # In a child: building a million-parameter manifest takes gigabytes, and a child's
    # ru_maxrss starts at its parent's peak.
    code = "import sys; from synthetic import cached_manifest; print(cached_manifest(int(sys.argv[1]), sys.argv[2]))"
    done = subprocess.run(
        [PY, "-c", code, str(n_params), encoding],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parent,
        check=True,
    )
    return Path(done.stdout.strip())


def rows(sizes=SIZES, runs: int = 3) -> list[dict]:
    out = []
    for n in sizes:
        json_file, msgpack_file = manifest_file(n, "json"), manifest_file(n, "msgpack")
        baseline = best(JSON_LOAD + [str(json_file)], runs)
        out.append(
            {"params": n, "command": "json.load (yardstick)", "file_mb": json_file.stat().st_size / 1e6, **baseline}
        )
        out.append(
            {
                "params": n,
                "command": "msgpack.unpackb",
                "file_mb": msgpack_file.stat().st_size / 1e6,
                **best(MSGPACK_LOAD + [str(msgpack_file)], runs),
            }
        )
        for label, path in (("ckptspec validate (JSON)", json_file), ("ckptspec validate (msgpack)", msgpack_file)):
            row = best(CKPTSPEC + ["validate", str(path)], runs)
            row["vs_json_load"] = row["wall_s"] / baseline["wall_s"]
            out.append({"params": n, "command": label, "file_mb": path.stat().st_size / 1e6, **row})
    return out


def markdown(table: list[dict]) -> str:
    lines = [
        "| parameters | command | file (MB) | wall (s) | CPU (s) | peak RSS (MiB) | wall vs json.load |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in table:
        ratio = f"{r['vs_json_load']:.2f}x" if "vs_json_load" in r else ""
        lines.append(
            f"| {r['params']:,} | {r['command']} | {r['file_mb']:.1f} | {r['wall_s']:.2f} | {r['cpu_s']:.2f} | "
            f"{r['rss_mib']:.0f} | {ratio} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=int, action="append", help="parameter count (repeatable); default 10k, 100k, 1M")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args(argv)
    print(markdown(rows(args.params or SIZES, args.runs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
