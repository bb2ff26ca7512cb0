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
from itertools import chain
from operator import attrgetter
from pathlib import Path

from .._version import __version__
from ..checkpoint.embedded import CLIENT_STATE_KEY, client_state_value
from ..checkpoint.states import StateCache
from ..errors import UnsupportedEngine
from ..format.codec import gc_paused
from ..format.models import ExcludedParam, Layout, Manifest, Producer, ShardFile
from ..format.validate import validate_manifest
from ..format.version import FORMAT_NAME, FORMAT_VERSION
from .describe import describe_files
from .digests import add_digests, record_digests
from .directory import ShardSet, scan_tag_dir
from .engine_groups import (
    flat_groups_bf16_optimizer,
    flat_groups_stage12,
    is_bf16_optimizer,
    per_param_groups_stage3,
)
from .engine_refusals import is_model_parallel_engine, refuse_unsaveable
from .engine_state import (
    aliases_of_engine,
    buffers_of_engine,
    frozen_of_engine,
    master_dtype_of_engine,
    optimizer_of_engine,
    save_of_engine,
)
from .engine_walk import walk_module
from .names import file_order
from .saved_state import SavedStates
from .staged_save import publish_on_rank_0, save_request, save_staged

_NAME = attrgetter("name")


def _check_supported(engine) -> None:
    refuse_unsaveable(engine)
    if getattr(engine, "has_moe_layers", False):
        raise UnsupportedEngine("MoE engines are described by a checkpoint index, not a manifest 1.x")
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
    with gc_paused():  # ~1M acyclic objects made: see codec.gc_paused (standalone at 100k: 2.2 s -> 1.0 s)
        return _engine_layout(engine, exclude_frozen_parameters)


def _engine_layout(engine, exclude_frozen_parameters: bool) -> Manifest:
    import deepspeed

    stage = engine.zero_optimization_stage()
    opt = engine.optimizer
    walk = walk_module(engine.module)
    # A tied param is named by its first name, as DeepSpeed names it (its other names are aliases).
    names = walk.names
    if stage == 3:
        groups = per_param_groups_stage3(engine, names)
    elif is_bf16_optimizer(opt):
        groups = flat_groups_bf16_optimizer(engine, names)
    elif stage in (1, 2):
        groups = flat_groups_stage12(engine, names)
    else:
        raise UnsupportedEngine(
            f"ZeRO stage 0 with {type(opt).__name__} is described by a checkpoint index, not a manifest 1.x"
        )
    trainable = set(map(_NAME, chain.from_iterable(g.params for g in groups)))  # in C: 100k params
    frozen_stage = 1 if is_bf16_optimizer(opt) else stage
    aliases = aliases_of_engine(walk)
    alias_names = {a.name for a in aliases}
    frozen = [
        f
        for f in frozen_of_engine(walk, trainable, frozen_stage, exclude_frozen_parameters)
        if f.name not in alias_names
    ]
    excluded = []
    if exclude_frozen_parameters:
        excluded = [
            ExcludedParam(name=names[id(p)], reason="exclude_frozen_parameters")
            for p in walk.params
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
        tail_padding_saved=is_bf16_optimizer(opt),
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
        buffers=buffers_of_engine(engine, walk),
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
    # The layout, DeepSpeed's pickling and the sidecar make ~1M acyclic objects: without the pause the
    # collector rescanned them all over and over (codec.gc_paused; at 100k tensors DeepSpeed's own save
    # took 5.1 s inside the hook against 2.9 s alone).
    with gc_paused():
        args = (client_state, hash, save_latest, exclude_frozen_parameters, sidecar_encoding)
        return _save_checkpoint(engine, save_dir, tag, *args)


def _save_checkpoint(
    engine, save_dir, tag, client_state, hash, save_latest, exclude_frozen_parameters, sidecar_encoding
) -> Manifest:
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
    captured: dict = {}  # the model states DeepSpeed handed torch.save: described without reading them back
    staged = save_staged(engine, dist, save_dir, tag, state, exclude_frozen_parameters, captured)
    try:
        mine, error = _describe_own_files(staged, rank, layout, "sha256" if hash else None, captured), None
    except Exception as exc:  # reported on every rank below, never left hanging in a collective
        mine, error = [], f"rank {rank}: {type(exc).__name__}: {exc}"
    captured.clear()
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
            lambda: _checked_document(complete),
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


def _checked_document(manifest: Manifest) -> tuple[dict, object]:
    """The sidecar's document and its validation report, from one dump (a model's dump holds plain
    ints: validate_manifest checks it as it is, without building the models again)."""
    doc = manifest.to_dict()
    return doc, validate_manifest(manifest, doc)


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
    every file (no shared filesystem), the manifest keeps the files' own hashes only. Rank 0
    digests ``manifest`` itself (the caller's fresh copy); the others record the digests it
    sends (only those: rebuilding the whole manifest from a broadcast took seconds at 100k).
    """
    found, error = None, None
    if rank == 0:
        try:
            if _sees_every_file(tag_dir, manifest):
                found = add_digests(manifest, tag_dir)
            else:
                warnings.warn("ckptspec: rank 0 cannot see every saved file; no tensor digests", stacklevel=3)
        except Exception as exc:  # raised on every rank below, never left hanging in the broadcast
            error = f"rank 0: {type(exc).__name__}: {exc}"
    found, error = _from_rank_0(dist, (found, error))
    if error:
        raise RuntimeError("ckptspec could not digest the saved tensors (no sidecar written): " + error)
    if rank != 0 and found:
        record_digests(manifest, found)
    return manifest


def _sees_every_file(tag_dir: Path, manifest: Manifest) -> bool:
    return all((tag_dir / f.path).is_file() for f in manifest.files)


def _describe_own_files(
    tag_dir: Path, rank: int, layout: Manifest, hash_algorithm: str | None, captured: dict | None = None
) -> list[dict]:
    """This rank's files of the tag directory (rank 0 also takes the rank-less ones), described;
    ``captured`` model states from their live state where they check out (saved_state.py)."""
    every = scan_tag_dir(tag_dir)
    own = ShardSet(tag_dir)
    own.model_files = {r: p for r, p in every.model_files.items() if r == rank}
    own.optim_files = {r: p for r, p in every.optim_files.items() if r == rank}
    own.other_files = list(every.other_files) if rank == 0 else []
    states = SavedStates(captured) if captured else StateCache()
    described = describe_files(own, layout.layout.zero_stage, hash_algorithm, states, layout)
    return [f.model_dump(mode="json", exclude_unset=True) for f in described]
