"""What torch's ``dcp_to_torch_save`` does with DCP directories, run by tests/dcp/test_dcp_faults.py in a process of
its own (one for every fault: torch is imported once): ``python dcp_torch_load.py JOBS.json``, where JOBS.json lists
``[DCP_DIR, OUT.pt, ORACLE.pt]`` triples, prints one JSON line per triple, in order (each measured in a process
forked before any load), the outcome: "raises" (the error's type and first line; DCP's ``CheckpointException`` is
unwrapped to the failure it carries), "loads wrong" (the consolidated state differs from the saving job's
``params``/``state`` oracles: the names listed) or "loads right"."""

import json
import os
import sys

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save


def _error(exc: BaseException) -> str:
    failures = getattr(exc, "failures", None)  # CheckpointException: rank -> the exception (or its traceback)
    if failures:
        inner = next(iter(failures.values()))  # (the exception, its stack)
        exc = inner[0] if isinstance(inner, tuple) and isinstance(inner[0], BaseException) else exc
    return f"{type(exc).__name__}: " + (str(exc).splitlines() or [""])[0][:200]


def outcome(source: str, out: str, oracle: str) -> dict:
    try:
        dcp_to_torch_save(source, out)
    except BaseException as exc:  # CheckpointException is a BaseException
        return {"outcome": "raises", "error": _error(exc)}
    got = torch.load(out, weights_only=True)
    want = torch.load(oracle, weights_only=True)
    wrong = [n for n, t in want["params"].items() if n not in got["model"] or not torch.equal(got["model"][n], t)]
    for name, moments in want["state"].items():
        for key, tensor in moments.items():
            found = got["optim"]["state"].get(name, {}).get(key)
            if found is None or not torch.equal(found, tensor):
                wrong.append(f"{name}.{key}")
    return {"outcome": "loads wrong" if wrong else "loads right", "wrong": wrong}


def main() -> None:
    with open(sys.argv[1]) as fh:
        jobs = json.load(fh)
    for source, out, oracle in jobs:
        # Each in a child forked before any load: a fault that leaves a tensor unwritten (a gap) gives whatever
        # memory torch.empty returns, which after an earlier load of the same checkpoint can be the right values.
        pid = os.fork()
        if pid == 0:
            print(json.dumps(outcome(source, out, oracle)), flush=True)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        if status != 0:
            raise SystemExit(f"measuring {source} failed (wait status {status})")


if __name__ == "__main__":
    main()
