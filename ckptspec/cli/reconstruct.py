"""``ckptspec reconstruct``: consolidated weights from a ZeRO checkpoint (see docs/reconstruct.md)."""

from __future__ import annotations

import functools
import sys

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
    from ..checkpoint.states import StateCache
    from ..deepspeed.check.zero import validate_checkpoint
    from ..export.optimizer_state import plan_optimizer_state
    from ..export.plan import plan_reconstruction
    from ..export.progress import progress_printer
    from ..export.writers import torch_available, write_consolidated
    from ..findings import has_errors
    from ..format.dtypes import output_dtype
    from ..location import fetched, is_remote, refuse_write

    if fmt == "torch" and not torch_available():
        raise click.UsageError("--format torch needs torch (pip install torch); --format safetensors does not")
    if _is_index_target(checkpoint, manifest, tag):
        options = {"fmt": fmt, "untie": untie, "optimizer_state": optimizer_state, "max_shard_size": max_shard_size}
        options["jobs"] = jobs
        _reconstruct_index(checkpoint, output_dir, manifest, tag, dtype, quiet, options)
        return
    try:
        refuse_write(output_dir, "the reconstruction")  # before anything is fetched
        states = StateCache()  # what validation reads, the plan reuses
        # Tensor digests are checked while the tensors stream, not in a pass of their own; so are a
        # remote checkpoint's file hashes, so that each byte is fetched once (ShardReader.verify).
        in_stream = is_remote(checkpoint)
        found, findings = validate_checkpoint(
            checkpoint, manifest, tag, states=states, verify_hashes=not in_stream, verify_digests=False
        )
        echo_findings(findings, manifest or checkpoint, err=True, always_name_target=False)
        if found is None or has_errors(findings):
            click.echo(f"{checkpoint}: not reconstructed: the checkpoint has errors; nothing was written", err=True)
            sys.exit(EXIT_INVALID)
        plan = plan_reconstruction(checkpoint, found, tag, states=states, hashes_in_stream=in_stream)
        if optimizer_state:
            plan_optimizer_state(plan)  # refused before anything is written
        total = plan.total_numel(untie)  # elements written; the bar counts output bytes
        update, close = progress_printer(
            plan.total_nbytes(output_dtype(dtype), untie), enabled=not quiet and sys.stderr.isatty()
        )
        try:
            result = write_consolidated(
                plan,
                output_dir,
                dtype=dtype,
                max_shard_size=max_shard_size,
                fmt=fmt,
                untie=untie,
                progress=update,
                optimizer_state=optimizer_state,  # one more file of the same commit
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
            f"{result.output_dir}: wrote {result.tensors} tensors ({result.nbytes / 2**20:.1f} MiB, {total} elements) "
            f"to {files}{source}"
        )


def _is_index_target(checkpoint: str, manifest: str | None, tag: str | None) -> bool:
    """A tensor/pipeline-parallel checkpoint (or a checkpoint index given with --manifest)."""
    from ..deepspeed.kinds import needs_index
    from ..deepspeed.layout.tag_dir import resolve_tag_dir
    from ..format.codec import read_document
    from ..format.index_validate import is_index

    try:
        if manifest is not None:
            return is_index(read_document(manifest)[0])
        return needs_index(resolve_tag_dir(checkpoint, tag))
    except CkptspecError:
        return False  # the ordinary path reports it


def _reconstruct_index(checkpoint, output_dir, manifest, tag, dtype, quiet, options) -> None:
    """The whole model of a tensor/pipeline-parallel checkpoint, composed from every rank's shards."""
    from ..export.compose import reconstruct_index
    from ..format.index_validate import validate_index_file

    try:
        index = None
        if manifest is not None:
            index = validate_index_file(manifest)
            if not index.ok:
                echo_findings(index.findings, manifest, err=True, always_name_target=False)
                click.echo(f"{checkpoint}: not reconstructed: the index has errors; nothing was written", err=True)
                sys.exit(EXIT_INVALID)
        warn = functools.partial(echo_findings, target=manifest or checkpoint, err=True, always_name_target=False)
        result = reconstruct_index(checkpoint, output_dir, index=index, tag=tag, dtype=dtype, warn=warn, **options)
    except CheckpointInvalid as exc:
        echo_findings(exc.findings, manifest or checkpoint, err=True, always_name_target=False)
        click.echo(f"{checkpoint}: not reconstructed: the checkpoint has errors; nothing was written", err=True)
        sys.exit(EXIT_INVALID)
    except CkptspecError as exc:
        fail(exc)
    except OSError as exc:
        fail_write(output_dir, exc)
    if not quiet:
        from ..location import fetched, is_remote

        files = ", ".join(result.files + ([result.index] if result.index else []))
        done = fetched()
        source = f"; fetched {done.bytes:,} bytes in {done.requests:,} requests" if is_remote(checkpoint) else ""
        click.echo(
            f"{result.output_dir}: wrote {result.tensors} tensors ({result.nbytes / 2**20:.1f} MiB, "
            f"{result.numel} elements) to {files}{source}"
        )
