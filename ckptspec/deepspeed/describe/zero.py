"""Manifests from a saved DeepSpeed checkpoint directory, without DeepSpeed or torch.

Reads only metadata: each ``.pt`` file's ``data.pkl`` through the restricted unpickler of
``ckptspec.checkpoint.torchfile`` (no tensor bytes are read) and the zip directory for byte
locators, each file once through a ``StateCache``. Never executes pickled code.
"""

from __future__ import annotations

from itertools import filterfalse
from operator import attrgetter
from pathlib import Path
from typing import Literal

from ..._version import __version__
from ...checkpoint.hashing import file_digests
from ...checkpoint.states import StateCache, States
from ...checkpoint.torchfile import TensorRef
from ...errors import InvalidCheckpoint, UnsupportedCheckpoint
from ...format.models import Alias, Buffer, FrozenParam, Group, Layout, Locator, Manifest, Producer, ShardFile
from ...format.partition import ParamColumns, flat_group, frozen_params, per_param_group
from ...format.version import FORMAT_NAME, FORMAT_VERSION
from ...location import RemotePath
from ..layout import legacy
from ..layout.state_fields import (
    DEEPSPEED_DEFAULT_SUB_GROUP_SIZE,
    dtype_of_config,
    flat_partitions,
    int_shapes,
    master_dtype,
    module_dtypes,
    stage3_sub_group_owners,
    world_size_of,
)
from ..layout.tag_dir import ShardSet, index_kind_hint, scan_tag_dir
from .digests import add_digests
from .locators import model_weights_locators, state_locators, tensor_locators
from .scalars import embedded_class, optimizer_from_states, save_from_states

_SHAPE, _DTYPE = attrgetter("shape"), attrgetter("dtype")  # of a TensorRef


def describe(tag_dir: Path, states: StateCache, hash_algorithm: str | None = None) -> Manifest:
    """The manifest of a saved DeepSpeed ZeRO checkpoint's tag directory (stage 1-3), from its metadata alone.

    ``states``: files already read (and where the files read here are kept).
    """
    shards = scan_tag_dir(tag_dir)
    states.load_all([*shards.model_files.values(), *shards.optim_files.values()])
    return manifest_from_states(shards, states, hash_algorithm=hash_algorithm)


