"""``ckptspec reconstruct``: consolidated weights from a ZeRO checkpoint (see docs/reconstruct.md)."""

from __future__ import annotations

import sys
from typing import NoReturn

import click

from ..errors import CheckpointInvalid, CkptspecError
from ._common import EXIT_INVALID, OUTPUT_DIR, SIZE, echo_findings, fail, fail_write


@click.command()
@click.argument("checkpoint", metavar="CHECKPOINT")
@click.argument("output_dir", metavar="OUTPUT_DIR", type=OUTPUT_DIR)
@click.option(
    "--manifest",
    default=None,
    metavar="M",
    help="Reconstruct as this manifest describes (checked against the files first). "
    "Default: generate it from CHECKPOINT.",
)
@click.option("--tag", default=None, help="Tag directory to read (default: the one named by 'latest').")
@click.option(
    "--dtype",
    type=click.Choice(["fp32", "bf16", "fp16"]),
    default="fp32",
    show_default=True,
    help="Dtype of floating tensors in the output (integer buffers keep theirs).",
)
@click.option(
    "--max-shard-size",
    type=SIZE,
    default="5G",
    show_default=True,
    help="Split the output into shards of at most this size, plus an index (Hugging Face layout).",
)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["safetensors", "torch"]),
    default="safetensors",
    show_default=True,
    help="safetensors (no torch needed), or torch.save files (needs torch).",
)
@click.option(
    "--untie",
    is_flag=True,
    help="Write tied weights as separate copies instead of once with the tie recorded in the metadata.",
)
@click.option(
    "--optimizer-state",
    is_flag=True,
    help="Also write the per-parameter optimizer state (exp_avg, ...) and its per-group scalars as "
    "optimizer.safetensors (format 1.1 manifests).",
)
@click.option(
    "--jobs",
    "-j",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Threads writing each safetensors file (local checkpoints). Pays where tensors are cast or "
    "hashed; a plain copy is limited by the disk (docs/performance.md).",
)
@click.option("-q", "--quiet", is_flag=True, help="No progress bar and no summary.")
def reconstruct(
    checkpoint: str,
    output_dir: str,
    manifest: str | None,
    tag: str | None,
    dtype: str,
    max_shard_size: int,
    fmt: str,
    untie: bool,
    optimizer_state: bool,
    jobs: int,
    quiet: bool,
) -> None:
    """Write the full weights of a DeepSpeed ZeRO CHECKPOINT (a directory or a URL) into OUTPUT_DIR.

    The checkpoint is validated first: on any error finding nothing is written and
    the exit code is 1. Trainable parameters come from the fp32 master weights,
    frozen parameters from the model weights (any stage), plus persistent buffers
    and tied aliases. Needs neither DeepSpeed nor torch (except --format torch)
    and never executes pickled code.
    """
    from ..checkpoint.dcp.metadata import is_dcp

    try:
        dcp = is_dcp(checkpoint)  # a torch DCP checkpoint (.metadata), local or at a URL
    except CkptspecError as exc:  # a URL that cannot be read: its code
        fail(exc)
    if dcp:
        _reconstruct_dcp(checkpoint, output_dir, quiet, manifest, tag, dtype, fmt, optimizer_state)
    from ..export.checkpoint import open_checkpoint
    from ..export.progress import progress_printer
    from ..export.writers import torch_available
    from ..format.dtypes import output_dtype
    from ..location import fetched, is_remote, writable

    if fmt == "torch" and not torch_available():
        raise click.UsageError("--format torch needs torch (pip install torch); --format safetensors does not")
    try:
        writable(output_dir, "the reconstruction")  # CK916 (HTTP), CK917, before anything is fetched
        try:
            # Tensor digests are checked while the tensors stream, not in a pass of their own; so are a
            # remote checkpoint's file hashes, so that each byte is fetched once (ShardReader.verify).
            opened = open_checkpoint(checkpoint, document=manifest, tag=tag)
        except CheckpointInvalid as exc:
            echo_findings(exc.findings, manifest or checkpoint, err=True, always_name_target=False)
            click.echo(f"{checkpoint}: not reconstructed: the checkpoint has errors; nothing was written", err=True)
            sys.exit(EXIT_INVALID)
        echo_findings(opened.findings, manifest or checkpoint, err=True, always_name_target=False)
        plan = opened.plan
        update, close = progress_printer(
            plan.total_nbytes(output_dtype(dtype), untie), enabled=not quiet and sys.stderr.isatty()
        )
        try:
            result = opened.reconstruct(
                output_dir,
                dtype=dtype,
                max_shard_size=max_shard_size,
                fmt=fmt,
                untie=untie,
                progress=update,
                optimizer_state=optimizer_state,  # one more file of the same commit; refused before any write
                jobs=jobs,
            )
        finally:
            close()
    except CkptspecError as exc:
        fail(exc)
    except OSError as exc:
        fail_write(output_dir, exc)
    if not quiet:
        files = ", ".join(result.files + ([result.index] if result.index else []))
        done = fetched()
        source = f"; fetched {done.bytes:,} bytes in {done.requests:,} requests" if is_remote(checkpoint) else ""
        click.echo(
            f"{result.output_dir}: wrote {result.tensors} tensors ({result.nbytes / 2**20:.1f} MiB, "
            f"{result.numel} elements) to {files}{source}"
        )


