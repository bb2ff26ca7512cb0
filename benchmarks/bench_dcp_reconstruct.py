"""``ckptspec reconstruct`` of a ~100M-parameter FSDP2 DCP checkpoint against torch's ``dcp_to_torch_save`` plus a
safetensors save of its output (issue #42): wall time and peak RSS, each a process of its own.

    .venv/bin/python benchmarks/bench_dcp_reconstruct.py [--world-size 2]

Builds (once, cached in $CKPTSPEC_BENCH_CACHE or benchmarks/.cache) the checkpoint with an FSDP2 job
(fsdp2_save_big.py: 102.8M fp32 parameters), warms the page cache, runs both ways, checks both outputs equal the
job's ``full_tensor()`` bit for bit, and prints a markdown table. Imports nothing heavy (a child's ``ru_maxrss``
starts at its parent's).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torchrun
from bench_dcp_reader import _du, _warm_all
from child import load_line, run_child
from make_big_checkpoint import cache_root

PY = sys.executable
HERE = Path(__file__).resolve().parent
TORCH_WAY = """
import sys
import torch
from safetensors.torch import save_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
dcp_to_torch_save(sys.argv[1], sys.argv[2] + ".pt")
save_file(torch.load(sys.argv[2] + ".pt", weights_only=True)["model"], sys.argv[2])
"""
CHECK = """
import sys
import torch
from safetensors.torch import load_file
full = torch.load(sys.argv[1], weights_only=True)
for path in sys.argv[2:]:
    got = load_file(path)
    assert sorted(got) == sorted(full), path
    assert all(torch.equal(got[n], t) for n, t in full.items()), path
print("equal")
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world-size", type=int, default=2)
    args = ap.parse_args()
    start = os.getloadavg()
    source = cache_root() / f"dcp-100m-ws{args.world_size}"
    if not (source / ".metadata").is_file():
        shutil.rmtree(source, ignore_errors=True)
        run_child(torchrun.command(HERE / "fsdp2_save_big.py", args.world_size, str(source)))
    _warm_all(source)
    env = dict(os.environ, PYTHONPATH=str(HERE.parent))
    with tempfile.TemporaryDirectory(dir=source.parent) as tmp:
        ours = run_child([PY, "-m", "ckptspec", "reconstruct", str(source), f"{tmp}/ours", "-q"], env)
        theirs = run_child([PY, "-c", TORCH_WAY, str(source), f"{tmp}/theirs.safetensors"], env)
        check = subprocess.run(
            [PY, "-c", CHECK, f"{source}.full.pt", f"{tmp}/ours/model.safetensors", f"{tmp}/theirs.safetensors"],
            capture_output=True,
            text=True,
        )
        assert check.stdout.strip() == "equal", check.stderr
    print(f"DCP checkpoint: {_du(source) / 2**20:.0f} MiB, world size {args.world_size}; both outputs equal the job's")
    print("full_tensor() bit for bit.\n")
    print("| way | wall | peak RSS |\n|---|---|---|")
    print(f"| `ckptspec reconstruct` | {ours['wall']:.2f} s | {ours['rss_mib']:.0f} MiB |")
    print(f"| `dcp_to_torch_save` + `safetensors` `save_file` | {theirs['wall']:.2f} s | {theirs['rss_mib']:.0f} MiB |")
    print("\n" + load_line(start))


if __name__ == "__main__":
    main()