def manifest_from_states(
    shards: ShardSet,
    states: StateCache,
    *,
    hash_algorithm: str | None = None,
    pipeline_stage: bool = False,
    in_index: bool = False,
    recorded_ties: dict[str, str] | None = None,
) -> Manifest:
    """The manifest of the files of ``shards``, read through ``states``.

    The tolerant generation of ``validate DIR`` passes only the files it could read.
    ``pipeline_stage``: the files of one pipeline stage (a domain of a checkpoint index), whose
    model states hold no ``module`` (the weights are in the layer files the index lists).
    ``in_index``: the files of one model-parallel rank of a checkpoint index (otherwise a
    model-parallel checkpoint whose other ranks' files are all missing is refused, CK206).
    ``recorded_ties``: tensor rank 0's ``shared_params`` (alias -> owner), for another tensor rank's files,
    whose ``shared_params`` DeepSpeed leaves empty (``proven_ties``).
    """
    model_states = {rank: states.state(path) for rank, path in shards.model_files.items()}
    optim_states = {rank: states.state(path) for rank, path in shards.optim_files.items()}
    first_model = model_states[min(model_states)]
    if isinstance(first_model, dict) and optim_states:
        legacy.refuse_shapes_in_optimizer_files(
            first_model, optim_states[min(optim_states)], shards.optim_files[min(optim_states)]
        )
    if not isinstance(first_model, dict) or "param_shapes" not in first_model:
        raise UnsupportedCheckpoint(
            "model states have no 'param_shapes'",
            "is this a DeepSpeed checkpoint?",
            str(shards.model_files[min(model_states)]),
        )
    mp_world = first_model.get("mp_world_size")
    if not in_index and isinstance(mp_world, int) and mp_world > 1:
        # Only mp rank 0's files are here (else the checkpoint index describes it): the rest is lost.
        raise InvalidCheckpoint(
            "CK206",
            f"model-parallel checkpoint (mp_world_size {mp_world}) with the files of model-parallel rank 0 only",
            "restore the mp_rank_01 ... files of the other tensor/pipeline ranks; a merge of rank 0 alone would "
            "be silently incomplete",
            str(shards.tag_dir / "mp_rank_01_model_states.pt"),
        )
    if first_model.get("module") is None and not pipeline_stage:
        raise UnsupportedCheckpoint(
            "model states hold no 'module' (pipeline-parallel checkpoint)",
            index_kind_hint("pipeline-parallel"),
            str(shards.model_files[min(model_states)]),
        )
    if not optim_states:
        raise UnsupportedCheckpoint(
            "no ZeRO optimizer states (*_optim_states.pt)",
            index_kind_hint("ZeRO stage-0"),
            str(shards.tag_dir),
        )
    first_optim = optim_states[min(optim_states)]
    osd = first_optim.get("optimizer_state_dict") if isinstance(first_optim, dict) else None
    if not isinstance(osd, dict):
        raise UnsupportedCheckpoint(
            "optimizer states hold no 'optimizer_state_dict'",
            "is this a DeepSpeed checkpoint?",
            str(shards.optim_files[min(optim_states)]),
        )

    ds_config = first_model.get("ds_config") or {}
    zero_cfg = ds_config.get("zero_optimization") or {}
    bf16_optimizer = "zero_stage" not in osd  # BF16_Optimizer records no stage
    stage = (
        int(zero_cfg.get("stage", 1))
        if bf16_optimizer
        else legacy.saved_stage(int(osd["zero_stage"]), zero_cfg.get("stage"), first_model.get("ds_version"))
    )
    module = first_model.get("module") or {}

    groups = _groups(first_model, osd, stage, bf16_optimizer)
    shared = real_ties(first_model.get("shared_params") or {}, module, stage)
    if not shared and recorded_ties:
        shared = proven_ties(recorded_ties, module)
    frozen = _frozen(first_model, groups, shared, stage)
    if stage == 3 and legacy.frozen_shapes_unrecorded(first_model):
        taken = {p.name for g in groups for p in g.params} | set(shared)
        legacy.refuse_lost_frozen(first_model, taken, shards.model_files[min(model_states)])
    aliases = _aliases(module, groups, frozen, shared, stage)
    buffers = _buffers(first_model)
    layout = _layout(
        first_model,
        osd,
        first_optim,
        stage,
        bf16_optimizer,
        excluded_flag=stage >= 2 and legacy.frozen_excluded(first_model) and not bf16_optimizer,
    )
    manifest = Manifest(
        format=FORMAT_NAME,
        format_version=FORMAT_VERSION,
        producer=Producer(
            tool="ckptspec",
            tool_version=__version__,
            framework="deepspeed",
            framework_version=str(first_model.get("ds_version", "unknown")),
        ),
        layout=layout,
        groups=groups,
        frozen=frozen,
        buffers=buffers,
        aliases=aliases,
        excluded=[],  # DeepSpeed does not record which names exclude_frozen_parameters dropped
        files=[],
    )
    first_optim_path = shards.optim_files[min(optim_states)]
    optimizer = optimizer_from_states(manifest, first_optim, first_optim_path, states.members(first_optim_path))
    if optimizer is not None:
        optimizer.class_ = embedded_class(first_model) or optimizer.class_
        manifest.optimizer = optimizer
    if (save := save_from_states(first_model)) is not None:
        manifest.save = save
    manifest.files = describe_files(shards, stage, hash_algorithm, states, manifest)
    if hash_algorithm:
        add_digests(manifest, shards.tag_dir)
    return manifest


def _groups(first_model: dict, osd: dict, stage: int, bf16_optimizer: bool) -> list[Group]:
    """The flat groups (stage 1/2) or stage-3 sub-groups, from ``param_shapes`` and the optimizer header."""
    model_dtype = dtype_of_config(first_model.get("ds_config") or {})
    module = first_model.get("module") or {}
    counts, world_size = osd.get("partition_count"), world_size_of(osd)
    groups: list[Group] = []
    if stage == 3:
        sub_to_group = stage3_sub_group_owners(osd, len(first_model["param_shapes"]))
        for j, shapes in enumerate(first_model["param_shapes"]):
            specs = ParamColumns(list(shapes), int_shapes(shapes.values()), [model_dtype] * len(shapes))
            groups.append(per_param_group(specs, optimizer_group=sub_to_group[j], partition_count=world_size))
        return groups
    paddings = osd.get("param_alignment_paddings")
    for g, shapes in enumerate(first_model["param_shapes"]):
        names = list(shapes)
        specs = ParamColumns(names, int_shapes(shapes.values()), module_dtypes(module, model_dtype, names))
        groups.append(
            flat_group(
                specs,
                optimizer_group=g,
                partition_count=counts[g] if isinstance(counts, list) else world_size,
                zero_stage=stage,
                paddings=paddings[g] if paddings else None,
                tail_padding_saved=bf16_optimizer,
            )
        )
    return groups


