"""Start a job's ranks as torchrun does, forked from one process that has imported torch and DeepSpeed.

    python tests/_harness/job/ranks.py --plan PLAN.json --results RESULTS.json

Every process torchrun starts imports torch and DeepSpeed, and DeepSpeed's engine then imports
torch._dynamo and torch._inductor (its Muon optimizer module calls ``torch.compile`` at import;
``torch.use_deterministic_algorithms`` imports the inductor config): about 7 s of CPU per rank
here, most of a short launch. This launcher imports them once, then forks each launch of the
plan (two at a time, say), which forks its ranks, each with the environment torchrun gives it
(RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...; not the elastic agent's own
TORCHELASTIC_* variables: rank 0 hosts the rendezvous store, as with any env:// launcher), and
runs the launch's script as ``__main__``: the DeepSpeed code each rank runs is the same.
Nothing runs a tensor operation before the fork, so no thread pool is copied half-made
(checked: one thread).

As torchrun does, the first rank to fail stops the others, and the launch ends with its status;
a launch over its time is stopped, and one that lost its port to another process is run again.
"""

import argparse
import gc
import json
import os
import runpy
import signal
import socket
import sys
import threading
import time
from pathlib import Path

# What the ranks import anyway; a module missing from this DeepSpeed (an older one) is skipped.
PRELOAD = (
    "torch",
    "deepspeed",
    "deepspeed.comm",
    "deepspeed.runtime.engine",
    "deepspeed.runtime.zero.muon.muon_optimizer",
    "deepspeed.runtime.pipe",
    "deepspeed.moe.layer",
    "torch._dynamo",
    "torch._inductor.config",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
)
STOP_GRACE_S = 10  # SIGTERM to the other ranks, then SIGKILL


def preload() -> None:
    import importlib

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    if threading.active_count() != 1 or len(os.listdir("/proc/self/task")) != 1:
        raise SystemExit("ranks.py: a thread was started before the fork; use torchrun")
    # The preloaded modules' objects live as long as the ranks: out of the collector's sight, the
    # gc.collect() a job script runs between its tasks no longer scans millions of them in every rank
    # (measured: a 38-task launch 91 s -> 36 s on a loaded machine), and the forked ranks share their pages.
    gc.freeze()


def rank_environment(rank: int, world_size: int, master_port: int) -> dict:
    return {
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),  # torchrun's default
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "GROUP_RANK": "0",
        "ROLE_RANK": str(rank),
        "ROLE_NAME": "default",
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "ROLE_WORLD_SIZE": str(world_size),
        "GROUP_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(master_port),
    }


def run_rank(rank: int, world_size: int, master_port: int, script: str, args: list[str]) -> None:
    """In the forked child: become rank ``rank`` and run the script; never returns."""
    code = 0
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a plan's launch set its own (launch())
        os.environ.update(rank_environment(rank, world_size, master_port))
        sys.argv = [script, *args]
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python SCRIPT` has it
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def wait_for(children: dict[int, int]) -> int:
    """Wait for every rank; the first to fail stops the rest. Returns the launch's exit status."""
    status = 0
    while children:
        pid, wait_status = os.wait()
        rank = children.pop(pid, None)
        if rank is None:
            continue
        code = os.waitstatus_to_exitcode(wait_status)
        if code != 0 and status == 0:
            status = code if code > 0 else 128 - code
            how = f"exited with {code}" if code > 0 else f"was killed by {signal.Signals(-code).name}"
            print(f"ranks.py: rank {rank} {how}; stopping the others", file=sys.stderr, flush=True)
            stop(children)
    return status


def stop(children: dict[int, int]) -> None:
    for pid in children:
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    while children and time.monotonic() < deadline:
        for pid in list(children):
            if os.waitpid(pid, os.WNOHANG)[0]:
                del children[pid]
        time.sleep(0.05)
    for pid in children:
        os.kill(pid, signal.SIGKILL)


def launch(nproc: int, script: str, args: list[str], master_port: int) -> int:
    """Fork the ranks of one launch and wait for them; returns the launch's exit status."""
    sys.stdout.flush()
    sys.stderr.flush()
    children = {}
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            run_rank(rank, nproc, master_port, script, args)
        children[pid] = rank
    # SIGTERM (a plan's timeout) stops the ranks with the launch.
    signal.signal(signal.SIGTERM, lambda *_: (stop(children), os._exit(124)))
    return wait_for(children)


def free_port() -> int:
    # Racy (the port is released before rank 0 binds it): a plan retries a launch that lost it.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_plan(plan: dict) -> list[dict]:
    """Run the launches of ``plan`` (``{"launches": [{"nproc", "script", "args", "log"}], "jobs",
    "timeout"}``), ``jobs`` at a time, each forked from this process with its output in its log.
    Returns per launch ``{"status", "timed_out", "attempts", "seconds"}``."""
    launches, jobs, timeout = plan["launches"], plan["jobs"], plan["timeout"]
    todo, running = list(range(len(launches))), {}  # pid -> (launch index, deadline, start)
    results = [{"status": None, "timed_out": False, "attempts": 0, "seconds": 0.0} for _ in launches]
    while todo or running:
        while todo and len(running) < jobs:
            index = todo.pop(0)
            results[index]["attempts"] += 1
            pid = os.fork()
            if pid == 0:
                _launch_child(launches[index])
            running[pid] = (index, time.monotonic() + timeout, time.monotonic())
        pid, wait_status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            for child, (index, deadline, _) in running.items():
                if time.monotonic() > deadline and not results[index]["timed_out"]:
                    results[index]["timed_out"] = True
                    os.kill(child, signal.SIGTERM)
            time.sleep(0.05)
            continue
        index, _, started = running.pop(pid)
        result = results[index]
        result["status"] = os.waitstatus_to_exitcode(wait_status)
        result["seconds"] = round(result["seconds"] + time.monotonic() - started, 1)
        if result["status"] != 0 and not result["timed_out"] and result["attempts"] < 3:
            with open(launches[index]["log"], errors="replace") as log:
                if "address already in use" in log.read().lower():
                    todo.append(index)
    return results


def _launch_child(spec: dict) -> None:
    """In the forked child: one launch of ``spec``, its output in its log; never returns."""
    code = 1
    try:
        fd = os.open(spec["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        code = launch(spec["nproc"], spec["script"], spec["args"], free_port())
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--plan", type=Path, required=True, help="the launches to run (run_plan)")
    ap.add_argument("--results", type=Path, required=True, help="where run_plan's results go")
    opts = ap.parse_args()
    del sys.path[0]  # this folder: its modules (model, train, ...) must not shadow what the preload imports
    preload()
    opts.results.write_text(json.dumps(run_plan(json.loads(opts.plan.read_text()))))


if __name__ == "__main__":
    main()
