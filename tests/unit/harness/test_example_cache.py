"""The example entries (``tasks.cached``: a shell script that starts its own Python processes, such
as examples/hf_gpt2/run.sh) are keyed, as the jobs, on the ckptspec modules those processes
imported (record_site/sitecustomize.py records them): an edit to a module they never imported
keeps the entry, an edit to one they imported rebuilds it.

A fake example in a fake checkout (its own ``ckptspec`` package), as test_job_cache.py: no
DeepSpeed, no torch."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from _harness import cache, guard, tasks

EXAMPLE = """
set -e
python -c "import ckptspec.used"
python -c "import os; import ckptspec.child_only" &
wait
echo done > "$1/out.txt"
"""


@pytest.fixture
def checkout(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    package = repo / "ckptspec"
    package.mkdir(parents=True)
    (repo / "schema").mkdir()
    for name in ("__init__", "used", "unused", "child_only"):
        (package / f"{name}.py").write_text(f"NAME = {name!r}\n")
    (repo / "example.sh").write_text(EXAMPLE)
    monkeypatch.setattr(cache, "REPO_ROOT", repo)
    monkeypatch.setattr(cache, "CKPTSPEC_SOURCES", (package, repo / "schema"))
    monkeypatch.setattr(cache, "_FOUND", {})
    (repo / "job").mkdir()
    monkeypatch.setattr(cache, "JOB_SOURCES", (repo / "job",))
    monkeypatch.setattr(cache, "versions", lambda: {"deepspeed": "x", "torch": "y"})
    monkeypatch.setenv("CKPTSPEC_DS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(guard, "armed", False)  # a fake entry: what is tested here is its key, not the marker
    _forget()
    yield repo
    _forget()  # the digests of this fake checkout's files are no other test's


def _forget():
    cache.imports_digest.cache_clear()
    cache.tree_digest.cache_clear()
    cache._FOUND.clear()


def entry(repo, runs: list):
    def build(directory, env):
        runs.append(directory)
        env = {**env, "PYTHONPATH": os.pathsep.join([str(repo), env["PYTHONPATH"]])}
        directory.mkdir()
        subprocess.run(["bash", str(repo / "example.sh"), str(directory)], env=env, check=True, cwd=repo)

    return tasks.cached("example", {"what": "fake"}, build)


def test_every_process_of_the_example_is_recorded(checkout):
    built = entry(checkout, runs := [])
    assert (built / "out.txt").read_text() == "done\n" and len(runs) == 1
    assert json.loads((built / cache.MODULES).read_text()) == ["ckptspec", "ckptspec.child_only", "ckptspec.used"]


def test_an_edit_to_a_module_no_process_imported_keeps_the_entry(checkout):
    built = entry(checkout, runs := [])
    (checkout / "ckptspec" / "unused.py").write_text("NAME = 'edited'\n")
    _forget()
    assert entry(checkout, runs) == built and len(runs) == 1


@pytest.mark.parametrize("edited", ["ckptspec/used.py", "ckptspec/child_only.py"])
def test_an_edit_to_a_module_a_process_imported_rebuilds_it(checkout, edited):
    built = entry(checkout, runs := [])
    (checkout / edited).write_text("NAME = 'edited'\n")
    _forget()
    assert entry(checkout, runs) != built and len(runs) == 2
