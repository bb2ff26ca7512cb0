import sys
from pathlib import Path

import pytest

# Make `ckptspec` importable when pytest runs from a checkout without `pip install -e .`.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@pytest.fixture(scope="session")
def ds():
    """Real DeepSpeed job results by name: ``ds.path("s2-bf16-ws2")`` (tests/_harness/tasks.py).

    Entries are cached in ``.cache/ds`` (or ``$CKPTSPEC_DS_CACHE``) and keyed on everything that
    runs inside the job; the first request builds every missing registered entry in batches.
    """
    from _harness import oracles, tasks

    oracles.check_deepspeed_version()  # a missing or other DeepSpeed is a broken environment, not a skip
    return tasks
