"""Build the missing real-DeepSpeed job results before any test asks for one.

    python tests/_harness/prebuild.py

``scripts/test.sh`` starts this in the background once ``.venv`` is ready, so that a cold cache
(every registered entry: about 3.5 minutes of launches, two at a time) builds while the unit tier's
environment, mypy and the unit tier run, instead of after them. It holds the lock ``tasks.path``
takes for the whole batch: a test that asks for an entry meanwhile waits for the build, then finds
its entry. An entry that failed here is built again, alone, by the test that asks for it, whose
error it then is (the log says which failed). A warm cache: nothing to build, about a second.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script: tests/, not this folder, is where the harness is imported from.
sys.path[0] = str(Path(__file__).resolve().parents[1])

from _harness import cache, tasks  # noqa: E402


def main() -> int:
    with cache.locked(cache.root() / "batch"):
        failed = tasks.build_missing()
    for name, error in sorted(failed.items()):
        first, _, rest = error.partition("\n")  # the launch's task names, then its log: the end says why
        print(f"[harness] {name} failed (a test asking for it builds it again): {first}", file=sys.stderr)
        print(rest[-4000:], file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
