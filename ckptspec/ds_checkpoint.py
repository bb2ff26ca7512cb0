"""Manifests from a saved DeepSpeed checkpoint directory, without DeepSpeed or torch.

Reads only metadata: each ``.pt`` file's ``data.pkl`` through the restricted
unpickler of ``ckptspec.torchfile`` (no tensor bytes are read) and the zip
directory for byte locators. Never executes pickled code.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import __version__
from .errors import CkptspecError, InvalidCheckpoint
from .layout import ParamSpec, flat_group, per_param_group
from .models import (
    FORMAT_NAME,
    FORMAT_VERSION,
    Alias,
    Buffer,
        FrozenParam,
    Group,
    Layout,
    Locator,
    Manifest,
    Producer,
    ShardFile,
)
from . import torchfile

OPTIM_RE = re.compile(r"^(?:bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
MODEL_RE = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
EXPERT_RE = re.compile(r"^(layer_\d+_expert_\d+_mp_rank_\d+_model_states|expp_rank_\d+_mp_rank_\d+_optim_states)\.pt$")
PIPE_LAYER_RE = re.compile(r"^layer_\d+-model_states\.pt$")
MAX_TAG_BYTES = 4096
DEEPSPEED_DEFAULT_SUB_GROUP_SIZE = 10**9  # deepspeed/runtime/zero/config.py (0.15-0.19)


class UnsupportedCheckpoint(InvalidCheckpoint):
    """A checkpoint format 1.0 cannot describe (exit 1)."""

    def __init__(self, message: str, hint: str, file: str | None = None):
        super().__init__("CK202", message, hint, file)


def resolve_tag_dir(checkpoint: str | os.PathLike, tag: str | None = None) -> Path:
    """A save directory (with ``latest``) or a tag directory -> the tag directory."""
    root = Path(checkpoint)
    if not root.exists():
        raise CkptspecError("CK901", "checkpoint directory not found", "check the path", str(root))
    if not root.is_dir():
        raise CkptspecError("CK901", "not a directory", "pass a DeepSpeed save directory or a tag directory", str(root))
    if tag is not None:
        tag_dir = root / tag
        if not tag_dir.is_dir():
            raise InvalidCheckpoint("CK201", f"tag {tag!r} has no directory", "list the save directory for the tags it holds", str(root))
        return tag_dir
    if any(MODEL_RE.match(p.name) or OPTIM_RE.match(p.name) for p in root.iterdir()):
        return root
    latest = root / "latest"
    if not latest.is_file():
        raise InvalidCheckpoint("CK201", "no 'latest' file and no model or optimizer states here",
                            "pass --tag TAG, or the tag directory itself", str(root))
    if latest.stat().st_size > MAX_TAG_BYTES:
        raise InvalidCheckpoint("CK201", "'latest' is too large to hold a tag", "write the tag name into 'latest'", str(latest))
    try:
        name = latest.read_text("utf-8").strip()
    except (UnicodeDecodeError, OSError) as exc:
        raise InvalidCheckpoint("CK201", f"'latest' cannot be read: {exc}", "write the tag name into 'latest'", str(latest)) from None
    if not name or "/" in name or "\\" in name or name in (".", ".."):
        raise InvalidCheckpoint("CK201", f"'latest' names {name!r}, which is not a tag", "write the tag name into 'latest'", str(latest))
    tag_dir = root / name
    if not tag_dir.is_dir():
        raise InvalidCheckpoint("CK201", f"'latest' names tag {name!r}, which has no directory",
                            "point 'latest' at a saved tag, or pass --tag", str(latest))
    return tag_dir


@dataclass
class ShardSet:
    """The files of one tag directory, sorted by rank (never by string order)."""

    tag_dir: Path
    model_files: dict[int, Path] = field(default_factory=dict)  # dp rank -> file (stage 3: one per rank)
    optim_files: dict[int, Path] = field(default_factory=dict)  # dp rank -> file
    other_files: list[Path] = field(default_factory=list)


def scan_tag_dir(tag_dir: Path) -> ShardSet:
    shards = ShardSet(tag_dir)
    for path in sorted(tag_dir.iterdir()):
        if not path.is_file():
            continue
        name = path.name
        if EXPERT_RE.match(name):
            raise UnsupportedCheckpoint(f"MoE expert file {name}", "MoE checkpoints are not described by format 1.0", str(path))
        if PIPE_LAYER_RE.match(name):
            raise UnsupportedCheckpoint(f"pipeline layer file {name}", "pipeline-parallel checkpoints are not described by format 1.0", str(path))
        if (m := OPTIM_RE.match(name)):
            if int(m.group(2)) != 0:
                raise UnsupportedCheckpoint(f"model-parallel rank {int(m.group(2))} in {name}", "tensor/pipeline parallelism is not described by format 1.0", str(path))
            shards.optim_files[int(m.group(1))] = path
        elif (m := MODEL_RE.match(name)):
            if int(m.group(2)) != 0:
                raise UnsupportedCheckpoint(f"model-parallel rank {int(m.group(2))} in {name}", "tensor/pipeline parallelism is not described by format 1.0", str(path))
            shards.model_files[int(m.group(1) or 0)] = path
        elif not name.startswith("ckptspec."):
            shards.other_files.append(path)
    if not shards.model_files:
        raise InvalidCheckpoint("CK203", "no *_model_states.pt file", "is this a DeepSpeed checkpoint tag directory?", str(tag_dir))
    return shards


def _load(path: Path) -> Any:
    try:
        return torchfile.read_pt_metadata(path)
    except torchfile.UnsafePickleError as exc:
        raise InvalidCheckpoint("CK204", _without_path(exc, path), "this file wants to run code on load; ckptspec refuses it", str(path)) from None
    except torchfile.TorchFileError as exc:
        raise InvalidCheckpoint("CK205", _without_path(exc, path), "the file is damaged or not a torch checkpoint", str(path)) from None


def _without_path(exc: Exception, path: Path) -> str:
    # The error line names the file already.
    return str(exc).replace(f"{path}: ", "")


def _numel(shape) -> int:
    return math.prod(int(d) for d in shape)


def _dtype_of_config(ds_config: dict) -> str:
    if (ds_config.get("bf16") or ds_config.get("bfloat16") or {}).get("enabled"):
        return "bfloat16"
    if (ds_config.get("fp16") or {}).get("enabled"):
        return "float16"
    return "float32"


def _module_dtype(module: dict, name: str, default: str) -> str:
    ref = module.get(name) if isinstance(module, dict) else None
    return ref.dtype if isinstance(ref, torchfile.TensorRef) else default


def manifest_from_checkpoint(checkpoint: str | os.PathLike, tag: str | None = None, *, hash_algorithm: str | None = None) -> Manifest:
    """Describe a saved DeepSpeed ZeRO checkpoint (stage 1-3) from its metadata alone."""
    tag_dir = resolve_tag_dir(checkpoint, tag)
    shards = scan_tag_dir(tag_dir)
    model_states = {rank: _load(path) for rank, path in shards.model_files.items()}
    optim_states = {rank: _load(path) for rank, path in shards.optim_files.items()}
    return manifest_from_states(shards, model_states, optim_states, hash_algorithm=hash_algorithm)


def manifest_from_states(shards: ShardSet, model_states: dict, optim_states: dict, *, hash_algorithm: str | None = None) -> Manifest:
    """The manifest from already-read metadata: ``read_pt_metadata`` results keyed by dp rank,
    for the files of ``shards`` (``ckptspec.shards`` leaves unreadable files out)."""
    tag_dir = shards.tag_dir
    first_model = model_states[min(model_states)]
    if not isinstance(first_model, dict) or "param_shapes" not in first_model:
        raise UnsupportedCheckpoint("model states have no 'param_shapes'", "is this a DeepSpeed checkpoint?", str(shards.model_files[min(model_states)]))
    if first_model.get("module") is None:
        raise UnsupportedCheckpoint("model states hold no 'module' (pipeline-parallel checkpoint)",
                                    "pipeline-parallel checkpoints are not described by format 1.0", str(shards.model_files[min(model_states)]))
    if not optim_states:
        raise UnsupportedCheckpoint("no ZeRO optimizer states (*_optim_states.pt)",
                                    "ZeRO stage 0 checkpoints are not described by format 1.0", str(tag_dir))
    first_rank = min(optim_states)
    first_optim = optim_states[first_rank]
    osd = first_optim.get("optimizer_state_dict") if isinstance(first_optim, dict) else None
    if not isinstance(osd, dict):
        raise UnsupportedCheckpoint("optimizer states hold no 'optimizer_state_dict'", "is this a DeepSpeed checkpoint?", str(shards.optim_files[first_rank]))
    ds_config = first_model.get("ds_config") or {}
    zero_cfg = ds_config.get("zero_optimization") or {}
    bf16_optimizer = "zero_stage" not in osd
    stage = int(zero_cfg.get("stage", 1)) if bf16_optimizer else int(osd["zero_stage"])
    counts = osd.get("partition_count")
    world_size = max(counts) if isinstance(counts, list) else int(counts)
    module = first_model.get("module") or {}
    model_dtype = _dtype_of_config(ds_config)

    param_shapes = first_model["param_shapes"]
    groups: list[Group] = []
    if stage == 3:
        sub_to_group = _stage3_sub_group_owners(osd, len(param_shapes))
        for j, shapes in enumerate(param_shapes):
            specs = [ParamSpec(n, tuple(int(d) for d in s), model_dtype) for n, s in shapes.items()]
            groups.append(per_param_group(specs, optimizer_group=sub_to_group[j], partition_count=world_size))
    else:
        paddings = osd.get("param_alignment_paddings")
        for g, shapes in enumerate(param_shapes):
            specs = [ParamSpec(n, tuple(int(d) for d in s), _module_dtype(module, n, model_dtype)) for n, s in shapes.items()]
            groups.append(flat_group(
                specs, optimizer_group=g, partition_count=counts[g] if isinstance(counts, list) else world_size,
                zero_stage=stage, paddings=paddings[g] if paddings else None, tail_padding_saved=bf16_optimizer,
            ))
    trainable = {p.name for g in groups for p in g.params}

    shared = _real_ties(first_model.get("shared_params") or {}, module, stage)
    buffer_names = list(first_model.get("buffer_names") or [])
    frozen_shapes = first_model.get("frozen_param_shapes")
    excluded_flag = stage >= 2 and frozen_shapes is None and not bf16_optimizer
    frozen: list[FrozenParam] = []
    if frozen_shapes is not None:
        stored_in = "partitioned_fragments" if stage == 3 else "fragments"
        for name, shape in frozen_shapes.items():
            if name in shared:
                continue  # DeepSpeed lists tied zero-element params here too; the alias wins
            frozen.append(FrozenParam(name=name, shape=[int(d) for d in shape], numel=_numel(shape),
                                      dtype=_fragment_dtype(first_model, name, model_dtype), stored_in=stored_in))
    elif stage < 3:
        # Stage 1 (and BF16_Optimizer) save no frozen_param_shapes: the frozen weights
        # are the module entries that have no other role.
        taken = trainable | set(shared) | set(buffer_names)
        for name, ref in module.items():
            if name not in taken and isinstance(ref, torchfile.TensorRef):
                frozen.append(FrozenParam(name=name, shape=list(ref.shape), numel=_numel(ref.shape), dtype=ref.dtype, stored_in="module"))
    shapes = {p.name: list(p.shape) for g in groups for p in g.params} | {f.name: list(f.shape) for f in frozen}
    aliases = []
    for alias, owner in shared.items():
        ref = module.get(alias)
        own_shape = list(ref.shape) if isinstance(ref, torchfile.TensorRef) and stage < 3 else shapes.get(owner, [])
        aliases.append(Alias(name=alias, owner=owner, shape=own_shape))
    buffers = []
    for name in buffer_names:
        ref = module.get(name)
        if isinstance(ref, torchfile.TensorRef):
            buffers.append(Buffer(name=name, shape=list(ref.shape), dtype=ref.dtype))

    master = _master_dtype(first_optim, stage)
    layout = Layout(
        zero_stage=stage, world_size=world_size,
        tensor_parallel_size=int((first_model.get("checkpoint_parallel_dimensions") or {}).get("tp_degree", 1) or 1),
        pipeline_parallel_size=int((first_model.get("checkpoint_parallel_dimensions") or {}).get("pp_degree", 1) or 1),
        model_parallel_size=int(first_model.get("mp_world_size", 1) or 1),
        model_dtype=model_dtype, master_dtype=master,
        round_robin=bool(zero_cfg.get("round_robin_gradients", False)) and stage in (1, 2),
        parameter_alignment=bool(zero_cfg.get("parameter_alignment", False)) and stage in (1, 2),
        tail_padding_saved=bf16_optimizer,
        optimizer="BF16_Optimizer" if bf16_optimizer else ("DeepSpeedZeroOptimizer_Stage3" if stage == 3 else "DeepSpeedZeroOptimizer"),
        exclude_frozen_parameters=excluded_flag,
    )
    if stage == 3:
        layout.sub_group_size = int(zero_cfg.get("sub_group_size", DEEPSPEED_DEFAULT_SUB_GROUP_SIZE))
    files = describe_files(shards, model_states, optim_states, stage, hash_algorithm)
    return Manifest(
        format=FORMAT_NAME, format_version=FORMAT_VERSION,
        producer=Producer(tool="ckptspec", tool_version=__version__, framework="deepspeed",
                          framework_version=str(first_model.get("ds_version", "unknown"))),
        layout=layout, groups=groups, frozen=frozen, buffers=buffers, aliases=aliases,
        excluded=[],  # DeepSpeed does not record which names exclude_frozen_parameters dropped
        files=files,
    )


def _real_ties(shared: dict, module: dict, stage: int) -> dict:
    """Drop DeepSpeed's false ties between zero-element params.

    Outside stage 3 DeepSpeed ties params by ``data_ptr()``, which is 0 for every
    zero-element tensor, so unrelated empty params come out "shared". An empty
    tensor shares nothing; those names stay frozen params of their own.
    """
    if stage == 3:
        return dict(shared)  # ties by ds_id there
    real = {}
    for alias, owner in shared.items():
        ref = module.get(alias)
        if isinstance(ref, torchfile.TensorRef) and ref.numel == 0:
            continue
        real[alias] = owner
    return real


def _fragment_dtype(model_state: dict, name: str, default: str) -> str:
    fragments = model_state.get("frozen_param_fragments") or {}
    ref = fragments.get(name)
    return ref.dtype if isinstance(ref, torchfile.TensorRef) else default


def _flat_partitions(optim_state: dict, stage: int) -> list:
    osd = optim_state["optimizer_state_dict"]
    key = "fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"
    parts = osd.get(key)
    return list(parts) if isinstance(parts, list) else []


def _master_dtype(optim_state: dict, stage: int) -> str:
    parts = _flat_partitions(optim_state, stage)
    return parts[0].dtype if parts and isinstance(parts[0], torchfile.TensorRef) else "float32"


def _stage3_sub_group_owners(osd: dict, n_sub_groups: int) -> list[int]:
    """Sub-group j belongs to the optimizer param group whose 'params' lists j."""
    owners = [0] * n_sub_groups
    inner = osd.get("optimizer_state_dict") or {}
    for g, group in enumerate(inner.get("param_groups") or []):
        for j in group.get("params") or []:
            if isinstance(j, int) and 0 <= j < n_sub_groups:
                owners[j] = g
    return owners


def describe_files(shards: ShardSet, model_states: dict, optim_states: dict, stage: int, hash_algorithm: str | None) -> list[ShardFile]:
    """Every file of the tag directory, with the byte locators of the flat master partitions."""
    from .hashing import file_digest

    files = []

    def entry(path: Path, role: str, ranks: list[int], partitions: list[Locator]) -> ShardFile:
        shard = ShardFile(path=path.relative_to(shards.tag_dir).as_posix(), role=role, ranks=ranks,
                          size=path.stat().st_size, partitions=partitions)
        if hash_algorithm:
            shard.hash = file_digest(path, hash_algorithm)
        return shard

    for rank, path in sorted(shards.model_files.items()):
        files.append(entry(path, "model_states", [rank], []))
    for rank, path in sorted(shards.optim_files.items()):
        try:
            members = torchfile.zip_member_locations(path)
        except torchfile.TorchFileError as exc:  # e.g. a compressed member, which read_pt_metadata can read
            raise InvalidCheckpoint("CK205", _without_path(exc, path), "the file is damaged or not a torch checkpoint", str(path)) from None
        locators = []
        for g, ref in enumerate(_flat_partitions(optim_states[rank], stage)):
            if not isinstance(ref, torchfile.TensorRef):
                continue
            data_offset, member_size = members[ref.storage.member]
            locators.append(Locator(group=g, rank=rank, member=ref.storage.member, data_offset=data_offset, member_size=member_size,
                                    dtype=ref.dtype, element_offset=ref.storage_offset, numel=ref.numel))
        files.append(entry(path, "optimizer_states", [rank], locators))
    for path in shards.other_files:
        files.append(entry(path, "other", [], []))
    return files
