"""``ckptspec generate``: a manifest describing a saved DeepSpeed checkpoint directory."""

from __future__ import annotations

import sys
from typing import NoReturn

import click

from ..errors import CheckpointInvalid, CkptspecError
from ._common import EXIT_INVALID, OUTPUT_FILE, echo_findings, fail, keep_until_exit, read_tag_dir_early


@click.command()
@click.argument("checkpoint", metavar="CHECKPOINT")
@click.option("--tag", default=None, help="Tag directory to describe (default: the one named by 'latest').")
@click.option(
    "-o",
    "--output",
    type=OUTPUT_FILE,
    default="-",
    show_default="stdout",
    help="Write the manifest here (.json or .msgpack).",
)
@click.option(
    "--hash",
    "hash_algorithm",
    flag_value="sha256",
    default=None,
    help="Record a SHA-256 of every shard file and of every tensor's real elements (reads every byte).",
)
def generate(checkpoint: str, tag: str | None, output: str, hash_algorithm: str | None) -> None:
    """Describe a saved DeepSpeed checkpoint directory in a manifest.

    A tensor- or pipeline-parallel checkpoint gets a checkpoint index
    (ckptspec.checkpoint 1.0: one manifest per model-parallel rank and the whole-model view).
    A torch DCP directory (.metadata) gets a DCP document (ckptspec.dcp 1.0: every tensor,
    its chunks and where their bytes are; docs/spec-dcp.md).

    Reads only metadata (no tensor data unless --hash), needs neither DeepSpeed nor
    torch, and never executes pickled code.
    """
    if _is_dcp(checkpoint):
        _generate_dcp(checkpoint, tag, output, hash_algorithm)
    from ..deepspeed.kinds import described_by_index
    from ..format.codec import gc_paused

    # No cyclic GC: the decoded pickles and the manifest are acyclic, and with 100k tensors the
    # collector rescanned them on every few thousand allocations (half of generate's time).
    try:
        with gc_paused(for_good=True):  # the command ends after it
            # A plain ZeRO checkpoint's pickles are read while the models import; an index's, by its producer.
            early = not described_by_index(checkpoint, None, tag)
            states = read_tag_dir_early(checkpoint, tag, "ckptspec.deepspeed.describe.zero") if early else None
            from ..deepspeed.describe import describe

            document = describe(checkpoint, tag, hash_algorithm=hash_algorithm, states=states)
            keep_until_exit(states, document)
            from ..format.codec import write_manifest

            write_manifest(document, output)
    except CheckpointInvalid as exc:  # files the index is made from are missing: one line each
        echo_findings(exc.findings, checkpoint, err=True, always_name_target=False)
        click.echo(f"{checkpoint}: not described: the checkpoint has errors; nothing was written", err=True)
        sys.exit(EXIT_INVALID)
    except CkptspecError as exc:
        fail(exc)


def _is_dcp(checkpoint: str) -> bool:
    from ..checkpoint.dcp.metadata import is_dcp

    return is_dcp(checkpoint)  # local or at a URL


def _generate_dcp(checkpoint: str, tag: str | None, output: str, hash_algorithm: str | None) -> NoReturn:
    """A torch DCP checkpoint's document, written when the directory has no error finding (CK250-CK254, CK204)."""

    from ..checkpoint.dcp.describe import describe_dcp
    from ..format.codec import write_manifest

    if tag is not None:
        raise click.UsageError("--tag names a DeepSpeed tag directory; a DCP checkpoint (.metadata) has none")
    try:
        write_manifest(describe_dcp(checkpoint, hash_algorithm).to_dict(), output)
    except CheckpointInvalid as exc:
        echo_findings(exc.findings, checkpoint, err=True)
        click.echo(f"{checkpoint}: not described: the checkpoint has errors; nothing was written", err=True)
        sys.exit(EXIT_INVALID)
    except CkptspecError as exc:
        fail(exc)
    sys.exit(0)
