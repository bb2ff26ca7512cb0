"""The ``ckptspec`` command line.

Exit codes: 0 valid (warnings allowed), 1 invalid, 2 usage or I/O error.
User input never produces a traceback: unexpected exceptions are reported as
CK999 (set ``CKPTSPEC_DEBUG=1`` to see the traceback).

One module per command group; what they share (exit codes, the SIZE parameter, finding
lines, JSON output) is in ``_common``. A command imports the layers it uses when it runs,
so ``ckptspec validate MANIFEST`` loads neither pydantic nor rich.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys

import click

from .._forked import fork_by_default
from .._version import __version__
from ._common import EXIT_USAGE, end_with_the_process, json_error_with, report_unexpected, unexpected, what_was_written
from .embed import convert, embed, extract, migrate
from .export import export
from .export_universal import export_universal
from .generate import generate
from .inspect import diff, inspect
from .reconstruct import reconstruct
from .reshard import reshard
from .scan import scan
from .schema import schema_command
from .validate import validate


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ckptspec")
def cli() -> None:
    """Self-describing manifests for sharded training checkpoints.

    Every command that reads a checkpoint directory or a manifest also reads a URL (s3://,
    gs://, hf://, https://... through fsspec; see docs/remote.md).
    """
    from ..location import forget

    json_error_with(None)  # set again by a command run with --format json
    forget()  # one command, one view of remote files: what an earlier command in this process saw is dropped


for _command in (
    validate,
    generate,
    schema_command,
    reconstruct,
    export,
    reshard,
    export_universal,
    convert,
    embed,
    extract,
    migrate,
    diff,
    inspect,
    scan,
):
    cli.add_command(_command)


class Terminated(BaseException):
    """SIGTERM arrived: unwind like Ctrl-C, so every writer removes its temporary files."""


def _terminate(signum, frame) -> None:
    raise Terminated()


def main() -> None:
    # A scheduler stops a job with SIGTERM before SIGKILL: unwinding removes the temporaries
    # (SIGKILL leaves them; the next run in that directory removes them, see ckptspec._fs).
    signal.signal(signal.SIGTERM, _terminate)
    fork_by_default()  # the process is the command's own: a second CPU may take part (CKPTSPEC_WORKERS=1: never)
    try:
        code = cli.main(standalone_mode=False)
    except SystemExit:
        raise
    except (KeyboardInterrupt, click.exceptions.Abort) as exc:
        click.echo(f"interrupted; {what_was_written(exc)}", err=True)
        sys.exit(130)  # 128 + SIGINT, as shells report it; never 1, which means "invalid"
    except Terminated as exc:
        click.echo(f"terminated; {what_was_written(exc)}", err=True)
        sys.exit(143)  # 128 + SIGTERM
    except click.ClickException as exc:  # usage errors: click's own message, exit 2
        exc.show()
        sys.exit(exc.exit_code)
    except Exception as exc:  # never a traceback for user input
        error = unexpected(exc)
        if os.environ.get("CKPTSPEC_DEBUG") and error.code == "CK999":
            raise
        report_unexpected(error)  # with --format json, still the command's one JSON object
        sys.exit(EXIT_USAGE)
    sys.exit(code if isinstance(code, int) else 0)  # --help and --version return here


def run() -> None:
    """The installed command (and ``python -m ckptspec``): ``main`` in a process that ends with it.

    Leaves with ``os._exit`` once the output is flushed and the exit handlers have run: the
    decoded checkpoint and the manifest (3M objects at 100k tensors), which the commands keep
    (``keep_until_exit``), are not freed one by one on the way out (a cost that grows with the tensors).
    Exit codes and messages are those of ``main``; an exception main lets through
    (``CKPTSPEC_DEBUG``) ends the process as Python does, with its traceback.
    """
    end_with_the_process()
    try:
        main()
        code = 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:  # sys.exit("message"): printed, status 1, as Python does
            print(exc.code, file=sys.stderr)
            code = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (`| head`) or stream: nothing more can be said
            code = code or 1
    os._exit(code)
