"""Start real-DeepSpeed jobs: one launch runs a list of tasks (tests/_harness/job/main.py).

A launch is torchrun's, or job/ranks.py's (``run_launches``): the same ranks and environment,
forked from one process that has imported torch and DeepSpeed, once for many launches (about
7 s of CPU per rank process saved)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from . import guard
from .cache import HARNESS, REPO_ROOT

JOB_MAIN = HARNESS / "job" / "main.py"
RANKS = HARNESS / "job" / "ranks.py"  # torchrun's ranks, forked after one import of torch and DeepSpeed
RESHARD_MAIN = HARNESS / "reshard_job.py"  # reshard and universal loads beyond job/resume.py (its own key)
FSDP2_MAIN = HARNESS / "fsdp2_job.py"  # the FSDP2 loads of the DCP export: no DeepSpeed, a launch of its own
DCP_SAVE_MAIN = HARNESS / "dcp_save_job.py"  # FSDP2 jobs that save DCP checkpoints (#42): a launch of its own
TRAINER_MAIN = HARNESS / "trainer_job.py"  # transformers' Trainer on DeepSpeed with ckptspec's callback (#43)
ACCELERATE_MAIN = HARNESS / "accelerate_job.py"  # accelerate's save_state/load_state on DeepSpeed, through ckptspec
OPTIM_MAIN = HARNESS / "optim_job.py"  # the optimizer state DeepSpeed loads from a parallel entry (its own key)
BEFORE_LOAD = HARNESS / "before_load.py"  # imported by RESHARD_MAIN, OPTIM_MAIN and job/resume.py (in their keys)
OPTIM_UNIVERSAL_MAIN = HARNESS / "optim_universal_job.py"  # the same from a universal folder's source (its own key)
RESUME_MAIN = HARNESS / "resume_job.py"  # ckptspec's validated resume of a run tasks.launched builds (its own key)
SERVERS = HARNESS / "servers.py"  # nginx, which FSDP2_MAIN's "http" loads start on rank 0 (in their keys)
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


def _run_in_session(cmd: list[str], env: dict, timeout: float) -> tuple[int | None, str]:
    """Run ``cmd`` in a session of its own, so that a timeout kills it with every process it
    started; returns its exit status (None: timed out) and its output."""
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO_ROOT, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return None, proc.communicate()[0]
    return proc.returncode, out


def run_torchrun(
    script: Path,
    args: list[str],
    world_size: int,
    python: str = sys.executable,
    what: str = "DeepSpeed job",
    env: dict | None = None,
) -> str:
    """Run ``script`` under torchrun on the CPU (the jobs' environment, and ``env``); returns its log, raises
    ``HarnessError``."""
    guard.reached(f"a torchrun launch of {script.name}")
    env = {**job_env(python), **(env or {})}
    for attempt in range(3):
        cmd = _torchrun(world_size, script, *args, python=python)
        returncode, log = _run_in_session(cmd, env, TIMEOUT_S)
        if returncode is None:
            raise HarnessError(f"{what} timed out after {TIMEOUT_S}s:\n{log[-20000:]}")
        if returncode == 0:
            return log
        if "address already in use" not in log.lower() or attempt == 2:
            raise HarnessError(f"{what} failed (exit {returncode}, world_size={world_size}):\n{log[-20000:]}")
    raise AssertionError("unreachable")


def _torchrun(nproc: int, *args, python: str = sys.executable, node: tuple[int, int, int] | None = None) -> list[str]:
    """The command line of ``torchrun --nproc_per_node nproc ARGS`` on 127.0.0.1 (a free port); ``node``: (node
    rank, number of nodes, the port node 0 listens on) for one node of a job of several."""
    nodes = [] if node is None else [f"--nnodes={node[1]}", f"--node_rank={node[0]}"]
    port = _free_port() if node is None else node[2]
    return [
        python,
        "-m",
        "torch.distributed.run",
        *nodes,
        f"--nproc_per_node={nproc}",
        "--master_addr=127.0.0.1",
        f"--master_port={port}",
        *map(str, args),
    ]


def torchrun_command(nproc: int, *args, env: dict | None = None, nnodes: int = 1) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node nproc ARGS`` (a module with ``-m``, or a script) on 127.0.0.1, on the CPU,
    with the jobs' environment; its exit code and output, whatever they are (the caller asserts them). ``nnodes``
    above 1: that many torchrun agents started at once (``--nnodes``, ``--node_rank``), as the nodes of one job would
    start them; the highest exit code, and their outputs, node 0's first."""
    env = {**job_env(), **(env or {})}
    if nnodes == 1:
        return subprocess.run(_torchrun(nproc, *args), env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    agents = _start_agents(nproc, nnodes, args, env, sys.executable, subprocess.PIPE, cwd=None)
    outputs = [agent.communicate(timeout=TIMEOUT_S) for agent in agents]
    return subprocess.CompletedProcess(
        agents[0].args,
        max(agent.returncode for agent in agents),
        "".join(out for out, _ in outputs),
        "".join(err for _, err in outputs),
    )


def _start_agents(
    nproc: int, nnodes: int, args, env: dict, python: str, stderr, cwd: Path | None = REPO_ROOT
) -> list[subprocess.Popen]:
    """The ``nnodes`` torchrun agents of one job, one rendezvous port, each in a session of its own (a timeout
    kills an agent with the ranks it started)."""
    port = _free_port()
    return [
        subprocess.Popen(
            _torchrun(nproc, *args, python=python, node=(rank, nnodes, port)),
            env=env,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            cwd=cwd,
            start_new_session=True,
        )
        for rank in range(nnodes)
    ]


def run_nodes(launch: Launch, python: str = sys.executable) -> Done | HarnessError:
    """``launch`` as ``launch.nodes`` torchrun agents on this machine (``--nnodes``, ``--node_rank``, one
    rendezvous port), ``world_size / nodes`` ranks each, as the nodes of a job start them: not forked from
    job/ranks.py, whose ranks are one node's. Its log: every agent's output, node 0's first."""
    env = job_env(python)
    nproc = launch.world_size // launch.nodes
    for attempt in range(3):
        start = time.monotonic()
        agents = _start_agents(nproc, launch.nodes, [launch.script, *launch.args], env, python, subprocess.STDOUT)
        deadline, timed_out, logs = start + TIMEOUT_S, False, []
        for agent in agents:
            try:
                logs.append(agent.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
            except subprocess.TimeoutExpired:
                timed_out = True
                for other in agents:  # every agent, with the ranks it started
                    if other.poll() is None:
                        os.killpg(other.pid, signal.SIGKILL)
                logs.append(agent.communicate()[0])
        log = "".join(f"[node {rank}]\n{text}" for rank, text in enumerate(logs))
        launch.log.write_text(log)
        status = max(agent.returncode for agent in agents)
        if timed_out:
            return HarnessError(f"{launch.what} timed out after {TIMEOUT_S}s:\n{log[-20000:]}")
        if status == 0:
            return Done(log, round(time.monotonic() - start, 1))
        if "address already in use" not in log.lower() or attempt == 2:
            how = f"exit {status}, world_size={launch.world_size}, nodes={launch.nodes}"
            return HarnessError(f"{launch.what} failed ({how}):\n{log[-20000:]}")
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class Launch:
    """One launch of ``script`` with ``args`` on ``world_size`` ranks (over ``nodes`` agents); ``workdir`` holds its
    log."""

    script: Path
    args: list[str]
    world_size: int
    workdir: Path
    what: str = "DeepSpeed job"
    nodes: int = 1  # above 1: that many torchrun agents (run_nodes), not ranks forked by job/ranks.py

    @property
    def log(self) -> Path:
        return self.workdir / "launch.log"


@dataclass(frozen=True)
class Done:
    log: str
    seconds: float  # the launch's wall time


def run_launches(launches: list[Launch], python: str = sys.executable, jobs: int = 2) -> list[Done | HarnessError]:
    """Run ``launches``, ``jobs`` at a time, from one job/ranks.py process: torch and DeepSpeed are
    imported once for all of them and every launch's ranks are forked from it. Returns per launch
    its log and time, or the ``HarnessError`` that says how it failed."""
    guard.reached(f"a launch of DeepSpeed ranks ({', '.join(sorted({ln.script.name for ln in launches}))})")
    if any(ln.nodes > 1 for ln in launches):  # the agents of several nodes: run_nodes, after the forked launches
        forked = iter(run_launches([ln for ln in launches if ln.nodes == 1], python, jobs))
        return [run_nodes(ln, python) if ln.nodes > 1 else next(forked) for ln in launches]
    if not launches:
        return []
    plan = {
        "jobs": jobs,
        "timeout": TIMEOUT_S,
        "launches": [
            {"nproc": ln.world_size, "script": str(ln.script), "args": ln.args, "log": str(ln.log)} for ln in launches
        ],
    }
    plan_file, results_file = launches[0].workdir / "plan.json", launches[0].workdir / "plan-results.json"
    plan_file.write_text(json.dumps(plan, indent=1))
    cmd = [python, str(RANKS), "--plan", str(plan_file), "--results", str(results_file)]
    # Each launch has its own timeout inside the plan; this one only catches a plan that hangs.
    returncode, out = _run_in_session(cmd, job_env(python), TIMEOUT_S * (len(launches) // max(1, jobs) + 2))
    if returncode != 0 or not results_file.exists():
        error = HarnessError(f"the launcher (job/ranks.py --plan) failed (exit {returncode}):\n{out[-20000:]}")
        return [error] * len(launches)
    outcome = []
    for launch, result in zip(launches, json.loads(results_file.read_text())):
        log = launch.log.read_text(errors="replace") if launch.log.exists() else ""
        if result["timed_out"]:
            outcome.append(HarnessError(f"{launch.what} timed out after {TIMEOUT_S}s:\n{log[-20000:]}"))
        elif result["status"] != 0:
            status, ws = result["status"], launch.world_size
            outcome.append(HarnessError(f"{launch.what} failed (exit {status}, world_size={ws}):\n{log[-20000:]}"))
        else:
            outcome.append(Done(log, result["seconds"]))
    return outcome


def task_launch(tasks: list[dict], world_size: int, workdir: Path, script: Path = JOB_MAIN, nodes: int = 1) -> Launch:
    """The launch of ``script`` that runs job tasks (``{"kind", "args", "out"}``), set up in ``workdir``."""
    tasks_file = workdir / "tasks.json"
    tasks_file.write_text(json.dumps(tasks, indent=1))
    names = ", ".join(Path(t["out"]).parent.name.removeprefix(".tmp-") for t in tasks)
    return Launch(script, ["--tasks", str(tasks_file)], world_size, workdir, f"DeepSpeed job [{names}]", nodes)


def run_tasks(
    tasks: list[dict],
    world_size: int,
    workdir: Path,
    python: str = sys.executable,
    script: Path = JOB_MAIN,
    env: dict | None = None,
) -> str:
    """Run job tasks in one torchrun launch of ``script``, as a user starts a job (``examples/demo.py``;
    the harness's own launches go through ``run_launches``); returns the launch log, raises ``HarnessError``."""
    launch = task_launch(tasks, world_size, workdir, script)
    return run_torchrun(launch.script, launch.args, world_size, python, launch.what, env)
