"""The public API of reading a checkpoint of any kind (``ckptspec.open``, ``load_state_dict`` and friends).

Every function opens the checkpoint through ``checkpoint.open_checkpoint``, where its kind is decided
once. Torch-free by default: torch ``.pt`` zip members are stored uncompressed, so numpy (only
for dtype conversion) and the standard library suffice. ``framework="torch"`` wraps the
same arrays with ``torch.from_numpy``, so both frameworks give the same bits.

Each call validates the checkpoint first, reading and validating every file and the
manifest once; the plan then reuses what validation read.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..deepspeed.kinds import described_by_index
from ..findings import Finding
from ..location import writable
from .checkpoint import Checkpoint, open_checkpoint, require
from .writers import DEFAULT_MAX_SHARD_SIZE, SAFETENSORS_INDEX, SAFETENSORS_SINGLE, WriteResult


def open(  # ckptspec.open, as tarfile.open and fsspec.open name theirs (this module calls no builtin open)
    checkpoint: str | os.PathLike,
    *,
    manifest: Any = None,
    tag: str | None = None,
) -> Checkpoint:
    """Validate a checkpoint of any kind (plain ZeRO, tensor/pipeline parallel, MoE, stage 0, universal;
    a directory or a URL) and give its one view: domains, the whole model's tensor table, and the verbs
    that read it (``state_dict``, ``optimizer_state``, ``reconstruct``). ``manifest``: the manifest or
    checkpoint index to validate it against (a model, a validated report, or a file), else the sidecar,
    else one generated from the files. Raises ``CheckpointInvalid`` with the findings."""
    return open_checkpoint(checkpoint, document=manifest, tag=tag)


def validate_checkpoint(
    checkpoint: str | os.PathLike,
    manifest: Any = None,
    tag: str | None = None,
    *,
    verify_hashes: bool = True,
) -> list[Finding]:
    """The findings of validating a checkpoint of any kind against its document (``validate DIR``):
    the document's rules, then every file. Raises ``CkptspecError`` only when it cannot be checked at all."""
    from ..deepspeed.check import validate_checkpoint as validate_any

    return validate_any(checkpoint, manifest, tag, verify_hashes=verify_hashes)


def load_state_dict(
    checkpoint: str | os.PathLike,
    framework: str = "torch",
    *,
    dtype: Any = "fp32",
    manifest: Any = None,
    tag: str | None = None,
) -> dict[str, Any]:
    """The full state dict of a checkpoint of any kind: trainable (fp32 masters), frozen, buffers, aliases; of a
    torch DCP directory (``.metadata``), its ``model.`` tensors (``export/dcp_load.py``).

    Validates the checkpoint first (raises ``CheckpointInvalid`` with the findings).
    ``framework="numpy"`` needs only numpy; bfloat16 arrays are then returned as
    ``ml_dtypes.bfloat16`` when ``ml_dtypes`` is installed and refused otherwise.
    Aliases are the same object as their owner, as in the model.
    Runs in this process only unless ``CKPTSPEC_WORKERS=2`` lets it fork (docs/performance.md).
    """
    if framework not in ("torch", "numpy"):
        raise ValueError(f"framework must be 'torch' or 'numpy', not {framework!r}")
    from ..checkpoint.dcp.metadata import is_dcp

    if is_dcp(checkpoint):  # a torch DCP directory, local or at a URL: its model state (docs/api.md)
        if manifest is not None or tag is not None:
            raise ValueError("manifest and tag name a DeepSpeed checkpoint's documents; a DCP checkpoint has none")
        from .dcp_load import dcp_state_dict

        return dcp_state_dict(checkpoint, framework, dtype)
    return open_checkpoint(checkpoint, document=manifest, tag=tag).state_dict(framework, dtype)


def reconstruct(
    checkpoint: str | os.PathLike,
    output_dir: str | os.PathLike,
    *,
    manifest: Any = None,
    tag: str | None = None,
    dtype: str = "fp32",
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    fmt: str = "safetensors",
    untie: bool = False,
    progress: Callable[[int], None] | None = None,
    optimizer_state: bool = False,
    jobs: int = 1,
) -> WriteResult:
    """Validate, then write the consolidated weights to ``output_dir`` (see ``write_consolidated``),
    and with ``optimizer_state`` the per-parameter optimizer state as ``optimizer.safetensors``
    (``export/optimizer_state.py``). ``jobs``: threads writing each file.
    Runs in this process only unless ``CKPTSPEC_WORKERS=2`` lets it fork (docs/performance.md)."""
    writable(output_dir, "the reconstruction")  # CK916 (HTTP), CK917, before the checkpoint is read
    return open_checkpoint(checkpoint, document=manifest, tag=tag).reconstruct(
        output_dir,
        dtype=dtype,
        max_shard_size=max_shard_size,
        fmt=fmt,
        untie=untie,
        progress=progress,
        optimizer_state=optimizer_state,
        jobs=jobs,
    )


