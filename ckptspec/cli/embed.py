"""``ckptspec convert``, ``embed``, ``extract`` and ``migrate``: manifests that travel with checkpoints.

Problems are one line each, ``file: CODE message (hint: ...)``, on stderr (stdout carries
the document when one is printed); exit codes as for every command (``_common``).
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, NoReturn

import click

from ..errors import CkptspecError
from ..findings import Finding, has_errors
from ..format.codec import DEFAULT_MAX_BYTES, dumps, encoding_for_output, load_document, write_manifest
from ._common import ENCODING_CHOICE, EXIT_INVALID, EXIT_OK, OUTPUT_FILE, echo_findings, fail, tag_needs_a_directory

if TYPE_CHECKING:
    from ..format.codec import Encoding


def _show(target: str, findings: list[Finding], err: bool = True) -> None:
    echo_findings(findings, target, err=err, always_name_target=False)


def _check_input(name: str, doc) -> None:
    """The reader's gate for every command here: version first, then schema and rules (a
    checkpoint index's own: it is converted as a manifest is)."""
    from ..format.documents import validate_at_own_version

    findings = validate_at_own_version(doc)
    _show(name, findings)
    if has_errors(findings):
        sys.exit(EXIT_INVALID)


def _not_written(checkpoint: str, exc, not_done: str) -> NoReturn:
    """The files no longer match the record a command would replace or build on (``RecordMismatch``)."""
    _show(checkpoint, exc.findings)
    hint = exc.hint.replace("CHECKPOINT", checkpoint)
    click.echo(f"{checkpoint}: {not_done}: {exc.what}; nothing was written (hint: {hint})", err=True)
    sys.exit(EXIT_INVALID)


def _write(doc, output: str, encoding: Encoding | None) -> int:
    write_manifest(doc, output, encoding)
    return len(dumps(doc, encoding_for_output(output, encoding))) if output != "-" else 0


@click.command()
@click.argument("source", metavar="IN")
@click.argument("output", metavar="OUT", type=OUTPUT_FILE)
@click.option(
    "--encoding",
    type=ENCODING_CHOICE,
    default=None,
    help="Encoding of OUT (default: by its extension, .msgpack/.mpk or JSON; '-' is stdout).",
)
@click.option(
    "--input-encoding",
    type=ENCODING_CHOICE,
    default=None,
    help="Override the encoding guessed from IN's extension and first byte.",
)
def convert(source: str, output: str, encoding: Encoding | None, input_encoding: Encoding | None) -> None:
    """Re-encode a manifest or checkpoint index, JSON <-> msgpack, losslessly.

    IN is validated first (an invalid document is not converted); OUT is canonical
    (sorted keys; JSON is UTF-8 with a two-space indent) and written atomically.
    Fields a newer minor version added are kept as they are.
    """
    try:
        doc = load_document(source, DEFAULT_MAX_BYTES, input_encoding)
        _check_input(source, doc)
        size = _write(doc, output, encoding)
    except CkptspecError as exc:
        fail(exc, source)
    if output != "-":
        click.echo(f"{output}: written ({encoding_for_output(output, encoding)}, {size} bytes)")


