"""Hugging Face ``transformers``: the manifest of every DeepSpeed save the ``Trainer`` makes, and a validated resume.

    from ckptspec.integrations.transformers import CkptspecCallback, resume_from

    trainer = Trainer(model, args, train_dataset=data, callbacks=[CkptspecCallback()])   # args.deepspeed set
    trainer.train(resume_from_checkpoint=resume_from(args.output_dir, fallback=True))

The Trainer saves ``OUTPUT_DIR/checkpoint-N/``: DeepSpeed's tag (``global_stepN/``) and its ``latest``, beside the
Trainer's own files. ``CkptspecCallback.on_save`` embeds the manifest into that tag (``embed_checkpoint``: model
states rewritten and the sidecar written last, atomically), on rank 0 once every rank has saved, its outcome on
every rank. The Trainer loads a checkpoint before any callback event (``on_train_begin`` comes after DeepSpeed's
``load_checkpoint``), so the resume is checked where its path is chosen: ``resume_from`` validates the folder
(rank 0, the verdict broadcast) and returns it, or raises the same findings on every rank.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

from transformers import TrainerCallback

from .._fs import is_leftover
from ..deepspeed.check.run import read_latest
from ..deepspeed.embed import embed_checkpoint
from ..deepspeed.load.verdict import same_on_every_rank
from ..errors import CheckpointInvalid, CkptspecError, InvalidCheckpoint
from ..findings import Finding, finding
from ..format.codec import Encoding
from .checks import tag_findings

__all__ = ["CkptspecCallback", "resume_from"]

TRAINER_FOLDER = re.compile(r"^checkpoint-(\d+)$")  # transformers' PREFIX_CHECKPOINT_DIR-<global step>


class CkptspecCallback(TrainerCallback):
    """Embeds the manifest into the DeepSpeed tag of each ``checkpoint-N`` the Trainer saves.

    ``hash`` records every file's SHA-256 and the tensor digests (what ``validate --hash`` checks); ``encoding``
    is the sidecar's (``ckptspec.json`` or ``ckptspec.msgpack``). A failure is raised on every rank.
    """

    def __init__(self, *, hash: bool = True, encoding: Encoding = "json"):
        self.hash = hash
        self.encoding: Encoding = encoding

    def on_train_begin(self, args, state, control, **kwargs):
        # Refused before the first step, not at the first save: there would be no DeepSpeed tag to describe.
        if not args.deepspeed:
            raise ValueError("CkptspecCallback describes DeepSpeed checkpoints: set TrainingArguments(deepspeed=...)")
        if args.save_only_model:
            raise ValueError("CkptspecCallback: save_only_model=True saves no DeepSpeed checkpoint to describe")

    def on_save(self, args, state, control, **kwargs):
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        # Every rank is past DeepSpeed's save (it ends in a barrier); rank 0 embeds, every rank learns how it went.
        same_on_every_rank(lambda: embed_saved(folder, self.hash, self.encoding))


def embed_saved(folder: Path, hash: bool, encoding: Encoding) -> Path:
    """Embed the manifest into the tag the folder's ``latest`` names (the one DeepSpeed just wrote); its sidecar."""
    tag = read_latest(folder)
    if tag is None or not (folder / tag).is_dir():
        raise CkptspecError(
            "CK901",
            f"no DeepSpeed tag in {folder} ('latest' missing or naming no directory)",
            "CkptspecCallback needs the Trainer to save DeepSpeed checkpoints",
            str(folder),
        )
    # rehash: a resumed run saves again into a folder it loaded from, and DeepSpeed has just replaced the files
    # that folder's sidecar describes; what is on disk now is this save's, so it is recorded as it is.
    algorithm = "sha256" if hash else None
    result = embed_checkpoint(folder, tag=tag, hash_algorithm=algorithm, encoding=encoding, rehash=True)
    assert isinstance(result.sidecar, Path)  # the Trainer's output folder is local
    return result.sidecar


def resume_from(checkpoint: str | Path, *, fallback: bool = False, verify_hashes: bool = False) -> str | None:
    """The ``checkpoint-N`` folder ``trainer.train(resume_from_checkpoint=...)`` may load, validated; call it on
    every rank (after the Trainer is built: its process group is up).

    ``checkpoint`` is a ``checkpoint-N`` folder (checked as it is) or the run's output directory: its highest
    ``checkpoint-N``, the one the Trainer's ``resume_from_checkpoint=True`` picks; with ``fallback``, the newest
    valid one, warning (rank 0) of each newer one skipped and why. None when the run has no ``checkpoint-N`` yet
    (the Trainer starts from scratch). ``verify_hashes`` also checks every file's recorded SHA-256.

    Raises, on every rank: ``CheckpointInvalid`` with the folder's findings (the DeepSpeed tag its ``latest``
    names, checked as ``ckptspec validate`` does); CK260 when no folder of the run is valid.
    """
    return same_on_every_rank(lambda: _choose(Path(checkpoint), fallback, verify_hashes))


def _choose(checkpoint: Path, fallback: bool, verify_hashes: bool) -> str | None:
    if TRAINER_FOLDER.match(checkpoint.name):
        findings = folder_findings(checkpoint, verify_hashes)
        if findings:
            raise CheckpointInvalid(findings, str(checkpoint))
        return str(checkpoint)
    folders = trainer_folders(checkpoint)
    skipped: list[str] = []
    for folder in reversed(folders):
        findings = folder_findings(folder, verify_hashes)
        if not findings:
            if skipped:
                warnings.warn(f"ckptspec: resuming from {folder.name}, skipped " + "; ".join(skipped), stacklevel=2)
            return str(folder)
        if not fallback:
            raise CheckpointInvalid(findings, str(folder))
        skipped.append(f"{folder.name}: {findings[0].to_line()}")
    if folders:
        raise InvalidCheckpoint(
            "CK260",
            f"none of the run's {len(folders)} checkpoint folders is valid: " + "; ".join(skipped),
            "a resume from this run would fail or start from scratch; `ckptspec scan` lists each tag's findings",
            str(checkpoint),
        )
    return None


def trainer_folders(run_dir: Path) -> list[Path]:
    """The run's ``checkpoint-N`` folders, by step (as ``transformers.trainer_utils.get_last_checkpoint`` orders
    them). A run directory that cannot be listed is an error (CK901), not a fresh start."""
    try:
        entries = list(run_dir.iterdir())
    except OSError as exc:
        raise CkptspecError("CK901", f"cannot list the run directory: {exc}", "pass the Trainer's output_dir") from exc
    found = [(int(m.group(1)), p) for p in entries if (m := TRAINER_FOLDER.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def folder_findings(folder: Path, verify_hashes: bool) -> list[Finding]:
    """The errors of the DeepSpeed tag a resume from ``folder`` loads (the one its ``latest`` names)."""
    tag = read_latest(folder)
    why = None
    if tag is None:
        why = "has no readable 'latest': DeepSpeed's load_checkpoint would load nothing"
    elif is_leftover(tag) or not (folder / tag).is_dir():
        why = f"has 'latest' naming {tag!r}, which is not a tag directory"
    if why is not None:
        hint = "resume from an older checkpoint folder"
        return [finding("CK261", "$", f"{folder.name} {why}", hint, file=str(folder))]
    assert tag is not None
    return tag_findings(folder, tag, verify_hashes)
