"""``ckptspec reshard``: a ZeRO checkpoint rewritten for another world size or stage (docs/reshard.md)."""

from __future__ import annotations

import json

import click

from ..export.torchrun import torchrun_share
from ._common import OUTPUT_DIR, echo_split, writing_deepspeed_files


@click.command()
@click.argument("checkpoint", metavar="CHECKPOINT")
@click.argument("output", metavar="OUTPUT", type=OUTPUT_DIR)
@click.option(
    "--world-size",
    type=click.IntRange(min=1),
    required=True,
    help="Ranks of the target job (a tensor/pipeline-parallel checkpoint keeps its tensor and pipeline degrees).",
)
@click.option(
    "--stage",
    type=click.IntRange(0, 3),
    default=None,
    help="ZeRO stage of the target job (default: the checkpoint's): 0, 1, 2 or 3.",
)
@click.option(
    "--grad-accum-dtype",
    type=click.Choice(["fp32", "bf16"]),
    default=None,
    help="The target job's data_types.grad_accum_dtype (default: the checkpoint's optimizer kept). A bf16 job's at "
    "stage 1 picks its optimizer: fp32 DeepSpeed's BF16_Optimizer, bf16 its ZeRO optimizer.",
)
@click.option(
    "--sub-group-size",
    type=click.IntRange(min=1),
    default=None,
    help="The target job's zero_optimization.sub_group_size (stage 3; default: a stage-3 source's, else 1e9).",
)
@click.option(
    "--tensor-parallel",
    type=click.IntRange(min=1),
    default=None,
    help="AutoTP degree of the target job (default: the checkpoint's).",
)
@click.option(
    "--pipeline-parallel",
    type=click.IntRange(min=1),
    default=None,
    help="Pipeline stages of the target job (default: the checkpoint's).",
)
@click.option(
    "--expert-parallel",
    type=click.IntRange(min=1),
    default=None,
    help="Expert-parallel degree of the target MoE job (default: the checkpoint's).",
)
@click.option(
    "--partition-method",
    type=click.Choice(["parameters", "uniform"]),
    default=None,
    help="With --pipeline-parallel: the target PipelineModule's partition_method (default: parameters, DeepSpeed's).",
)
@click.option(
    "--ds-config",
    "ds_config",
    type=click.File("rb"),
    default=None,
    metavar="FILE",
    help="With --tensor-parallel T of a data-parallel checkpoint: the target job's ds_config (JSON), whose "
    "tensor_parallel.partition_config.layer_specs say how AutoTP splits each layer.",
)
@click.option(
    "--to",
    "to",
    default=None,
    metavar="FRAMEWORK",
    help="The framework written: deepspeed (the only one, and the default; a DCP checkpoint's target).",
)
@click.option(
    "--model-dtype",
    type=click.Choice(["fp32", "bf16", "fp16"]),
    default=None,
    help="A DCP checkpoint's target job's model dtype (default fp32; its masters are fp32 either way).",
)
@click.option("--tag", default=None, help="Tag directory to read (default: the one named by 'latest').")
@click.option(
    "--manifest",
    default=None,
    metavar="M",
    help="Read CHECKPOINT as this manifest describes (checked against the files first). Default: its own.",
)
def reshard(
    checkpoint: str,
    output: str,
    world_size: int,
    stage: int | None,
    grad_accum_dtype: str | None,
    sub_group_size: int | None,
    tensor_parallel: int | None,
    pipeline_parallel: int | None,
    expert_parallel: int | None,
    partition_method: str | None,
    ds_config,
    to,
    model_dtype,
    tag,
    manifest,
) -> None:
    """Write CHECKPOINT for a job of --world-size ranks (and --stage) into OUTPUT.

    The source is validated first (digests included); on any error finding, or a layout reshard cannot write (CK410),
    nothing is written and the exit code is 1. OUTPUT (new or empty) then holds a DeepSpeed checkpoint the target job
    loads with a plain engine.load_checkpoint(OUTPUT): fp32 masters, optimizer state, step, hyperparameters, loss
    scaler, model weights, frozen parameters, buffers, LR scheduler and client state, plus `latest` and the checkpoint's
    format 1.1 manifest. A tensor- or pipeline-parallel ZeRO-1/2 checkpoint keeps its tensor and pipeline degrees:
    --world-size / (tp x pp) data-parallel ranks, each coordinate's ZeRO partitions resharded, the pipeline's layer
    files copied. --tensor-parallel 1 merges an AutoTP ZeRO-1/2 checkpoint for a job without tensor parallelism on
    --world-size ranks, another degree splits it (or a tensor-parallel pipeline) by its own saved rules;
    --pipeline-parallel N (ZeRO-1 pipelines; a tensor-parallel one keeps its tensor degree, or is merged or split too
    with --tensor-parallel) gives the layers to N stages by --partition-method and rebuilds each stage's ZeRO groups;
    --expert-parallel N regroups a MoE checkpoint's experts over N expert-parallel ranks. --grad-accum-dtype fp32 writes
    a bf16 ZeRO checkpoint for a stage-1 BF16_Optimizer job, bf16 a BF16_Optimizer one for a ZeRO job. A torch DCP
    directory (an FSDP checkpoint) is written as the ZeRO-1/2/3 checkpoint (--stage required) of a DeepSpeed job of
    --model-dtype. Never executes pickled code; needs torch only to write the pickles, not DeepSpeed. Under torchrun
    (any number of processes and nodes; OUTPUT on a file system they all mount) the ranks share the work: each writes
    every N-th file, reading only what its files need, and the output is the same, byte for byte.
    """
    from ..export.api import reshard as run

    with writing_deepspeed_files(checkpoint, output, manifest, "not resharded"), torchrun_share() as share:
        result = run(
            checkpoint,
            output,
            world_size,
            zero_stage=stage,
            sub_group_size=sub_group_size,
            tensor_parallel=tensor_parallel,
            pipeline_parallel=pipeline_parallel,
            expert_parallel=expert_parallel,
            partition_method=partition_method,
            ds_config=_json_object(ds_config),
            tag=tag,
            manifest=manifest,
            to=to,
            model_dtype=_DTYPES.get(model_dtype, model_dtype),
            grad_accum_dtype=_DTYPES[grad_accum_dtype] if grad_accum_dtype else None,
        )
        shares = share.report()
    if not share.first:
        return
    click.echo(
        f"{result.output}: {result.tag} resharded from {result.source_world_size} to {result.world_size} ranks "
        f"(ZeRO stage {result.zero_stage}): {len(result.files)} files; resume with "
        + result.resume_with.format(output=output)
    )
    echo_split(shares)


_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _json_object(file) -> dict | None:
    """The --ds-config file's JSON object (at most 16 MiB); a usage error (exit 2) otherwise."""
    if file is None:
        return None
    data = file.read(16 * 1024 * 1024 + 1)
    try:
        value = json.loads(data) if len(data) <= 16 * 1024 * 1024 else None
    except ValueError as exc:
        raise click.BadParameter(f"{file.name}: not JSON ({exc})", param_hint="--ds-config") from None
    if not isinstance(value, dict):
        raise click.BadParameter(f"{file.name}: not a JSON object of at most 16 MiB", param_hint="--ds-config")
    return value
