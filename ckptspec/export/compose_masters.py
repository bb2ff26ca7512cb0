"""The bytes of a domain's masters when the index locates them (#17: stage 0, MoE, universal folders).

A master's locators, in order, concatenated, are its flat fp32 tensor (``Domain.masters``); the
parameter's shape is its shard's (the domain's manifest names it). No torch, no pickle.
"""

from __future__ import annotations

from pathlib import Path

from ..format.dtypes import ITEMSIZE
from ..format.index_models import Domain
from .plan import Segment, TensorSource


def master_sources(tag_dir: Path, domain: Domain) -> dict[str, TensorSource]:
    """local name -> where its master's bytes are."""
    shapes = {p.name: tuple(p.shape) for g in domain.manifest.groups for p in g.params}
    out: dict[str, TensorSource] = {}
    for loc in domain.masters.tensors:
        item = ITEMSIZE[loc.dtype]
        segment = Segment(tag_dir / loc.file, loc.data_offset + loc.element_offset * item, loc.numel * item)
        if loc.param in out:
            out[loc.param].segments.append(segment)
        else:
            out[loc.param] = TensorSource(loc.param, shapes[loc.param], loc.dtype, [segment], "trainable")
    return out
