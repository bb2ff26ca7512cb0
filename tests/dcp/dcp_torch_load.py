"""What torch's ``dcp_to_torch_save`` does with a DCP directory, run by tests/dcp/test_dcp_faults.py in a process of
its own: ``python dcp_torch_load.py DCP_DIR OUT.pt ORACLE.pt`` prints one JSON line, the outcome: "raises" (the
error's type and first line; DCP's ``CheckpointException`` is unwrapped to the failure it carries), "loads wrong"
(the consolidated state differs from the saving job's ``params``/``state`` oracles: the names listed) or "loads
right"."""

import json
import sys

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save


def _error(exc: BaseException) -> str:
    failures = getattr(exc, "failures", None)  # CheckpointException: rank -> the exception (or its traceback)
    if failures:
        inner = next(iter(failures.values()))  # (the exception, its stack)
        exc = inner[0] if isinstance(inner, tuple) and isinstance(inner[0], BaseException) else exc
    return f"{type(exc).__name__}: " + (str(exc).splitlines() or [""])[0][:200]


def main() -> None:
    source, out, oracle = sys.argv[1:4]
    try:
        dcp_to_torch_save(source, out)
    except BaseException as exc:  # CheckpointException is a BaseException
        print(json.dumps({"outcome": "raises", "error": _error(exc)}))
        return
    got = torch.load(out, weights_only=True)
    want = torch.load(oracle, weights_only=True)
    wrong = [n for n, t in want["params"].items() if n not in got["model"] or not torch.equal(got["model"][n], t)]
    for name, moments in want["state"].items():
        for key, tensor in moments.items():
            found = got["optim"]["state"].get(name, {}).get(key)
            if found is None or not torch.equal(found, tensor):
                wrong.append(f"{name}.{key}")
    print(json.dumps({"outcome": "loads wrong" if wrong else "loads right", "wrong": wrong}))


if __name__ == "__main__":
    main()
