"""Manifests from a live DeepSpeed engine.

The layout is read from the optimizer objects themselves (flat-buffer offsets,
alignment paddings, round-robin order, partition sizes, stage-3 sub-groups), not
re-derived from the config. No collective call is made: every value read here is
already present on each rank, so ``manifest_from_engine`` may be called on any
subset of ranks without deadlock.

Imports torch and DeepSpeed only when called.
"""

from __future__ import annotations

import shutil
import uuid
import warnings
from pathlib import Path

from .._version import __version__
from ..checkpoint.embedded import CLIENT_STATE_KEY, client_state_value
from ..checkpoint.states import StateCache
from ..errors import EngineLayoutMismatch, UnsupportedEngine
from ..format.dtypes import dtype_name
from ..format.models import ExcludedParam, Group, Layout, Manifest, Producer, ShardFile
from ..format.partition import ParamSpec, flat_group, per_param_group
from ..format.validate import validate_document
from ..format.version import FORMAT_NAME, FORMAT_VERSION
from .describe import describe_files
from .digests import add_digests
from .directory import ShardSet, scan_tag_dir
from .engine_refusals import is_model_parallel_engine, refuse_unsaveable
from .engine_state import (
    aliases_of_engine,
    buffers_of_engine,
    frozen_of_engine,
    master_dtype_of_engine,
    optimizer_of_engine,
    save_of_engine,
)
from .names import file_order
from .staged_save import publish_on_rank_0, save_request, save_staged


def _param_names(engine) -> dict[int, str]:
    # A tied param is named by its first name, as DeepSpeed names it (its other names are aliases).
    return {id(p): name for name, p in engine.module.named_parameters()}


def _shape(param) -> tuple[int, ...]:
    return tuple(param.ds_shape if hasattr(param, "ds_shape") else param.shape)


def _spec(param, names: dict[int, str]) -> ParamSpec:
    return ParamSpec(names[id(param)], _shape(param), dtype_name(param.dtype))


