"""A training run's save directory: every tag, oldest first, and each tag's verdict (``ckptspec scan``, and the
validated resume ``ckptspec.deepspeed.load_checkpoint``: one order of the tags for both).

A tag is a directory of the run holding DeepSpeed's states (model, optimizer, layer or expert files) or
a universal folder (``zero/``); a Hugging Face Trainer ``checkpoint-N/`` folder holds one such tag and
its own ``latest``. ``list_run`` finds and orders the tags (file names and sizes only); ``check_tag`` gives
one its verdict, by ``validate_checkpoint`` (the checks of ``validate DIR``, one validator for every command).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..._fs import is_leftover
from ...errors import CkptspecError, FileUnreadable, InputOutputError
from ...findings import Finding
from ...location import RemotePath, location, walk
from ..kinds import kind_of_dir
from ..layout.names import EXPERT_RE, MODEL_RE, OPTIM_RE, PIPE_LAYER_RE
from ..layout.tag_dir import MAX_TAG_BYTES, UNIVERSAL_FOLDER

_TRAINER_FOLDER = re.compile(r"^checkpoint-(\d+)$")  # transformers' Trainer: PREFIX_CHECKPOINT_DIR-<global step>
_STEP = re.compile(r"(\d+)\D*$")  # DeepSpeed's default tag, global_step<N> (and ds_to_universal's ..._universal)


@dataclass
class TagScan:
    """One tag of the run and its verdict."""

    name: str  # relative to the run: "global_step2", or "checkpoint-500/global_step500"
    step: int | None
    kind: str | None
    size: int
    saved: float | None  # the newest file's modification time (None at a URL)
    valid: bool = False
    findings: list[Finding] = field(default_factory=list)  # the errors (warnings are not a verdict)
    error: CkptspecError | None = None  # the tag could not be checked at all
    directory: Path | RemotePath | None = field(default=None, repr=False, compare=False)
    checked: bool = False  # check_tag has given its verdict (list_run gives none)

    @property
    def latest_can_name(self) -> bool:
        """A tag DeepSpeed's ``latest`` at the run's root names: not inside a Trainer folder, and not a universal
        folder (which a job loads through ``latest_universal`` and ``load_universal``)."""
        return "/" not in self.name and self.kind != "universal"


@dataclass
class RunScan:
    run_dir: str
    tags: list[TagScan]  # oldest first
    latest: str | None  # what the run's ``latest`` names (None: no such file)
    is_a_tag: bool = False  # RUN_DIR is itself a tag directory (a common slip)

    @property
    def newest_valid(self) -> TagScan | None:
        """The newest valid tag a resume would choose among: those ``latest`` can name, if the run has any."""
        return self.newest_resumable or next((t for t in reversed(self.tags) if t.valid), None)

    @property
    def newest_resumable(self) -> TagScan | None:
        """The newest valid tag ``latest`` can name (a Trainer folder is chosen by the Trainer, by its number)."""
        valid = [t for t in self.tags if t.valid and t.latest_can_name]
        return valid[-1] if valid else None


def is_tag_dir(directory: Path | RemotePath) -> bool:
    """DeepSpeed's states, or a universal folder: file names only. A folder this user may not list may be one:
    it is listed as a tag that cannot be read (CK901), never left out without a word."""
    try:
        entries: list[Path | RemotePath] = list(directory.iterdir())
    except OSError:
        return True
    for entry in entries:
        name = entry.name
        if entry.is_dir():
            if name == UNIVERSAL_FOLDER:
                return True
            continue
        if MODEL_RE.match(name) or OPTIM_RE.match(name) or PIPE_LAYER_RE.match(name) or EXPERT_RE.match(name):
            return True
    return False


def find_tags(run: Path | RemotePath) -> list[tuple[str, Path | RemotePath, int | None]]:
    """(name, directory, step) of every tag: the run's own, and the one inside each Trainer folder."""
    found: list[tuple[str, Path | RemotePath, int | None]] = []
    entries: list[Path | RemotePath] = sorted(run.iterdir())  # a local directory's Paths, a URL's RemotePaths
    for entry in entries:
        if not entry.is_dir() or is_leftover(entry.name):
            continue
        trainer = _TRAINER_FOLDER.match(entry.name)
        if trainer:
            found += [(f"{entry.name}/{inner.name}", inner, int(trainer.group(1))) for inner in _inner_tags(entry)]
        elif is_tag_dir(entry):
            step = _STEP.search(entry.name)
            found.append((entry.name, entry, int(step.group(1)) if step else None))
    return found