def _check_dcp_document(checkpoint: str, manifest: str) -> None:
    """``--manifest`` of a DCP checkpoint: a valid DCP document (``ckptspec.dcp``) that the directory matches, or
    ``CheckpointInvalid`` with the findings (the document's, or the directory's against it)."""
    from pathlib import Path

    from ..checkpoint.dcp.against import check_against_document
    from ..findings import has_errors
    from ..format.dcp_validate import DcpReport
    from ..format.documents import validate_file
    from ..location import is_remote

    if is_remote(checkpoint):
        raise click.UsageError(f"{checkpoint}: --manifest checks a local DCP directory only; leave it out for a URL")
    report = validate_file(manifest)
    if not isinstance(report, DcpReport):
        raise click.UsageError(f"{manifest}: a DCP checkpoint is reconstructed as a DCP document (ckptspec.dcp) says")
    if not report.ok or report.document is None:
        raise CheckpointInvalid(report.findings, manifest)
    _, findings = check_against_document(Path(checkpoint), report.document)
    if has_errors(findings):
        raise CheckpointInvalid(findings, checkpoint)


def _reconstruct_dcp(checkpoint, output_dir, quiet, manifest, tag, dtype, fmt, optimizer_state) -> NoReturn:
    """A torch DCP checkpoint's model weights, at their saved dtype, as OUTPUT_DIR/model.safetensors, and with
    --optimizer-state its optimizer state as OUTPUT_DIR/optimizer.safetensors (issue #42); with --manifest, after the
    directory is checked against that DCP document."""
    from ..export.dcp_input import reconstruct_dcp

    refused = {
        "--tag": tag is not None,
        "--dtype other than fp32": dtype != "fp32",
        "--format torch": fmt == "torch",
    }
    named = [option for option, given in refused.items() if given]
    if named:
        raise click.UsageError(
            f"{', '.join(named)}: not for a DCP checkpoint (.metadata) yet; it writes the model's tensors at their "
            "saved dtype to model.safetensors (and optimizer.safetensors)"
        )
    try:
        if manifest is not None:  # the directory must be the document's save (CK255-CK257) before anything is written
            _check_dcp_document(checkpoint, manifest)
        result = reconstruct_dcp(checkpoint, output_dir, optimizer_state=optimizer_state)
    except CheckpointInvalid as exc:
        echo_findings(exc.findings, checkpoint, err=True)
        click.echo(f"{checkpoint}: not reconstructed: the checkpoint has errors; nothing was written", err=True)
        sys.exit(EXIT_INVALID)
    except CkptspecError as exc:
        fail(exc)
    except OSError as exc:
        fail_write(output_dir, exc)
    if not quiet:
        from ..location import fetched, is_remote

        done = fetched()
        source = f"; fetched {done.bytes:,} bytes in {done.requests:,} requests" if is_remote(checkpoint) else ""
        click.echo(
            f"{result.output_dir}: wrote {result.tensors} tensors ({result.nbytes / 2**20:.1f} MiB) "
            f"to {', '.join(result.files)}{source}"
        )
    sys.exit(0)
