"""``ckptspec validate``: a manifest, or a checkpoint's files against its manifest (docs/cli.md)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, NoReturn

import click

from ..errors import CkptspecError
from ..findings import Finding, has_errors
from ..format.codec import DEFAULT_MAX_BYTES
from ._common import (
    EXIT_INVALID,
    EXIT_OK,
    SIZE,
    echo_findings,
    echo_json,
    error_line,
    fetched_line,
    json_error_with,
    keep_until_exit,
    read_tag_dir_early,
    validation_report,
)

if TYPE_CHECKING:
    from ..format.codec import Encoding


@click.command()
@click.argument("target", metavar="MANIFEST|DIR")
@click.option(
    "--checkpoint",
    "checkpoint",
    default=None,
    metavar="DIR",
    help="Also check the files of this DeepSpeed checkpoint directory (a path or a URL) against MANIFEST.",
)
@click.option(
    "--tag", default=None, help="With a checkpoint: the tag directory to check (default: the one named by 'latest')."
)
@click.option(
    "--no-hash", "no_hash", is_flag=True, help="With a checkpoint: skip verifying the recorded content hashes."
)
@click.option(
    "--format",
    "output_format",
    type=click.Choice(["text", "json"]),
    default="text",
    show_default=True,
    help="Text: one line per finding. JSON: one report object (schema/report-1.0.schema.json; "
    "1.1 for a URL, with the bytes fetched).",
)
@click.option(
    "--max-size",
    type=SIZE,
    default=DEFAULT_MAX_BYTES,
    show_default="512M",
    help="Refuse manifest files larger than this before reading them.",
)
@click.option(
    "--encoding",
    type=click.Choice(["json", "msgpack"]),
    default=None,
    help="Override the encoding guessed from the file extension and first byte.",
)
def validate(
    target: str,
    checkpoint: str | None,
    tag: str | None,
    no_hash: bool,
    output_format: str,
    max_size: int,
    encoding: Encoding | None,
) -> None:
    """Check a manifest, or a checkpoint's files against its manifest.

    \b
    validate MANIFEST                   the manifest alone: schema and every semantic rule
    validate MANIFEST --checkpoint DIR  then the files of DIR against MANIFEST
    validate DIR                        DIR against its sidecar ckptspec.json/.msgpack, or
                                        against a manifest generated from DeepSpeed's metadata
    validate DCP_DIR                    a torch DCP checkpoint (.metadata): its files against
                                        .metadata, read without running its pickle

    MANIFEST and DIR may be URLs (s3://, gs://, hf://, https://...; docs/remote.md): only what is
    checked is fetched, and the report says how many bytes that was.
    """
    from ..checkpoint.dcp.metadata import is_dcp
    from ..location import is_directory, is_remote

    remote = is_remote(target) or is_remote(checkpoint)  # then the report says what was fetched
    _json_errors_about(target, output_format, remote)
    try:
        is_dir = checkpoint is None and is_directory(target)
        dcp = is_dir and is_dcp(target)  # a torch DCP checkpoint, local or at a URL
    except CkptspecError as exc:
        _emit(output_format, target, [], exc, remote)
        sys.exit(exc.exit_code)
    if dcp:
        _validate_dcp(target, output_format, tag, remote)
    if checkpoint is None and not is_dir and (tag is not None or no_hash):
        raise click.UsageError(
            "--tag and --no-hash need a checkpoint: validate DIR, or validate MANIFEST --checkpoint DIR"
        )
    if checkpoint is None and not is_dir:
        try:  # the verdict only: no models to build (they cost more than the rules)
            report = _validate_document_file(target, max_size, encoding)
        except CkptspecError as exc:
            _emit(output_format, target, [], exc, remote)
            sys.exit(exc.exit_code)
        _emit(output_format, target, report.findings, None, remote)
        sys.exit(EXIT_OK if report.ok else EXIT_INVALID)

    from ..deepspeed.kinds import described_by_index
    from ..format.codec import gc_paused

    shown = checkpoint if checkpoint is not None else target
    try:
        manifest = None
        if checkpoint is not None:
            manifest = _validate_document_file(target, max_size, encoding, build_model=True)
            if not manifest.ok or manifest.manifest is None:
                _emit(output_format, target, manifest.findings, None, remote)
                sys.exit(EXIT_INVALID)
            if _is_dcp_report(manifest):
                _validate_dcp_against(manifest.manifest, checkpoint, output_format, tag, no_hash, remote)
        _json_errors_about(shown, output_format, remote)  # the report is about DIR from here
        # The report is handed over: the manifest is not validated a second time.
        if described_by_index(shown, manifest, tag):  # the checkpoint index and every domain's files
            from ..deepspeed.check.checkpoint_index import index_files_bytes, validate_index_checkpoint

            with gc_paused(for_good=True):  # the command ends after it
                index, findings = validate_index_checkpoint(shown, manifest, tag, verify_hashes=not no_hash)
            checkpoint_bytes = index_files_bytes(index) if index is not None else None
        else:
            with gc_paused(for_good=True):  # large acyclic trees, and the command ends after them
                early = manifest is None and not is_remote(shown)
                states = read_tag_dir_early(shown, tag, "ckptspec.deepspeed.check.zero") if early else None
                from ..deepspeed.check.zero import validate_checkpoint

                found, findings = validate_checkpoint(shown, manifest, tag, verify_hashes=not no_hash, states=states)
                keep_until_exit(manifest, states, found)
            checkpoint_bytes = sum(f.size for f in found.files) if found else None
    except CkptspecError as exc:
        _emit(output_format, shown, [], exc, remote)
        sys.exit(exc.exit_code)
    _emit(output_format, shown, findings, None, remote, checkpoint_bytes)
    sys.exit(EXIT_INVALID if has_errors(findings) else EXIT_OK)


def _validate_dcp(target: str, output_format: str, tag: str | None, remote: bool) -> NoReturn:
    """A torch DCP checkpoint: ``.metadata`` read without running it, the files checked against it (CK250-CK254).
    Its bytes entries (pickles) are read by the restricted reader: plain values only (CK204 names any global).
    At a URL the report says what was fetched, of how many bytes of files (docs/remote.md)."""
    from ..checkpoint.dcp.checks import bytes_entries, check_dcp, files_bytes
    from ..location import location

    if tag is not None:
        raise click.UsageError("--tag names a DeepSpeed tag directory; a DCP checkpoint (.metadata) has none")
    try:
        where = location(target)
        meta, findings = check_dcp(where)
        checkpoint_bytes = files_bytes(where, meta) if remote else None
    except CkptspecError as exc:
        _emit(output_format, target, [], exc, remote)
        sys.exit(exc.exit_code)
    listed = bytes_entries(meta)
    if output_format == "text" and meta.megatron is not None:
        click.echo(f"{target}: Megatron-core torch_dist: metadata.json and common.pt read, nothing run")
    if output_format == "text" and listed:
        shown = ", ".join(listed[:3]) + (f", ... ({len(listed) - 3} more)" if len(listed) > 3 else "")
        click.echo(
            f"{target}: {len(listed)} bytes entries (pickles, read by the restricted reader, nothing run): {shown}"
        )
    _emit(output_format, target, findings, None, remote, checkpoint_bytes)
    sys.exit(EXIT_INVALID if has_errors(findings) else EXIT_OK)


def _is_dcp_report(report) -> bool:
    from ..format.dcp_validate import DcpReport

    return isinstance(report, DcpReport)


def _validate_dcp_against(document, checkpoint: str, output_format: str, tag, no_hash: bool, remote: bool) -> NoReturn:
    """A torch DCP checkpoint's files against its document (``ckptspec.dcp``): ``.metadata`` and the files checked
    as ``validate DCP_DIR`` checks them, then against the document (CK255-CK257)."""
    from pathlib import Path

    from ..checkpoint.dcp.against import check_against_document
    from ..checkpoint.dcp.metadata import is_dcp

    if tag is not None:
        raise click.UsageError("--tag names a DeepSpeed tag directory; a DCP checkpoint (.metadata) has none")
    if remote or not is_dcp(checkpoint):
        raise click.UsageError(f"{checkpoint}: a DCP document is checked against a local DCP directory (.metadata)")
    try:
        _, findings = check_against_document(Path(checkpoint), document, verify_hashes=not no_hash)
    except CkptspecError as exc:
        _emit(output_format, checkpoint, [], exc)
        sys.exit(exc.exit_code)
    _emit(output_format, checkpoint, findings)
    sys.exit(EXIT_INVALID if has_errors(findings) else EXIT_OK)


def _json_errors_about(target: str, output_format: str, remote: bool) -> None:
    """An error no handler here catches (an internal one, CK999) is still one JSON report about ``target``."""
    if output_format == "json":
        json_error_with(lambda error: _emit("json", target, [], error, remote))


def _validate_document_file(target: str, max_size: int, encoding: Encoding | None, *, build_model: bool = False):
    """A manifest's report, or a checkpoint index's (``documents.validate_file`` tells them apart)."""
    from ..format.codec import gc_paused
    from ..format.documents import validate_file

    with gc_paused(for_good=True):  # a one-shot command: see codec.gc_paused
        return validate_file(target, max_size, encoding, build_model=build_model)


def _emit(
    output_format: str,
    target: str,
    findings: list[Finding],
    error: CkptspecError | None = None,
    remote: bool = False,
    checkpoint_bytes: int | None = None,
) -> None:
    fetched = None
    if remote:
        from ..location import fetched as fetched_so_far

        done = fetched_so_far()
        fetched = {"bytes": done.bytes, "requests": done.requests}
        if checkpoint_bytes:
            fetched["checkpoint_bytes"] = checkpoint_bytes
    if output_format == "json":
        echo_json(validation_report(target, findings, error, fetched))
        return
    echo_findings(findings, target)
    if error is not None:
        click.echo(error_line(error, target), err=True)
    elif not has_errors(findings):
        click.echo(f"{target}: valid")
    if fetched is not None:
        click.echo(fetched_line(target, fetched))
