"""``ckptspec schema``: print a shipped JSON Schema."""

from __future__ import annotations

import sys

import click

from ..format.schemas import (
    INDEX_SCHEMA,
    LATEST_REPORT,
    MANIFEST_SCHEMAS,
    REPORT_SCHEMAS,
    manifest_schema_file,
    schema_text,
)
from ._common import EXIT_USAGE


@click.command("schema")
@click.option(
    "--version",
    "version",
    default=None,
    metavar="V",
    help=f"Format version (known: {', '.join(sorted(MANIFEST_SCHEMAS))}); default the latest.",
)
@click.option(
    "--report", is_flag=True, help="Print the schema of `validate --format json` reports (the latest, 1.1) instead."
)
@click.option(
    "--checkpoint-index",
    "index",
    is_flag=True,
    help="Print the schema of the checkpoint index (format ckptspec.checkpoint 1.0) instead.",
)
def schema_command(version: str | None, report: bool, index: bool) -> None:
    """Print the manifest JSON Schema."""
    if report:
        click.echo(schema_text(REPORT_SCHEMAS[LATEST_REPORT]), nl=False)
        return
    if index:  # one version so far: the index embeds manifests of the latest format
        click.echo(schema_text(INDEX_SCHEMA), nl=False)
        return
    try:
        filename = manifest_schema_file(version) if version else manifest_schema_file()
    except KeyError as exc:
        click.echo(f"CK905 {exc.args[0]} (hint: run `ckptspec schema` for the latest)", err=True)
        sys.exit(EXIT_USAGE)
    click.echo(schema_text(filename), nl=False)
