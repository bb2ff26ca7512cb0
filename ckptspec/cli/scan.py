"""``ckptspec scan``: every tag of a training run, and the newest one a resume can trust (docs/cli.md)."""

from __future__ import annotations

import sys
import time
from typing import Any

import click

from .._version import __version__
from ..errors import CkptspecError
from ._common import (
    EXIT_INVALID,
    EXIT_OK,
    FORMAT_CHOICE,
    echo_json,
    error_dict,
    error_line,
    fail,
    json_error_with,
)


@click.command()
@click.argument("run_dir", metavar="RUN_DIR")
@click.option("--hash", "verify_hashes", is_flag=True, help="Also verify recorded content hashes (reads every byte).")
@click.option(
    "--fix-latest",
    is_flag=True,
    help="Point 'latest' at the newest valid tag (atomically); what it replaced is printed and appended "
    "to RUN_DIR/ckptspec-scan.log.",
)
@click.option(
    "--keep",
    type=click.IntRange(min=1),
    default=None,
    metavar="N",
    help="Remove the run's tags that have at least N newer valid tags (never the one 'latest' names, never one "
    "holding files ckptspec cannot attribute to a tag); logged in RUN_DIR/ckptspec-scan.log.",
)
@click.option("--format", "output_format", type=FORMAT_CHOICE, default="text", show_default=True)
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
def scan(
    run_dir: str, verify_hashes: bool, fix_latest: bool, keep: int | None, output_format: str, quiet: bool
) -> None:
    """Every tag of a DeepSpeed run: step, kind, size, save time, verdict; and the newest valid tag.

    \b
    RUN_DIR is the directory a job saves into (with 'latest'), or one holding Hugging Face Trainer
    checkpoint-N/ folders. Each tag is checked as `validate RUN_DIR --tag TAG --no-hash` does
    (--hash: as `validate` does). Exit 0 when a resume would load the newest valid tag, 1 when it
    would not (CK261) or no tag is valid (CK260), 2 when RUN_DIR cannot be read.
    """
    from ..export.progress import progress_printer
    from ..export.run_scan import fix_latest as rewrite_latest
    from ..export.run_scan import resume_problem, scan_run
    from ..location import refuse_write

    if output_format == "json":  # an error no handler here catches (CK999) is still the one JSON object
        json_error_with(lambda error: echo_json(_error_report(run_dir, error)))
    bar: list = []

    def progress(done: int, total: int) -> None:
        if not bar:
            bar.extend(progress_printer(total, enabled=not quiet and sys.stderr.isatty(), desc="scan", unit="tag"))
        bar[0](1)

    try:
        if fix_latest or keep is not None:
            refuse_write(run_dir, "--fix-latest" if fix_latest else "--keep")
        found = scan_run(run_dir, verify_hashes, progress)
    except CkptspecError as exc:
        if output_format == "json":
            echo_json(_error_report(run_dir, exc))
            sys.exit(exc.exit_code)
        fail(exc, run_dir)
    finally:
        if bar:
            bar[1]()
    fixed, plan, removed = None, None, []
    try:
        if fix_latest and found.newest_resumable is not None:
            fixed = rewrite_latest(found)
        if keep is not None:
            from ..export.run_keep import plan_keep, remove_tags

            plan = plan_keep(found, keep)
            removed = remove_tags(found.run_dir, plan.remove, keep)
    except CkptspecError as exc:  # CK908: another ckptspec run holds the run directory
        fail(exc, run_dir)
    except OSError as exc:
        from ._common import fail_write

        fail_write(str(found.run_dir), exc)
    problem = resume_problem(found)
    kept = plan.kept if plan else {}
    if output_format == "json":
        echo_json({**_report(found, fixed, problem), "removed": plan.remove if plan else [], "kept": kept})
    else:
        _print(found, fixed, problem, removed, kept)
    sys.exit(EXIT_INVALID if problem else EXIT_OK)


def _error_report(run_dir: str, error: CkptspecError) -> dict[str, Any]:
    return {"tool": "ckptspec", "tool_version": __version__, "run_dir": run_dir, "error": error_dict(error)}


def _when(saved: float | None) -> str | None:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(saved)) if saved is not None else None


def _report(found, fixed: str | None, problem) -> dict[str, Any]:
    newest = found.newest_valid
    return {
        "tool": "ckptspec",
        "tool_version": __version__,
        "run_dir": found.run_dir,
        "latest": found.latest,
        "newest_valid": newest.name if newest else None,
        "fixed": fixed,
        "resumes_newest_valid": problem is None,
        "problem": {"code": problem[0], "message": problem[1], "hint": problem[2]} if problem else None,
        "tags": [
            {
                "name": t.name,
                "step": t.step,
                "kind": t.kind,
                "size": t.size,
                "saved": _when(t.saved),
                "valid": t.valid,
                "findings": [f.to_dict() for f in t.findings],
                "error": error_dict(t.error) if t.error else None,
            }
            for t in found.tags
        ],
    }


def _print(found, fixed: str | None, problem, removed: list[str], kept: dict[str, str]) -> None:
    run = found.run_dir
    for t in found.tags:
        step = "-" if t.step is None else str(t.step)
        verdict = "valid" if t.valid else "INVALID"
        click.echo(
            f"{t.name}  step {step}  {t.kind or '?'}  {t.size:,} bytes  {_when(t.saved) or '-'}  {verdict}"
            + ("  <- latest" if t.name == found.latest else "")
        )
        for finding in t.findings:
            click.echo(f"  {finding.to_line()}")
        if t.error is not None:
            click.echo(f"  {error_line(t.error)}")
    newest = found.newest_valid
    click.echo(f"{run}: newest valid tag: {newest.name if newest else 'none'}")
    for line in [fixed] if fixed else []:
        click.echo(f"{run}: {line}")
    for line in removed:
        click.echo(f"{run}: {line}")
    for name, why in kept.items():
        click.echo(f"{run}: kept {name!r}: {why}")
    if problem:
        code, message, hint = problem
        click.echo(f"{run}: {code} {message} (hint: {hint})", err=True)
