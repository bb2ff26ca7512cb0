import os
import sys
from pathlib import Path

import pytest

# Make `ckptspec` importable when pytest runs from a checkout without `pip install -e .`.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@pytest.fixture(scope="session")
def ds_root(tmp_path_factory):
    """Cache dir for real DeepSpeed checkpoints (see tests/dsharness/build.py).

    Set CKPTSPEC_DS_CACHE to keep the cache across pytest runs. Under pytest-xdist the
    workers share one dir; build_checkpoint locks per entry, so each spec is built once.
    """
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # skip DeepSpeed's accelerator probing
    import deepspeed  # noqa: F401  (a missing DeepSpeed is a broken environment, not a skip)
    if os.environ.get("CKPTSPEC_DS_CACHE"):
        return Path(os.environ["CKPTSPEC_DS_CACHE"])
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    return base / "ds-cache"
