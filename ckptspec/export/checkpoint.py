"""One checkpoint, any kind: ``ckptspec.open`` and the ``Checkpoint`` it gives.

A checkpoint is a set of *domains* (``Checkpoint.index``: a checkpoint index; a plain ZeRO manifest is
the index of its one data-parallel domain, ``CheckpointIndex.from_manifest``) and the whole model's
*tensor table* (``Checkpoint.tensors``, ``Checkpoint.optimizer_tensors``): every tensor of the model's
state dict and every optimizer state, as *chunks*, each a run of the whole tensor's elements (row-major)
located in bytes of one file, with its dtype and byte order. Torch DCP's ``Metadata`` (FQN -> chunks ->
storage) is the model; here the table is built from a validated document and files only.

The kind is decided once, here, where the document is read (``kinds.described_by_index``); what a kind
cannot do yet is refused in one place, by capability (``CAPABILITIES``, CK403), before anything is read
or written. ``export/api.py`` (``ckptspec.load_state_dict`` and friends) and the CLI's read commands go
through ``open_checkpoint``.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..checkpoint.states import StateCache
from ..deepspeed.kinds import Kind, described_by_index, kind_of_dir, kind_of_index
from ..errors import CheckpointInvalid, KindUnsupported
from ..findings import Finding, has_errors
from ..format.dtypes import ITEMSIZE
from ..format.index_models import CheckpointIndex, Domain
from ..format.index_validate import IndexReport
from ..format.models import Manifest
from ..location import RemotePath, is_remote
from . import writers
from .arrays import ShardReader, read_array
from .model_plan import ModelPlan, ReconstructionPlan, TensorSource
from .writers import WriteResult, to_torch

# What each capability needs of a checkpoint's kind; every other capability works on every kind.
# Issue #40 extends these to tensor/pipeline-parallel, MoE and stage-0 sources. ``export_dcp`` works on
# every kind (#39): where a kind's optimizer state is not located or not Adam's, the DCP export itself
# refuses it (CK402, export/dcp.py).
CAPABILITIES: dict[str, frozenset[Kind]] = {
    # model parallel: the data axis and degrees (reshard_parallel.py); stage 0: as ZeRO-1/2 (reshard_stage0_source.py)
    "reshard": frozenset({Kind.ZERO, Kind.MODEL_PARALLEL, Kind.STAGE0, Kind.PIPELINE_STAGE0, Kind.MOE}),
    # stage 0: universal_stage0.py; tensor/pipeline parallel: universal_parallel.py; MoE: universal_moe.py
    "export_universal": frozenset({Kind.ZERO, Kind.STAGE0, Kind.PIPELINE_STAGE0, Kind.MODEL_PARALLEL, Kind.MOE}),
    "export_dcp": frozenset(Kind),
}
_DOING = {
    "reshard": "resharding",
    "export_universal": "the universal export (export-universal)",
    "export_dcp": "the DCP export (export --format dcp)",
}


@dataclass(frozen=True)
class Chunk:
    """``numel`` elements of the whole tensor from element ``start`` (row-major), stored as ``dtype``
    (``byteorder``) in ``nbytes`` bytes at byte ``offset`` of ``file`` (relative to the tag directory)."""

    start: int
    numel: int
    file: str
    offset: int
    nbytes: int
    dtype: str
    byteorder: str = "little"  # torch's zip files and safetensors are little-endian


@dataclass(frozen=True)
class WholeTensor:
    """One tensor of the whole model: its chunks, in order, cover its elements exactly once."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    role: str  # "trainable" (the fp32 master), "frozen", "buffer", "state" (an optimizer state)
    origin: str  # what the bytes are (model_plan.ORIGINS)
    chunks: tuple[Chunk, ...]
    digest: str | None  # sha256 of the chunks' bytes, concatenated, where the document records it


