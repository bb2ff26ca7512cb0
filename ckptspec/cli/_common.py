"""What the ckptspec commands share: exit codes, the SIZE parameter, finding and error lines, JSON output.

Exit codes: 0 success (warnings allowed), 1 invalid input or checkpoint, 2 usage or I/O
error. A problem is one line, ``[TARGET: ]CODE message (hint: ...)``.
"""

from __future__ import annotations

import errno
import json
import os
import sys
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

import click

from .._version import __version__
from ..errors import CheckpointInvalid, CkptspecError, FileUnreadable, InputOutputError, InternalError
from ..findings import Finding, has_errors
from ..split import reports_findings

EXIT_OK, EXIT_INVALID, EXIT_USAGE = 0, 1, 2
REPORT_VERSION = "1.0"
ENCODING_CHOICE = click.Choice(["json", "msgpack"])
FORMAT_CHOICE = click.Choice(["text", "json"])
# What a command made (a manifest, decoded pickles), left for ``run``'s ``os._exit`` rather than
# freed one object at a time when the command returns (docs/performance.md). Kept only
# in a process that ends with the command (``run``); a caller of ``main`` keeps nothing.
_KEPT: list | None = None


def end_with_the_process() -> None:
    """The command is the last thing this process does (``run``): keep what it made until then."""
    global _KEPT
    _KEPT = []


def keep_until_exit(*objects: object) -> None:
    """Leave ``objects`` to the end of the process when it ends with the command (see ``_KEPT``)."""
    if _KEPT is not None:
        _KEPT.extend(objects)


_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}


class SizeParam(click.ParamType):
    """512M, 2G, 5GB, 1048576: a positive byte count in binary units."""

    name = "SIZE"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        raw = str(value).strip().upper().removesuffix("B").removesuffix("I")
        number, unit = (raw[:-1], raw[-1]) if raw and raw[-1] in _UNITS else (raw, "")
        try:
            size = int(float(number) * _UNITS[unit])
        except (ValueError, OverflowError):  # "abc", "inf", "1e400"
            self.fail(f"{value!r} is not a size such as 512M or 2G", param, ctx)
        if size <= 0:
            self.fail("the size must be positive", param, ctx)
        return size


SIZE = SizeParam()


class OutputPath(click.ParamType):
    """Where a command writes: never the empty string (which would mean the current directory)."""

    name = "PATH"

    def __init__(self, directory: bool = False):
        self.directory = directory

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        text = os.fspath(value)
        if text == "":
            self.fail("an empty path; name the output" + (" directory" if self.directory else " (or - for stdout)"))
        if self.directory and os.path.exists(text) and not os.path.isdir(text):
            self.fail(f"{text} exists and is not a directory", param, ctx)
        return text


OUTPUT_FILE, OUTPUT_DIR = OutputPath(), OutputPath(directory=True)


def echo_findings(
    findings: Iterable[Finding], target: str, *, err: bool = False, always_name_target: bool = True
) -> None:
    """One line per finding, ``TARGET: <finding>``. With ``always_name_target=False`` a finding
    that names its own file is printed without the target."""
    for finding in findings:
        line = finding.to_line()
        named = always_name_target or finding.file is None
        click.echo(f"{target}: {line}" if named else line, err=err)


def error_line(exc: CkptspecError, target: str | None = None) -> str:
    """The error's line, prefixed with ``target`` when the error names no file itself."""
    line = exc.to_line()
    return line if exc.file or not target else f"{target}: {line}"


def fail(exc: CkptspecError, target: str | None = None) -> NoReturn:
    """Print the error on stderr and exit with its status. An ``InternalError`` (a ckptspec bug, CK999)
    goes on to ``main``, which reports it as every unexpected exception (``CKPTSPEC_DEBUG`` shows its traceback)."""
    if isinstance(exc, InternalError):
        raise exc
    click.echo(error_line(exc, target), err=True)
    sys.exit(exc.exit_code)


