"""Checkpoint index 1.1's ``extras`` and ``aliases``: the frozen parameters, persistent buffers and ties of a
tensor- or pipeline-parallel checkpoint's whole model, placed once, here, for every writer and reader.

``generate`` writes them into the document (and the save hook, through ``index_extras``); a reader of a
1.0 document, which has no place for them, derives them with the same function from the files
(``export/compose_extras.py``). Metadata only: no tensor bytes, no pickle code.

* A tensor-parallel domain's (its 1.x manifest's ``frozen`` and ``buffers``, located in the module by
  the manifest): placed as DeepSpeed placed them, a frozen parameter by AutoTP's ``affine_map`` (it
  splits frozen weights as trainable ones), a buffer whole on every tensor rank unless the map names it
  (``layout/placements.untrainable_placement``). Every tensor rank holds each name; replicated copies
  are compared with the primary before anything is written (CK401, ``compose.check_replicas``).
* A pipeline stage's are in its layer files: every key of a layer file (the index's ``tensors``,
  checked against the file, CK230) is ``<layer>.<key>`` of the whole model. A key that is its stage's
  trainable shard elsewhere (a ``TiedLayerSpec`` run at several layers) is a tie of that parameter;
  a key that is none of the stage's trainables is a buffer if the stage's model states name it in
  ``buffer_names``, else a frozen parameter, located in the layer file (``Shard.locator``). In a
  tensor-parallel pipeline (a layer file per tensor rank, ``tp_pipeline.py``) each tensor rank's copy is a
  shard: a frozen parameter placed by the ``universal_checkpoint_info`` rules as a trainable one, a buffer
  replicated (the rules name parameters only), tensor rank 0's primary.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, cast

from ...checkpoint.states import StateCache
from ...checkpoint.torchfile import TensorRef
from ...errors import ReconstructMismatch, UnsupportedCheckpoint
from ...format.dtypes import Dtype
from ...format.index_models import CheckpointIndex, IndexExtra, Shard, ShardLocator
from ...format.paths import join_inside
from ...location import RemotePath
from ..layout.placements import affine_params, rule_info, rule_placement, untrainable_placement

Role = Literal["frozen", "buffer"]


def index_extras(
    index: CheckpointIndex, tag_dir: Path | RemotePath, states: StateCache
) -> tuple[list[IndexExtra], dict[str, str]]:
    """(extras, tie -> owner) of the domains whose masters are ZeRO partitions (module docstring)."""
    extras = _model_parallel_extras(index, tag_dir, states)
    aliases = _tensor_parallel_ties(index, tag_dir)
    if index.layer_files:
        layered, aliases = _pipeline_extras(index, tag_dir, states)
        extras += layered
    return extras, aliases


def _tensor_parallel_ties(index: CheckpointIndex, tag_dir: Path | RemotePath) -> dict[str, str]:
    """alias -> owner of the ties of the ZeRO domains outside a pipeline (AutoTP: a weight it left whole,
    ``describe/model_parallel._check_ties``), the same in every domain: the whole model's names."""
    ties = {
        d.id: {a.name: a.owner for a in d.manifest.aliases}
        for d in index.domains
        if d.masters is None and not index.layer_files
    }
    first = next(iter(ties.values()), {})
    for domain, found in ties.items():
        if found != first:
            raise ReconstructMismatch(f"domain {domain} ties {found}, another domain {first}", tag_dir)
    return first


def with_extras(index: CheckpointIndex, tag_dir: Path | RemotePath, states: StateCache) -> CheckpointIndex:
    """``index`` made a 1.1 document with its extras and ties when its whole model has any (else left a 1.0
    one: every 1.0 reader reads it whole)."""
    from ...format.index_models import INDEX_EXTRAS_VERSION

    extras, aliases = index_extras(index, tag_dir, states)
    if extras or aliases:
        index.format_version, index.extras, index.aliases = INDEX_EXTRAS_VERSION, extras, aliases
    return index


def _model_parallel_extras(index: CheckpointIndex, tag_dir: Path | RemotePath, states: StateCache) -> list[IndexExtra]:
    # the ZeRO domains, or an AutoTP stage-0 checkpoint's (masters located apart, one domain per tensor rank): its
    # frozen parameters only (a buffer is a whole copy in every tensor rank's file: compose_plan.whole_plan's)
    stage0 = index.topology.degrees.tensor > 1 and all(d.masters is not None for d in index.domains)
    zero_domains = [d for d in index.domains if d.masters is None or (stage0 and not index.expert_files)]
    out: dict[str, tuple[list[int], Dtype, Role, list[Shard]]] = {}  # name -> (whole shape, dtype, role, shards)
    for domain in zero_domains:
        manifest = domain.manifest
        held: list[tuple[str, list[int], Dtype, Role]] = [
            (f.name, list(f.shape), f.dtype, "frozen") for f in manifest.frozen
        ]
        if domain.masters is None:
            held += [(b.name, list(b.shape), b.dtype, "buffer") for b in manifest.buffers]
        if not held:
            continue
        model_path = next(f.path for f in manifest.files if f.role == "model_states")
        amap = affine_params(states.state(_file(tag_dir, model_path)))
        for name, local, dtype, role in held:
            whole, placement = untrainable_placement(
                amap, name, domain.coordinate.tensor, local, model_path, buffer=role == "buffer"
            )
            shard = Shard(domain=domain.id, local_name=name, local_shape=local, placement=placement)
            shape, first_dtype, first_role, shards = out.setdefault(name, (whole, dtype, role, []))
            if (shape, first_dtype, first_role) != (whole, dtype, role):
                raise ReconstructMismatch(
                    f"{name!r} is a {role} of shape {whole} ({dtype}) in domain {domain.id}, a {first_role} of "
                    f"shape {shape} ({first_dtype}) in domain {shards[0].domain}",
                    tag_dir,
                )
            shards.append(shard)
    extras = []
    for name, (shape, dtype, role, shards) in out.items():
        if len(shards) != len(zero_domains):
            held_by = sorted(s.domain for s in shards)
            raise ReconstructMismatch(f"{name!r} is in domains {held_by} only, not in all {len(zero_domains)}", tag_dir)
        if all(s.placement == "replicated" for s in shards):
            for s in shards:
                s.primary = s is shards[0]
        extras.append(
            IndexExtra(name=name, shape=shape, dtype=dtype, role=role, shards=shards, placement_source="affine_map")
        )
    return extras


