"""The processes of a torchrun job as the ranks of one ckptspec command (``split.Share``): a gloo group set up from
torchrun's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), the ranks' values exchanged with
``all_gather_object`` (small messages: statuses, digests, counts; never tensor bytes)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from ..split import Share, shared_by, sharing, torchrun_size


@contextlib.contextmanager
def torchrun_share() -> Iterator[Share]:
    """This process's share of a torchrun job, or one process outside torchrun."""
    if torchrun_size() <= 1:
        with sharing(Share()) as share:
            yield share
        return
    import torch.distributed as dist

    dist.init_process_group("gloo")

    def gather(value: Any) -> list[Any]:
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, value)
        return out

    try:
        with shared_by(Share(dist.get_rank(), dist.get_world_size(), gather)) as share:
            yield share
    finally:
        dist.destroy_process_group()
