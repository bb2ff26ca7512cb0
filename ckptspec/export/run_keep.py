"""``scan --keep N``: remove a run's older tags once N newer valid tags exist, and only what ckptspec can attribute
to a tag.

A tag is removed when N valid tags of the run's own are newer than it, ``latest`` does not name it, and every file
in it is DeepSpeed's (states, layer and expert files; a universal folder's ``zero/*.pt``) or ckptspec's (the sidecar,
its temporaries); any other file or folder keeps the whole tag, and says why. Each tag goes in one step: renamed
to a hidden temporary of this run (``_fs.temp_dir``), then deleted; a kill leaves every tag complete or gone from
view, its hidden remains removed by the next write in the run (``_fs.sweep``).
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from .._fs import exclusive, fsync_dir, io_point, is_leftover, sweep, temp_dir
from ..checkpoint.sidecar import SIDECAR_NAMES
from ..deepspeed.layout.masters import EXPERT_FILE_RE, EXPP_RE
from ..deepspeed.layout.names import EXPERT_RE, MODEL_RE, OPTIM_RE, PIPE_LAYER_RE
from ..deepspeed.layout.tag_dir import UNIVERSAL_FOLDER
from .run_scan import LOG_NAME, RunScan

_STATES = (MODEL_RE, OPTIM_RE, PIPE_LAYER_RE, EXPERT_RE, EXPERT_FILE_RE, EXPP_RE)


@dataclass
class KeepPlan:
    remove: list[str] = field(default_factory=list)  # oldest first
    kept: dict[str, str] = field(default_factory=dict)  # an older tag that stays -> why


def _attributed(name: str) -> bool:
    return any(r.match(name) for r in _STATES) or name in SIDECAR_NAMES.values() or is_leftover(name)


def unattributed(tag_dir: Path, kind: str | None) -> list[str]:
    """What in a tag directory is neither DeepSpeed's nor ckptspec's (names relative to it)."""
    out = []
    for entry in sorted(tag_dir.iterdir()):
        if entry.is_symlink():
            out.append(entry.name)
        elif entry.is_dir() and kind == "universal" and entry.name == UNIVERSAL_FOLDER:
            for root, dirs, files in os.walk(entry):
                rel = Path(root).relative_to(tag_dir)
                out += [f"{rel / n}" for n in files if not n.endswith(".pt") or (Path(root) / n).is_symlink()]
                out += [f"{rel / d}/" for d in dirs if (Path(root) / d).is_symlink()]
        elif entry.is_dir():
            out.append(f"{entry.name}/")
        elif not _attributed(entry.name):
            out.append(entry.name)
    return out


def plan_keep(scan: RunScan, keep: int) -> KeepPlan:
    """Which of the run's own tags go: those with at least ``keep`` newer valid tags (``scan.tags`` is oldest first)."""
    plan = KeepPlan()
    own = [t for t in scan.tags if t.latest_can_name]
    for i, tag in enumerate(own):
        newer_valid = sum(t.valid for t in own[i + 1 :])
        if newer_valid < keep:
            continue
        if tag.name == scan.latest:
            plan.kept[tag.name] = "'latest' names it"
            continue
        try:
            foreign = unattributed(Path(scan.run_dir) / tag.name, tag.kind)
        except OSError as exc:
            plan.kept[tag.name] = f"cannot be listed: {exc.strerror or exc}"
            continue
        if foreign:
            plan.kept[tag.name] = f"holds what ckptspec cannot attribute to a tag: {', '.join(foreign[:5])}"
            continue
        plan.remove.append(tag.name)
    return plan


def remove_tags(run_dir: str, names: list[str], keep: int) -> list[str]:
    """Remove ``names`` (tags of ``run_dir``), oldest first, each renamed out of view in one step then deleted;
    each removal is appended to ``ckptspec-scan.log``. Returns the lines."""
    run = Path(run_dir)
    lines = []
    with exclusive(run):  # a second scan --keep (or a writer) in the run is refused, CK908
        sweep(run)  # the hidden remains of a killed earlier --keep
        for name in names:
            hidden = temp_dir(run / name)
            io_point("rename")
            os.replace(run / name, hidden)  # over the empty temporary: the tag is gone from view at once
            fsync_dir(run)
            shutil.rmtree(hidden)
            io_point("remove")
            line = f"removed {name!r} (--keep {keep}: at least {keep} newer valid tags)"
            with open(run / LOG_NAME, "a", encoding="utf-8") as log:
                log.write(f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} {line}\n")
            lines.append(line)
    return lines