def load_optimizer_state(
    checkpoint: str | os.PathLike,
    *,
    manifest: Any = None,
    tag: str | None = None,
) -> tuple[dict[str, dict[str, Any]], dict]:
    """The optimizer state of a checkpoint per parameter, as numpy arrays in the parameter's shape
    (``{"emb.weight": {"exp_avg": ..., "exp_avg_sq": ...}}``, tied aliases included), and the
    optimizer's metadata (class, per-group hyperparameters and step, loss scaler).

    Validates the checkpoint first (``CheckpointInvalid``); CK402 where the document locates no state.
    States are returned as stored (float32 for torch's Adam; a bfloat16 state as uint16 bits).
    Runs in this process only unless ``CKPTSPEC_WORKERS=2`` lets it fork (docs/performance.md).
    """
    return open_checkpoint(checkpoint, document=manifest, tag=tag).optimizer_state()


def reshard(
    checkpoint: str | os.PathLike,
    output: str | os.PathLike,
    world_size: int,
    *,
    zero_stage: int | None = None,
    sub_group_size: int | None = None,
    tensor_parallel: int | None = None,
    pipeline_parallel: int | None = None,
    expert_parallel: int | None = None,
    partition_method: str | None = None,
    ds_config: dict | None = None,
    manifest: Any = None,
    tag: str | None = None,
    to: str | None = None,
    model_dtype: str | None = None,
    grad_accum_dtype: str | None = None,
) -> Any:
    """Validate ``checkpoint``, then write it for ``world_size`` ranks (and ``zero_stage``) as a DeepSpeed
    checkpoint ``output`` that ``engine.load_checkpoint`` resumes (docs/reshard.md). A tensor/pipeline-parallel
    checkpoint keeps its tensor and pipeline degrees unless ``tensor_parallel`` / ``pipeline_parallel`` give
    the target's: ``world_size / (tp x pp)`` data-parallel ranks; a pipeline's layers go to the target's stages by
    ``partition_method`` (DeepSpeed's PipelineModule ``partition_method``: "parameters", its default, or "uniform");
    a MoE checkpoint's experts are regrouped over ``expert_parallel`` expert-parallel ranks. A data-parallel
    checkpoint is split for an AutoTP job of ``tensor_parallel`` ranks by its ``ds_config`` (the target job's:
    ``tensor_parallel.partition_config.layer_specs``).
    A torch DCP directory (an FSDP checkpoint, ``.metadata``) is written as a ZeRO-1/2/3 checkpoint of an fp32 job
    (``reshard_dcp``), for a job of ``model_dtype`` ("float32", the default, or "bfloat16"; fp32 masters either way).
    ``to``: the framework written, DeepSpeed (the only one, and the default). ``grad_accum_dtype``: the target
    job's ``data_types.grad_accum_dtype`` ("float32" or "bfloat16"; default: the source's kind kept), which picks a
    bf16 job's optimizer at stage 1: "float32" DeepSpeed's BF16_Optimizer, "bfloat16" its ZeRO optimizer.
    CK403 for a kind it does not reshard yet, CK410 for a target it cannot write; nothing written then."""
    from ..checkpoint.dcp.metadata import is_dcp

    _refuse_framework(checkpoint, to)
    if is_dcp(checkpoint):
        others: dict[str, Any] = {"--tensor-parallel": tensor_parallel, "--pipeline-parallel": pipeline_parallel}
        others.update({"--expert-parallel": expert_parallel, "--partition-method": partition_method})
        others.update({"--tag": tag, "--manifest": manifest, "--ds-config": ds_config})
        others["--grad-accum-dtype"] = grad_accum_dtype
        return _reshard_dcp(checkpoint, output, world_size, zero_stage, sub_group_size, model_dtype, others)
    if model_dtype is not None:  # a ZeRO checkpoint's target keeps its dtypes
        from ..errors import ReshardUnsupported

        raise ReshardUnsupported(
            "--model-dtype: for a DCP checkpoint only (a DeepSpeed checkpoint keeps its dtypes)",
            "leave it out",
            os.fspath(checkpoint),
        )
    require("reshard", checkpoint, manifest, tag)
    degrees = {
        "tensor_parallel": tensor_parallel,
        "pipeline_parallel": pipeline_parallel,
        "expert_parallel": expert_parallel,
    }
    if described_by_index(checkpoint, manifest, tag):
        from .reshard_parallel import reshard_model_parallel

        return reshard_model_parallel(
            checkpoint,
            output,
            world_size,
            zero_stage=zero_stage,
            tag=tag,
            index=manifest,
            partition_method=partition_method,
            sub_group_size=sub_group_size,
            grad_accum_dtype=grad_accum_dtype,
            **degrees,
        )
    from .reshard_parallel import refuse_degrees_of_plain_zero

    # a plain ZeRO checkpoint is tp 1, pp 1: split for AutoTP by the target's ds_config, no other degree
    refuse_degrees_of_plain_zero(checkpoint, None, pipeline_parallel, expert_parallel)
    from .reshard import reshard as reshard_zero

    return reshard_zero(
        checkpoint,
        output,
        world_size,
        zero_stage=zero_stage,
        sub_group_size=sub_group_size,
        tag=tag,
        manifest=manifest,
        tensor_parallel=tensor_parallel,
        ds_config=ds_config,
        grad_accum_dtype=grad_accum_dtype,
    )


