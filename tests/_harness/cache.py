"""Where real-DeepSpeed job results are kept, and what their keys hash.

An entry is ``ROOT/<name>-<key>/``; it appears only complete (built in a temporary directory of
ROOT, then renamed), so a killed run leaves at most a ``.tmp-*`` directory that the next prune
removes. The key hashes everything that runs inside the job and can change its output:

* the task (kind and arguments, normalized) and its world size;
* DeepSpeed's and torch's versions;
* every file of ``tests/_harness/job/`` and ``tests/_harness/site/`` (the job's code);
* for tasks that run ckptspec inside the job (hooks, ``save_with: ckptspec``, resumes), the
  files of the ckptspec modules the job imported (record_imports.py writes their names beside the
  result, ``ckptspec-modules.json``), every other file of ``ckptspec/`` (the packaged schemas) and
  ``schema/``. Such an entry is ``ROOT/<name>-<key>-<imports digest>/``: it is found by checking
  the digest of its recorded modules' files as they are now (``find_recorded``);
* the keys of the entries a task reads (a resume reads a saved checkpoint).

So an edit invalidates exactly the entries it can affect, and a warm run rebuilds nothing;
superseded entries are pruned after an hour.
ROOT is ``$CKPTSPEC_DS_CACHE`` or ``.cache/ds`` in the repository (ignored by git); entries
are content-keyed, so several checkouts may share one ROOT.
"""

from __future__ import annotations

import bisect
import fcntl
import hashlib
import itertools
import json
import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from functools import cache
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
HARNESS = Path(__file__).resolve().parent
JOB_SOURCES = (HARNESS / "job", HARNESS / "site")
CKPTSPEC_SOURCES = (REPO_ROOT / "ckptspec", REPO_ROOT / "schema")
DONE = "task.json"  # written last into an entry: its presence marks it complete
MODULES = "ckptspec-modules.json"  # the ckptspec modules a job imported (record_imports.py), in its entry


def root() -> Path:
    configured = os.environ.get("CKPTSPEC_DS_CACHE")
    path = Path(configured) if configured else REPO_ROOT / ".cache" / "ds"
    path.mkdir(parents=True, exist_ok=True)
    return path


@cache
def tree_digest(*folders: Path) -> str:
    """SHA-256 over the relative names and bytes of every file under ``folders`` (caches excluded)."""
    digest = hashlib.sha256()
    for folder in folders:
        for path in sorted(folder.rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts and not path.name.endswith(".pyc"):
                digest.update(str(path.relative_to(REPO_ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


@cache
def imports_digest(modules: tuple[str, ...]) -> str:
    """SHA-256 over the source files of ckptspec ``modules`` (dotted names) as they are now (a module
    since removed counts as missing), ckptspec's files that are no module and ``schema/``."""
    digest = hashlib.sha256()
    for name in sorted(set(modules)):
        base = REPO_ROOT.joinpath(*name.split("."))
        source = next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.is_file()), None)
        digest.update(name.encode() + b"\0" + (source.read_bytes() if source else b"<missing>") + b"\0")
    for path in sorted(CKPTSPEC_SOURCES[0].rglob("*")):
        if path.is_file() and path.suffix not in (".py", ".pyc") and "__pycache__" not in path.parts:
            digest.update(str(path.relative_to(REPO_ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update(tree_digest(*CKPTSPEC_SOURCES[1:]).encode())
    return digest.hexdigest()[:16]


def recorded_entry(name: str, task_key: str, modules: list[str]) -> Path:
    """Where the entry of a job that imported ckptspec ``modules`` goes."""
    return root() / f"{name}-{task_key}-{imports_digest(tuple(modules))}"


_FOUND: dict[tuple[str, str], Path] = {}  # entries found in this process (complete entries stay)
_LISTED: list[str] = []  # the cache directory's names, as last listed: looked up for every registered entry


def _names(fresh: bool) -> list[str]:
    if fresh or not _LISTED:
        _LISTED[:] = sorted(os.listdir(root()))
    return _LISTED


def find_recorded(name: str, task_key: str) -> Path | None:
    """The complete entry of ``name``/``task_key`` whose recorded ckptspec modules are unchanged, if any: from the
    listing this process last read, then, not found there, from a new one (an entry built since)."""
    if (name, task_key) in _FOUND:
        return _FOUND[name, task_key]
    prefix = f"{name}-{task_key}-"
    for fresh in (False, True):
        names = _names(fresh)
        for found in itertools.takewhile(lambda n: n.startswith(prefix), names[bisect.bisect_left(names, prefix) :]):
            path = root() / found
            if not is_done(path):
                continue
            try:
                modules = json.loads((path / MODULES).read_text())
            except (OSError, ValueError):
                continue
            if path == recorded_entry(name, task_key, modules):
                _FOUND[name, task_key] = path
                return path
    return None


@cache
def versions() -> dict:
    """DeepSpeed's and torch's versions, read from their metadata (importing them costs seconds)."""
    from importlib.metadata import version

    return {"deepspeed": version("deepspeed"), "torch": version("torch")}


def key(identity: dict) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def entry(name: str, task_key: str) -> Path:
    return root() / f"{name}-{task_key}"


def is_done(path: Path) -> bool:
    return (path / DONE).is_file()


@contextmanager
def locked(path: Path):
    """An exclusive lock on ``path`` (an entry, built or not), across processes and checkouts."""
    with open(path.parent / f".{path.name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def staging(path: Path) -> Path:
    """A fresh temporary directory beside ``path`` to build it in."""
    return Path(tempfile.mkdtemp(prefix=f".tmp-{path.name}-", dir=path.parent))


def publish(built: Path, path: Path, description: dict) -> None:
    """Mark ``built`` complete and move it to ``path`` in one rename."""
    (built / DONE).write_text(json.dumps(description, indent=1, sort_keys=True))
    try:
        os.rename(built, path)
    except OSError:
        if not is_done(path):  # else another checkout published the same content first: keep theirs
            raise


def prune(current: dict[str, Path]) -> None:
    """Remove superseded entries of the tasks in ``current`` (name -> current entry) and leftovers
    of killed builds, when nobody touched them for an hour (another checkout may still use them).
    The current entries are touched, so that another checkout's prune leaves them an hour more;
    ``$CKPTSPEC_DS_CACHE_KEEP`` (set by checkouts that share a cache while running changed job code)
    prunes nothing."""
    if os.environ.get("CKPTSPEC_DS_CACHE_KEEP"):
        return
    now, names, keep = time.time(), set(current), {p.name for p in current.values()}
    for path in root().iterdir():
        try:
            if path.name in keep:
                os.utime(path)
                continue
            if now - path.stat().st_mtime < 3600:
                continue
            if path.name.startswith(".tmp-"):
                shutil.rmtree(path, ignore_errors=True)
            elif path.is_dir() and json.loads((path / DONE).read_text()).get("name") in names:
                shutil.rmtree(path, ignore_errors=True)
        except (OSError, ValueError):
            continue