def fail_write(output: str, exc: OSError) -> NoReturn:
    """CK906 for a writer's OSError, naming the output as given: the file being written was one of
    the run's temporaries, removed by now. An error on a file elsewhere (an input read late, such as
    a universal folder's ``zero/``) is the read error it is (CK901)."""
    if exc.errno not in _WRITE_ERRNOS and exc.filename is not None and not _is_output(output, exc.filename):
        fail(unexpected(exc))
    click.echo(
        f"{output}: CK906 cannot write: {exc.strerror or exc} "
        f"(hint: check the output directory is writable and has space; {what_was_written(exc)})",
        err=True,
    )
    sys.exit(EXIT_USAGE)


def _is_output(output: str, name) -> bool:
    """``name`` is the output, inside it, or one of its temporaries beside it."""
    target, path = Path(os.path.realpath(output)), Path(os.path.realpath(os.fsdecode(name)))
    beside = path.parent == target.parent and path.name.startswith(f".{target.name}.ckptspec-")
    return path == target or target in path.parents or beside


def what_was_written(stopped: BaseException) -> str:
    """What a run stopped by ``stopped`` (an error, Ctrl-C, SIGTERM) leaves: its temporaries are removed,
    so nothing, unless it stopped while putting its output in place (``_commit.commit_outcome``)."""
    from .._commit import JOURNAL, commit_outcome

    uploaded = getattr(stopped, "ckptspec_upload", None)  # an upload to a URL (location.upload.publish)
    if isinstance(uploaded, str):
        return uploaded
    state, where = commit_outcome(stopped) or ("", None)
    if where is None or not where.exists():  # none, or into a temporary directory, removed since
        return "nothing was written"
    if state == "complete":
        return f"{where} holds the complete new output (it was being committed, and that was finished first)"
    return f"the commit into {where} stopped half way: the next ckptspec write there finishes it ({JOURNAL})"


@contextmanager
def writing_deepspeed_files(checkpoint: str, output: str, manifest: str | None, not_done: str):
    """The errors of a command that validates CHECKPOINT and writes DeepSpeed's files into OUTPUT
    (``reshard``, ``export-universal``): findings and exit 1, a coded error, torch missing (CK402),
    or CK906 for a write that failed; ``not_done`` says what did not happen ("not resharded")."""
    try:
        yield
    except CheckpointInvalid as exc:
        if not reports_findings():  # a torchrun split: every rank found the same, rank 0 prints them
            sys.exit(EXIT_INVALID)
        echo_findings(exc.findings, manifest or checkpoint, err=True, always_name_target=False)
        click.echo(f"{checkpoint}: {not_done}: the checkpoint has errors; nothing was written", err=True)
        sys.exit(EXIT_INVALID)
    except CkptspecError as exc:
        fail(exc)
    except ImportError as exc:
        click.echo(f"{output}: CK402 writing DeepSpeed's files needs torch: {exc} (hint: pip install torch)", err=True)
        sys.exit(EXIT_USAGE)
    except OSError as exc:
        fail_write(output, exc)


def echo_split(shares: list[tuple[int, int]]) -> None:
    """Under torchrun, what each rank of the split did (``split.Share.report``), after the command's line."""
    if "WORLD_SIZE" in os.environ:
        for rank, (files, read) in enumerate(shares):
            click.echo(f"  rank {rank} of {len(shares)}: wrote {files} files, read {read} checkpoint bytes")


def tag_needs_a_directory(name: str, option: str = "--tag") -> click.UsageError:
    """``--tag`` (``--tag-a``, ``--tag-b``) given with a file argument: a usage error, in the same words everywhere."""
    return click.UsageError(f"{option} needs a checkpoint directory, and {name} is not one")


def echo_json(doc: dict[str, Any]) -> None:
    click.echo(json.dumps(doc, indent=2, sort_keys=True))