@click.command()
@click.argument("checkpoint", metavar="CHECKPOINT")
@click.option(
    "--manifest",
    "manifest_path",
    default=None,
    metavar="M",
    help="Embed this manifest (or, for a checkpoint an index describes, this index): it must describe the checkpoint.",
)
@click.option("--tag", default=None, help="Tag directory (default: the one named by 'latest').")
@click.option(
    "--encoding",
    type=ENCODING_CHOICE,
    default="json",
    show_default=True,
    help="Sidecar encoding: ckptspec.json or ckptspec.msgpack.",
)
@click.option("--no-hash", is_flag=True, help="Do not record SHA-256 hashes of the files (faster).")
@click.option("--sidecar-only", is_flag=True, help="Write the sidecar only; leave the model-states files untouched.")
@click.option(
    "--rehash",
    is_flag=True,
    help="Record the files as they are now even where they no longer match the sizes, hashes or digests "
    "recorded (without it, embed refuses).",
)
def embed(
    checkpoint: str,
    manifest_path: str | None,
    tag: str | None,
    encoding: Encoding,
    no_hash: bool,
    sidecar_only: bool,
    rehash: bool,
) -> None:
    """Add a manifest to an existing DeepSpeed checkpoint.

    The layout manifest goes into each model-states file's client state (key
    'ckptspec_manifest'; every other byte of the file is kept), then the complete
    manifest (files, sizes, hashes, locators) is written last, atomically, as the
    sidecar ckptspec.json of the tag directory. What is recorded already (the sidecar;
    M when it lists files) is checked against the files first, hashes and digests
    included: if they no longer match it, nothing is written (exit 1) unless --rehash.

    A checkpoint at an object store's URL (s3://...) takes --sidecar-only: the sidecar
    is uploaded last, as one verified object (the model-states objects are not rewritten).

    A tensor/pipeline-parallel, MoE or ZeRO stage-0 checkpoint takes --sidecar-only too:
    its checkpoint index (as `ckptspec generate` makes it) is written as the sidecar.
    """
    from ..deepspeed.embed import embed_checkpoint
    from ..deepspeed.embed_index import files_recorded
    from ..errors import RecordMismatch
    from ..format.index_validate import is_index

    try:
        manifest = None
        if manifest_path is not None:
            manifest = load_document(manifest_path)
            _check_input(manifest_path, manifest)
        # At a URL: the sidecar only, uploaded (without --sidecar-only: CK916, by name)
        result = embed_checkpoint(
            checkpoint,
            manifest,
            tag=tag,
            hash_algorithm=None if no_hash else "sha256",
            encoding=encoding,
            model_states=not sidecar_only,
            rehash=rehash,
        )
    except RecordMismatch as exc:
        _not_written(checkpoint, exc, "not embedded")
    except CkptspecError as exc:
        fail(exc, checkpoint)
    _show(checkpoint, result.replaced)
    for path in result.model_states:
        click.echo(f"{path}: manifest embedded in the client state")
    codes = ", ".join(dict.fromkeys(f.code for f in result.replaced))
    again = f"; re-recorded from the files as they are now ({codes} against the previous record)" if codes else ""
    what = "checkpoint index, " if is_index(result.manifest) else ""
    click.echo(f"{result.sidecar}: written ({what}{files_recorded(result.manifest)} files{again})")


@click.command()
@click.argument("target", metavar="FILE_OR_DIR")
@click.option("--tag", default=None, help="With a DeepSpeed save directory: the tag directory (default: 'latest').")
@click.option(
    "-o",
    "--output",
    type=OUTPUT_FILE,
    default="-",
    show_default="stdout",
    help="Write the manifest here (.json or .msgpack).",
)
@click.option(
    "--encoding", type=ENCODING_CHOICE, default=None, help="Output encoding (default: by extension; stdout is JSON)."
)
@click.option("--list", "list_copies", is_flag=True, help="List every copy found and whether they agree, instead.")
def extract(target: str, tag: str | None, output: str, encoding: Encoding | None, list_copies: bool) -> None:
    """Print the manifest embedded in a checkpoint or file.

    \b
    FILE_OR_DIR is one of:
      a DeepSpeed save or tag directory  sidecar and model-states client state(s)
      a *_model_states.pt file           its client state
      a .safetensors file                its __metadata__ (key ckptspec.manifest)
      a directory of .safetensors files  their __metadata__ (and a sidecar, if any)

    The most complete copy is printed (the sidecar when there is one). When several
    copies exist they must agree (CK301, exit 1, otherwise).
    """
    from ..checkpoint.embedded import agreement_findings, best_copy
    from ..deepspeed.check.copies import find_copies
    from ..errors import EmbedError
    from ..format.version import version_findings

    if tag is not None and "://" not in target and os.path.exists(target) and not os.path.isdir(target):
        raise tag_needs_a_directory(target)
    try:
        copies = find_copies(target, tag)
    except CkptspecError as exc:
        fail(exc, target)
    if not copies:
        hint = "add one with `ckptspec embed CHECKPOINT`, or save with ckptspec.deepspeed.save_checkpoint"
        if _index_kind(target, tag):  # embed writes these only as the sidecar: the hint says so
            hint = (
                "write its checkpoint index as the sidecar with `ckptspec embed CHECKPOINT --sidecar-only`, "
                "or save with ckptspec.deepspeed.save_checkpoint"
            )
        fail(EmbedError("CK303", "no embedded manifest found", hint, target))
    disagree = agreement_findings(copies)
    if list_copies:
        for found in copies:
            click.echo(f"{found.source}: {found.kind}, {_contents(found.document)}")
        _show(target, disagree, err=False)
        if not disagree:
            click.echo(f"{target}: {len(copies)} cop{'y' if len(copies) == 1 else 'ies agree'}")
        sys.exit(EXIT_INVALID if disagree else EXIT_OK)
    if disagree:
        _show(target, disagree)
        sys.exit(EXIT_INVALID)
    chosen = best_copy(copies)
    doc = chosen.document
    gate, stop = version_findings(doc) if isinstance(doc, dict) else ([], False)
    _show(chosen.source, gate)
    if stop:
        sys.exit(EXIT_INVALID)
    try:
        _write(doc, output, encoding)
    except CkptspecError as exc:
        fail(exc, chosen.source)


