"""``ckptspec diff A B`` of two torch DCP directories (issue #42): each checked as ``validate DCP_DIR`` checks it
(one with an error finding is reported and nothing compared, exit 1), then ``checkpoint.dcp.compare``'s changes:
entries added, removed, reshaped, retyped, and ``values`` (a tensor's digest, a bytes item's value). No resume
verdict (``dcp.load`` reshards on load): exit 0 when both are valid, whatever changed.
"""

from __future__ import annotations

import sys
from typing import Any, NoReturn

import click

from ..errors import CkptspecError
from ..findings import has_errors
from ..location import location
from ._common import EXIT_INVALID, EXIT_OK, echo_findings, echo_json, error_dict, error_line


def diff_dcp_dirs(a: str, b: str, is_dcp: list[bool], tags: list[str | None], output_format: str) -> NoReturn:
    from ..checkpoint.dcp.checks import check_dcp
    from ..checkpoint.dcp.compare import diff_dcp
    from ..report.diff import DIFF_VERSION

    if not all(is_dcp):
        one, other = (a, b) if is_dcp[0] else (b, a)
        raise click.UsageError(f"{one} is a torch DCP checkpoint and {other} is not: diff compares two of a kind")
    if any(t is not None for t in tags):
        raise click.UsageError("--tag-a and --tag-b name DeepSpeed tag directories; a DCP checkpoint has none")
    sides = {"a": {"target": a, "source": "dcp"}, "b": {"target": b, "source": "dcp"}}
    checked = []
    for target in (a, b):
        try:
            where = location(target)  # a URL: ranged reads (docs/remote.md)
            checked.append((where, *check_dcp(where)))
        except CkptspecError as exc:
            if output_format == "json":
                echo_json({**sides, "valid": False, "findings": [], "error": {**error_dict(exc), "target": target}})
            else:
                click.echo(error_line(exc, target), err=True)
            sys.exit(exc.exit_code)
    bad = [(t, f) for t, (_, _, f) in zip((a, b), checked) if has_errors(f)]
    if bad:
        if output_format == "json":
            findings = [{**f.to_dict(), "target": t} for t, fs in bad for f in fs]
            echo_json({**sides, "valid": False, "findings": findings})
        else:
            for t, fs in bad:
                echo_findings(fs, t)
        sys.exit(EXIT_INVALID)
    (where_a, meta_a, _), (where_b, meta_b, _) = checked
    changes = diff_dcp(where_a, meta_a, where_b, meta_b)
    result: dict[str, Any] = {
        "diff_version": DIFF_VERSION,
        "identical": not changes,
        "changes": changes,
    }  # no resume verdict
    if output_format == "json":
        echo_json({**sides, "valid": True, **result})
    else:
        from .render import render_diff

        shown = [{**c, "a": _short(c["a"]), "b": _short(c["b"])} for c in result["changes"]]
        kind = "Megatron-core torch_dist" if meta_a.megatron and meta_b.megatron else "torch DCP"
        click.echo(render_diff(f"{a} ({kind})", f"{b} ({kind})", {**result, "changes": shown}), nl=False)
    sys.exit(EXIT_OK)


def _short(value):
    """A digest's first 16 hex digits in the text table (the JSON has them whole)."""
    return value[:23] if isinstance(value, str) and value.startswith("sha256:") else value
