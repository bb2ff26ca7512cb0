"""JSON vs msgpack for a large manifest: size, decode time, decode + validate time.

    .venv/bin/python benchmarks/bench_encoding.py            # 100k parameters (about a minute)
    .venv/bin/python benchmarks/bench_encoding.py --params 10000 --repeat 3

The manifest is synthetic but valid: a ZeRO-2 layout of ``--params`` parameters in
two flat groups over 8 ranks (with frozen parameters, buffers, aliases and one
optimizer-states file per rank with its locators). Each encoding is its canonical
form (``ckptspec.encoding.dumps``); "decode" is reading the bytes with the
validator's own loader (``ckptspec.loader.decode``: UTF-8, duplicate-key and NaN
checks included), "+ validate" adds ``ckptspec.validate_document`` (schema, models,
semantic rules). Times are CPU seconds of this process (``time.process_time``: steadier
than wall time on a shared machine), the median of ``--repeat`` runs, printed as a
markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckptspec.encoding import dumps  # noqa: E402
from ckptspec.layout import ParamSpec, flat_group  # noqa: E402
from ckptspec.loader import decode  # noqa: E402
from ckptspec.models import (  # noqa: E402
    FORMAT_NAME, FORMAT_VERSION, Alias, Buffer, FrozenParam, Hash, Layout, Locator, Manifest, Producer, ShardFile,
)
from ckptspec.validate import validate_document  # noqa: E402

WORLD = 8


def synthetic_manifest(n_params: int, world_size: int = WORLD) -> Manifest:
    """A valid stage-2 bf16 manifest with ``n_params`` trainable parameters."""
    shapes = [(4096, 1024), (1024,), (1024, 4096), (4096,), (7, 33), (33,)]
    specs = [[], []]
    for i in range(n_params):
        shape = shapes[i % len(shapes)]
        kind = "weight" if len(shape) > 1 else "bias"
        specs[0 if kind == "weight" else 1].append(ParamSpec(f"model.layers.{i // 6}.block{i % 6}.{kind}", shape, "bfloat16"))
    groups = [flat_group(s, optimizer_group=g, partition_count=world_size, zero_stage=2) for g, s in enumerate(specs)]
    frozen = [FrozenParam(name=f"model.frozen.{i}.weight", shape=[64, 64], numel=4096, dtype="bfloat16", stored_in="fragments")
              for i in range(max(1, n_params // 100))]
    buffers = [Buffer(name=f"model.layers.{i}.rotary.inv_freq", shape=[64], dtype="float32") for i in range(max(1, n_params // 100))]
    aliases = [Alias(name="lm_head.weight", owner=specs[0][0].name, shape=list(specs[0][0].shape))]
    files = [ShardFile(path="global_step100/mp_rank_00_model_states.pt", role="model_states", ranks=[0], size=123456789,
                       hash=Hash(algorithm="sha256", digest="ab" * 32), partitions=[])]
    offset = 1 << 20
    for rank in range(world_size):
        partitions = []
        position = offset
        for g, group in enumerate(groups):
            numel = group.saved_numels[rank]
            partitions.append(Locator(group=g, rank=rank, member=f"zero_pp_rank_{rank}_mp_rank_00_optim_states/data/{g}",
                                      data_offset=position, member_size=group.partition_numel * 4, dtype="float32",
                                      element_offset=0, numel=numel))
            position += group.partition_numel * 4 + 64
        files.append(ShardFile(path=f"global_step100/zero_pp_rank_{rank}_mp_rank_00_optim_states.pt", role="optimizer_states",
                               ranks=[rank], size=position + 4096, hash=Hash(algorithm="sha256", digest=f"{rank:02x}" * 32),
                               partitions=partitions))
    layout = Layout(zero_stage=2, world_size=world_size, tensor_parallel_size=1, pipeline_parallel_size=1,
                    model_dtype="bfloat16", master_dtype="float32", round_robin=False, parameter_alignment=False,
                    tail_padding_saved=False, optimizer="DeepSpeedZeroOptimizer")
    return Manifest(format=FORMAT_NAME, format_version=FORMAT_VERSION,
                    producer=Producer(tool="bench_encoding", tool_version="1", framework="deepspeed", framework_version="0.19.8"),
                    layout=layout, groups=groups, frozen=frozen, buffers=buffers, aliases=aliases, excluded=[], files=files)


def _median_seconds(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return statistics.median(times)


def measure(n_params: int, repeat: int, validate: bool = True) -> list[dict]:
    doc = synthetic_manifest(n_params).to_dict()
    rows = []
    for encoding in ("json", "msgpack"):
        data = dumps(doc, encoding)
        assert decode(data, encoding) == doc
        row = {"encoding": encoding, "bytes": len(data), "decode_s": _median_seconds(lambda: decode(data, encoding), repeat)}
        if validate:
            def load_and_validate():
                report = validate_document(decode(data, encoding))
                assert report.ok, [f.to_line() for f in report.findings][:3]
            row["decode_validate_s"] = _median_seconds(load_and_validate, repeat)
        rows.append(row)
    return rows


def markdown(rows: list[dict], n_params: int) -> str:
    json_row = rows[0]
    lines = [f"Manifest with {n_params:,} parameters ({WORLD} ranks, ZeRO-2), median CPU seconds of the runs:", "",
             "| encoding | size (bytes) | size vs JSON | decode (s) | decode vs JSON | decode + validate (s) | vs JSON |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        validate = row.get("decode_validate_s")
        lines.append(
            f"| {row['encoding']} | {row['bytes']:,} | {row['bytes'] / json_row['bytes']:.2f} | {row['decode_s']:.3f} | "
            f"{row['decode_s'] / json_row['decode_s']:.2f} | "
            + (f"{validate:.3f} | {validate / json_row['decode_validate_s']:.2f} |" if validate else "- | - |"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--no-validate", action="store_true", help="measure decoding only")
    args = parser.parse_args(argv)
    rows = measure(args.params, args.repeat, validate=not args.no_validate)
    print(markdown(rows, args.params))
    return 0


if __name__ == "__main__":
    sys.exit(main())