def _index_kind(target: str, tag: str | None) -> bool:
    """A local checkpoint a checkpoint index describes (tensor/pipeline parallel, MoE, stage 0, universal)."""
    from ..deepspeed.kinds import described_by_index

    if "://" in target or not os.path.isdir(target):
        return False
    try:
        return described_by_index(target, None, tag)
    except OSError:
        return False


def _contents(doc) -> str:
    """What a copy holds, in a few words: its document, version and size."""
    from ..format.index_validate import is_index

    doc = doc if isinstance(doc, dict) else {}
    version = doc.get("format_version", "?")
    if is_index(doc):
        domains = doc.get("domains")
        return f"checkpoint index {version}, {len(domains) if isinstance(domains, list) else '?'} domains"
    files = doc.get("files")
    return f"format {version}, {len(files) if isinstance(files, list) else '?'} files"


def _filled(doc: dict, checkpoint: str, tag: str | None, source: str) -> dict:
    """``doc`` with 1.1's fields from the checkpoint, checked like any migration's result."""
    from ..deepspeed.upgrade import fill_from_checkpoint
    from ..errors import MigrationError
    from ..format.validate import validate_document

    filled = fill_from_checkpoint(doc, checkpoint, tag)
    errors = [f for f in validate_document(filled).findings if f.severity == "error"]
    if errors:
        raise MigrationError(
            "CK312",
            f"the filled document is not valid: {errors[0].path}: {errors[0].code} {errors[0].message}",
            "this is a bug in ckptspec; the output was not written",
            source,
        )
    return filled


@click.command()
@click.argument("source", metavar="IN")
@click.argument("output", metavar="OUT", type=OUTPUT_FILE)
@click.option("--to", "to_version", required=True, metavar="VERSION", help="Target format version, e.g. 1.0 or 1.0.0.")
@click.option("--encoding", type=ENCODING_CHOICE, default=None, help="Encoding of OUT (default: by its extension).")
@click.option(
    "--checkpoint",
    default=None,
    metavar="DIR",
    help="Going up to 1.1: fill 1.1's fields (locators, optimizer state, counters, digests) from this checkpoint.",
)
@click.option("--tag", default=None, help="Tag directory of --checkpoint (default: the one named by 'latest').")
def migrate(
    source: str, output: str, to_version: str, encoding: Encoding | None, checkpoint: str | None, tag: str | None
) -> None:
    """Rewrite a manifest in another format version.

    Follows the registered migrations (docs/versioning.md). IN is checked against its
    own version first and OUT against the target version before it is written; a
    field the target version has no place for is reported (CK313 warning). A checkpoint
    index: the manifest of each of its domains is migrated (the index keeps its version).
    """
    from ..errors import InvalidInput, MigrationError, RecordMismatch
    from ..format.documents import migrate as migrate_either
    from ..format.index_migrate import domain_versions
    from ..format.index_validate import is_index
    from ..format.version import version_key

    try:
        target = version_key(to_version)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--to") from None
    if checkpoint is not None and target == "1.0":
        raise click.BadParameter("format 1.0 has no field the checkpoint fills", param_hint="--checkpoint")
    try:
        doc = load_document(source)
        if checkpoint is not None and is_index(doc):
            raise MigrationError(
                "CK311",
                "--checkpoint fills the 1.1 fields of one ZeRO checkpoint's manifest; the manifests of a "
                "checkpoint index's domains are filled by describing the checkpoint again",
                "`ckptspec generate CHECKPOINT -o index.json` writes its index with 1.1 manifests; "
                "without --checkpoint, migrate raises every domain's manifest to the target version",
                source,
            )
        result = migrate_either(doc, target, source)
        if checkpoint is not None:
            result.document = _filled(result.document, checkpoint, tag, source)
    except InvalidInput as exc:
        _show(source, exc.findings)
        sys.exit(EXIT_INVALID)
    except RecordMismatch as exc:  # raised by _filled: only with --checkpoint
        _not_written(checkpoint or source, exc, "not migrated")
    except CkptspecError as exc:
        fail(exc, source)
    _show(source, result.findings)
    try:
        _write(result.document, output, encoding)
    except CkptspecError as exc:
        fail(exc, output)
    if output != "-":
        if is_index(result.document):  # the distinct steps of its domains
            steps = ", ".join(f"{a} -> {b}" for a, b in result.steps) or "no change"
            versions = ", ".join(domain_versions(result.document))
            count = len(result.document["domains"])
            click.echo(
                f"{output}: checkpoint index {result.document['format_version']}, "
                f"{count} domain manifest{'s' if count != 1 else ''} at format {versions} ({steps})"
            )
        else:
            steps = " -> ".join([result.steps[0][0]] + [b for _, b in result.steps]) if result.steps else "no change"
            click.echo(f"{output}: format {result.document['format_version']} ({steps})")
