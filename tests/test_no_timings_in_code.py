"""No timing statement in ckptspec's docstrings and comments: measurements go stale where nobody
re-measures them, so they live in docs/performance.md (which says when and where each was taken);
the code says only why it is shaped the way it is.

Flagged: a duration (``0.2 s``, ``~20 us``, ``15 ns``, ``3 seconds``) and a measured speed-up
(``3x faster``, ``25% fewer``). Not flagged: sizes (``2 MiB``, ``1 << 20``), which in this code are
caps and thresholds, rules rather than measurements; durations that are settings (a timeout) are
named constants, not prose.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "ckptspec"

TIMING = re.compile(
    r"(?<![\w.-])~?\d[\d,_]*(?:\.\d+)?(?:-\d+(?:\.\d+)?)?\s?(?:s|ms|us|µs|ns|secs?|seconds?|mins?|minutes?)\b"
    r"|\b\d+(?:\.\d+)?\s?(?:x|times|%)\s(?:faster|slower|fewer|less|more|quicker)\b",
    re.IGNORECASE,
)


def prose(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring of ``path``; a docstring's lines joined, so a
    number and its unit on two lines are still read together."""
    source = path.read_text("utf-8")
    found = [
        (tok.start[0], tok.string)
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                if isinstance(first.value.value, str):
                    found.append((first.lineno, " ".join(first.value.value.split())))
    return found


def timing_statements(path: Path) -> list[tuple[int, str]]:
    return [(line, m.group(0)) for line, text in sorted(prose(path)) for m in TIMING.finditer(text)]


def test_no_timing_statement_in_a_docstring_or_comment():
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {text!r}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for line, text in timing_statements(path)
    ]
    assert not found, "move these measurements to docs/performance.md:\n" + "\n".join(found)


def test_the_pattern_flags_timings_and_leaves_sizes(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text(
        '"""Describe it.\n\nAt 100k tensors: 7.26 -> 5.64\ns, and 3x faster."""\n'
        "CAP = 2 * 1024 * 1024  # 2 MiB cap: a rule\n"
        "X = 1  # took ~20 us a call; 25% fewer reads\n"
        "Y = 2  # format 1.x, CK2xx, 1 << 20 bytes, 5 attempts\n",
        "utf-8",
    )
    assert [text for _, text in timing_statements(sample)] == ["5.64 s", "3x faster", "~20 us", "25% fewer"]
