"""A training run's save directory: every tag, its verdict, and the newest tag a resume can trust (``ckptspec scan``).

The tags and their verdicts are ``deepspeed/check/run.py``'s (``scan_run``: the order the validated resume
``ckptspec.deepspeed.load_checkpoint`` falls back in, too); here, what a scan does with them:
``fix_latest`` points the run's ``latest`` at the newest valid tag, ``resume_problem`` says why a resume of the
run would not load it.
"""

from __future__ import annotations

import time
from pathlib import Path

from .._fs import io_point, write_atomic
from ..deepspeed.check.run import RunScan, scan_run
from ..deepspeed.layout.tag_dir import is_tag_name

__all__ = ["LOG_NAME", "RunScan", "fix_latest", "resume_problem", "scan_run"]

LOG_NAME = "ckptspec-scan.log"  # beside `latest`: what --fix-latest replaced, kept with the run


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
