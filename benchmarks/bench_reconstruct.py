"""Wall time and peak memory of `ckptspec reconstruct` beside DeepSpeed's zero_to_fp32, and of `ckptspec generate`.

    .venv/bin/python benchmarks/bench_reconstruct.py [--runs 3] [--stage 2 --stage 3] [--no-verify]

Builds (once, cached; see make_big_checkpoint.py) real ~100M-parameter ZeRO-2 and ZeRO-3
checkpoints (2 ranks, bf16, ~1.4 GB each), then runs every tool as a separate process on
the same files and prints one markdown table. Each row is the fastest of ``--runs`` runs
(wall clock, process start to exit) and the largest peak RSS (``ru_maxrss`` of that process)
over the runs. The page cache is warmed first, so every tool reads from memory. This
script imports nothing heavy, so that the children's ``ru_maxrss`` (which starts at the
parent's peak) is their own; the ``python -c pass`` row shows that floor.

zero_to_fp32 is DeepSpeed's own ``convert_zero_checkpoint_to_state_dict`` with
``max_shard_size=None`` (its CLI's code path without the Hugging Face shard planner,
which needs huggingface_hub): once with torch.save output (its default) and once with
safetensors (``--safe_serialization``). ckptspec writes safetensors, fp32, and validates
the checkpoint first. With ``--verify`` (default) the safetensors outputs of both tools
are compared bit for bit.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from child import run_child
from make_big_checkpoint import build

PY = sys.executable
Z2F = (
    "from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_state_dict as c; import sys; "
    "c(sys.argv[1], sys.argv[2], max_shard_size=None, safe_serialization=sys.argv[3] == 'safetensors')"
)


@dataclass
class Row:
    tool: str
    stage: str
    wall: float
    rss_mib: float
    note: str = ""


def run_once(cmd: list[str], env: dict, out: Path | None) -> tuple[float, float]:
    """(wall seconds, peak RSS MiB) of ``cmd`` as a child process; ``out`` is removed first."""
    if out is not None:
        shutil.rmtree(out, ignore_errors=True)
    result = run_child(cmd, env)
    return result["wall"], result["rss_mib"]


def warm(checkpoint: Path) -> int:
    """Read every shard once (into one small buffer: this process must stay small)."""
    total, buffer = 0, bytearray(1 << 20)
    for path in checkpoint.rglob("*.pt"):
        with open(path, "rb", buffering=0) as fh:
            while n := fh.readinto(buffer):
                total += n
    return total


VERIFY = """
import sys, torch
from safetensors.torch import load_file
a, b = load_file(sys.argv[1]), load_file(sys.argv[2])
if sorted(a) != sorted(b):
    print(f"keys differ: {sorted(set(a) ^ set(b))}")
else:
    raw = lambda t: t.contiguous().view(-1).view(torch.uint8)
    bad = [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(raw(a[k]), raw(b[k]))]
    print("bit-identical" if not bad else f"{len(bad)} tensors differ: {bad[:5]}")
