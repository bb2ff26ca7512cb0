"""The ``ckptspec`` command line.

Exit codes: 0 valid (warnings allowed), 1 invalid, 2 usage or I/O error.
User input never produces a traceback: unexpected exceptions are reported as
CK999 (set ``CKPTSPEC_DEBUG=1`` to see the traceback).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import click

from .._version import __version__
from ..errors import CkptspecError
from ..findings import Finding
from ..format.codec import DEFAULT_MAX_BYTES
from ..format.schemas import MANIFEST_SCHEMAS, REPORT_SCHEMA, manifest_schema_file, schema_text

EXIT_OK, EXIT_INVALID, EXIT_USAGE = 0, 1, 2
REPORT_VERSION = "1.0"


def _parse_size(text: str) -> int:
    units = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}
    raw = text.strip().upper().removesuffix("B").removesuffix("I")
    number, unit = (raw[:-1], raw[-1]) if raw and raw[-1] in units else (raw, "")
    try:
        value = int(float(number) * units[unit])
    except (ValueError, OverflowError):  # "abc", "inf", "1e400"
        raise click.BadParameter(f"{text!r} is not a size such as 512M or 2G") from None
    if value <= 0:
        raise click.BadParameter("the size must be positive")
    return value


class _Size(click.ParamType):
    name = "SIZE"

    def convert(self, value, param, ctx):
        return value if isinstance(value, int) else _parse_size(str(value))


def _report(target: str, findings: list[Finding], error: CkptspecError | None = None) -> dict[str, Any]:
    """The stable JSON report shape, defined by ``schema/report-1.0.schema.json``."""
    report: dict[str, Any] = {
        "report_version": REPORT_VERSION,
        "tool": "ckptspec",
        "tool_version": __version__,
        "target": target,
        "valid": error is None and not any(f.severity == "error" for f in findings),
        "findings": [f.to_dict() for f in findings],
    }
    if error is not None:
        report["error"] = {"code": error.code, "message": error.message, "hint": error.hint}
    return report


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ckptspec")
def cli() -> None:
    """Self-describing manifests for sharded training checkpoints."""


@cli.command()
@click.argument("target", metavar="MANIFEST|DIR")
@click.option("--checkpoint", "checkpoint", default=None, metavar="DIR",
              help="Also check the files of this DeepSpeed checkpoint directory against MANIFEST.")
@click.option("--tag", default=None, help="With a checkpoint: the tag directory to check (default: the one named by 'latest').")
@click.option("--no-hash", "no_hash", is_flag=True, help="With a checkpoint: skip verifying the recorded content hashes.")
@click.option("--format", "output_format", type=click.Choice(["text", "json"]), default="text", show_default=True,
              help="Text: one line per finding. JSON: one report object (schema/report-1.0.schema.json).")
@click.option("--max-size", type=_Size(), default=DEFAULT_MAX_BYTES, show_default="512M",
              help="Refuse manifest files larger than this before reading them.")
@click.option("--encoding", type=click.Choice(["json", "msgpack"]), default=None,
              help="Override the encoding guessed from the file extension and first byte.")
def validate(target: str, checkpoint: str | None, tag: str | None, no_hash: bool, output_format: str,
             max_size: int, encoding: str | None) -> None:
    """Check a manifest, or a checkpoint's files against its manifest.

    \b
    validate MANIFEST                   the manifest alone: schema and every semantic rule
    validate MANIFEST --checkpoint DIR  then the files of DIR against MANIFEST
    validate DIR                        DIR against its sidecar ckptspec.json/.msgpack, or
                                        against a manifest generated from DeepSpeed's metadata
    """
    from ..format.validate import validate_file

    is_dir = checkpoint is None and os.path.isdir(target)
    if checkpoint is None and not is_dir and (tag is not None or no_hash):
        raise click.UsageError("--tag and --no-hash need a checkpoint: validate DIR, or validate MANIFEST --checkpoint DIR")
    if checkpoint is None and not is_dir:
        try:  # the verdict only: no models to build (they cost more than the rules)
            report = validate_file(target, max_bytes=max_size, encoding=encoding, build_model=False)
        except CkptspecError as exc:
            _emit(output_format, target, [], exc)
            sys.exit(exc.exit_code)
        _emit(output_format, target, report.findings)
        sys.exit(EXIT_OK if report.ok else EXIT_INVALID)

    from ..deepspeed.validate import validate_checkpoint

    shown = checkpoint if checkpoint is not None else target
    try:
        manifest = None
        if checkpoint is not None:
            report = validate_file(target, max_bytes=max_size, encoding=encoding)
            if not report.ok or report.manifest is None:
                _emit(output_format, target, report.findings)
                sys.exit(EXIT_INVALID)
            manifest = report.manifest
        _, findings = validate_checkpoint(shown, manifest, tag, verify_hashes=not no_hash)
    except CkptspecError as exc:
        _emit(output_format, shown, [], exc)
        sys.exit(exc.exit_code)
    _emit(output_format, shown, findings)
    sys.exit(EXIT_INVALID if any(f.severity == "error" for f in findings) else EXIT_OK)


def _emit(output_format: str, target: str, findings: list[Finding], error: CkptspecError | None = None) -> None:
    if output_format == "json":
        click.echo(json.dumps(_report(target, findings, error), indent=2, sort_keys=True))
        return
    for finding in findings:
        click.echo(f"{target}: {finding.to_line()}")
    if error is not None:
        click.echo(error.to_line() if error.file else f"{target}: {error.to_line()}", err=True)
    elif not any(f.severity == "error" for f in findings):
        click.echo(f"{target}: valid")


@cli.command()
@click.argument("checkpoint", metavar="CHECKPOINT")
@click.option("--tag", default=None, help="Tag directory to describe (default: the one named by 'latest').")
@click.option("-o", "--output", default="-", show_default="stdout", help="Write the manifest here (.json or .msgpack).")
@click.option("--hash", "hash_algorithm", flag_value="sha256", default=None,
              help="Record a SHA-256 content hash of every shard file (reads every byte).")
def generate(checkpoint: str, tag: str | None, output: str, hash_algorithm: str | None) -> None:
    """Describe a saved DeepSpeed checkpoint directory in a manifest.

    Reads only metadata (no tensor data unless --hash), needs neither DeepSpeed nor
    torch, and never executes pickled code.
    """
    from ..deepspeed.describe import manifest_from_checkpoint
    from ..format.codec import write_manifest

    try:
        manifest = manifest_from_checkpoint(checkpoint, tag, hash_algorithm=hash_algorithm)
        write_manifest(manifest, output)
    except CkptspecError as exc:
        click.echo(exc.to_line(), err=True)
        sys.exit(exc.exit_code)


@cli.command("schema")
@click.option("--version", "version", default=None, metavar="V",
              help=f"Format version (known: {', '.join(sorted(MANIFEST_SCHEMAS))}); default the latest.")
@click.option("--report", is_flag=True, help="Print the schema of `validate --format json` reports instead.")
def schema_command(version: str | None, report: bool) -> None:
    """Print the manifest JSON Schema."""
    if report:
        click.echo(schema_text(REPORT_SCHEMA), nl=False)
        return
    try:
        filename = manifest_schema_file(version) if version else manifest_schema_file()
    except KeyError as exc:
        click.echo(f"CK905 {exc.args[0]} (hint: run `ckptspec schema` for the latest)", err=True)
        sys.exit(EXIT_USAGE)
    click.echo(schema_text(filename), nl=False)


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
        click.echo(f"CK999 internal error: {type(exc).__name__}: {exc} "
                   "(hint: this is a ckptspec bug; rerun with CKPTSPEC_DEBUG=1 and report it)", err=True)
        sys.exit(EXIT_USAGE)


from .reconstruct import reconstruct  # noqa: E402  (registered last; see cli_reconstruct.py)

cli.add_command(reconstruct)

from .embed import convert, embed, extract, migrate  # noqa: E402  (registered last; see cli_embed.py)

cli.add_command(convert)
cli.add_command(embed)
cli.add_command(extract)
cli.add_command(migrate)

from .inspect import diff, inspect  # noqa: E402  (registered last; see cli_inspect.py)

cli.add_command(diff)
cli.add_command(inspect)
