"""``ckptspec export``: a checkpoint of any kind as a PyTorch Distributed Checkpoint (see docs/fsdp2.md)."""

from __future__ import annotations

import sys

import click

from ..errors import CheckpointInvalid, CkptspecError
from ._common import EXIT_INVALID, OUTPUT_DIR, echo_findings, fail, fail_write


@click.command()
@click.argument("checkpoint", metavar="CHECKPOINT")
@click.argument("output", metavar="OUTPUT", type=OUTPUT_DIR)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["dcp"]),
    default="dcp",
    show_default=True,
    help="dcp: a torch.distributed.checkpoint directory with get_state_dict's keys (model.*, optim.*).",
)
@click.option(
    "--manifest",
    default=None,
    metavar="M",
    help="Export as this manifest describes (checked against the files first; format 1.1). "
    "Default: generate it from CHECKPOINT.",
)
@click.option("--tag", default=None, help="Tag directory to read (default: the one named by 'latest').")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar and no summary.")
def export(checkpoint: str, output: str, fmt: str, manifest: str | None, tag: str | None, quiet: bool) -> None:
    """Write a DeepSpeed CHECKPOINT of any kind as the PyTorch Distributed Checkpoint directory OUTPUT.

    The checkpoint is validated first: on any error finding nothing is written and the exit
    code is 1. OUTPUT holds the fp32 masters, frozen parameters, buffers, Adam's moments and step
    and the param groups under the keys get_state_dict(model, optimizer) gives for an FSDP2 model,
    so an FSDP2 job of any world size loads it with dcp.load and set_state_dict. Needs torch.
    What DCP does not carry (loss scaler, gradient clipping, counters) is listed in the summary.
    """
    from ..export.checkpoint import open_checkpoint, require
    from ..export.dcp import held_export_output, plan_dcp, write_dcp
    from ..export.progress import progress_printer
    from ..export.writers import torch_available

    if not torch_available():
        raise click.UsageError("--format dcp needs torch (pip install torch)")
    try:
        require("export_dcp", checkpoint, manifest, tag)  # CK403 before anything is read or written
        with held_export_output(output) as held:  # for the whole run: a second one is CK908 at once
            try:
                opened = open_checkpoint(checkpoint, document=manifest, tag=tag)
            except CheckpointInvalid as exc:
                echo_findings(exc.findings, manifest or checkpoint, err=True, always_name_target=False)
                click.echo(f"{checkpoint}: not exported: the checkpoint has errors; nothing was written", err=True)
                sys.exit(EXIT_INVALID)
            echo_findings(opened.findings, manifest or checkpoint, err=True, always_name_target=False)
            total = plan_dcp(opened).nbytes  # refused (CK402) before anything is written
            update, close = progress_printer(total, enabled=not quiet and sys.stderr.isatty())
            try:
                result = write_dcp(opened, output, progress=update, held=held)
            finally:
                close()
    except CkptspecError as exc:
        fail(exc)
    except OSError as exc:
        fail_write(output, exc)
    if not quiet:
        click.echo(
            f"{result.output_dir}: wrote a {fmt} checkpoint: {result.tensors} tensors "
            f"({result.nbytes / 2**20:.1f} MiB) in {result.files} files"
        )
        for line in result.not_carried:
            click.echo(f"  not carried: {line}")
