"""DeepSpeed's own answers, computed in the test process: the ground truth ckptspec is compared with."""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path

from . import guard

DEEPSPEED_VERSION = "0.19.8"  # the tests are pinned to it (pyproject.toml extra "deepspeed")


def check_deepspeed_version() -> None:
    """From the installed metadata: importing DeepSpeed costs each worker about 2 s, and most never need it."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("deepspeed")
    except PackageNotFoundError:
        found = "none"
    if found != DEEPSPEED_VERSION:
        raise RuntimeError(f"the tests are pinned to deepspeed {DEEPSPEED_VERSION}, found {found}")


def zero_to_fp32(save_dir: str | Path) -> dict:
    """DeepSpeed's own zero_to_fp32 reconstruction, in-process (its progress output discarded)."""
    guard.reached(f"DeepSpeed's zero_to_fp32 on {save_dir}")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    check_deepspeed_version()
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return get_fp32_state_dict_from_zero_checkpoint(str(save_dir))