def _frozen(first_model: dict, groups: list[Group], shared: dict, stage: int) -> list[FrozenParam]:
    module = first_model.get("module") or {}
    model_dtype = dtype_of_config(first_model.get("ds_config") or {})
    frozen_shapes = first_model.get("frozen_param_shapes")
    if frozen_shapes is not None:
        # DeepSpeed lists tied zero-element params here too; the alias wins.
        names = list(filterfalse(shared.__contains__, frozen_shapes))
        shapes = int_shapes(map(frozen_shapes.__getitem__, names))
        stored_in: Literal["partitioned_fragments", "fragments"] = (
            "partitioned_fragments" if stage == 3 else "fragments"
        )
        dtypes = module_dtypes(first_model.get("frozen_param_fragments") or {}, model_dtype, names)
        return frozen_params(names, shapes, dtypes, stored_in)
    if stage < 3:
        # Stage 1 (and BF16_Optimizer) save no frozen_param_shapes: the frozen weights
        # are the module entries that have no other role.
        trainable = {p.name for g in groups for p in g.params}
        taken = trainable | set(shared) | set(first_model.get("buffer_names") or [])
        names = [name for name, ref in module.items() if name not in taken and isinstance(ref, TensorRef)]
        refs = list(map(module.__getitem__, names))
        return frozen_params(names, list(map(_SHAPE, refs)), list(map(_DTYPE, refs)), "module")
    return []


def _aliases(module: dict, groups: list[Group], frozen: list[FrozenParam], shared: dict, stage: int) -> list[Alias]:
    owners = set(shared.values())  # the shapes of these only (a few tied params among 100k)
    shapes = {p.name: list(p.shape) for g in groups for p in g.params if p.name in owners}
    shapes |= {f.name: list(f.shape) for f in frozen if f.name in owners}
    aliases = []
    for alias, owner in shared.items():
        ref = module.get(alias)
        own_shape = list(ref.shape) if isinstance(ref, TensorRef) and stage < 3 else shapes.get(owner, [])
        aliases.append(Alias(name=alias, owner=owner, shape=own_shape))
    return aliases


def _buffers(first_model: dict) -> list[Buffer]:
    module = first_model.get("module") or {}
    buffers = []
    for name in list(first_model.get("buffer_names") or []):
        ref = module.get(name)
        if isinstance(ref, TensorRef):
            buffers.append(Buffer(name=name, shape=list(ref.shape), dtype=ref.dtype))
    return buffers


def _layout(
    first_model: dict, osd: dict, first_optim: dict, stage: int, bf16_optimizer: bool, *, excluded_flag: bool
) -> Layout:
    ds_config = first_model.get("ds_config") or {}
    zero_cfg = ds_config.get("zero_optimization") or {}
    dimensions = first_model.get("checkpoint_parallel_dimensions") or {}
    layout = Layout(
        zero_stage=stage,
        world_size=world_size_of(osd),
        tensor_parallel_size=int(dimensions.get("tp_degree", 1) or 1),
        pipeline_parallel_size=int(dimensions.get("pp_degree", 1) or 1),
        model_parallel_size=int(first_model.get("mp_world_size", 1) or 1),
        model_dtype=dtype_of_config(ds_config),
        master_dtype=master_dtype(first_optim, stage),
        # ZeRO-1/2's flags: BF16_Optimizer reads neither (module order, no gaps), whatever the saved ds_config asks
        round_robin=bool(zero_cfg.get("round_robin_gradients", False)) and stage in (1, 2) and not bf16_optimizer,
        parameter_alignment=bool(zero_cfg.get("parameter_alignment", False)) and stage in (1, 2) and not bf16_optimizer,
        tail_padding_saved=bf16_optimizer,
        byte_order="little",  # torchfile refuses any other archive
        optimizer="BF16_Optimizer"
        if bf16_optimizer
        else ("DeepSpeedZeroOptimizer_Stage3" if stage == 3 else "DeepSpeedZeroOptimizer"),
        exclude_frozen_parameters=excluded_flag,
    )
    if stage == 3:
        layout.sub_group_size = int(zero_cfg.get("sub_group_size", DEEPSPEED_DEFAULT_SUB_GROUP_SIZE))
    return layout