@dataclass
class Checkpoint:
    """A validated checkpoint of any kind (``ckptspec.open``). Reading it never executes pickled code."""

    location: str  # the path or URL it was opened from
    kind: Kind
    document: Manifest | CheckpointIndex  # the document it was validated against
    plan: ModelPlan  # where every tensor's bytes are, as the writers read them
    findings: list[Finding]  # what validation found besides errors (warnings); an error refuses the open
    _copies_checked: bool = False

    @functools.cached_property
    def index(self) -> CheckpointIndex:
        """The checkpoint's domains as a checkpoint index (a plain ZeRO manifest: one domain)."""
        document = self.document
        return document if isinstance(document, CheckpointIndex) else CheckpointIndex.from_manifest(document)

    @property
    def domains(self) -> list[Domain]:
        return self.index.domains

    @property
    def tag_dir(self) -> Path | RemotePath:
        return self.plan.tag_dir

    @property
    def names(self) -> list[str]:
        """Every name of the model's state dict, in its order (tied aliases included)."""
        return list(self.plan.order)

    @property
    def aliases(self) -> dict[str, str]:
        """Tied alias -> the name that owns the tensor."""
        return dict(self.plan.aliases)

    @functools.cached_property
    def tensors(self) -> dict[str, WholeTensor]:
        """Every tensor of the whole model an alias is not: trainable (fp32 masters), frozen, buffers."""
        return {name: self._whole(source) for name, source in self.plan.sources.items()}

    @functools.cached_property
    def optimizer_tensors(self) -> dict[str, WholeTensor]:
        """Every parameter's optimizer states (``<param>.<state>``: exp_avg, exp_avg_sq, ...), in the
        parameter's shape; CK402 where the document locates none."""
        from .optimizer_state import optimizer_state_plan

        return {name: self._whole(source) for name, source in optimizer_state_plan(self.plan).sources.items()}

    def supports(self, capability: str) -> bool:
        return self.kind in CAPABILITIES.get(capability, frozenset(Kind))

    def state_dict(self, framework: str = "torch", dtype: Any = "fp32") -> dict[str, Any]:
        """The full state dict (``ckptspec.load_state_dict``): aliases are the same object as their owner."""
        from ..format.dtypes import output_dtype

        if framework not in ("torch", "numpy"):
            raise ValueError(f"framework must be 'torch' or 'numpy', not {framework!r}")
        dtype = output_dtype(dtype)
        bf16_view = numpy_bfloat16() if framework == "numpy" and dtype == "bfloat16" else None
        self.check_copies()
        plan = self.plan
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

    def optimizer_state(self) -> tuple[dict[str, dict[str, Any]], dict]:
        """``ckptspec.load_optimizer_state``: per parameter its states as numpy arrays, and the optimizer."""
        from .optimizer_state import load_optimizer_state_arrays

        return load_optimizer_state_arrays(self.plan)

    def reconstruct(
        self, output_dir: str | os.PathLike, *, optimizer_state: bool = False, **options: Any
    ) -> WriteResult:
        """Write the whole model with the writers (``writers.write_consolidated``: ``dtype``,
        ``max_shard_size``, ``fmt``, ``untie``, ``progress``, ``jobs``), and with ``optimizer_state``
        every parameter's optimizer state as ``optimizer.safetensors``; atomic, nothing on a refusal."""
        self.check_copies()
        if optimizer_state:
            from .optimizer_state import optimizer_state_plan

            optimizer_state_plan(self.plan)  # CK402 before anything is written, when nothing locates the states
        return writers.write_consolidated(self.plan, output_dir, optimizer_state=optimizer_state, **options)

    def check_copies(self) -> None:
        """Every copy the model holds twice (a replicated parameter across tensor-parallel domains) is
        equal, bit for bit, before any tensor is given out (CK401); once per opened checkpoint."""
        if self._copies_checked:
            return
        from .compose import check_replicas
        from .compose_plan import IndexReconstructionPlan

        if isinstance(self.plan, IndexReconstructionPlan):
            with ShardReader() as files:
                check_replicas(self.plan, files)
        self._copies_checked = True

    def _whole(self, source: TensorSource) -> WholeTensor:
        prefix = str(self.plan.tag_dir).rstrip("/") + "/"
        chunks, start = [], 0
        for seg in source.segments:
            path = str(seg.path)
            numel = seg.nbytes // ITEMSIZE[source.dtype]
            rel = path[len(prefix) :] if path.startswith(prefix) else path
            chunks.append(Chunk(start, numel, rel, seg.offset, seg.nbytes, source.dtype))
            start += numel
        return WholeTensor(
            source.name, source.shape, source.dtype, source.role, source.origin, tuple(chunks), source.digest
        )


