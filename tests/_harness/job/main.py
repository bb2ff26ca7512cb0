"""Entry point of every real-DeepSpeed job of the tests: run a list of tasks in one torchrun launch.

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 tests/_harness/job/main.py --tasks TASKS.json

(the harness starts it through ranks.py, which forks torchrun's ranks after one import of torch
and DeepSpeed).

TASKS.json is a list of ``{"kind": "train" | "resume" | "parallel" | "save_crash", "args": {...}, "out": DIR}``;
every rank runs them in order, each into its own ``out`` directory (see train.py, resume.py, parallel.py and
save_crash.py). Starting torch,
DeepSpeed and the process group costs 5-10 s per launch; a task costs about a second, so the
harness (tests/_harness/launch.py) puts every task of one world size into one launch.

Everything in this folder runs inside the job and is part of every job's cache key.
"""

import argparse
import gc
import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script by torchrun: make `_harness` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from _harness.job import parallel, resume, save_crash, train

KINDS = {"train": train.run, "resume": resume.run, "parallel": parallel.run, "save_crash": save_crash.run}


def reset_deepspeed_globals():
    """What one DeepSpeed engine leaves behind that would make the next task differ from a solo run."""
    from deepspeed.runtime.zero.partition_parameters import Init

    Init.param_id = 0  # ZeRO-3 numbers parameters (ds_id) from a class-level counter


def serve(run_task, reset: bool = True) -> None:
    """Every job script's entry: set up the process group, then ``run_task(task)`` for each task of
    ``--tasks`` in order (each into its own ``out``), DeepSpeed's globals reset before each when ``reset``."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", required=True, type=Path)
    tasks = json.loads(ap.parse_args().tasks.read_text())

    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    # The CPU accelerator reports no fp16 support; its kernels work anyway for the tiny model.
    get_accelerator().is_fp16_supported = lambda: True
    torch.use_deterministic_algorithms(True)
    deepspeed.init_distributed()
    for task in tasks:
        print(f"[harness] rank {dist.get_rank()}: {task['kind']} -> {task['out']}", flush=True)
        if reset:
            reset_deepspeed_globals()
        run_task(task)
        dist.barrier()
        gc.collect()
    dist.destroy_process_group()


def main():
    serve(lambda task: KINDS[task["kind"]](task["args"], Path(task["out"])))


if __name__ == "__main__":
    main()
