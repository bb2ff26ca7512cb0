"""Rank 0 decides, every rank acts alike: the one collective pattern of the integrations.

A training job runs the same callback on every rank. What touches the files (writing a manifest, validating
a checkpoint) runs once, on rank 0, and its outcome is broadcast, so every rank raises the same error or
goes on with the same answer: no rank is left waiting in the next collective.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any


def distributed() -> tuple[Any, int]:
    """``torch.distributed`` when a process group is up (else None), and this process's rank."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist, dist.get_rank()
    return None, 0


def on_rank_0(work: Callable[[], Any]) -> Any:
    """``work()``'s result on every rank, computed on rank 0; an exception it raised is raised on every rank,
    as the same class with the same attributes (a ``CheckpointInvalid`` with its findings)."""
    dist, rank = distributed()
    box: list[Any] = [None, None]
    if rank == 0:
        try:
            box[0] = work()
        except Exception as exc:  # raised on every rank below, never left hanging in the broadcast
            box[1] = _portable(exc)
    if dist is not None:
        dist.broadcast_object_list(box, src=0)
    if box[1] is not None:
        cls, args, attributes = box[1]
        error = cls.__new__(cls)  # as it was: ckptspec's errors take other arguments than they store in args
        Exception.__init__(error, *args)
        error.__dict__.update(attributes)
        raise error
    return box[0]


def _portable(exc: Exception) -> tuple:
    """The exception as (class, args, attributes), or a ``RuntimeError`` naming it when those cannot be pickled."""
    value = (type(exc), exc.args, dict(vars(exc)))
    try:
        pickle.loads(pickle.dumps(value))
    except Exception:
        return RuntimeError, (f"rank 0: {type(exc).__name__}: {exc}",), {}
    return value
