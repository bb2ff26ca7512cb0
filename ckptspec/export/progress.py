"""A byte progress bar on stderr for ``ckptspec reconstruct``: tqdm when installed, else a percentage line."""

from __future__ import annotations

import sys
from collections.abc import Callable


def progress_printer(total: int, enabled: bool) -> tuple[Callable[[int], None], Callable[[], None]]:
    """(update, close) for a byte progress bar on stderr; no-ops unless ``enabled``."""
    if not enabled:
        return (lambda n: None), (lambda: None)
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    if tqdm is not None:
        bar = tqdm(
            total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="reconstruct", file=sys.stderr, leave=False
        )
        return bar.update, bar.close
    state = {"done": 0, "shown": -1}

    def update(n: int) -> None:
        state["done"] += n
        percent = int(100 * state["done"] / total) if total else 100
        if percent != state["shown"]:
            state["shown"] = percent
            sys.stderr.write(f"\rreconstruct {percent:3d}% ({state['done'] / 2**20:.0f}/{total / 2**20:.0f} MiB)")
            sys.stderr.flush()

    def close() -> None:
        sys.stderr.write("\r\033[K")
        sys.stderr.flush()

    return update, close
