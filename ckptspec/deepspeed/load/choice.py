"""Which tag of a run the validated resume loads: the rule, on the process that validates (rank 0).

The candidates are the run's own tags (those ``latest`` can name: not a universal folder, not a tag inside a
Hugging Face Trainer ``checkpoint-N/`` folder), in ``ckptspec scan``'s order (``check/run.py``: by step, then save
time, then name). The first tried is the one asked for: ``tag``, or without it the newest tag of the run (what
``scan`` calls the newest valid one when it is valid; ``latest`` may lag behind it, when a save stopped after its
files and before ``latest``). With ``fallback``, the tags older than it follow, newest first; a tag newer than the
one asked for is never tried. Each is validated (``check_tag``) until one is valid; none is validated twice.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ...errors import CkptspecError, NoValidTag
from ...findings import CODES, Finding
from ..check.run import TagScan, check_tag, list_run


def choose(load_dir: str, tag: str | None, fallback: bool, verify_hashes: bool) -> dict[str, Any]:
    """The verdict: ``{"tag": the tag to load, "skipped": [each tag tried before it, newest first: "tag", "code",
    "message", "findings"]}``. Raises ``NoValidTag`` (CK260) with the findings of every tag tried when none is
    valid, and ``CkptspecError`` (CK901) when ``load_dir`` cannot be read."""
    run = list_run(load_dir)
    own = [t for t in run.tags if t.latest_can_name]
    if tag is None:
        tried = own[::-1]
    else:
        names = [t.name for t in own]
        if tag not in names:
            found = ", ".join(names) or "none"
            hint = f"pass one of the run's tags ({found}), or tag=None for the newest valid one"
            raise NoValidTag(f"{tag!r} is not a tag of the run {load_dir}", hint, str(load_dir), [])
        tried = own[: names.index(tag) + 1][::-1]
    if not fallback:
        tried = tried[:1]
    skipped: list[dict[str, Any]] = []
    for scan in tried:
        if check_tag(scan, verify_hashes).valid:
            return {"tag": scan.name, "skipped": skipped}
        skipped.append(_skipped(scan))
    raise _none_valid(load_dir, run.tags, skipped, fallback)


def _findings(scan: TagScan) -> list[Finding]:
    """The errors of a tag, each under its tag's name (``global_step2/<file>``); an error that kept it from being
    checked is one finding."""
    if scan.error is not None:
        error: CkptspecError = scan.error
        hint = error.hint or "ckptspec validate names what cannot be read"
        return [Finding(error.code, CODES.get(error.code, ""), "$", error.message, hint, file=scan.name)]
    return [dataclasses.replace(f, file=f"{scan.name}/{f.file}" if f.file else scan.name) for f in scan.findings]


def _skipped(scan: TagScan) -> dict[str, Any]:
    findings = _findings(scan)
    first = findings[0]
    return {"tag": scan.name, "code": first.code, "message": first.message, "findings": [f.to_dict() for f in findings]}


def _none_valid(load_dir: str, tags: list[TagScan], skipped: list[dict], fallback: bool) -> NoValidTag:
    findings = [Finding(**f) for s in skipped for f in s["findings"]]
    scan = f"`ckptspec scan {load_dir}` gives every tag's verdict"
    if not skipped:
        where = "no DeepSpeed tag found" if not tags else "no tag of the run's own (only universal or Trainer folders)"
        hint = "pass the directory the job saves into (its tags and 'latest'), or a Trainer's checkpoint-N folder"
        return NoValidTag(f"{where} in {load_dir}", hint, str(load_dir), findings)
    said = "; ".join(f"{s['tag']}: {s['code']} {s['message']}" for s in skipped)
    if not fallback:
        hint = f"fallback=True resumes from the newest valid older tag; {scan}"
        return NoValidTag(f"the tag to resume from is not valid ({said})", hint, str(load_dir), findings)
    return NoValidTag(f"no valid tag to resume from ({said})", scan, str(load_dir), findings)
