"""Run a job script as ``__main__`` and record which ckptspec modules its process imports.

    record_imports.py RECORD_DIR SCRIPT ARGS...

Each process appends the module names, one a line, to ``RECORD_DIR/ckptspec-imports.<pid>``:
first what it holds already (a rank forked from ranks.py's preloader), then every module as it is
loaded (a finder first on ``sys.meta_path``: a script that leaves by ``os._exit`` is recorded as well). The cache keys
an entry that runs ckptspec on the files of the modules recorded (cache.py), so an edit to a
module no job imports rebuilds nothing.

It lives outside ``job/`` on purpose: it changes nothing a job computes, so it is no part of the
job code every entry's key hashes.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

PACKAGE = "ckptspec"
PREFIX = "ckptspec-imports."


def _is_ckptspec(name: str) -> bool:
    return name == PACKAGE or name.startswith(PACKAGE + ".")


def start(record_dir: Path) -> None:
    """Record this process's ckptspec modules, those imported already and every later import."""
    fd = os.open(record_dir / f"{PREFIX}{os.getpid()}", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def note(name: str) -> None:
        os.write(fd, f"{name}\n".encode())  # unbuffered: nothing is lost to an os._exit

    for name in [n for n in sys.modules if _is_ckptspec(n)]:
        note(name)

    class Recorder:
        """First on ``sys.meta_path``: told of every module about to be loaded, whichever way (the "import"
        audit event misses ``importlib.import_module``, which ckptspec's lazy names use); finds nothing."""

        @staticmethod
        def find_spec(name, path=None, target=None):
            if _is_ckptspec(name):
                note(name)
            return None

    sys.meta_path.insert(0, Recorder)


def read(record_dir: Path) -> set[str]:
    """Every module name recorded under ``record_dir``, by any process."""
    return {line for path in record_dir.glob(PREFIX + "*") for line in path.read_text().split()}


if __name__ == "__main__":
    record_dir, script, *args = sys.argv[1:]
    start(Path(record_dir))
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python SCRIPT` has it
    runpy.run_path(script, run_name="__main__")
