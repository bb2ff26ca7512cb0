"""What a reader sees of a directory a writer was stopped in, and which steps to stop it at: pure
functions of files and numbers (crash.py runs the writers)."""

from __future__ import annotations

import os
from pathlib import Path


def points(total: int, sample: int = 8) -> list[int]:
    """Which steps to stop at: all with CKPTSPEC_CRASH_ALL=1, else ``sample`` spread over all of
    them, the first and the last included (the commit sits at the end)."""
    if os.environ.get("CKPTSPEC_CRASH_ALL") or total <= sample:
        return list(range(1, total + 1))
    spread = {1 + round(i * (total - 1) / (sample - 1)) for i in range(sample)}
    return sorted(spread | {total - 1, total})


def visible(directory: Path) -> dict[str, bytes]:
    """The files a reader sees in ``directory``: every file but hidden ones (temporaries, journals)."""
    if not directory.exists():
        return {}
    return {
        p.relative_to(directory).as_posix(): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(directory).parts)
    }


def hidden(directory: Path) -> list[str]:
    """Hidden files and directories below ``directory``: what a run may leave behind."""
    if not directory.exists():
        return []
    return sorted(p.relative_to(directory).as_posix() for p in directory.rglob(".*"))
