"""The bytes of a domain's masters when the index locates them (#17: stage 0, MoE, universal folders),
and the rest of the model such a domain names: its buffers and ties.

A master's locators, in order, concatenated, are its flat fp32 tensor (``Domain.masters``); the
parameter's shape is its shard's (the domain's manifest names it). What the bytes are follows from
where they are (``stored_in``): the optimizer's fp32 copy, the fp32 weights of a run without mixed
precision, or a universal folder's ``fp32.pt``. A buffer is ``module[name]`` of the model states the
domain lists (the copy of the source's in a universal folder); a tie is its owner. No torch, no pickle.
"""

from __future__ import annotations

from pathlib import Path

from ..checkpoint.states import StateCache
from ..deepspeed.layout.names import MODEL_RE
from ..errors import ReconstructMismatch
from ..format.dtypes import ITEMSIZE
from ..format.index_models import Domain
from .model_plan import MODULE_FP32_WEIGHT, ORIGINS, UNIVERSAL_FP32, Segment, TensorSource
from .plan import _inside, buffer_source

_ORIGIN = {"module": MODULE_FP32_WEIGHT, "expert_files": MODULE_FP32_WEIGHT, "universal": UNIVERSAL_FP32}


def master_sources(tag_dir: Path, domain: Domain) -> dict[str, TensorSource]:
    """local name -> where its master's bytes are."""
    shapes = {p.name: tuple(p.shape) for g in domain.manifest.groups for p in g.params}
    digests = {p.name: p.digest.sha256 for g in domain.manifest.groups for p in g.params if p.digest is not None}
    origin = _ORIGIN.get(domain.masters.stored_in, ORIGINS["trainable"])
    out: dict[str, TensorSource] = {}
    for loc in domain.masters.tensors:
        item = ITEMSIZE[loc.dtype]
        segment = Segment(tag_dir / loc.file, loc.data_offset + loc.element_offset * item, loc.numel * item)
        if loc.param in out:
            segments = out[loc.param].segments
            assert isinstance(segments, list)  # made just below, as a list
            segments.append(segment)
        else:
            out[loc.param] = TensorSource(  # a 1.1 manifest's digest: checked as the bytes stream (CK222)
                loc.param, shapes[loc.param], loc.dtype, [segment], "trainable", digests.get(loc.param), origin
            )
    return out


def named_extras(
    tag_dir: Path, domain: Domain, masters: dict[str, TensorSource], states: StateCache
) -> tuple[dict[str, TensorSource], dict[str, str]]:
    """(buffer or frozen parameter name -> its bytes, alias -> owner) of a domain whose index locates its masters
    (a stage-0 one's frozen parameters: its module's weights that hold no master, ``stage0_names.frozen_apart``)."""
    buffers: dict[str, TensorSource] = {}
    if domain.manifest.buffers or domain.manifest.frozen:
        model = next((f.path for f in domain.manifest.files if MODEL_RE.match(Path(f.path).name)), None)
        if model is None:
            raise ReconstructMismatch(f"domain {domain.id} names buffers but lists no model states", tag_dir)
        path = _inside(tag_dir, model)
        for buffer in domain.manifest.buffers:
            buffers[buffer.name] = buffer_source(buffer, path, states)
        for frozen in domain.manifest.frozen:  # in the module, as saved (stored_in "module")
            located = buffer_source(frozen, path, states)
            buffers[frozen.name] = TensorSource(frozen.name, located.shape, located.dtype, located.segments, "frozen")
    aliases = {}
    for alias in domain.manifest.aliases:
        owner = masters.get(alias.owner)
        if owner is None or list(owner.shape) != list(alias.shape):
            raise ReconstructMismatch(
                f"alias {alias.name!r} has no owner {alias.owner!r} of shape {list(alias.shape)}", tag_dir
            )
        aliases[alias.name] = alias.owner
    return buffers, aliases
