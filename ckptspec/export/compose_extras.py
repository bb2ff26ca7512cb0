"""The frozen parameters, persistent buffers and ties of a tensor- or pipeline-parallel checkpoint's
whole model.

A checkpoint index 1.0 lists trainable parameters only (``parameters[].role`` is ``"trainable"``);
each domain's 1.x manifest names its rank's frozen parameters and buffers, and its plan locates
their bytes (the module, ``frozen_param_fragments``). They are placed as DeepSpeed placed them: a
frozen parameter by AutoTP's ``affine_map`` (it splits frozen weights as trainable ones), a buffer
whole on every tensor rank unless the map names it (``layout/placements.untrainable_placement``).
Every tensor rank must hold each name; replicated copies are compared with the first before
anything is written (CK401, ``compose.check_replicas``).

A pipeline stage's are in its layer files: every key of a layer file (the index's ``tensors``,
checked against the file, CK230) is ``<layer>.<key>`` of the whole model. A key that is its stage's
trainable shard elsewhere (a ``TiedLayerSpec`` run at several layers) is a tie of that parameter;
a key that is none of the stage's trainables is a buffer if the stage's model states name it in
``buffer_names``, else a frozen parameter, read from the layer file as saved. No torch, no pickle.
"""

from __future__ import annotations

from pathlib import Path

from ..checkpoint.states import StateCache
from ..deepspeed.layout.placements import affine_params, untrainable_placement
from ..errors import ReconstructMismatch
from ..format.index_models import CheckpointIndex, Shard
from ..format.paths import join_inside
from ..location import RemotePath
from .model_plan import ReconstructionPlan, TensorSource
from .plan import ref_source

EXTRA_ROLES = ("frozen", "buffer")


def model_parallel_extras(
    index: CheckpointIndex, tag_dir: Path | RemotePath, domain_plans: dict[str, ReconstructionPlan], states: StateCache
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


def tensor_parallel_ties(
    index: CheckpointIndex, tag_dir: Path | RemotePath, domain_plans: dict[str, ReconstructionPlan]
) -> dict[str, str]:
    """alias -> owner of the ties of the ZeRO domains outside a pipeline (AutoTP: a weight it left whole,
    ``describe/model_parallel._check_ties``), the same in every domain: the whole model's names."""
    ties: dict[str, dict[str, str]] = {
        d.id: dict(domain_plans[d.id].aliases) for d in index.domains if d.masters is None and not index.layer_files
    }
    first = next(iter(ties.values()), {})
    for domain, found in ties.items():
        if found != first:
            raise ReconstructMismatch(f"domain {domain} ties {found}, another domain {first}", tag_dir)
    return first


def pipeline_extras(
    index: CheckpointIndex, tag_dir: Path | RemotePath, states: StateCache
) -> tuple[dict[str, tuple[list[int], list[tuple[Shard, TensorSource]]]], dict[str, str]]:
    """(name -> (shape, its one whole shard and source) of every frozen parameter and buffer in the
    layer files, tie -> owner) of a pipeline (module docstring)."""
    stage_domain = {d.coordinate.pipeline: d for d in index.domains if d.masters is None}
    owner = {  # (stage, local name) -> the whole-model parameter its shard is
        (next(d.coordinate.pipeline for d in index.domains if d.id == s.domain), s.local_name): p.name
        for p in index.parameters
        for s in p.shards
    }
    buffer_names: dict[int, set[str]] = {}
    for stage, domain in stage_domain.items():
        model = next(f.path for f in domain.manifest.files if f.role == "model_states")
        names = states.state(_file(tag_dir, model)).get("buffer_names") or []
        buffer_names[stage] = {str(n) for n in names}
    extras: dict[str, tuple[list[int], list[tuple[Shard, TensorSource]]]] = {}
    aliases: dict[str, str] = {}
    found: dict[int, set[str]] = {stage: set() for stage in stage_domain}
    for lf in index.layer_files:
        if lf.pipeline not in stage_domain:
            continue
        path = _file(tag_dir, lf.path)
        state = states.state(path)
        for key, local in lf.tensors.items():
            whole = f"{lf.layer}.{key}"
            if (lf.pipeline, local) in owner:
                if owner[(lf.pipeline, local)] != whole:
                    aliases[whole] = owner[(lf.pipeline, local)]
                continue
            role = "buffer" if local in buffer_names[lf.pipeline] else "frozen"
            found[lf.pipeline].add(local)
            source = ref_source(whole, state[key], path, states, role)
            shard = Shard(
                domain=stage_domain[lf.pipeline].id, local_name=local, local_shape=list(source.shape), placement="whole"
            )
            extras[whole] = (list(source.shape), [(shard, source)])
    for stage, names in buffer_names.items():
        if names - found[stage]:
            raise ReconstructMismatch(
                f"stage {stage}'s model states name buffers {sorted(names - found[stage])} that no layer file holds",
                tag_dir,
            )
    return extras, aliases


def _file(tag_dir: Path | RemotePath, relative: str) -> Path | RemotePath:
    path = join_inside(tag_dir, relative)
    if path is None:  # the index rules refuse such a path first
        raise ReconstructMismatch(f"{relative!r} is outside the checkpoint", tag_dir)
    return path
