"""Compare ``ckptspec generate`` bytes of this tree with another build's (e.g. main's), per checkpoint.

    .venv/bin/python benchmarks/check_identical.py --reference /work/main/.venv/bin/ckptspec DIR [DIR ...]
    .venv/bin/python benchmarks/check_identical.py --reference ... --hash --many 10000 100000

Prints one row per checkpoint (and ``--hash``): identical or not, each side's wall time. Exit 1 if
any differ. ``--many N``: the real DeepSpeed checkpoints with N tiny tensors (make_many_tensors.py).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import make_many_tensors

THIS = [sys.executable, "-m", "ckptspec"]


def _run(cmd: list[str], out: Path) -> float:
    t0 = time.perf_counter()
    subprocess.run([*cmd, "-o", str(out)], check=True, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reference", required=True, help="the other build's ckptspec executable")
    ap.add_argument("--hash", action="store_true", help="also compare generate --hash")
    ap.add_argument("--many", type=int, nargs="*", default=[], help="many-tensor checkpoints (ZeRO-2)")
    ap.add_argument("dirs", nargs="*", type=Path)
    args = ap.parse_args()
    dirs = [*args.dirs, *(make_many_tensors.build(n, 2) for n in args.many)]
    print("| checkpoint | command | identical | bytes | this s | reference s |")
    print("|---|---|---|---:|---:|---:|")
    bad = 0
    with tempfile.TemporaryDirectory() as tmp:
        for d in dirs:
            for extra in [[], ["--hash"]] if args.hash else [[]]:
                mine, ref = Path(tmp, "mine.json"), Path(tmp, "ref.json")
                t_mine = _run([*THIS, "generate", str(d), *extra], mine)
                t_ref = _run([args.reference, "generate", str(d), *extra], ref)
                same = mine.read_bytes() == ref.read_bytes()
                bad += not same
                print(
                    f"| {d.name} | generate {' '.join(extra)} | {'yes' if same else 'NO'} | "
                    f"{mine.stat().st_size} | {t_mine:.2f} | {t_ref:.2f} |",
                    flush=True,
                )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
