"""Start real-DeepSpeed jobs: one launch runs a list of tasks (tests/_harness/job/main.py).

A launch is torchrun's, or (``forked``) job/ranks.py's: the same ranks and environment, forked
from one process that has imported torch and DeepSpeed (7 s of CPU per rank saved)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from .cache import HARNESS, REPO_ROOT

JOB_MAIN = HARNESS / "job" / "main.py"
RANKS = HARNESS / "job" / "ranks.py"  # torchrun's ranks, forked after one import of torch and DeepSpeed
RESHARD_MAIN = HARNESS / "reshard_job.py"  # reshard and universal loads beyond job/resume.py (its own key)
FSDP2_MAIN = HARNESS / "fsdp2_job.py"  # the FSDP2 loads of the DCP export: no DeepSpeed, a launch of its own
SITE = HARNESS / "site"  # sitecustomize: no shm comm op compile (see its docstring)
TIMEOUT_S = 900


class HarnessError(RuntimeError):
    pass


def job_env(python: str = sys.executable) -> dict:
    """The environment of every DeepSpeed process the tests start (jobs and examples)."""
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONHASHSEED="0")
    env["PATH"] = f"{Path(python).parent}{os.pathsep}{env['PATH']}"
    extra = [str(SITE), str(REPO_ROOT / "tests"), str(REPO_ROOT)]
    env["PYTHONPATH"] = os.pathsep.join(extra + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def _free_port() -> int:
    # Racy (the port is released before torchrun binds it), hence the retry in run_torchrun.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torchrun(
    script: Path,
    args: list[str],
    world_size: int,
    python: str = sys.executable,
    what: str = "DeepSpeed job",
    forked: bool = False,
) -> str:
    """Run ``script`` under torchrun (``forked``: job/ranks.py) on the CPU; returns its log, raises
    ``HarnessError``."""
    env = job_env(python)
    for attempt in range(3):
        if forked:
            launcher = [str(RANKS), f"--nproc-per-node={world_size}", f"--master-port={_free_port()}"]
        else:
            launcher = [
                "-m",
                "torch.distributed.run",
                f"--nproc_per_node={world_size}",
                "--master_addr=127.0.0.1",
                f"--master_port={_free_port()}",
            ]
        cmd = [python, *launcher, str(script), *args]
        # Own session, so a timeout can kill torchrun together with its worker processes.
        proc = subprocess.Popen(
            cmd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=REPO_ROOT,
            start_new_session=True,
        )
        try:
            log, _ = proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            log, _ = proc.communicate()
            raise HarnessError(f"{what} timed out after {TIMEOUT_S}s:\n{log[-20000:]}") from None
        if proc.returncode == 0:
            return log
        if "address already in use" not in log.lower() or attempt == 2:
            raise HarnessError(f"{what} failed (exit {proc.returncode}, world_size={world_size}):\n{log[-20000:]}")
    raise AssertionError("unreachable")


def run_tasks(
    tasks: list[dict],
    world_size: int,
    workdir: Path,
    python: str = sys.executable,
    script: Path = JOB_MAIN,
    forked: bool = False,
) -> str:
    """Run job tasks (``{"kind", "args", "out"}``) in one launch of ``script`` (``forked``: see
    ``run_torchrun``); returns the launch log."""
    tasks_file = workdir / "tasks.json"
    tasks_file.write_text(json.dumps(tasks, indent=1))
    names = ", ".join(Path(t["out"]).parent.name.removeprefix(".tmp-") for t in tasks)
    what = f"DeepSpeed job [{names}]"
    return run_torchrun(script, ["--tasks", str(tasks_file)], world_size, python, what, forked)
