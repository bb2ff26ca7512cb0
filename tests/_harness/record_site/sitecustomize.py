"""Test-only: record the ckptspec modules every Python process of an example imports, then do what
the harness's own ``site/sitecustomize.py`` does.

``tasks.cached`` puts this folder first on PYTHONPATH, and ``$CKPTSPEC_RECORD_IMPORTS`` names the
folder the records go to (record_imports.py), for a run whose processes are not started by the
harness (a shell script, torchrun, the ``ckptspec`` command). Python imports one ``sitecustomize``,
the first found: this one runs the other.
"""

import importlib.util
import os
import runpy
from pathlib import Path

_HARNESS = Path(__file__).resolve().parents[1]
_RECORD = os.environ.get("CKPTSPEC_RECORD_IMPORTS")

if _RECORD:
    _spec = importlib.util.spec_from_file_location("_ckptspec_record_imports", _HARNESS / "record_imports.py")
    _recorder = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_recorder)
    _recorder.start(Path(_RECORD))

runpy.run_path(str(_HARNESS / "site" / "sitecustomize.py"), run_name="sitecustomize")
