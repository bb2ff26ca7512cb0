"""Build (once, cached) the largest real DeepSpeed checkpoint this machine holds (issue #19: reconstruct at scale).

    .venv/bin/python benchmarks/make_scale_checkpoint.py --layers 16               # ~0.67B params, ZeRO-3, 2 ranks
    .venv/bin/python benchmarks/make_scale_checkpoint.py --layers 26 --max-rss-gib 19   # ~1.0B params

The model is train_big.py's (embedding, ``--layers`` MLP blocks of 2048 -> 8192 -> 2048, head; 32000
tokens): 131M + 33.6M per layer parameters. One AdamW step in bf16 at ZeRO-3 (``--stage``) with
``deepspeed.zero.Init``, then ``save_checkpoint``. Every parameter costs about 18 bytes of memory
across the ranks (bf16 partition 2, fp32 master 4, two Adam moments 8, fp32 gradient 4), so 1B
parameters need about 18 GB plus the processes themselves. A sampler adds up the RSS of every process
of the build twice a second and ends the build (the whole process group) when the sum passes
``--max-rss-gib`` or the machine's available memory drops under 1.5 GiB: other work shares the machine.

The checkpoint goes to $CKPTSPEC_BENCH_CACHE (or benchmarks/.cache/) as
``scale-<M>M-zero<stage>-ws<N>-bf16``, built in a temporary directory and renamed when complete;
``bench.json`` records the parameter count, DeepSpeed's phase times and the build's peak total RSS.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torchrun

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
DIM, HIDDEN, VOCAB = 2048, 8192, 32000


def params(layers: int) -> int:
    return 2 * VOCAB * DIM + layers * (2 * DIM * HIDDEN + HIDDEN + DIM) + 2 * DIM


def cache_root() -> Path:
    return Path(os.environ.get("CKPTSPEC_BENCH_CACHE", HERE / ".cache"))


def checkpoint_dir(layers: int, stage: int, world_size: int) -> Path:
    return cache_root() / f"scale-{params(layers) // 10**6}M-zero{stage}-ws{world_size}-bf16"


def _meminfo(key: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _tree(root: int) -> list[int]:
    """``root`` and every descendant (torchrun starts its ranks in sessions of their own)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += parents.get(pid, [])
    return out


def _rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class Sampler(threading.Thread):
    """Peak summed RSS of a process and its descendants; kills them all past the limit."""

    def __init__(self, pid: int, limit: int):
        super().__init__(daemon=True)
        self.pid, self.limit, self.peak, self.killed, self.stop = pid, limit, 0, "", threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.5):
            pids = _tree(self.pid)
            rss = sum(map(_rss, pids))
            self.peak = max(self.peak, rss)
            available = _meminfo("MemAvailable")
            if rss > self.limit or available < 1.5 * 2**30:
                self.killed = f"total RSS {rss / 2**30:.1f} GiB, available {available / 2**30:.1f} GiB"
                for pid in pids:
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)
                return


def build(layers: int, stage: int = 3, world_size: int = 2, max_rss_gib: float = 15.0) -> Path:
    final = checkpoint_dir(layers, stage, world_size)
    if (final / "bench.json").exists():
        return final
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    need = params(layers) * 14 * 1.1  # fp32 masters and two moments (12 B), bf16 weights (2 B) at most
    if shutil.disk_usage(root).free < need:
        sys.exit(
            f"{root}: {shutil.disk_usage(root).free / 2**30:.0f} GiB free, the checkpoint needs {need / 2**30:.0f}"
        )
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=root))
    env = torchrun.environment()
    cmd = torchrun.command(
        HERE / "train_big.py",
        world_size,
        f"--stage={stage}",
        f"--dim={DIM}",
        f"--hidden={HIDDEN}",
        f"--layers={layers}",
        f"--out={tmp / 'ckpt'}",
        *(["--zero-init"] if stage == 3 else []),
    )
    print(f"building {final.name}: {params(layers) / 1e9:.2f}B parameters ...", file=sys.stderr)
    t0 = time.monotonic()
    try:
        proc = subprocess.Popen(
            cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        sampler = Sampler(proc.pid, int(max_rss_gib * 2**30))
        sampler.start()
        output, _ = proc.communicate()
        sampler.stop.set()
        sampler.join()
        if sampler.killed:
            sys.exit(f"build stopped: {sampler.killed} (limit {max_rss_gib} GiB)")
        if proc.returncode != 0:
            sys.exit(f"DeepSpeed run failed (exit {proc.returncode}):\n{output[-8000:]}")
        info = json.loads((tmp / "ckpt" / "bench.json").read_text())
        info.update(
            build_wall_s=round(time.monotonic() - t0, 1),
            build_peak_total_rss_gib=round(sampler.peak / 2**30, 2),
            shard_bytes=sum(p.stat().st_size for p in (tmp / "ckpt").rglob("*.pt")),
        )
        (tmp / "ckpt" / "bench.json").write_text(json.dumps(info, indent=1))
        os.rename(tmp / "ckpt", final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"built {final} in {time.monotonic() - t0:.0f} s", file=sys.stderr)
    return final


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--stage", type=int, choices=[1, 2, 3], default=3)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--max-rss-gib", type=float, default=15.0, help="end the build past this summed RSS")
    args = ap.parse_args()
    path = build(args.layers, args.stage, args.world_size, args.max_rss_gib)
    print(path, (path / "bench.json").read_text())


if __name__ == "__main__":
    main()