def export_universal(
    checkpoint: str | os.PathLike, output: str | os.PathLike, *, manifest: Any = None, tag: str | None = None
) -> Any:
    """Validate ``checkpoint``, then write DeepSpeed's universal checkpoint folder (``ds_to_universal``'s
    output) as ``output`` (docs/reshard.md). CK403 for a kind it does not export yet."""
    require("export_universal", checkpoint, manifest, tag)
    if described_by_index(checkpoint, manifest, tag):  # stage 0, AutoTP, a pipeline (MoE: CK410)
        from .universal_parallel import export_universal_index

        return export_universal_index(checkpoint, output, tag=tag, index=manifest)
    from .universal import export_universal as export_zero

    return export_zero(checkpoint, output, tag=tag, manifest=manifest)


def export_dcp(
    checkpoint: str | os.PathLike,
    output_dir: str | os.PathLike,
    *,
    manifest: Any = None,
    tag: str | None = None,
    progress: Callable[[int], None] | None = None,
) -> Any:
    """Validate ``checkpoint`` (any kind), then write its whole model as a PyTorch Distributed Checkpoint
    directory that an FSDP2 job of the consolidated module loads with ``dcp.load`` (docs/fsdp2.md):
    weights, Adam's moments and step, param groups. Needs torch. CK402 where the optimizer state is not
    located or not Adam's (a universal folder's); nothing is written then."""
    require("export_dcp", checkpoint, manifest, tag)
    from .dcp import held_export_output, plan_dcp, write_dcp

    with held_export_output(output_dir) as held:
        opened = open_checkpoint(checkpoint, document=manifest, tag=tag)
        plan_dcp(opened)  # refused (CK402) before anything is written
        return write_dcp(opened, output_dir, progress=progress, held=held)


def load_consolidated(output_dir: str | os.PathLike, framework: str = "torch") -> dict[str, Any]:
    """Read ``reconstruct`` safetensors output back, re-tying aliases recorded in the metadata.

    The result is a state dict that ``module.load_state_dict`` accepts (tied names
    share one tensor), whether or not the output was written with ``--untie``.
    """
    from safetensors import safe_open

    out = Path(output_dir)
    index = out / SAFETENSORS_INDEX
    files = (
        sorted(set(json.loads(index.read_text("utf-8"))["weight_map"].values()))
        if index.exists()
        else [SAFETENSORS_SINGLE]
    )
    state: dict[str, Any] = {}
    aliases: dict[str, str] = {}
    for filename in files:
        with safe_open(out / filename, framework="pt" if framework == "torch" else "np") as f:
            aliases.update(json.loads((f.metadata() or {}).get("ckptspec.aliases", "{}")))
            for key in f.keys():
                state[key] = f.get_tensor(key)
    for alias, owner in aliases.items():
        state.setdefault(alias, state[owner])
    return state


def _refuse_framework(checkpoint, to: str | None) -> None:
    """``--to``: reshard writes DeepSpeed checkpoints only; CK410 naming any other framework."""
    if to is not None and to != "deepspeed":
        from ..errors import ReshardUnsupported

        raise ReshardUnsupported(
            f"--to {to}: reshard writes DeepSpeed checkpoints only (--to deepspeed)",
            "leave --to out, or give --to deepspeed",
            os.fspath(checkpoint),
        )


def _reshard_dcp(checkpoint, output, world_size: int, zero_stage, sub_group_size, model_dtype, given: dict) -> Any:
    """An FSDP checkpoint (torch DCP) as a DeepSpeed ZeRO checkpoint; CK410 naming an option it does not take."""
    from ..errors import ReshardUnsupported
    from .reshard_dcp import reshard_dcp

    named = [option for option, value in given.items() if value is not None]
    if named:
        raise ReshardUnsupported(
            f"{', '.join(named)}: not for a DCP checkpoint (.metadata)", "leave them out", os.fspath(checkpoint)
        )
    return reshard_dcp(checkpoint, output, world_size, zero_stage, sub_group_size, model_dtype or "float32")
