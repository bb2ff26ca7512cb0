"""How the benchmark builders start a real DeepSpeed job: ``torch.distributed.run`` on 127.0.0.1 (a free
port each time) with the test harness's sitecustomize on the path (no JIT compile of DeepSpeed's shm
comm op, unused by training and saving), on CPU, one thread per rank."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def environment() -> dict[str, str]:
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(REPO / "tests" / "_harness" / "site"), env.get("PYTHONPATH")])
    )
    return env


def command(script: Path | str, nproc: int, *args: str) -> list[str]:
    """``torchrun`` of ``script`` (or ``"-m"`` with the module as the first of ``args``) on ``nproc`` processes."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--master_addr=127.0.0.1",
        f"--master_port={_free_port()}",
        str(script),
        *args,
    ]
