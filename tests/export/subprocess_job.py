"""Run by test_reshard_split.py under torchrun (2 processes): a training job whose rank 0 runs ``ckptspec`` as a
subprocess, which inherits the worker's ``RANK``, ``WORLD_SIZE`` and ``MASTER_*``.

    torchrun --nproc_per_node 2 tests/export/subprocess_job.py ARGS...

Both ranks join the job's own gloo group first (as a training script would), then rank 0 runs
``python -m ckptspec ARGS...`` and prints its exit status; a subprocess that joined the job's group instead would
wait for ranks that never come, until the timeout.
"""

import subprocess
import sys

import torch.distributed as dist


def main() -> int:
    dist.init_process_group("gloo")
    status = 0
    if dist.get_rank() == 0:
        try:
            run = subprocess.run([sys.executable, "-m", "ckptspec", *sys.argv[1:]], timeout=120)
            status = run.returncode
        except subprocess.TimeoutExpired:
            status = 124
        print(f"ckptspec exited {status}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