"""


def verify(ours: Path, theirs: Path) -> str:
    # In a child process: this process must stay small, because a child's ru_maxrss starts
    # at its parent's peak RSS (Linux carries the high-water mark across fork and exec).
    done = subprocess.run([PY, "-c", VERIFY, str(ours), str(theirs)], capture_output=True, text=True)
    return done.stdout.strip() or done.stderr.strip()[-500:]


def measure(stages: list[int], runs: int, check_bits: bool = True) -> tuple[list[Row], list[str], list[float]]:
    """Run every tool ``runs`` times on each stage's checkpoint: (rows, notes, load averages seen)."""
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    env.pop("CKPTSPEC_DEBUG", None)
    scratch = Path(tempfile.mkdtemp(prefix="ckptspec-bench-"))
    notes: list[str] = []
    loads: list[float] = []
    try:
        # (tool, checkpoint label, command, output dir to clear, note)
        jobs: list[tuple[str, str, list[str], Path | None, str]] = [
            ("python -c pass (floor)", "-", [PY, "-c", "pass"], None, "")
        ]
        sizes: dict[str, int] = {}
        for stage in stages:
            ckpt = build(stage)
            label = f"ZeRO-{stage}"
            sizes[label] = warm(ckpt)
            notes.append(f"{label}: {sizes[label] / 1e9:.2f} GB of shard files ({ckpt})")
            for fmt, name in (("torch", "torch.save"), ("safetensors", "safetensors")):
                out = scratch / f"z2f-{fmt}-{stage}"
                jobs.append((f"zero_to_fp32 ({name})", label, [PY, "-c", Z2F, str(ckpt), str(out), fmt], out, ""))
            out = scratch / f"ckptspec-{stage}"
            jobs.append(
                (
                    "ckptspec reconstruct (safetensors)",
                    label,
                    [PY, "-m", "ckptspec", "reconstruct", str(ckpt), str(out), "--quiet"],
                    out,
                    "",
                )
            )
            if stage == 2:
                manifest = scratch / "manifest.json"
                jobs.append(
                    (
                        "ckptspec generate",
                        label,
                        [PY, "-m", "ckptspec", "generate", str(ckpt), "-o", str(manifest)],
                        None,
                        "goal: < 1 s, < 200 MB",
                    )
                )
                jobs.append(
                    (
                        "ckptspec generate --hash",
                        label,
                        [PY, "-m", "ckptspec", "generate", str(ckpt), "-o", str(manifest), "--hash"],
                        None,
                        "",
                    )
                )
        # Round-robin over the tools, so that every tool meets the same background load.
        results: dict[tuple[str, str], list[tuple[float, float]]] = {}
        for _ in range(runs):
            for tool, label, cmd, out, _note in jobs:
                results.setdefault((tool, label), []).append(run_once(cmd, env, out))
                loads.append(os.getloadavg()[0])
        rows = []
        for tool, label, _cmd, _out, note in jobs:
            timings = results[(tool, label)]
            wall, rss = min(w for w, _ in timings), max(r for _, r in timings)
            if tool == "ckptspec generate --hash":
                note = f"{sizes[label] / 1e6 / wall:.0f} MB/s hashed (from the page cache)"
            rows.append(Row(tool, label, wall, rss, note))
        by = {(r.tool, r.stage): r for r in rows}
        for stage in stages:
            label = f"ZeRO-{stage}"
            out = scratch / f"ckptspec-{stage}"
            notes.append(f"{label}: output {sum(p.stat().st_size for p in out.iterdir()) / 2**20:.0f} MiB (fp32)")
            if check_bits:
                result = verify(out / "model.safetensors", scratch / f"z2f-safetensors-{stage}" / "model.safetensors")
                notes.append(f"{label}: ckptspec output vs zero_to_fp32 safetensors output: {result}")
            ours = by[("ckptspec reconstruct (safetensors)", label)]
            for name in ("zero_to_fp32 (torch.save)", "zero_to_fp32 (safetensors)"):
                ref = by[(name, label)]
                notes.append(
                    f"{label}: vs {name}: {ref.wall / ours.wall:.1f}x faster, "
                    f"{ours.rss_mib / ref.rss_mib:.2f} of its peak RSS (goal: >= 3x, <= 0.25)"
                )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return rows, notes, loads


def markdown(rows: list[Row]) -> str:
    lines = ["| tool | checkpoint | wall s | peak RSS MiB | note |", "|---|---|---:|---:|---|"]
    lines += [f"| {r.tool} | {r.stage} | {r.wall:.2f} | {r.rss_mib:.0f} | {r.note} |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--stage", type=int, choices=[2, 3], action="append")
    ap.add_argument("--no-verify", action="store_true")
    args = ap.parse_args()
    rows, notes, loads = measure(args.stage or [2, 3], args.runs, check_bits=not args.no_verify)
    print(
        f"\n{os.cpu_count()} CPUs, load average {min(loads):.1f}-{max(loads):.1f} during the runs; "
        f"fastest of {args.runs} interleaved runs, largest peak RSS\n"
    )
    print(markdown(rows))
    print()
    for note in notes:
        print(f"- {note}")


if __name__ == "__main__":
    main()
