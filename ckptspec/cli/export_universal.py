"""``ckptspec export-universal``: DeepSpeed's universal checkpoint folder from a ZeRO checkpoint (docs/reshard.md)."""

from __future__ import annotations

import click

from ..export.torchrun import torchrun_share
from ._common import OUTPUT_DIR, echo_split, writing_deepspeed_files


@click.command("export-universal")
@click.argument("checkpoint", metavar="CHECKPOINT")
@click.argument("output", metavar="OUTPUT", type=OUTPUT_DIR)
@click.option("--tag", default=None, help="Tag directory to read (default: the one named by 'latest').")
@click.option(
    "--manifest",
    default=None,
    metavar="M",
    help="Read CHECKPOINT as this manifest describes (checked against the files first). Default: its own.",
)
def export_universal(checkpoint: str, output: str, tag, manifest) -> None:
    """Write CHECKPOINT as DeepSpeed's universal checkpoint folder OUTPUT (what ds_to_universal writes).

    The source is validated first (digests included); on any error finding, or a checkpoint the
    folder cannot be written for (CK410), nothing is written and the exit code is 1. A job with
    `checkpoint.load_universal: true` then loads it at any world size and ZeRO stage 1 or 2: put
    OUTPUT's name in a `latest_universal` file beside it and call engine.load_checkpoint(OUTPUT's
    parent). Positions come from the manifest, so round-robin checkpoints give the saved values.
    Under torchrun the processes share the work, as for reshard: each writes every N-th file.
    """
    from ..export.api import export_universal as run

    with writing_deepspeed_files(checkpoint, output, manifest, "not exported"), torchrun_share() as share:
        result = run(checkpoint, output, tag=tag, manifest=manifest)
        shares = share.report()
    if not share.first:
        return
    click.echo(
        f"{result.output}: universal checkpoint of {result.tag} ({result.params} parameters); load it with "
        f"checkpoint.load_universal: true and a latest_universal file naming '{result.output.name}'"
    )
    echo_split(shares)