def _live_paddings(params, flat) -> list[int]:
    """Alignment padding after each param, from where the params really sit in the flat buffer.

    DeepSpeed before 0.19.6 keeps no ``round_robin_bit16_padding``; its params are views
    into ``bit16_groups_flat``, so their storage positions give the layout.
    """
    size = flat.element_size()
    offsets = [(p.data_ptr() - flat.data_ptr()) // size for p in params]
    ends = [o + p.numel() for o, p in zip(offsets, params)]
    return [nxt - end for end, nxt in zip(ends, offsets[1:])] + [0]


def _check_padded_numel(group: Group, i: int, flat) -> None:
    """Cross-check with the optimizer's own numbers: the computed group fills its live flat buffer."""
    if group.padded_numel != flat.numel():
        raise EngineLayoutMismatch(
            f"group {i}: computed padded numel {group.padded_numel}, live flat buffer has {flat.numel()}"
        )


def _flat_groups_stage12(engine, names) -> list[Group]:
    opt = engine.optimizer
    groups = []
    for i, params in enumerate(opt.round_robin_bit16_groups):
        count = opt.partition_count[i]
        paddings = (
            opt.round_robin_bit16_padding[i]
            if hasattr(opt, "round_robin_bit16_padding")
            else _live_paddings(params, opt.bit16_groups_flat[i])
        )
        group = flat_group(
            [_spec(p, names) for p in params],
            optimizer_group=i,
            partition_count=count,
            zero_stage=engine.zero_optimization_stage(),
            paddings=paddings,
        )
        _check_padded_numel(group, i, opt.bit16_groups_flat[i])
        if hasattr(opt, "round_robin_bit16_offsets") and [p.offset for p in group.params] != list(
            opt.round_robin_bit16_offsets[i]
        ):
            raise EngineLayoutMismatch(f"group {i}: computed offsets differ from the live optimizer's")
        groups.append(group)
    return groups


def _flat_groups_bf16_optimizer(engine, names) -> list[Group]:
    # BF16_Optimizer saves each rank's fp32 partition *with* its tail padding.
    opt = engine.optimizer
    groups = []
    for i, params in enumerate(opt.bf16_groups):
        group = flat_group(
            [_spec(p, names) for p in params],
            optimizer_group=i,
            partition_count=opt.partition_count[i],
            zero_stage=1,
            tail_padding_saved=True,
        )
        _check_padded_numel(group, i, opt.bf16_groups_flat[i])
        groups.append(group)
    return groups


def _per_param_groups_stage3(engine, names) -> list[Group]:
    opt = engine.optimizer
    groups = []
    for j, sub_group in enumerate(opt.fp16_groups):
        group = per_param_group(
            [_spec(p, names) for p in sub_group],
            optimizer_group=int(opt.sub_group_to_group_id[j]),
            partition_count=opt.sub_group_partition_counts[j]
            if hasattr(opt, "sub_group_partition_counts")
            else engine.dp_world_size,
        )
        if group.partition_numel != int(opt.fp16_partitioned_groups_flat_numel[j]):
            raise EngineLayoutMismatch(
                f"sub-group {j}: computed partition numel {group.partition_numel}, "
                f"live optimizer has {opt.fp16_partitioned_groups_flat_numel[j]}"
            )
        groups.append(group)
    return groups


def _is_bf16_optimizer(opt) -> bool:
    return type(opt).__name__ == "BF16_Optimizer"


def _check_supported(engine) -> None:
    refuse_unsaveable(engine)
    if getattr(engine, "has_moe_layers", False):
        raise UnsupportedEngine("MoE engines are not described by manifest format 1.0")
    if engine.mp_world_size > 1 or type(engine).__name__ == "PipelineEngine":
        raise UnsupportedEngine(
            "tensor- or pipeline-parallel engines are described by a checkpoint index (engine_index.index_from_engine)"
        )


def manifest_from_engine(engine, *, exclude_frozen_parameters: bool = False) -> Manifest:
    """Describe ``engine``'s checkpoint layout (no ``files``: see ``describe_files``).

    Arguments:
        engine: a ``deepspeed.DeepSpeedEngine`` after ``deepspeed.initialize``.
        exclude_frozen_parameters: the value passed to ``engine.save_checkpoint``.

    Returns:
        The manifest; identical on every rank. Makes no collective call.

    Raises:
        UnsupportedEngine: MoE, tensor or pipeline parallelism, ZeRO stage 0.
    """
    _check_supported(engine)
    return engine_layout(engine, exclude_frozen_parameters)


def engine_layout(engine, exclude_frozen_parameters: bool = False) -> Manifest:
    """The manifest of the ZeRO data-parallel group ``engine`` belongs to (no refusal of model
    parallelism: a checkpoint index embeds one per tensor/pipeline coordinate, engine_index.py)."""
    import deepspeed

    stage = engine.zero_optimization_stage()
    opt = engine.optimizer
    names = _param_names(engine)
    if stage == 3:
        groups = _per_param_groups_stage3(engine, names)
    elif _is_bf16_optimizer(opt):
        groups = _flat_groups_bf16_optimizer(engine, names)
    elif stage in (1, 2):
        groups = _flat_groups_stage12(engine, names)
    else:
        raise UnsupportedEngine(f"ZeRO stage 0 with {type(opt).__name__} is not described by manifest format 1.0")
    trainable = {p.name for g in groups for p in g.params}
    shapes = {p.name: tuple(p.shape) for g in groups for p in g.params}
    frozen_stage = 1 if _is_bf16_optimizer(opt) else stage
    aliases = aliases_of_engine(engine, shapes)
    alias_names = {a.name for a in aliases}
    frozen = [
        f
        for f in frozen_of_engine(engine, names, trainable, frozen_stage, exclude_frozen_parameters)
        if f.name not in alias_names
    ]
    excluded = []
    if exclude_frozen_parameters:
        excluded = [
            ExcludedParam(name=names[id(p)], reason="exclude_frozen_parameters")
            for p in engine.module.parameters()
            if names[id(p)] not in trainable
        ]
    model_dtype = "bfloat16" if engine.bfloat16_enabled() else "float16" if engine.fp16_enabled() else "float32"
    master = master_dtype_of_engine(engine, stage)
    zero_cfg = engine._config.zero_config
    layout = Layout(
        zero_stage=stage,
        world_size=engine.dp_world_size,
        tensor_parallel_size=1,
        pipeline_parallel_size=1,
        model_parallel_size=engine.mp_world_size,
        model_dtype=model_dtype,
        master_dtype=master,
        round_robin=bool(getattr(opt, "round_robin_gradients", False)),
        parameter_alignment=bool(getattr(opt, "parameter_alignment", False)),
        tail_padding_saved=_is_bf16_optimizer(opt),
        byte_order="little",
        optimizer=type(opt).__name__,
        exclude_frozen_parameters=exclude_frozen_parameters,
    )
    if stage == 3:
        layout.sub_group_size = int(zero_cfg.sub_group_size)
    manifest = Manifest(
        format=FORMAT_NAME,
        format_version=FORMAT_VERSION,
        producer=Producer(
            tool="ckptspec", tool_version=__version__, framework="deepspeed", framework_version=deepspeed.__version__
        ),
        layout=layout,
        groups=groups,
        frozen=frozen,
        buffers=buffers_of_engine(engine),
        aliases=aliases,
        excluded=excluded,
        files=[],
        save=save_of_engine(engine),
    )
    if (optimizer := optimizer_of_engine(engine, stage)) is not None:
        manifest.optimizer = optimizer
    return manifest


def save_checkpoint(
    engine,
    save_dir,
    tag=None,
    client_state=None,
    hash=True,
    *,
    save_latest: bool = True,
    exclude_frozen_parameters: bool = False,
    sidecar_encoding: str = "json",
) -> Manifest:
    """``engine.save_checkpoint`` plus the manifest, embedded where it travels with the files.

    Call it on every rank, exactly where ``engine.save_checkpoint`` would be called. It:

    1. describes the layout from the live engine (``manifest_from_engine``: the exact
       partition layout of the optimizer) and refuses unsupported engines before
       anything is written;
    2. calls ``engine.save_checkpoint`` with the layout manifest (``files: []``) added to
       ``client_state`` under ``"ckptspec_manifest"`` as a JSON string, so it is inside
       the model-states file(s) and survives when only the ``.pt`` files are copied;
    3. after every rank has written its files (DeepSpeed's closing barrier), has each
       rank describe the files it wrote (size, locators, ``sha256`` when ``hash``) and
       gathers the descriptions (one ``all_gather_object``);
    4. on rank 0, validates the complete manifest and writes it last, atomically, as
       ``ckptspec.json`` (``sidecar_encoding="msgpack"``: ``ckptspec.msgpack``), then
       writes ``latest`` (atomically, after the sidecar, so ``latest`` never names a
       checkpoint without its manifest).

    DeepSpeed writes into a temporary tag directory, which takes the tag's name (swapped in
    atomically where the tag exists) once every file and the sidecar are complete: killed at
    any instant, the save leaves the earlier checkpoint or the new one complete.

    Arguments are those of ``engine.save_checkpoint`` (``client_state`` may not use
    the ``"ckptspec_manifest"`` key); ``hash`` records a SHA-256 of every file (each
    rank hashes its own files, in parallel).

    Returns:
        The complete manifest, identical on every rank.

    Raises:
        UnsupportedEngine: before saving, for engines format 1.0 cannot describe (and
            decoupled/asynchronous checkpoint engines, whose files are not final on return).
        ValueError: ``client_state`` already holds ``"ckptspec_manifest"``.
        RuntimeError: describing or writing failed on some rank; raised on every rank
            (no rank is left waiting), and neither the sidecar nor ``latest`` is written.
    """
    import torch.distributed as dist

    checkpoint_engine = getattr(engine, "checkpoint_engine", None)
    if checkpoint_engine is not None and getattr(checkpoint_engine, "is_decoupled", lambda: False)():
        raise UnsupportedEngine(
            "a decoupled checkpoint engine writes files after save_checkpoint returns; "
            "ckptspec cannot describe them then"
        )
    if sidecar_encoding not in ("json", "msgpack"):
        raise ValueError(f"sidecar_encoding must be 'json' or 'msgpack', not {sidecar_encoding!r}")
    refuse_unsaveable(engine)  # whatever describes it: nothing is written for these
    from .engine_masters import masters_kind

    if masters_kind(engine) is not None:  # stage 0, MoE: an index locating the masters (engine_masters_save.py)
        from .engine_masters_save import save_masters_checkpoint

        args = (client_state, hash, save_latest, exclude_frozen_parameters, sidecar_encoding)
        return save_masters_checkpoint(engine, save_dir, tag, *args)
    if is_model_parallel_engine(engine):  # a checkpoint index, not a manifest (engine_index_save.py)
        from .engine_index_save import save_index_checkpoint

        args = (client_state, hash, save_latest, exclude_frozen_parameters, sidecar_encoding)
        return save_index_checkpoint(engine, save_dir, tag, *args)
    layout = manifest_from_engine(engine, exclude_frozen_parameters=exclude_frozen_parameters)
    layout.save.id = _from_rank_0(dist, str(uuid.uuid4()))  # the save id every file's copy carries
    state, tag = save_request(engine, client_state, tag)
    state[CLIENT_STATE_KEY] = client_state_value(layout)
    distributed = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    staged = save_staged(engine, dist, save_dir, tag, state, exclude_frozen_parameters)
    try:
        mine, error = _describe_own_files(staged, rank, layout, "sha256" if hash else None), None
    except Exception as exc:  # reported on every rank below, never left hanging in a collective
        mine, error = [], f"rank {rank}: {type(exc).__name__}: {exc}"
    gathered: list = [None] * world
    if distributed:
        dist.all_gather_object(gathered, (mine, error))
    else:
        gathered = [(mine, error)]
    errors = [e for _, e in gathered if e]
    if errors:
        if rank == 0:  # every rank has finished writing (the gather above): nothing is left half-saved
            shutil.rmtree(staged, ignore_errors=True)
        raise RuntimeError("ckptspec could not describe the saved files (no sidecar written): " + "; ".join(errors))
    # Shallow: only ``files`` changes, and the layout is not used again (a deep copy took 1 s per 10k params).
    complete = layout.model_copy()
    gathered_files = [ShardFile.model_validate(d) for files, _ in gathered for d in files]
    complete.files = sorted(gathered_files, key=lambda f: file_order(f.role, f.ranks, f.path))
    if hash:
        complete = _with_digests(complete, staged, rank, dist)

    status = None
    if rank == 0:
        status = publish_on_rank_0(
            staged,
            save_dir,
            tag,
            lambda: (complete, validate_document(complete.to_dict())),
            sidecar_encoding,
            save_latest,
        )
    if distributed:
        box = [status]
        dist.broadcast_object_list(box, src=0)
        status = box[0]
    if status:
        raise RuntimeError("ckptspec could not write the manifest sidecar: " + status)
    return complete


def _from_rank_0(dist, value):
    """Rank 0's ``value`` on every rank (a broadcast when running distributed)."""
    if dist.is_available() and dist.is_initialized():
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return value


def _with_digests(manifest: Manifest, tag_dir: Path, rank: int, dist) -> Manifest:
    """The manifest with every tensor's digest, computed by rank 0 and the same on every rank.

    A digest spans the files of several ranks, so rank 0 reads them all: when it cannot see
    every file (no shared filesystem), the manifest keeps the files' own hashes only.
    """
    found, error = None, None
    if rank == 0:
        try:
            if _sees_every_file(tag_dir, manifest):
                found = manifest.model_copy(deep=True)
                add_digests(found, tag_dir)
            else:
                warnings.warn("ckptspec: rank 0 cannot see every saved file; no tensor digests", stacklevel=3)
        except Exception as exc:  # raised on every rank below, never left hanging in the broadcast
            error = f"rank 0: {type(exc).__name__}: {exc}"
    found, error = _from_rank_0(dist, (found.to_dict() if found is not None else None, error))
    if error:
        raise RuntimeError("ckptspec could not digest the saved tensors (no sidecar written): " + error)
    return Manifest.model_validate(found) if found is not None else manifest


def _sees_every_file(tag_dir: Path, manifest: Manifest) -> bool:
    return all((tag_dir / f.path).is_file() for f in manifest.files)


def _describe_own_files(tag_dir: Path, rank: int, layout: Manifest, hash_algorithm: str | None) -> list[dict]:
    """This rank's files of the tag directory (rank 0 also takes the rank-less ones), described."""
    every = scan_tag_dir(tag_dir)
    own = ShardSet(tag_dir)
    own.model_files = {r: p for r, p in every.model_files.items() if r == rank}
    own.optim_files = {r: p for r, p in every.optim_files.items() if r == rank}
    own.other_files = list(every.other_files) if rank == 0 else []
    described = describe_files(own, layout.layout.zero_stage, hash_algorithm, StateCache(), layout)
    return [f.model_dump(mode="json", exclude_unset=True) for f in described]
