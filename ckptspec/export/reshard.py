"""``ckptspec reshard``: a ZeRO checkpoint rewritten for another data-parallel world size (or stage).

The source is validated first (digests included); nothing is written when it has an error finding
or when the target cannot be expressed (CK410, ``reshard_layout``). The output is built in a
temporary directory beside OUTPUT and renamed into place when complete, validated and embedded.

What is written (``reshard_files``): per target rank DeepSpeed's optimizer-state file, with every
layout-dependent entry recomputed (masters, moments, paddings, partition counts, stage, slice
mappings) and everything else copied as saved (step, hyperparameters, loss scaler, clip_grad); the
model states with the flat low-precision buffers re-laid and ``dp_world_size`` changed (frozen
params, buffers, LR scheduler, counters, client state as saved); ``latest``; and the format 1.1
manifest of the new checkpoint (sidecar and client state).

Bytes are read and written a chunk (16 MiB at most) at a time (``ds_pickle.save_streamed``, torch's zip
format written record by record by ``torch_zip``): peak memory does not grow with the model. torch is
used only to write the pickles (``ds_pickle``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .. import split
from ..checkpoint.hashing import file_digests
from ..checkpoint.states import StateCache
from ..deepspeed.check.checkpoint_index import validate_index_checkpoint
from ..deepspeed.check.zero import validate_checkpoint
from ..deepspeed.describe.digests import add_digests
from ..deepspeed.describe.zero import manifest_from_states
from ..deepspeed.embed import embed_checkpoint
from ..deepspeed.layout.tag_dir import scan_tag_dir
from ..errors import CheckpointInvalid, ReshardUnsupported
from ..findings import has_errors
from ..format.models import Manifest
from ..location import RemotePath, location
from .optimizer_state import plan_optimizer_state
from .output_dir import build_and_publish, held_new_output
from .plan import plan_reconstruction
from .reshard_bf16 import is_bf16_optimizer, refuse_grad_accum_dtype_model_parallel, target_config, zero_source
from .reshard_files import write_files
from .reshard_layout import target_layout
from .reshard_stage0 import module_order, refuse_stage0, source_osd, write_stage0_files
from .reshard_stage3 import write_stage3_files


@dataclass
class ReshardResult:
    output: Path | RemotePath  # a URL's is a RemotePath
    tag: str
    source_world_size: int
    world_size: int
    zero_stage: int
    files: list[Path | RemotePath]
    # How a job resumes the output ({output}: where it was written). DeepSpeed 0.19.8's load_checkpoint fails on a
    # stage-0 bf16 pipeline's optimizer state (KeyError: 0, on its own save too); its ZeRO reader loads it.
    resume_with: str = "engine.load_checkpoint('{output}')"


def reshard(
    checkpoint: str | os.PathLike,
    output: str | os.PathLike,
    world_size: int,
    *,
    zero_stage: int | None = None,
    sub_group_size: int | None = None,
    tag: str | None = None,
    manifest: Manifest | str | os.PathLike | None = None,
    tensor_parallel: int | None = None,
    ds_config: dict | None = None,
    grad_accum_dtype: str | None = None,
) -> ReshardResult:
    """Validate ``checkpoint``, then write it for ``world_size`` ranks (and ``zero_stage``) into ``output``;
    ``tensor_parallel`` above 1: for an AutoTP job of that degree, by the rules of its ``ds_config``.
    ``grad_accum_dtype``: the target job's ``data_types.grad_accum_dtype`` ("float32", "bfloat16"), which picks a
    stage-1 bf16 job's optimizer (``reshard_bf16``); default: the source's kind."""
    if tensor_parallel not in (None, 1):
        refuse_grad_accum_dtype_model_parallel(checkpoint, grad_accum_dtype)  # CK410 before anything is read
        return _reshard_to_tensor_parallel(
            checkpoint, output, world_size, zero_stage, tag, manifest, tensor_parallel, ds_config, sub_group_size
        )
    with held_new_output(output, "the resharded checkpoint") as out:
        found, states = validated_source(checkpoint, manifest, tag)
        try:
            # CK410 before anything is read or written
            target = target_layout(found, world_size, zero_stage, sub_group_size, grad_accum_dtype=grad_accum_dtype)
        except ReshardUnsupported as exc:
            raise ReshardUnsupported(exc.message, exc.hint, str(checkpoint)) from None
        plan = plan_reconstruction(checkpoint, found, tag, states=states)
        state_plan = plan_optimizer_state(plan)
        if target.zero_stage == 0:
            try:  # CK410 before anything is written
                order = module_order(found, plan, states)
                refuse_stage0(found, source_osd(found, plan, states), order, ties=True)  # a tie: one tensor
            except ReshardUnsupported as exc:
                raise ReshardUnsupported(exc.message, exc.hint, str(checkpoint)) from None

        def build(tmp: Path) -> list:
            tag_dir = tmp / plan.tag_dir.name
            tag_dir.mkdir(exist_ok=True)  # every rank of a torchrun split
            if target.zero_stage == 0:  # described by a checkpoint index: validated as such from its files
                files = write_stage0_files(found, plan, state_plan, target, states, tag_dir)
                commit_and_validate_index(tmp, tag_dir, output)
                return files
            # a BF16_Optimizer source written for a ZeRO-1/2/3 job: its entries as DeepSpeed's ZeRO optimizer's
            zero = zero_source(found, plan, states) if is_bf16_optimizer(found) and not target.bf16_optimizer else None
            if target.zero_stage == 3:
                files = write_stage3_files(
                    found, plan, state_plan, target, states, tag_dir, sub_group_size, source=zero
                )
            else:  # a ZeRO source for a BF16_Optimizer job: reshard_files writes its keys
                config = target_config(found, target)
                files = write_files(found, plan, state_plan, target, states, tag_dir, source=zero, config=config)
            embed_and_validate(found, tmp, tag_dir, output)
            return files

        files = build_and_publish(out, build)
    written_to = location(output)
    return ReshardResult(
        written_to,
        plan.tag_dir.name,
        found.layout.world_size,
        world_size,
        target.zero_stage,
        [written_to / plan.tag_dir.name / f.name for f in files],
    )


def _reshard_to_tensor_parallel(
    checkpoint, output, world_size: int, zero_stage, tag, manifest, degree: int, ds_config, sub_group_size
) -> ReshardResult:
    """A data-parallel ZeRO checkpoint written for an AutoTP job of ``degree`` (``reshard_tensor_split``),
    validated from its files as a tensor-parallel checkpoint index before it is put in place."""
    from .reshard_tensor_split import plan_data_parallel_split

    with held_new_output(output, "the resharded checkpoint") as out:
        found, states = validated_source(checkpoint, manifest, tag)
        plan = plan_reconstruction(checkpoint, found, tag, states=states)
        state_plan = plan_optimizer_state(plan)
        try:  # CK410 before anything is written
            writes = plan_data_parallel_split(
                found, plan, state_plan, states, world_size, zero_stage, degree, ds_config, sub_group_size
            )
        except ReshardUnsupported as exc:
            raise ReshardUnsupported(exc.message, exc.hint, str(checkpoint)) from None

        def build(tmp: Path) -> list:
            tag_dir = tmp / plan.tag_dir.name
            tag_dir.mkdir(exist_ok=True)  # every rank of a torchrun split
            files = [f for write in writes for f in write.write(states, tag_dir)]
            commit_and_validate_index(tmp, tag_dir, output)
            return files

        files = build_and_publish(out, build)
    stage = writes[0].target.zero_stage
    written: list[Path | RemotePath] = [location(output) / plan.tag_dir.name / f.name for f in files]
    return ReshardResult(location(output), plan.tag_dir.name, found.layout.world_size, world_size, stage, written)


def validated_source(checkpoint, manifest, tag) -> tuple[Manifest, StateCache]:
    """Validate ``checkpoint``, digests included: its manifest and the states read while checking."""
    states = StateCache()
    found, findings = validate_checkpoint(checkpoint, manifest, tag, states=states, verify_digests=True)
    if found is None or has_errors(findings):
        raise CheckpointInvalid(findings, str(checkpoint))
    return found, states


def commit_and_validate_index(tmp: Path, tag_dir: Path, output) -> None:
    """``latest`` naming ``tag_dir``, then the checkpoint in ``tmp`` validated from its files as a checkpoint index
    (a kind a format 1.x manifest does not describe), digests included: ``CheckpointInvalid`` naming ``output``.
    Under a torchrun split, rank 0 writes ``latest`` once every rank wrote its files; the ranks share the validation."""
    split.current().first_only(lambda: (tmp / "latest").write_text(tag_dir.name))
    written, findings = validate_index_checkpoint(tmp, tag=tag_dir.name, verify_digests=True)
    if written is None or has_errors(findings):
        raise CheckpointInvalid(findings, str(output))


def embed_and_validate(found: Manifest, tmp: Path, tag_dir: Path, output) -> None:
    """``latest`` naming ``tag_dir`` and the new data-parallel checkpoint in ``tmp`` described (embedded), then
    validated from its files, digests included: ``CheckpointInvalid`` (naming ``output``) on any error finding.
    Under a torchrun split, rank 0 alone writes and embeds (reading every file), once every rank wrote its files;
    the ranks share the validation."""

    def commit() -> None:
        (tmp / "latest").write_text(tag_dir.name)
        _embed(found, tag_dir)

    _hashed_together(tag_dir)
    split.current().first_only(commit)
    out_manifest, out_findings = validate_checkpoint(tmp, tag=tag_dir.name, verify_digests=True)
    if out_manifest is None or has_errors(out_findings):
        raise CheckpointInvalid(out_findings, str(output))


def _hashed_together(tag_dir: Path) -> None:
    """Under a torchrun split: every written file's hash and tensor digest, a share by each rank, before rank 0
    embeds the manifest that records them (it then reads again only the model states file it rewrites)."""
    share = split.current()
    if share.size == 1:
        return
    share.synchronize()  # every rank's files are written
    file_digests(sorted(p for p in tag_dir.iterdir() if p.is_file()))
    add_digests(manifest_from_states(scan_tag_dir(tag_dir), StateCache()), tag_dir)


def _embed(found: Manifest, tag_dir: Path) -> None:
    """The new checkpoint's format 1.1 manifest, from its files, with what only the source knew."""
    derived = manifest_from_states(scan_tag_dir(tag_dir), StateCache()).to_dict()
    source = found.to_dict()
    for key in ("excluded",):
        if key in source:
            derived[key] = source[key]
    if found.optimizer is not None and derived.get("optimizer", {}).get("class") == "unknown":
        derived["optimizer"]["class"] = source["optimizer"]["class"]
    embed_checkpoint(tag_dir.parent, derived, tag=tag_dir.name)