def _pipeline_extras(
    index: CheckpointIndex, tag_dir: Path | RemotePath, states: StateCache
) -> tuple[list[IndexExtra], dict[str, str]]:
    domain_of = {(d.coordinate.pipeline, d.coordinate.tensor): d for d in index.domains if d.masters is None}
    owner = {(s.domain, s.local_name): p.name for p in index.parameters for s in p.shards}
    tp = index.topology.degrees.tensor
    buffer_names: dict[str, set[str]] = {}
    models: dict[str, tuple[str, Any]] = {}  # domain -> (model-states file, its state)
    for domain in domain_of.values():
        model = next(f.path for f in domain.manifest.files if f.role == "model_states")
        models[domain.id] = (model, states.state(_file(tag_dir, model)))
        buffer_names[domain.id] = {str(n) for n in models[domain.id][1].get("buffer_names") or []}
    by_name: dict[str, IndexExtra] = {}
    aliases: dict[str, str] = {}
    found: dict[str, set[str]] = {d: set() for d in buffer_names}
    for lf in index.layer_files:
        if (lf.pipeline, lf.tensor or 0) not in domain_of:
            continue
        domain = domain_of[lf.pipeline, lf.tensor or 0]
        path = _file(tag_dir, lf.path)
        state = states.state(path)
        for key, local in lf.tensors.items():
            whole = f"{lf.layer}.{key}"
            if (domain.id, local) in owner:
                if owner[(domain.id, local)] != whole:
                    aliases[whole] = owner[(domain.id, local)]
                continue
            role: Role = "buffer" if local in buffer_names[domain.id] else "frozen"
            found[domain.id].add(local)
            ref = _contiguous(state.get(key) if isinstance(state, dict) else None, path, whole)
            shape, placement = list(ref.shape), cast(Any, "whole")
            if lf.tensor is not None:  # a tensor-parallel pipeline's (module docstring)
                shape, placement = list(ref.shape), "replicated"
                if role == "frozen":
                    model, model_state = models[domain.id]
                    shape, placement = rule_placement(rule_info(model_state), whole, lf.tensor, tp, shape, model)
            shard = Shard(
                domain=domain.id,
                local_name=local,
                local_shape=list(ref.shape),
                placement=placement,
                layer_file=lf.path,
                layer_key=key,
                locator=_locator(ref, path, states, whole),
            )
            known = by_name.get(whole)
            if known is None:
                by_name[whole] = IndexExtra(
                    name=whole,
                    shape=shape,
                    dtype=ref.dtype,
                    role=role,
                    shards=[shard],
                    placement_source="pipeline_layer",
                )
                continue
            if (known.shape, known.dtype, known.role) != (shape, ref.dtype, role):
                raise ReconstructMismatch(
                    f"{whole!r} is a {role} of shape {shape} ({ref.dtype}) in {lf.path}, a {known.role} of shape "
                    f"{known.shape} ({known.dtype}) in {known.shards[0].layer_file}",
                    tag_dir,
                )
            known.shards.append(shard)
    for (stage, tensor), domain in domain_of.items():
        if buffer_names[domain.id] - found[domain.id]:
            rank = f" (tensor rank {tensor})" if tp > 1 else ""
            raise ReconstructMismatch(
                f"stage {stage}{rank}'s model states name buffers {sorted(buffer_names[domain.id] - found[domain.id])} "
                "that no layer file holds",
                tag_dir,
            )
    for extra in by_name.values():
        if tp > 1 and len(extra.shards) != tp:
            raise ReconstructMismatch(f"{extra.name!r} is in {len(extra.shards)} of {tp} tensor ranks' files", tag_dir)
        if extra.shards[0].placement == "replicated":
            for s in extra.shards:
                s.primary = s is extra.shards[0]
    return list(by_name.values()), aliases


def _contiguous(ref: object, path: Path | RemotePath, name: str) -> TensorRef:
    if not isinstance(ref, TensorRef) or not ref.is_contiguous():
        raise UnsupportedCheckpoint(
            f"{name!r} is not a contiguous tensor of {path.name}", "save the model with contiguous tensors", str(path)
        )
    return ref


def _locator(ref: TensorRef, path: Path | RemotePath, states: StateCache, name: str) -> ShardLocator:
    """Where a layer file's tensor is: one contiguous range of its zip member."""
    members = states.members(path)
    if ref.storage.member not in members:
        raise ReconstructMismatch(f"storage {ref.storage.member} of {name!r} is missing", path)
    data_offset, member_size = members[ref.storage.member]
    return ShardLocator(
        member=ref.storage.member,
        data_offset=data_offset,
        member_size=member_size,
        dtype=ref.dtype,
        element_offset=ref.storage_offset,
        numel=ref.numel,
    )


def _file(tag_dir: Path | RemotePath, relative: str) -> Path | RemotePath:
    path = join_inside(tag_dir, relative)
    if path is None:  # the index rules refuse such a path first
        raise ReconstructMismatch(f"{relative!r} is outside the checkpoint", tag_dir)
    return path