# How the running command prints an error none of its own handlers caught (``report_unexpected``):
# with --format json, its one JSON object; otherwise (None) the error line on stderr.
_JSON_ERROR: Callable[[CkptspecError], None] | None = None


def json_error_with(print_error: Callable[[CkptspecError], None] | None) -> None:
    """With --format json, the command's way to print an error as its one JSON object (None: none)."""
    global _JSON_ERROR
    _JSON_ERROR = print_error


_WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG}


def unexpected(exc: Exception) -> CkptspecError:
    """What an exception no handler of the command caught is: an I/O error of the input or output
    (CK901 reading, CK906 writing; the system refused, so not a bug) or an internal error (CK999)."""
    if isinstance(exc, OSError):
        where = exc.filename
        if exc.errno in _WRITE_ERRNOS:
            return InputOutputError(
                "CK906",
                f"cannot write: {exc.strerror or exc}",
                "check the output directory is writable and has space",
                where,
            )
        return (
            FileUnreadable(where, exc)
            if where is not None
            else InputOutputError(
                "CK901",
                f"cannot read: {exc.strerror or exc}",
                "an I/O error: check the storage, then run the command again",
            )
        )
    return InternalError(
        "CK999",
        f"internal error: {type(exc).__name__}: {exc}",
        "this is a ckptspec bug; rerun with CKPTSPEC_DEBUG=1 and report it",
    )


def report_unexpected(error: CkptspecError) -> None:
    """Print ``unexpected``'s error as the command prints its own: one JSON object with --format json."""
    if _JSON_ERROR is not None:
        _JSON_ERROR(error)
    else:
        click.echo(error.to_line(), err=True)


def error_dict(exc: CkptspecError) -> dict[str, str]:
    return {"code": exc.code, "message": exc.message, "hint": exc.hint}


def validation_report(
    target: str, findings: list[Finding], error: CkptspecError | None = None, fetched: dict[str, int] | None = None
) -> dict[str, Any]:
    """The ``validate --format json`` report, defined by ``schema/report-1.0.schema.json``; with
    ``fetched`` (a target at a URL: what was fetched), a 1.1 report (``schema/report-1.1.schema.json``)."""
    report: dict[str, Any] = {
        "report_version": REPORT_VERSION if fetched is None else "1.1",
        "tool": "ckptspec",
        "tool_version": __version__,
        "target": target,
        "valid": error is None and not has_errors(findings),
        "findings": [f.to_dict() for f in findings],
    }
    if error is not None:
        report["error"] = error_dict(error)
    if fetched is not None:
        report["fetched"] = fetched
    return report


def fetched_line(target: str, fetched: dict[str, int]) -> str:
    """What reading a target at a URL fetched, in words."""
    line = f"{target}: fetched {fetched['bytes']:,} bytes in {fetched['requests']:,} requests"
    total = fetched.get("checkpoint_bytes")
    if total:
        line += f" ({100 * fetched['bytes'] / total:.3f}% of the {total:,} bytes of its files)"
    return line


def read_tag_dir_early(checkpoint: str, tag: str | None, then: str):
    """The tag directory's pickles read (walked by a forked process ahead of the unpickler) before the module ``then``
    (``ckptspec.deepspeed.describe.zero``, ``check.zero``: pydantic and the models, a slow import) is imported,
    which happens while the forked walk is going (``prescan.scan_all``'s ``meanwhile``).
    A ``StateCache`` to hand on, or None when the directory cannot be listed: the command's own
    flow then raises what it always raised, where it always did."""
    import importlib

    from ..checkpoint.states import StateCache
    from ..deepspeed.layout.tag_dir import resolve_tag_dir, scan_tag_dir

    try:
        shards = scan_tag_dir(resolve_tag_dir(checkpoint, tag))
    except CkptspecError:
        return None
    states = StateCache()
    states.load_all([*shards.model_files.values(), *shards.optim_files.values()], lambda: importlib.import_module(then))
    return states
