"""A training run's save directory: every tag, its verdict, and the newest tag a resume can trust (``ckptspec scan``).

A tag is a directory of the run holding DeepSpeed's states (model, optimizer, layer or expert files) or
a universal folder (``zero/``); a Hugging Face Trainer ``checkpoint-N/`` folder holds one such tag and
its own ``latest``. Each tag is checked by ``validate_checkpoint`` (the checks of ``validate DIR``, one
validator for both commands); ``fix_latest`` points the run's ``latest`` at the newest valid tag.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .._fs import io_point, is_leftover, write_atomic
from ..deepspeed.kinds import kind_of_dir
from ..deepspeed.layout.names import EXPERT_RE, MODEL_RE, OPTIM_RE, PIPE_LAYER_RE
from ..deepspeed.layout.tag_dir import MAX_TAG_BYTES, UNIVERSAL_FOLDER, is_tag_name
from ..errors import CkptspecError, FileUnreadable, InputOutputError
from ..findings import Finding
from ..location import RemotePath, location, walk

LOG_NAME = "ckptspec-scan.log"  # beside `latest`: what --fix-latest replaced, kept with the run
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


def scan_run(run_dir: str, verify_hashes: bool = False, progress: Callable[[int, int], None] | None = None) -> RunScan:
    """Every tag of ``run_dir``, oldest first (by step, then save time, then name), each validated
    (``progress(done, total)`` after each). Raises ``CkptspecError`` (CK901) when the run directory
    itself cannot be read."""
    from .api import validate_checkpoint

    run = location(run_dir)
    if not run.is_dir():
        raise InputOutputError("CK901", "run directory not found", "pass the directory the run saves into", run_dir)
    scans, found = [], find_tags(run)
    for name, tag_dir, step in found:
        scan = TagScan(name, step, None, 0, None)
        try:
            scan.size, scan.saved = _size_and_time(tag_dir)
            scan.kind = kind_of_dir(tag_dir).value
            findings = validate_checkpoint(str(tag_dir.parent), tag=tag_dir.name, verify_hashes=verify_hashes)
            scan.findings = [f for f in findings if f.severity == "error"]
            scan.valid = not scan.findings
        except CkptspecError as exc:  # CK201/CK202/CK203, or CK901: this tag cannot be read
            scan.error = exc
        except OSError as exc:  # listing it, or telling its kind
            scan.error = FileUnreadable(exc.filename or tag_dir, exc)
        scans.append(scan)
        if progress is not None:
            progress(len(scans), len(found))
    scans.sort(key=lambda s: (s.step is not None, s.step or 0, s.saved or 0.0, s.name))
    return RunScan(str(run_dir), scans, read_latest(run), is_a_tag=not scans and is_tag_dir(run))


def fix_latest(scan: RunScan) -> str | None:
    """Point the run's ``latest`` at the newest valid tag (written atomically: ``_fs.write_atomic``), then
    append the line saying what it replaced to ``ckptspec-scan.log`` in the run: the log is kept with the run,
    where a scheduler's output is not. The line, or None when ``latest`` already names that tag. The caller
    has made sure there is one (``newest_resumable``); a kill leaves ``latest`` old or new, never a part."""
    target = scan.newest_resumable
    assert target is not None and is_tag_name(target.name)
    if scan.latest == target.name:
        return None
    run = Path(scan.run_dir)
    write_atomic(run / "latest", target.name.encode("utf-8"))  # as DeepSpeed writes it: the name, no newline
    was = repr(scan.latest) if scan.latest is not None else "no 'latest'"
    newer = [
        t.name for t in scan.tags if not t.valid and t.latest_can_name and scan.tags.index(t) > scan.tags.index(target)
    ]
    line = f"latest: {was} -> {target.name!r} (the newest valid tag; newer and invalid: {', '.join(newer) or 'none'})"
    with open(run / LOG_NAME, "a", encoding="utf-8") as log:
        io_point("append")  # a kill here leaves `latest` new and the line unwritten
        log.write(f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} {line}\n")
    scan.latest = target.name
    return line


def resume_problem(scan: RunScan) -> tuple[str, str, str] | None:
    """(code, message, hint) when a resume of the run would not load its newest valid tag, else None.
    DeepSpeed resumes from the tag ``latest`` names; the Trainer from its highest ``checkpoint-N``."""
    if not any(t.valid for t in scan.tags):
        if not scan.tags:
            hint = "pass the directory the job saves into (its tags and 'latest')"
            return "CK260", "no DeepSpeed tag found", hint + (": this is a tag directory" if scan.is_a_tag else "")
        found = f"none of its {len(scan.tags)} tags is valid"
        return "CK260", found, "a resume from this run would fail or start from scratch; see each tag's findings"
    if not any(t.latest_can_name for t in scan.tags):
        newest = scan.tags[-1]
        good = scan.newest_valid
        assert good is not None
        if newest.valid:
            return None
        return (
            "CK261",
            f"the newest Trainer folder {newest.name} is invalid, and the Trainer resumes from the highest one",
            f"resume_from_checkpoint={good.name.split('/')[0]}, the newest valid one",
        )
    target = scan.newest_resumable
    if target is None:
        return "CK260", "no tag of the run's own is valid", "resume from a valid Trainer folder instead"
    if scan.latest == target.name:
        return None
    named = {t.name: t for t in scan.tags}
    if scan.latest is None:
        what = "there is no readable 'latest': load_checkpoint without a tag loads nothing"
    elif scan.latest not in named:
        what = f"'latest' names {scan.latest!r}, which is not a tag of the run"
    elif not named[scan.latest].valid:
        what = f"'latest' names {scan.latest!r}, which is invalid"
    else:
        what = f"'latest' names {scan.latest!r}, older than the newest valid tag"
    hint = f"ckptspec scan --fix-latest {scan.run_dir} points it there"
    return "CK261", f"{what}; the newest valid tag is {target.name!r}", hint
