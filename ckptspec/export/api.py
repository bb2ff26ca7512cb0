"""Loading a ZeRO checkpoint's weights: the public API (``ckptspec.load_state_dict`` and friends).

Torch-free by default: torch ``.pt`` zip members are stored uncompressed, so numpy (only
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

from ..checkpoint.states import StateCache
from ..deepspeed.check.zero import validate_checkpoint
from ..errors import CheckpointInvalid
from ..findings import has_errors
from ..format.dtypes import output_dtype
from ..format.models import Manifest
from ..format.validate import Report
from ..location import is_remote, refuse_write
from .arrays import ShardReader, read_array
from .optimizer_state import load_optimizer_state_arrays, plan_optimizer_state
from .plan import ReconstructionPlan, plan_reconstruction
from .writers import (
    DEFAULT_MAX_SHARD_SIZE,
    SAFETENSORS_INDEX,
    SAFETENSORS_SINGLE,
    WriteResult,
    to_torch,
    write_consolidated,
)


def validated_plan(
    checkpoint: str | os.PathLike,
    manifest: Manifest | Report | str | os.PathLike | None = None,
    tag: str | None = None,
    *,
    hashes_in_stream: bool = False,
) -> ReconstructionPlan:
    """Validate the checkpoint (against ``manifest``: a model, the report of a validated one, or a
    file), then plan from the files validation read. Raises ``CheckpointInvalid`` with the findings.
    ``hashes_in_stream``: a remote checkpoint's file hashes are left to the reader (``plan.file_hashes``)."""
    states = StateCache()
    in_stream = hashes_in_stream and is_remote(checkpoint)  # each byte fetched once: hashed as it is read
    # Digests are checked as each tensor is read (arrays.py), not in a pass of their own here.
    found, findings = validate_checkpoint(
        checkpoint, manifest, tag, states=states, verify_hashes=not in_stream, verify_digests=False
    )
    if found is None or has_errors(findings):
        raise CheckpointInvalid(findings, str(checkpoint))
    return plan_reconstruction(checkpoint, found, tag, states=states, hashes_in_stream=in_stream)


def load_state_dict(
    checkpoint: str | os.PathLike,
    framework: str = "torch",
    *,
    dtype: Any = "fp32",
    manifest: Manifest | str | os.PathLike | None = None,
    tag: str | None = None,
) -> dict[str, Any]:
    """The full state dict of a ZeRO checkpoint: trainable (fp32 masters), frozen, buffers, aliases.

    Validates the checkpoint first (raises ``CheckpointInvalid`` with the findings).
    ``framework="numpy"`` needs only numpy; bfloat16 arrays are then returned as
    ``ml_dtypes.bfloat16`` when ``ml_dtypes`` is installed and refused otherwise.
    Aliases are the same object as their owner, as in the model.
    Runs in this process only unless ``CKPTSPEC_WORKERS=2`` lets it fork (docs/performance.md).
    """
    if framework not in ("torch", "numpy"):
        raise ValueError(f"framework must be 'torch' or 'numpy', not {framework!r}")
    dtype = output_dtype(dtype)
    if _model_parallel(checkpoint, manifest, tag):  # the whole model, composed from every rank's shards
        from .compose import check_replicas, validated_index_plan

        plan = validated_index_plan(checkpoint, manifest, tag)
        with ShardReader() as files:
            check_replicas(plan, files)  # CK401 before any tensor is returned
    else:
        plan = validated_plan(checkpoint, manifest, tag, hashes_in_stream=True)
    bf16_view = None
    if framework == "numpy" and dtype == "bfloat16":
        try:
            import ml_dtypes
        except ImportError:
            raise ValueError("numpy has no bfloat16: install ml_dtypes, or use dtype='fp32'") from None
        bf16_view = ml_dtypes.bfloat16
    out: dict[str, Any] = {}
    with ShardReader(plan.file_hashes) as files:
        files.plan(seg for name in plan.order if name not in plan.aliases for seg in plan.sources[name].segments)
        for name in plan.order:
            if name in plan.aliases:
                continue
            out_dtype = plan.output_dtype(name, dtype)
            array = read_array(plan.sources[name], out_dtype, files)
            if framework == "torch":
                out[name] = to_torch(array, out_dtype)
            else:
                out[name] = array.view(bf16_view) if out_dtype == "bfloat16" else array
        files.verify()  # a remote file's recorded hash, from the bytes read once
    return {name: out[plan.aliases.get(name, name)] for name in plan.order}


def _model_parallel(checkpoint, manifest, tag) -> bool:
    """A tensor/pipeline-parallel checkpoint: described by a checkpoint index, not a manifest."""
    from ..deepspeed.kinds import needs_index
    from ..deepspeed.layout.tag_dir import resolve_tag_dir
    from ..format.index_models import CheckpointIndex

    if isinstance(manifest, CheckpointIndex):
        return True
    if isinstance(manifest, (str, os.PathLike)):
        from ..format.codec import read_document
        from ..format.index_validate import is_index

        return is_index(read_document(manifest)[0])
    return manifest is None and needs_index(resolve_tag_dir(checkpoint, tag))


def reconstruct(
    checkpoint: str | os.PathLike,
    output_dir: str | os.PathLike,
    *,
    manifest: Manifest | str | os.PathLike | None = None,
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
    (format 1.1 manifests; ``export/optimizer_state.py``). ``jobs``: threads writing each file.
    Runs in this process only unless ``CKPTSPEC_WORKERS=2`` lets it fork (docs/performance.md)."""
    refuse_write(output_dir, "the reconstruction")  # before the checkpoint is read
    if _model_parallel(checkpoint, manifest, tag):
        from .compose import reconstruct_index

        return reconstruct_index(
            checkpoint,
            output_dir,
            index=manifest,
            tag=tag,
            dtype=dtype,
            max_shard_size=max_shard_size,
            fmt=fmt,
            untie=untie,
            progress=progress,
            optimizer_state=optimizer_state,
            jobs=jobs,
        )
    plan = validated_plan(checkpoint, manifest, tag, hashes_in_stream=True)
    if optimizer_state:
        plan_optimizer_state(plan)  # refuse before writing anything when the manifest locates no state
    return write_consolidated(
        plan,
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
    manifest: Manifest | str | os.PathLike | None = None,
    tag: str | None = None,
) -> tuple[dict[str, dict[str, Any]], dict]:
    """The optimizer state of a ZeRO checkpoint per parameter, as numpy arrays in the parameter's shape
    (``{"emb.weight": {"exp_avg": ..., "exp_avg_sq": ...}}``, tied aliases included), and the
    manifest's ``optimizer`` object (class, per-group hyperparameters and step, loss scaler).

    Validates the checkpoint first (``CheckpointInvalid``); needs a format 1.1 manifest (CK402).
    States are returned as stored (float32 for torch's Adam; a bfloat16 state as uint16 bits).
    Runs in this process only unless ``CKPTSPEC_WORKERS=2`` lets it fork (docs/performance.md).
    """
    if _model_parallel(checkpoint, manifest, tag):  # the whole model's, composed from every domain
        from .compose import validated_index_plan

        return load_optimizer_state_arrays(validated_index_plan(checkpoint, manifest, tag))
    return load_optimizer_state_arrays(validated_plan(checkpoint, manifest, tag, hashes_in_stream=True))


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
