"""``ckptspec reshard`` and ``export`` of a ~100M-parameter AutoTP tp2 and a MoE ep2 checkpoint, next to
DeepSpeed's ``ds_to_universal`` on the same files (issue #40).

    DS_ACCELERATOR=cpu .venv/bin/python benchmarks/bench_reshard_kinds.py [--kind tp2 moe] [--layers 4 16] [--keep]

The sources are real DeepSpeed ZeRO-2 bf16 jobs of 2 ranks (benchmarks/make_big_checkpoint.py, built on
first use, cached; ``$CKPTSPEC_BENCH_CACHE``): train_big.py's model with AutoTP of degree 2 (tp2 x dp1,
4 blocks: 99M parameters), and with every block a MoE of 2 experts on 2 expert-parallel ranks (2 blocks:
99M). ``--layers 16`` (~200M parameters: 16 blocks, or 8 MoE blocks) keeps the largest tensors, the 32.8M
embedding and head: a peak RSS that does not grow from one size to the other does not grow with the model.

Each command runs as a child process measured by benchmarks/child.py: wall and CPU seconds and peak RSS,
and the size of what it wrote. tp2: the merge (``--tensor-parallel 1``), the split
(``--tensor-parallel 4``), the data axis (tp2 x dp2); MoE: 4 ranks, and expert-parallel degree 1. Both:
``export --format dcp``, ``export-universal`` and ``ds_to_universal`` (the tp2 checkpoint carries
DeepSpeed's ``universal_checkpoint_info``; the MoE one does not: ``--inject_missing_state``). A command that
fails is a row with its exit code and the last line of its output. Prints a markdown table per
checkpoint, with the machine's load average at the start and the end (other jobs on a shared machine
slow every command).
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

from bench_reshard import _size
from child import load_line, run_child
from make_big_checkpoint import build

# kind -> make_big_checkpoint.build's arguments for ``--layers`` L (L MLP blocks' parameters: tp2 has L blocks,
# MoE L / 2 blocks of 2 experts), and ckptspec's commands on it (label, argv after the source)
KINDS = {
    "tp2": {
        "build": lambda layers: {"layers": layers, "tp": 2},
        "reshard": [
            ("reshard --tensor-parallel 1 --world-size 2 (merge)", ["--tensor-parallel", "1", "--world-size", "2"]),
            ("reshard --tensor-parallel 4 --world-size 4 (split)", ["--tensor-parallel", "4", "--world-size", "4"]),
            ("reshard --world-size 4 (tp2 x dp2)", ["--world-size", "4"]),
        ],
        "inject_missing_state": False,
    },
    "moe": {
        "build": lambda layers: {"layers": layers // 2, "experts": 2, "ep": 2},
        "reshard": [
            ("reshard --world-size 4", ["--world-size", "4"]),
            ("reshard --expert-parallel 1 --world-size 2", ["--expert-parallel", "1", "--world-size", "2"]),
        ],
        "inject_missing_state": True,
    },
}
ANY_EXIT = tuple(range(-64, 256))  # a failure is a row, not the end of the benchmark


def _last_line(out: str) -> str:
    """The error's last line, without ckptspec's hint."""
    lines = [line.strip() for line in out.splitlines() if line.strip()]
    return (lines[-1] if lines else "no output").split(" (hint:")[0].replace("|", "\\|")[:200]


def _measure(label: str, cmd: list[str], out: Path, env) -> tuple:
    r = run_child(cmd, env, ok_codes=ANY_EXIT)
    result = "ok" if r["code"] == 0 else f"failed (exit {r['code']}): {_last_line(r['out'])}"
    size = _size(out) if out.exists() else 0
    shutil.rmtree(out, ignore_errors=True)
    print(f"{label}: {result}", file=sys.stderr)
    return label, r, size, result


def _run(source: Path, kind: dict, env, keep: bool) -> list:
    tag = (source / "latest").read_text().strip()
    work = Path(tempfile.mkdtemp(prefix="bench-reshard-kinds-"))  # never inside the (maybe shared) source cache
    ckptspec = [sys.executable, "-m", "ckptspec"]
    rows = []
    try:
        out = work / "out"
        for label, argv in kind["reshard"]:
            rows.append(_measure(f"ckptspec {label}", ckptspec + ["reshard", str(source), str(out), *argv], out, env))
        rows.append(
            _measure("ckptspec export --format dcp", ckptspec + ["export", "-q", str(source), str(out)], out, env)
        )
        cmd = ckptspec + ["export-universal", str(source), str(out)]
        rows.append(_measure("ckptspec export-universal", cmd, out, env))
        flag = ["--inject_missing_state"] if kind["inject_missing_state"] else []
        universal = work / "universal"
        universal.mkdir()
        cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(source / tag)]
        cmd += ["--output_folder", str(universal / f"{tag}_universal"), *flag]
        rows.append(_measure(" ".join(["ds_to_universal", *flag]), cmd, universal, env))
    finally:
        if keep:
            print(f"outputs kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kind", choices=sorted(KINDS), nargs="+", default=["tp2", "moe"])
    ap.add_argument("--keep", action="store_true", help="keep the outputs (in the printed directory)")
    ap.add_argument("--layers", type=int, nargs="+", default=[4], help="model sizes: 4 is ~100M parameters, 16 ~200M")
    args = ap.parse_args()
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    sources = {
        f"{name} --layers {layers}": (name, build(2, **KINDS[name]["build"](layers)))
        for name in args.kind
        for layers in args.layers
    }
    start = os.getloadavg()
    tables = {label: _run(source, KINDS[name], env, args.keep) for label, (name, source) in sources.items()}
    print(load_line(start))
    for label, rows in tables.items():
        source = sources[label][1]
        bench = json.loads((source / "bench.json").read_text())
        print()
        print(f"{label}: {source} ({bench['params'] / 1e6:.0f}M parameters, {_size(source) / 2**20:.0f} MiB)")
        print()
        print("| command | wall s | CPU s | peak RSS MiB | output MiB | result |")
        print("| --- | ---: | ---: | ---: | ---: | --- |")
        for what, r, size, result in rows:
            print(f"| {what} | {r['wall']:.1f} | {r['cpu']:.1f} | {r['rss_mib']:.0f} | {size / 2**20:.0f} | {result} |")


if __name__ == "__main__":
    main()