def _inner_tags(folder: Path | RemotePath) -> list[Path | RemotePath]:
    entries: list[Path | RemotePath] = sorted(folder.iterdir())
    return [p for p in entries if p.is_dir() and not is_leftover(p.name) and is_tag_dir(p)]


def _size_and_time(tag_dir: Path | RemotePath) -> tuple[int, float | None]:
    size, newest = 0, None
    for root, _, files in walk(tag_dir):
        for name in files:
            if is_leftover(name):
                continue
            path = root / name
            if isinstance(path, Path):  # a URL's listing has sizes, not always times
                stat = path.stat()
                size, newest = size + stat.st_size, max(newest or 0.0, stat.st_mtime)
            else:
                size += path.stat().st_size
    return size, newest


def read_latest(run: Path | RemotePath) -> str | None:
    """The tag the run's ``latest`` names (stripped, as DeepSpeed reads it), or None without one."""
    latest = run / "latest"
    if not latest.is_file() or latest.stat().st_size > MAX_TAG_BYTES:
        return None
    try:
        return latest.read_text("utf-8").strip()
    except UnicodeDecodeError:
        return None


def list_run(run_dir: str) -> RunScan:
    """Every tag of ``run_dir``, oldest first (by step, then save time, then name), none checked yet. Raises
    ``CkptspecError`` (CK901) when the run directory itself cannot be read."""
    run = location(run_dir)
    if not run.is_dir():
        raise InputOutputError("CK901", "run directory not found", "pass the directory the run saves into", run_dir)
    scans = []
    for name, tag_dir, step in find_tags(run):
        scan = TagScan(name, step, None, 0, None, directory=tag_dir)
        try:
            scan.size, scan.saved = _size_and_time(tag_dir)
            scan.kind = kind_of_dir(tag_dir).value
        except CkptspecError as exc:  # CK202, or CK901: this tag cannot be read
            scan.error, scan.checked = exc, True
        except OSError as exc:  # listing it, or telling its kind
            scan.error, scan.checked = FileUnreadable(exc.filename or tag_dir, exc), True
        scans.append(scan)
    scans.sort(key=lambda s: (s.step is not None, s.step or 0, s.saved or 0.0, s.name))
    return RunScan(str(run_dir), scans, read_latest(run), is_a_tag=not scans and is_tag_dir(run))


def check_tag(scan: TagScan, verify_hashes: bool = False) -> TagScan:
    """``scan`` given its verdict (``tag_verdict``). Once: a tag already checked is returned as it is."""
    if scan.checked:
        return scan
    assert scan.directory is not None
    scan.findings, scan.error = tag_verdict(scan.directory, verify_hashes)
    scan.valid = scan.error is None and not scan.findings
    scan.checked = True
    return scan


def tag_verdict(tag_dir: Path | RemotePath, verify_hashes: bool = False) -> tuple[list[Finding], CkptspecError | None]:
    """The errors of ``validate_checkpoint`` on the tag directory (warnings are not a verdict), or the error that kept
    it from being checked (CK201/CK202/CK203, or CK901: it cannot be read) and no findings."""
    from . import validate_checkpoint

    try:
        findings = validate_checkpoint(str(tag_dir.parent), tag=tag_dir.name, verify_hashes=verify_hashes)
    except CkptspecError as exc:
        return [], exc
    except OSError as exc:
        return [], FileUnreadable(exc.filename or tag_dir, exc)
    return [f for f in findings if f.severity == "error"], None


def scan_run(run_dir: str, verify_hashes: bool = False, progress: Callable[[int, int], None] | None = None) -> RunScan:
    """Every tag of ``run_dir`` (``list_run``), each checked (``progress(done, total)`` after each)."""
    scan = list_run(run_dir)
    for done, tag in enumerate(scan.tags, 1):
        check_tag(tag, verify_hashes)
        if progress is not None:
            progress(done, len(scan.tags))
    return scan
