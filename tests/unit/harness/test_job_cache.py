"""One rule of the job cache (tests/_harness/cache.py): an entry of a job that runs ckptspec is
keyed on the ckptspec modules the job imported (recorded by record_imports.py), so an edit to a
module it never imported keeps the entry and an edit to one it imported rebuilds it.

A tiny fake job in a fake checkout (its own ``ckptspec`` package): no DeepSpeed, no torch."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from _harness import cache, record_imports

JOB = """
import os, sys
import ckptspec.used
if os.fork() == 0:  # a rank's child process: its imports count too
    import ckptspec.child_only
    os._exit(0)
os.wait()
os._exit(0)  # as fsdp2_job.py leaves: nothing after this line runs
"""


@pytest.fixture
def checkout(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    package = repo / "ckptspec"
    (package / "schemas").mkdir(parents=True)
    (repo / "schema").mkdir()
    for name in ("__init__", "used", "unused", "child_only"):
        (package / f"{name}.py").write_text(f"NAME = {name!r}\n")
    (package / "schemas" / "manifest.json").write_text("{}")
    (repo / "schema" / "manifest.json").write_text("{}")
    (repo / "job.py").write_text(textwrap.dedent(JOB))
    monkeypatch.setattr(cache, "REPO_ROOT", repo)
    monkeypatch.setattr(cache, "CKPTSPEC_SOURCES", (package, repo / "schema"))
    monkeypatch.setattr(cache, "_FOUND", {})
    monkeypatch.setenv("CKPTSPEC_DS_CACHE", str(tmp_path / "cache"))
    return repo


def _digests_forgotten():
    cache.imports_digest.cache_clear()
    cache.tree_digest.cache_clear()
    cache._FOUND.clear()


def build(repo, name="job", key="k" * 16):
    """Run the fake job under the recorder and publish its entry as tasks.py does."""
    stage = cache.staging(cache.entry(name, key))
    (stage / "imports").mkdir()
    (stage / "out").mkdir()
    command = [sys.executable, str(record_imports.__file__), str(stage / "imports"), str(repo / "job.py")]
    subprocess.run(command, check=True, cwd=repo, env={"PYTHONPATH": str(repo)})
    modules = sorted(record_imports.read(stage / "imports"))
    (stage / "out" / cache.MODULES).write_text(json.dumps(modules))
    cache.publish(stage / "out", cache.recorded_entry(name, key, modules), {"name": name})
    return modules


def test_the_job_records_what_it_and_its_children_import(checkout):
    assert build(checkout) == ["ckptspec", "ckptspec.child_only", "ckptspec.used"]


def test_an_edit_to_a_module_the_job_never_imported_keeps_its_entry(checkout):
    build(checkout)
    built = cache.find_recorded("job", "k" * 16)
    assert built is not None
    (checkout / "ckptspec" / "unused.py").write_text("NAME = 'edited'\n")
    (checkout / "ckptspec" / "new_module.py").write_text("")
    _digests_forgotten()
    assert cache.find_recorded("job", "k" * 16) == built


@pytest.mark.parametrize("edited", ["ckptspec/used.py", "ckptspec/child_only.py", "ckptspec/__init__.py"])
def test_an_edit_to_a_module_the_job_imported_rebuilds_it(checkout, edited):
    build(checkout)
    (checkout / edited).write_text("NAME = 'edited'\n")
    _digests_forgotten()
    assert cache.find_recorded("job", "k" * 16) is None
    build(checkout)  # built again, beside the old entry
    assert cache.find_recorded("job", "k" * 16) is not None


@pytest.mark.parametrize("edited", ["ckptspec/schemas/manifest.json", "schema/manifest.json"])
def test_an_edit_to_a_schema_rebuilds_it(checkout, edited):
    build(checkout)
    (checkout / edited).write_text('{"changed": true}')
    _digests_forgotten()
    assert cache.find_recorded("job", "k" * 16) is None


def test_a_removed_module_the_job_imported_rebuilds_it(checkout):
    build(checkout)
    (checkout / "ckptspec" / "used.py").unlink()
    _digests_forgotten()
    assert cache.find_recorded("job", "k" * 16) is None
