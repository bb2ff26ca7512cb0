"""A DeepSpeed save directory: which tag directory to read, and its files sorted by role and rank."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from ..._fs import is_leftover
from ...checkpoint.output_names import is_output_name
from ...errors import FileUnreadable, InputOutputError, InvalidCheckpoint, UnsupportedCheckpoint
from ...location import RemotePath, location, not_found, walk
from .names import EXPERT_RE, MODEL_RE, OPTIM_RE, PIPE_LAYER_RE

MAX_TAG_BYTES = 4096
UNIVERSAL_FOLDER = "zero"  # deepspeed/checkpoint/ds_to_universal.py writes zero/<param>/fp32.pt


def is_tag_name(name: str) -> bool:
    """A tag names one directory inside the save directory: ``latest`` and ``--tag`` alike."""
    return bool(name) and "/" not in name and "\\" not in name and name not in (".", "..") and "\x00" not in name


def resolve_tag_dir(checkpoint: str | os.PathLike | RemotePath, tag: str | None = None) -> Path | RemotePath:
    """A save directory (with ``latest``) or a tag directory -> the tag directory (a local path or a URL).

    A local directory or ``latest`` this user may not read (or an I/O error) is CK901, exit 2: the
    tag directory returned has been listed and entered once, so the readers after this see its files.
    """
    root = location(checkpoint)
    try:
        tag_dir = _resolve(root, tag)
        if isinstance(tag_dir, Path):
            _enter(tag_dir)
    except OSError as exc:
        raise FileUnreadable(exc.filename or root, exc) from None
    return tag_dir


def _enter(directory: Path) -> None:
    """List ``directory`` and stat one entry: OSError when it may not be listed, or not entered."""
    names = os.listdir(directory)
    if names:
        os.stat(directory / names[0], follow_symlinks=False)


def _resolve(root: Path | RemotePath, tag: str | None) -> Path | RemotePath:
    if not root.exists():
        if isinstance(root, RemotePath):
            raise not_found(str(root), "checkpoint directory not found")
        raise InputOutputError("CK901", "checkpoint directory not found", "check the path", str(root))
    if not root.is_dir():
        raise InputOutputError(
            "CK901", "not a directory", "pass a DeepSpeed save directory or a tag directory", str(root)
        )
    if tag is not None:
        if not is_tag_name(tag):
            raise InvalidCheckpoint(
                "CK201",
                f"tag {tag!r} is not a tag name",
                "a tag is the name of a directory inside the save directory, such as global_step2 "
                "(no '/', no '..'); to read another checkpoint, pass its own directory",
                str(root),
            )
        tag_dir = root / tag
        if not tag_dir.is_dir():
            raise InvalidCheckpoint(
                "CK201", f"tag {tag!r} has no directory", "list the save directory for the tags it holds", str(root)
            )
        return tag_dir
    if any(MODEL_RE.match(p.name) or OPTIM_RE.match(p.name) for p in root.iterdir()):
        return root
    latest = root / "latest"
    if not latest.is_file():
        raise InvalidCheckpoint(
            "CK201",
            "no 'latest' file and no model or optimizer states here",
            "pass --tag TAG, or the tag directory itself",
            str(root),
        )
    if latest.stat().st_size > MAX_TAG_BYTES:
        raise InvalidCheckpoint(
            "CK201", "'latest' is too large to hold a tag", "write the tag name into 'latest'", str(latest)
        )
    try:
        name = latest.read_text("utf-8").strip()
    except UnicodeDecodeError as exc:  # an OSError is the caller's CK901
        raise InvalidCheckpoint(
            "CK201", f"'latest' cannot be read: {exc}", "write the tag name into 'latest'", str(latest)
        ) from None
    if not is_tag_name(name):
        raise InvalidCheckpoint(
            "CK201", f"'latest' names {name!r}, which is not a tag", "write the tag name into 'latest'", str(latest)
        )
    tag_dir = root / name
    if not tag_dir.is_dir():
        raise InvalidCheckpoint(
            "CK201",
            f"'latest' names tag {name!r}, which has no directory",
            "point 'latest' at a saved tag, or pass --tag",
            str(latest),
        )
    return tag_dir


@dataclass
class ShardSet:
    """The files of one tag directory, sorted by rank (never by string order)."""

    tag_dir: Path | RemotePath
    model_files: dict[int, Path | RemotePath] = field(default_factory=dict)  # dp rank -> file (stage 3: one per rank)
    optim_files: dict[int, Path | RemotePath] = field(default_factory=dict)  # dp rank -> file
    other_files: list[Path | RemotePath] = field(default_factory=list)


def _nested_files(tag_dir: Path | RemotePath) -> list[Path | RemotePath]:
    """Files in the tag directory's subfolders (NVMe offload's ``offloaded_tensors/rank<NN>/``, a
    user's own folder), sorted: the manifest lists them as ``other`` files, as the file checks
    walk every subfolder (CK207 would otherwise name each one)."""
    out = []
    for sub in sorted((p for p in tag_dir.iterdir() if p.is_dir()), key=lambda p: p.name):
        for root, _, files in walk(sub):
            out += [root / n for n in files if not is_leftover(n) and not is_output_name(n) and (root / n).is_file()]
    return out


def index_kind_hint(kind: str) -> str:
    """The hint where a command of manifest 1.x checkpoints meets one that a checkpoint index describes."""
    return (
        f"{kind} checkpoints are described by a checkpoint index (docs/spec-checkpoint.md), which generate, "
        "validate, inspect, diff and reconstruct read (from a directory or a URL); this command reads ZeRO "
        "data-parallel checkpoints (manifest 1.x) only"
    )


def _other_model_parallel_rank(rank: int, path: Path | RemotePath) -> UnsupportedCheckpoint:
    return UnsupportedCheckpoint(
        f"model-parallel rank {rank} in {path.name}",
        "a tensor/pipeline-parallel checkpoint is read as a checkpoint index (docs/spec-checkpoint.md), "
        "which generate, validate, inspect, diff and reconstruct read; this command does not",
        str(path),
    )


def scan_tag_dir(tag_dir: Path | RemotePath) -> ShardSet:
    shards = ShardSet(tag_dir)
    entries: list[Path | RemotePath] = sorted(tag_dir.iterdir())  # a local directory's Paths, a URL's RemotePaths
    for path in entries:
        if not path.is_file():
            continue
        name = path.name
        if EXPERT_RE.match(name):
            raise UnsupportedCheckpoint(f"MoE expert file {name}", index_kind_hint("MoE"), str(path))
        if PIPE_LAYER_RE.match(name):
            raise UnsupportedCheckpoint(f"pipeline layer file {name}", index_kind_hint("pipeline-parallel"), str(path))
        if m := OPTIM_RE.match(name):
            if int(m.group(2)) != 0:
                raise _other_model_parallel_rank(int(m.group(2)), path)
            shards.optim_files[int(m.group(1))] = path
        elif m := MODEL_RE.match(name):
            if int(m.group(2)) != 0:
                raise _other_model_parallel_rank(int(m.group(2)), path)
            shards.model_files[int(m.group(1) or 0)] = path
        elif not name.startswith("ckptspec.") and not is_leftover(name) and not is_output_name(name):
            # ckptspec's own files (the sidecar) describe the others; a killed run's temporaries and a
            # reconstruction's outputs are not part of the checkpoint (validate warns: CK224, CK226).
            shards.other_files.append(path)
    if not shards.optim_files and (tag_dir / UNIVERSAL_FOLDER).is_dir():
        # ds_to_universal's output: the model states beside zero/<param>/fp32.pt, no optimizer files.
        raise UnsupportedCheckpoint(
            f"a DeepSpeed universal checkpoint ({UNIVERSAL_FOLDER}/ folder), not a ZeRO checkpoint",
            index_kind_hint("universal") + "; or pass the ZeRO tag it was converted from",
            str(tag_dir / UNIVERSAL_FOLDER),
        )
    if not shards.model_files:
        raise InvalidCheckpoint(
            "CK203", "no *_model_states.pt file", "is this a DeepSpeed checkpoint tag directory?", str(tag_dir)
        )
    shards.other_files += _nested_files(tag_dir)
    return shards
