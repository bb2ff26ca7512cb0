"""One collective the live producers share."""

from __future__ import annotations


def gather(value, dist=None) -> list:
    """``value`` of every rank, in rank order (one ``all_gather_object``)."""
    if dist is None:
        import torch.distributed

        dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return [value]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out
