"""An older DeepSpeed for the compatibility tier (``./scripts/compat.sh``; pytest marker ``compat``).

The default run reads the checkpoints this DeepSpeed wrote from ``tests/data/deepspeed-<version>/``
(committed, with the live engine's masters recorded in the job); the compat tier builds them
again in a virtualenv of their own, ``.venv-ds<major><minor>`` beside ``.venv``, and compares.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

from .cache import REPO_ROOT
from .launch import HarnessError

OLD_DEEPSPEED_VERSION = "0.15.4"  # before param_alignment_paddings; a pickled set in the model states
TORCH_VERSION = "2.13.0"  # the CPU wheel on this machine's disk (README)
OLD_VENV = REPO_ROOT / ".venv-ds015"
FIXTURES = REPO_ROOT / "tests" / "data" / f"deepspeed-{OLD_DEEPSPEED_VERSION}"


def old_python() -> str:
    """The interpreter of the old-DeepSpeed virtualenv, made on first use (about a minute)."""
    python = OLD_VENV / "bin" / "python"
    OLD_VENV.parent.mkdir(parents=True, exist_ok=True)
    with open(REPO_ROOT / ".venv-ds015.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        stamp = OLD_VENV / ".ready"
        if stamp.exists():
            return str(python)
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(OLD_VENV)], check=True)
        # DeepSpeed 0.15 is an sdist whose setup imports torch: build it against the torch of this
        # venv (no build isolation), and without DS_ACCELERATOR, which makes setup import torch's
        # CPU accelerator before it is needed.
        env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
        steps = [
            ["-m", "pip", "install", "-q", "--upgrade", "pip", "setuptools", "wheel"],
            ["-m", "pip", "install", "-q", f"torch=={TORCH_VERSION}"],
            ["-m", "pip", "install", "-q", "--no-build-isolation", f"deepspeed=={OLD_DEEPSPEED_VERSION}"],
            ["-m", "pip", "install", "-q", "-e", str(REPO_ROOT)],  # ckptspec, for the hooks run in the job
        ]
        for step in steps:
            done = subprocess.run([str(python), *step], capture_output=True, text=True, env=env)
            if done.returncode != 0:
                raise HarnessError(f"old-DeepSpeed venv: `pip {' '.join(step[2:])}` failed:\n{done.stderr[-5000:]}")
        stamp.touch()
    return str(python)


def commit_entry(name: str, target: Path) -> None:
    """Copy the checkpoint of harness entry ``name`` (built if needed) to ``target``: the tag
    directory, ``latest`` and what the job recorded (live masters and optimizer state, harness.json)."""
    import shutil

    from . import tasks

    built = tasks.path(name)
    tag = (built / "latest").read_text().strip()
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    for keep in ("latest", "live_fp32.pt", "live_optim.pt", "harness.json"):
        shutil.copy2(built / keep, target / keep)
    shutil.copytree(built / tag, target / tag)
    print(f"{target}: {sum(p.stat().st_size for p in target.rglob('*') if p.is_file())} bytes")


def refresh_fixtures() -> None:
    """Rewrite every committed checkpoint from the harness: the old-DeepSpeed ones (their own
    virtualenv) and the current-DeepSpeed ones the synthetic fault route mutates."""
    from .scenarios import COMMITTED, OLD_DEEPSPEED

    for name in OLD_DEEPSPEED:
        commit_entry(name, FIXTURES / name)
    for name, target in COMMITTED.items():
        commit_entry(name, target)


if __name__ == "__main__":  # python -m _harness.compat --refresh (run by scripts/compat.sh)
    if sys.argv[1:] != ["--refresh"]:
        sys.exit("usage: python -m _harness.compat --refresh")
    refresh_fixtures()
