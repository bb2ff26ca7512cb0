"""Run by test_reshard_split.py under torchrun (2 processes): rank 1 fails while building a split output.

    torchrun --nproc_per_node 2 tests/export/split_failure_job.py OUTPUT

Each rank prints how it ended (``rank R: ...``) and exits with its status: rank 1 its own OSError (a full disk),
rank 0 what ``ckptspec.split`` told it (CK918 naming rank 1, with rank 1's exit status).
"""

import errno
import sys

from ckptspec import split
from ckptspec.errors import CkptspecError
from ckptspec.export.output_dir import build_and_publish, held_new_output
from ckptspec.export.torchrun import torchrun_share


def build(tmp):
    share = split.current()
    if share.rank == 1:
        raise OSError(errno.ENOSPC, "No space left on device")
    (tmp / "rank0.bin").write_bytes(b"x" * 1024)  # rank 0's file: removed with the temporary directory
    share.synchronize()  # the commit would wait here for every rank's files
    return [tmp / "rank0.bin"]


def main() -> int:
    rank = "?"
    try:
        with torchrun_share() as share:
            rank = str(share.rank)
            with held_new_output(sys.argv[1], "the test output") as out:
                build_and_publish(out, build)
    except CkptspecError as exc:
        print(f"rank {rank}: {exc.to_line()} exit {exc.exit_code}", flush=True)
        return exc.exit_code
    except OSError as exc:
        print(f"rank {rank}: OSError {exc}", flush=True)
        return 2
    print(f"rank {rank}: done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