def real_ties(shared: dict, module: dict, stage: int) -> dict:
    """Drop DeepSpeed's false ties between zero-element params. Outside stage 3 DeepSpeed ties params
    by ``data_ptr()``, which is 0 for every zero-element tensor, so unrelated empty params come out
    "shared". An empty tensor shares nothing; those names stay frozen params of their own."""
    if stage == 3:
        return dict(shared)  # ties by ds_id there
    real = {}
    for alias, owner in shared.items():
        ref = module.get(alias)
        if isinstance(ref, TensorRef) and ref.numel == 0:
            continue
        real[alias] = owner
    return real


def proven_ties(recorded: dict[str, str], module: dict) -> dict[str, str]:
    """The ties of another rank's ``recorded`` ``shared_params`` that its own module proves: DeepSpeed computes
    ``shared_params`` on global rank 0 only (``engine._get_shared_params``), so under AutoTP every other tensor
    rank's model states hold ``{}``, and save the tied name as one more module key. A tie holds there when that
    key is the owner's very tensor in the file (same storage, offset, shape and strides); anything else stays
    what its role says (a frozen parameter, refused without a merge rule)."""
    out = {}
    for alias, owner in recorded.items():
        a, o = module.get(alias), module.get(owner)
        if isinstance(a, TensorRef) and isinstance(o, TensorRef) and a.numel and a.view == o.view:
            out[alias] = owner
    return out


def partition_locators(path: Path | RemotePath, rank: int, stage: int, states: States) -> list[Locator]:
    """The byte locators of the flat master partitions in one optimizer-states file."""
    members = states.members(path)
    locators = []
    for g, ref in enumerate(flat_partitions(states.state(path), stage)):
        if not isinstance(ref, TensorRef):
            continue
        data_offset, member_size = members[ref.storage.member]
        locators.append(
            Locator(
                group=g,
                rank=rank,
                member=ref.storage.member,
                data_offset=data_offset,
                member_size=member_size,
                dtype=ref.dtype,
                element_offset=ref.storage_offset,
                numel=ref.numel,
            )
        )
    return locators


def describe_files(
    shards: ShardSet, stage: int, hash_algorithm: str | None, states: States, manifest: Manifest | None = None
) -> list[ShardFile]:
    """Every file of ``shards`` (sizes as they are now), with the locators of the flat master partitions.

    With ``manifest`` (its groups, frozen parameters and buffers), also format 1.1's locators:
    the named tensors and flat low-precision weights of the model states, the optimizer state
    partitions (``deepspeed/locators.py``).
    """

    every = [*shards.model_files.values(), *shards.optim_files.values(), *shards.other_files]
    hashes = dict(zip(every, file_digests(every, hash_algorithm))) if hash_algorithm else {}  # all cores

    def entry(
        path: Path | RemotePath,
        role: Literal["model_states", "optimizer_states", "other"],
        ranks: list[int],
        partitions: list[Locator],
    ) -> ShardFile:
        shard = ShardFile(
            # type: ignore: path is one of shards' files, below its tag_dir and of its kind (both Path or both
            # RemotePath); mypy cannot pair the two unions' members.
            path=path.relative_to(shards.tag_dir).as_posix(),  # type: ignore[arg-type]
            role=role,
            ranks=ranks,
            size=path.stat().st_size,
            partitions=partitions,
        )
        if hash_algorithm:
            shard.hash = hashes[path]
        return shard

    files = [entry(path, "model_states", [rank], []) for rank, path in sorted(shards.model_files.items())]
    files += [
        entry(path, "optimizer_states", [rank], partition_locators(path, rank, stage, states))
        for rank, path in sorted(shards.optim_files.items())
    ]
    if manifest is not None:
        _add_locators(files, shards, states, manifest)
    files += [entry(path, "other", [], []) for path in shards.other_files]
    return files


def _add_locators(files: list[ShardFile], shards: ShardSet, states: States, manifest: Manifest) -> None:
    # rank -> the tensors of its model-states file: all or none (a tensor that cannot be located).
    named: dict | None = None
    located: dict = {}
    for rank, path in sorted(shards.model_files.items()):
        # Buffers and whole frozen parameters are located in rank 0's file (stage 3 repeats them per rank).
        found = tensor_locators(manifest, states.state(path), states.members(path), rank, rank == 0)
        if found is None:
            break
        located[rank] = found
    else:
        named = located
    for f in files:
        path = shards.tag_dir / f.path
        if f.role == "model_states":
            if named is not None:
                f.tensors = named[f.ranks[0]]
            if f.ranks[0] == 0 and manifest.layout.zero_stage < 3:
                f.model_weights = model_weights_locators(manifest, states.state(path), states.members(path))
        else:
            f.state_partitions = state_locators(manifest, states.state(path), states.members(path), f.ranks[0])
