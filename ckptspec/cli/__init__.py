"""The ``ckptspec`` command line.

Exit codes: 0 valid (warnings allowed), 1 invalid, 2 usage or I/O error.
User input never produces a traceback: unexpected exceptions are reported as
CK999 (set ``CKPTSPEC_DEBUG=1`` to see the traceback).

One module per command group; what they share (exit codes, the SIZE parameter, finding
lines, JSON output) is in ``_common``. A command imports the layers it uses when it runs,
so ``ckptspec validate MANIFEST`` loads neither pydantic nor rich.
"""

from __future__ import annotations

import os
import sys

import click

from .._version import __version__
from ._common import EXIT_USAGE
from .embed import convert, embed, extract, migrate
from .generate import generate
from .inspect import diff, inspect
from .reconstruct import reconstruct
from .schema import schema_command
from .validate import validate


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ckptspec")
def cli() -> None:
    """Self-describing manifests for sharded training checkpoints."""


for _command in (validate, generate, schema_command, reconstruct, convert, embed, extract, migrate, diff, inspect):
    cli.add_command(_command)


def main() -> None:
    try:
        cli.main(standalone_mode=True)
    except SystemExit:
        raise
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        sys.exit(130)
    except Exception as exc:  # never a traceback for user input
        if os.environ.get("CKPTSPEC_DEBUG"):
            raise
        click.echo(
            f"CK999 internal error: {type(exc).__name__}: {exc} "
            "(hint: this is a ckptspec bug; rerun with CKPTSPEC_DEBUG=1 and report it)",
            err=True,
        )
        sys.exit(EXIT_USAGE)
