"""The package keeps its shape: import contracts, lint, format, module size, import-time cost.

``lint-imports`` checks the contracts in pyproject.toml (the layers of docs/architecture.md
and where torch, numpy, DeepSpeed, click and rich may be imported); ``ruff`` checks lint
and format. They run from this interpreter's environment: a missing tool fails the test,
it is never skipped.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
MAX_LINES = 420  # "about 400": a module that outgrows it becomes a package (docs/architecture.md)


def _tool(name: str) -> str:
    path = BIN / name
    assert path.exists(), f"{name} is not installed in {BIN}: pip install -e '.[test]'"
    return str(path)


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True)


@pytest.mark.parametrize(
    "command",
    [
        ("lint-imports", "--no-logo", "--no-cache"),
        ("ruff", "check", "--no-cache", "."),
        ("ruff", "format", "--no-cache", "--check", "."),
    ],
    ids=lambda c: " ".join(c[:2]),
)
def test_tool_passes(command):
    result = _run(_tool(command[0]), *command[1:])
    assert result.returncode == 0, result.stdout + result.stderr


def test_no_module_is_long():
    long = {
        str(p.relative_to(ROOT)): n
        for p in (ROOT / "ckptspec").rglob("*.py")
        if (n := len(p.read_text("utf-8").splitlines())) > MAX_LINES
    }
    assert not long, (
        f"modules over {MAX_LINES} lines: {long}; a module that outgrows ~400 lines becomes a package of modules "
        "with one job each (not flat siblings importing each other's privates; docs/architecture.md)"
    )


def _modules_after(code: str) -> set[str]:
    probe = "import sys\n" + code + "\nprint(' '.join(sorted({m.split('.')[0] for m in sys.modules})))"
    result = _run(sys.executable, "-c", probe)
    assert result.returncode == 0, result.stderr
    return set(result.stdout.split())


HEAVY = {"torch", "deepspeed", "numpy", "safetensors", "ml_dtypes", "tqdm"}


def test_validate_manifest_loads_no_heavy_module():
    """`ckptspec validate MANIFEST` needs neither the models (pydantic) nor rich, torch or numpy."""
    loaded = _modules_after(
        "from ckptspec.cli import main\n"
        "sys.argv = ['ckptspec', 'validate', 'examples/manifests/zero2-bf16-2ranks.json']\n"
        "try:\n    main()\nexcept SystemExit as exc:\n    assert exc.code == 0, exc.code"
    )
    assert not loaded & (HEAVY | {"pydantic", "rich", "jsonschema"}), loaded & (HEAVY | {"pydantic", "rich"})


def test_public_modules_import_no_heavy_module():
    """The producers and the loading API import torch, DeepSpeed and numpy only when called."""
    loaded = _modules_after(
        "import ckptspec, ckptspec.deepspeed, ckptspec.torch, ckptspec.export.api\n"
        "assert ckptspec.load_state_dict and ckptspec.Manifest"
    )
    assert not loaded & HEAVY, loaded & HEAVY
