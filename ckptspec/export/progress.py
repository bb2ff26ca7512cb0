"""A progress bar on stderr (bytes for ``ckptspec reconstruct``, tags for ``scan``): tqdm when installed, else a
percentage line."""

from __future__ import annotations

import sys
from collections.abc import Callable


def progress_printer(
    total: int, enabled: bool, desc: str = "reconstruct", unit: str = "B"
) -> tuple[Callable[[int], None], Callable[[], None]]:
    """(update, close) for a progress bar on stderr counting ``unit`` (bytes: "B"); no-ops unless ``enabled``."""
    if not enabled:
        return (lambda n: None), (lambda: None)
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    if tqdm is not None:
        scaled = unit == "B"
        bar = tqdm(
            total=total, unit=unit, unit_scale=scaled, unit_divisor=1024, desc=desc, file=sys.stderr, leave=False
        )
        return bar.update, bar.close
    state = {"done": 0, "shown": -1}

    def update(n: int) -> None:
        state["done"] += n
        percent = int(100 * state["done"] / total) if total else 100
        if percent != state["shown"]:
            state["shown"] = percent
            done = (
                f"{state['done'] / 2**20:.0f}/{total / 2**20:.0f} MiB"
                if unit == "B"
                else f"{state['done']}/{total} {unit}s"
            )
            sys.stderr.write(f"\r{desc} {percent:3d}% ({done})")
            sys.stderr.flush()

    def close() -> None:
        sys.stderr.write("\r\033[K")
        sys.stderr.flush()

    return update, close
