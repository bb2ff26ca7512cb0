"""The guard (tests/_harness/guard.py): a test that reaches a DeepSpeed job's result, or DeepSpeed's
zero_to_fp32, without the ``deepspeed`` marker fails, naming itself, what it reached and the fixture
to take; through a fixture it passes.

One pytest run in a subprocess on a tiny test folder that loads the real plugin. Its ``ds`` fixture
is the real tasks module with the one entry point stubbed (``tasks.entry`` gives a complete
directory): no job, no DeepSpeed, no torch."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from _harness import plugin

TESTS = Path(plugin.__file__).resolve().parents[1]

CONFTEST = """
import sys
sys.path.insert(0, {tests!r})
import pytest
from _harness import tasks

pytest_plugins = ["_harness.plugin"]
DONE = {done!r}


@pytest.fixture(scope="session")
def ds():  # the plugin's ds, its DeepSpeed version check aside; the entry of any name is DONE
    tasks.entry = lambda name, task=None: __import__("pathlib").Path(DONE)
    return tasks
"""

TESTS_FILE = """
import pytest
from _harness import tasks
from _harness.oracles import zero_to_fp32


def test_unmarked_reaches_a_job():
    tasks.path("s2-bf16-ws2")


def test_unmarked_reads_a_job_result():
    tasks.read_json("s1-bf16-ws2", "task.json")


def test_unmarked_catches_the_refusal():
    try:
        tasks.path("s3-bf16-ws2")
    except Exception:
        pass


def test_unmarked_runs_zero_to_fp32(tmp_path):
    zero_to_fp32(tmp_path)


def test_unmarked_launches_ranks():
    from _harness.launch import run_launches

    run_launches([])


@pytest.fixture(scope="module")
def module_entry(ds):
    return ds.path("s2-bf16-ws2")


def test_marked_by_ds(ds):
    assert ds.path("s2-bf16-ws2").name == "done"


def test_marked_through_a_module_fixture(module_entry):
    assert module_entry.name == "done"


def test_no_job_needs_no_mark(tmp_path):
    assert tmp_path.is_dir()
"""

COLLECTION_FILE = """
from _harness import tasks

NAMES = [tasks.path("s2-bf16-ws2").name]  # a result at collection, not a scenario name


def test_never_collected():
    pass
"""


@pytest.fixture(scope="module")
def outcome(tmp_path_factory) -> tuple[dict[str, str], str]:
    root = tmp_path_factory.mktemp("guarded")
    done = root / "cache" / "done"
    done.mkdir(parents=True)
    (done / "task.json").write_text("{}")
    (root / "conftest.py").write_text(CONFTEST.format(tests=str(TESTS), done=str(done)))
    (root / "test_tiny.py").write_text(textwrap.dedent(TESTS_FILE))
    (root / "test_collection.py").write_text(textwrap.dedent(COLLECTION_FILE))
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", "-rA", "-q"]
    command += ["--continue-on-collection-errors", "-o", "addopts=", "--rootdir", str(root), str(root)]
    done_run = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=120)
    out = done_run.stdout + done_run.stderr
    results = {name: status for status, name in re.findall(r"^(PASSED|FAILED|ERROR) \S+::(\w+)", out, re.M)}
    return results, out


def test_a_job_result_reached_without_the_marker_fails(outcome):
    results, out = outcome
    unmarked = ("test_unmarked_reaches_a_job", "test_unmarked_reads_a_job_result", "test_unmarked_catches_the_refusal")
    for name in unmarked:
        assert results.get(name) == "FAILED", out
    assert "test_tiny.py::test_unmarked_reaches_a_job reached the DeepSpeed job result 's2-bf16-ws2'" in out
    assert "test_tiny.py::test_unmarked_reads_a_job_result reached the DeepSpeed job result 's1-bf16-ws2'" in out
    assert "without the `deepspeed` marker: take it through a fixture, `ds_checkpoint`" in out


def test_deepspeed_run_in_the_test_process_without_the_marker_fails(outcome):
    results, out = outcome
    assert results.get("test_unmarked_runs_zero_to_fp32") == "FAILED", out
    assert "test_unmarked_runs_zero_to_fp32 reached DeepSpeed's zero_to_fp32 on " in out
    assert results.get("test_unmarked_launches_ranks") == "FAILED", out
    assert "test_unmarked_launches_ranks reached a launch of DeepSpeed ranks" in out
    assert "ModuleNotFoundError" not in out  # refused before DeepSpeed is imported


def test_a_result_reached_at_collection_fails(outcome):
    _, out = outcome
    assert "ERROR" in out and "test_collection.py" in out, out
    assert "the DeepSpeed job result 's2-bf16-ws2' reached while no test runs (at collection?)" in out


def test_tests_that_take_the_fixture_pass(outcome):
    results, out = outcome
    for name in ("test_marked_by_ds", "test_marked_through_a_module_fixture", "test_no_job_needs_no_mark"):
        assert results.get(name) == "PASSED", out
