"""Synthetic but valid manifests of any size, for the validation and encoding benchmarks.

A ZeRO-2 bf16 layout of ``n_params`` trainable parameters in two flat groups over
``world_size`` ranks, with frozen parameters, buffers, an alias and one optimizer-states
file per rank with its locators. The group arithmetic comes from ``ckptspec.format.partition``
(the producers' own code), so the documents pass every semantic rule.

    .venv/bin/python benchmarks/synthetic.py 100000 out.json    # or out.msgpack
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckptspec.format.codec import dumps, encoding_for_output
from ckptspec.format.models import (
    Alias,
    Buffer,
    FrozenParam,
    Hash,
    Layout,
    Locator,
    Manifest,
    Producer,
    ShardFile,
)
from ckptspec.format.partition import ParamSpec, flat_group
from ckptspec.format.version import FORMAT_NAME, FORMAT_VERSION

WORLD = 8
CACHE = Path(__file__).resolve().parent / ".cache" / "manifests"


def synthetic_manifest(n_params: int, world_size: int = WORLD) -> Manifest:
    """A valid stage-2 bf16 manifest with ``n_params`` trainable parameters."""
    shapes = [(4096, 1024), (1024,), (1024, 4096), (4096,), (7, 33), (33,)]
    specs = [[], []]
    for i in range(n_params):
        shape = shapes[i % len(shapes)]
        kind = "weight" if len(shape) > 1 else "bias"
        specs[0 if kind == "weight" else 1].append(
            ParamSpec(f"model.layers.{i // 6}.block{i % 6}.{kind}", shape, "bfloat16")
        )
    groups = [flat_group(s, optimizer_group=g, partition_count=world_size, zero_stage=2) for g, s in enumerate(specs)]
    frozen = [
        FrozenParam(
            name=f"model.frozen.{i}.weight", shape=[64, 64], numel=4096, dtype="bfloat16", stored_in="fragments"
        )
        for i in range(max(1, n_params // 100))
    ]
    buffers = [
        Buffer(name=f"model.layers.{i}.rotary.inv_freq", shape=[64], dtype="float32")
        for i in range(max(1, n_params // 100))
    ]
    aliases = [Alias(name="lm_head.weight", owner=specs[0][0].name, shape=list(specs[0][0].shape))]
    files = [
        ShardFile(
            path="global_step100/mp_rank_00_model_states.pt",
            role="model_states",
            ranks=[0],
            size=123456789,
            hash=Hash(algorithm="sha256", digest="ab" * 32),
            partitions=[],
        )
    ]
    offset = 1 << 20
    for rank in range(world_size):
        partitions = []
        position = offset
        for g, group in enumerate(groups):
            numel = group.saved_numels[rank]
            partitions.append(
                Locator(
                    group=g,
                    rank=rank,
                    member=f"zero_pp_rank_{rank}_mp_rank_00_optim_states/data/{g}",
                    data_offset=position,
                    member_size=group.partition_numel * 4,
                    dtype="float32",
                    element_offset=0,
                    numel=numel,
                )
            )
            position += group.partition_numel * 4 + 64
        files.append(
            ShardFile(
                path=f"global_step100/zero_pp_rank_{rank}_mp_rank_00_optim_states.pt",
                role="optimizer_states",
                ranks=[rank],
                size=position + 4096,
                hash=Hash(algorithm="sha256", digest=f"{rank:02x}" * 32),
                partitions=partitions,
            )
        )
    layout = Layout(
        zero_stage=2,
        world_size=world_size,
        tensor_parallel_size=1,
        pipeline_parallel_size=1,
        model_dtype="bfloat16",
        master_dtype="float32",
        round_robin=False,
        parameter_alignment=False,
        tail_padding_saved=False,
        optimizer="DeepSpeedZeroOptimizer",
    )
    return Manifest(
        format=FORMAT_NAME,
        format_version=FORMAT_VERSION,
        producer=Producer(
            tool="ckptspec-benchmarks", tool_version="1", framework="deepspeed", framework_version="0.19.8"
        ),
        layout=layout,
        groups=groups,
        frozen=frozen,
        buffers=buffers,
        aliases=aliases,
        excluded=[],
        files=files,
    )


def cached_manifest(n_params: int, encoding: str) -> Path:
    """The canonical ``encoding`` file of ``synthetic_manifest(n_params)``, made once."""
    path = CACHE / f"synthetic-{n_params}.{'msgpack' if encoding == 'msgpack' else 'json'}"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        data = dumps(synthetic_manifest(n_params).to_dict(), encoding)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_bytes(data)
        tmp.replace(path)
    return path


if __name__ == "__main__":
    n, out = int(sys.argv[1]), Path(sys.argv[2])
    out.write_bytes(dumps(synthetic_manifest(n).to_dict(), encoding_for_output(str(out))))
