"""The frozen parameters and persistent buffers of a tensor-parallel checkpoint's whole model.

A checkpoint index 1.0 lists trainable parameters only (``parameters[].role`` is ``"trainable"``);
each domain's 1.x manifest names its rank's frozen parameters and buffers, and its plan locates
their bytes (the module, ``frozen_param_fragments``). They are placed as DeepSpeed placed them: a
frozen parameter by AutoTP's ``affine_map`` (it splits frozen weights as trainable ones), a buffer
whole on every tensor rank unless the map names it (``layout/placements.untrainable_placement``).
Every tensor rank must hold each name; replicated copies are compared with the first before
anything is written (CK401, ``compose.check_replicas``). No torch, no pickle.
"""

from __future__ import annotations

from pathlib import Path

from ..checkpoint.states import StateCache
from ..deepspeed.layout.placements import affine_params, untrainable_placement
from ..errors import ReconstructMismatch
from ..format.index_models import CheckpointIndex, Shard
from .plan import ReconstructionPlan, TensorSource

EXTRA_ROLES = ("frozen", "buffer")


def model_parallel_extras(
    index: CheckpointIndex, tag_dir: Path, domain_plans: dict[str, ReconstructionPlan], states: StateCache
) -> dict[str, tuple[list[int], list[tuple[Shard, TensorSource]]]]:
    """name -> (whole shape, its shards with their sources, tensor rank order) of every frozen parameter
    and buffer of the domains whose masters are ZeRO partitions (the #17 kinds add theirs as they are)."""
    zero_domains = [d for d in index.domains if d.masters is None]
    out: dict[str, tuple[list[int], list[tuple[Shard, TensorSource]]]] = {}
    for domain in zero_domains:
        plan = domain_plans[domain.id]
        names = [n for n in plan.order if n in plan.sources and plan.sources[n].role in EXTRA_ROLES]
        if not names:
            continue
        model_path = next(f.path for f in domain.manifest.files if f.role == "model_states")
        amap = affine_params(states.state(tag_dir / model_path))
        for name in names:
            source = plan.sources[name]
            local = list(source.shape)
            whole, placement = untrainable_placement(
                amap, name, domain.coordinate.tensor, local, model_path, buffer=source.role == "buffer"
            )
            shard = Shard(domain=domain.id, local_name=name, local_shape=local, placement=placement)
            shape, shards = out.setdefault(name, (whole, []))
            if shape != whole or shards and (shards[0][1].role, shards[0][1].dtype) != (source.role, source.dtype):
                raise ReconstructMismatch(
                    f"{name!r} is a {source.role} of shape {whole} ({source.dtype}) in domain {domain.id}, "
                    f"a {shards[0][1].role} of shape {shape} ({shards[0][1].dtype}) in domain {shards[0][0].domain}",
                    tag_dir,
                )
            shards.append((shard, source))
    for name, (_, shards) in out.items():
        if len(shards) != len(zero_domains):
            held = sorted(s.domain for s, _ in shards)
            raise ReconstructMismatch(f"{name!r} is in domains {held} only, not in all {len(zero_domains)}", tag_dir)
        if all(s.placement == "replicated" for s, _ in shards):
            for s, _ in shards:
                s.primary = s is shards[0][0]
    return out