def numpy_bfloat16():
    """``ml_dtypes.bfloat16``, the numpy dtype a bfloat16 array is viewed as; ``ValueError`` without ml_dtypes."""
    try:
        import ml_dtypes
    except ImportError:
        raise ValueError("numpy has no bfloat16: install ml_dtypes, or use dtype='fp32'") from None
    return ml_dtypes.bfloat16


def open_checkpoint(
    checkpoint: str | os.PathLike,
    *,
    document: Any = None,
    tag: str | None = None,
) -> Checkpoint:
    """Validate a checkpoint of any kind and give its one view (``ckptspec.open``). ``document``: the
    manifest or checkpoint index to validate it against (a model, a validated report or a file), else
    the tag directory's sidecar, else one generated from its files. Raises ``CheckpointInvalid`` with
    every finding when there is an error (nothing read beyond what validation reads)."""
    if described_by_index(checkpoint, document, tag):
        from .compose import validated_index_plan

        index_plan = validated_index_plan(checkpoint, document, tag)
        kind = kind_of_index(index_plan.index)
        return Checkpoint(os.fspath(checkpoint), kind, index_plan.index, index_plan, index_plan.warnings)
    plan, findings = _validated_zero_plan(checkpoint, document, tag)
    return Checkpoint(os.fspath(checkpoint), Kind.ZERO, plan.manifest, plan, findings)


def _validated_zero_plan(checkpoint, manifest, tag) -> tuple[ReconstructionPlan, list[Finding]]:
    """A plain ZeRO checkpoint validated (its manifest, then its files), and its plan from what validation
    read. A remote checkpoint's file hashes are checked by the reader, from the bytes it fetches once."""
    from ..deepspeed.check.zero import validate_checkpoint
    from .plan import plan_reconstruction

    states = StateCache()
    in_stream = is_remote(checkpoint)
    # Digests are checked as each tensor is read (arrays.py), not in a pass of their own here.
    found, findings = validate_checkpoint(
        checkpoint, manifest, tag, states=states, verify_hashes=not in_stream, verify_digests=False
    )
    if found is None or has_errors(findings):
        raise CheckpointInvalid(findings, str(checkpoint))
    return plan_reconstruction(checkpoint, found, tag, states=states, hashes_in_stream=in_stream), findings


def require(capability: str, checkpoint: str | os.PathLike, document: Any = None, tag: str | None = None) -> None:
    """Refuse (CK403) a capability the checkpoint's kind does not have, before anything is read or written."""
    kinds = CAPABILITIES[capability]
    if kinds == frozenset(Kind):
        return
    if kinds == frozenset({Kind.ZERO}) and not described_by_index(checkpoint, document, tag):
        return
    kind = _kind(checkpoint, document, tag)
    if kind not in kinds:
        raise KindUnsupported(
            f"{_DOING[capability]} of a {kind.label} checkpoint is not supported yet",
            f"it supports {', '.join(sorted(k.label for k in kinds))} checkpoints; `ckptspec reconstruct` "
            "writes the whole model of every kind",
            os.fspath(checkpoint),
        )


def _kind(checkpoint, document, tag) -> Kind:
    from ..deepspeed.layout.tag_dir import resolve_tag_dir
    from ..format.documents import load

    if isinstance(document, (str, os.PathLike)):
        document = load(document)
    if isinstance(document, CheckpointIndex):
        return kind_of_index(document)
    if isinstance(document, IndexReport) and document.index is not None:
        return kind_of_index(document.index)
    return kind_of_dir(resolve_tag_dir(checkpoint, tag))
