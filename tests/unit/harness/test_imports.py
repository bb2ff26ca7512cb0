"""Test files reach the harness's processes, servers and jobs through fixtures (which mark them),
and import only its data and pure functions: the modules of ``plugin.IMPORTABLE``."""

from __future__ import annotations

import ast
from pathlib import Path

from _harness import plugin

TESTS = Path(plugin.__file__).resolve().parents[1]
HARNESS = TESTS / "_harness"
# The harness's own tests: they test the machinery itself.
EXEMPT = (TESTS / "test_harness.py", TESTS / "unit" / "harness")


def harness_imports(source: str) -> set[str]:
    """The ``_harness`` modules ``source`` imports (``from _harness import x`` counts as module x
    when x is a module of the harness, else as the package itself)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name.removeprefix("_harness.") for a in node.names if a.name.startswith("_harness.")}
            found |= {"_harness" for a in node.names if a.name == "_harness"}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "_harness":
                for alias in node.names:
                    module = HARNESS / alias.name
                    found.add(alias.name if module.with_suffix(".py").is_file() or module.is_dir() else "_harness")
            elif node.module.startswith("_harness."):
                found.add(node.module.removeprefix("_harness."))
    return found


def test_the_importable_modules_exist():
    for name in plugin.IMPORTABLE:
        assert (HARNESS / name.replace(".", "/")).with_suffix(".py").is_file(), name


def test_test_files_import_only_data_and_pure_functions_of_the_harness():
    offenders = {}
    for path in sorted(TESTS.rglob("*.py")):
        if HARNESS in path.parents or any(path == e or e in path.parents for e in EXEMPT):
            continue
        if outside := sorted(harness_imports(path.read_text("utf-8")) - set(plugin.IMPORTABLE)):
            offenders[str(path.relative_to(TESTS))] = outside
    assert not offenders, (
        f"test files import harness machinery: {offenders}; take its fixture instead (tests/README.md, "
        "Fixtures and markers), or, for data or a pure function, add its module to plugin.IMPORTABLE"
    )


def test_the_rule_sees_every_form_of_import():
    source = """
import _harness.tasks
from _harness import cli_process, scenarios
from _harness.servers import serve
from _harness.job.model import build_model
def f():
    from _harness.launch import job_env
"""
    assert harness_imports(source) == {"tasks", "cli_process", "scenarios", "servers", "job.model", "launch"}
