"""``ckptspec schema``: print a shipped JSON Schema, of any document kind and version."""

from __future__ import annotations

import sys

import click

from ..format.schemas import MANIFEST_SCHEMAS, SCHEMAS_BY_KIND, schema_file, schema_text
from ..format.version import version_order
from ._common import EXIT_USAGE


@click.command("schema")
@click.option(
    "--version",
    "version",
    default=None,
    metavar="V",
    help=f"Version of the schema (manifests: {', '.join(sorted(MANIFEST_SCHEMAS))}; `--list` lists every kind's); "
    "default the latest.",
)
@click.option("--report", is_flag=True, help="Print the schema of `validate --format json` reports instead.")
@click.option(
    "--checkpoint-index",
    "index",
    is_flag=True,
    help="Print the schema of the checkpoint index (format ckptspec.checkpoint) instead.",
)
@click.option(
    "--dcp", "dcp", is_flag=True, help="Print the schema of the torch DCP document (format ckptspec.dcp) instead."
)
@click.option(
    "--list", "list_all", is_flag=True, help="List every shipped schema: kind, version, file, '*' the latest."
)
def schema_command(version: str | None, report: bool, index: bool, dcp: bool, list_all: bool) -> None:
    """Print the manifest JSON Schema (or the checkpoint index's, the DCP document's, or the report's)."""
    if report + index + dcp > 1:
        raise click.UsageError("--report, --checkpoint-index and --dcp name kinds of document: choose one")
    if list_all:
        for kind, (files, latest) in SCHEMAS_BY_KIND.items():
            for line, filename in sorted(files.items(), key=lambda item: version_order(item[0])):
                click.echo(f"{kind} {line} {filename}{' *' if line == latest else ''}")
        return
    kind = "report" if report else "checkpoint-index" if index else "dcp" if dcp else "manifest"
    try:
        filename = schema_file(kind, version)
    except KeyError as exc:
        flag = {"manifest": "", "report": " --report", "checkpoint-index": " --checkpoint-index", "dcp": " --dcp"}[kind]
        click.echo(f"CK905 {exc.args[0]} (hint: run `ckptspec schema{flag}` for the latest)", err=True)
        sys.exit(EXIT_USAGE)
    click.echo(schema_text(filename), nl=False)
