"""Generate the valid manifests of the format 1.0 conformance corpus.

    python tests/conformance/make_corpus.py          # (re)write tests/conformance/1.0/valid/*.json
    python tests/conformance/make_corpus.py --check  # exit 1 if a committed file differs

The layout numbers (offsets, paddings, padded/partition/saved numels, locators)
are derived here from the rules of docs/spec.md, independently of ``ckptspec``:
this script imports nothing from the package, so the corpus is a second,
independent statement of the rules. Only the *valid* files are generated; each
invalid file is a hand edit of one of them (see ``1.0/expected.json``), kept
as a static file so that it breaks exactly one rule.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
VALID = HERE / "1.0" / "valid"
EXAMPLE = HERE.parent.parent / "examples" / "manifests" / "zero2-bf16-2ranks.json"

ITEMSIZE = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16,
}
NCCL_START_ALIGNMENT_FACTOR = 2  # stage 1/2 flat groups are padded to 2 x world size
ZIP_HEADER = 1024  # where the first tensor data starts in a fake torch zip file
ZIP_ALIGN = 64  # torch aligns every zip member's data to 64 bytes
ZIP_TRAILER = 700  # central directory etc. after the last member


# --------------------------------------------------------------------------- pieces


def producer(**extra) -> dict:
    doc = {
        "tool": "ckptspec-corpus",
        "tool_version": "1.0.0",
        "framework": "deepspeed",
        "framework_version": "0.19.8",
        "created": "2026-11-29T12:00:00Z",
    }
    doc.update(extra)
    return doc


def layout(stage: int, world_size: int, *, model_dtype="bfloat16", master_dtype="float32", round_robin=False,
           parameter_alignment=False, tail_padding_saved=False, **optional) -> dict:
    doc = {
        "zero_stage": stage,
        "world_size": world_size,
        "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1,
        "model_dtype": model_dtype,
        "master_dtype": master_dtype,
        "round_robin": round_robin,
        "parameter_alignment": parameter_alignment,
        "tail_padding_saved": tail_padding_saved,
    }
    doc.update(optional)
    return doc


def tensor(name: str, shape: list[int], dtype: str) -> dict:
    return {"name": name, "shape": list(shape), "numel": math.prod(shape), "dtype": dtype}


def flat_group(optimizer_group: int, params: list[tuple[str, list[int], str]], *, stage: int, partition_count: int,
               tail_padding_saved: bool, paddings: list[int] | None = None) -> dict:
    """Stage 0/1/2: params back to back (offset + numel + padding), the end rounded up to
    the alignment (2 x partition_count at stage 1/2, 1 at stage 0), split into equal
    partitions; without tail_padding_saved each rank saves only the real elements of its
    partition: clamp(end - r * partition_numel, 0, partition_numel)."""
    paddings = paddings or [0] * len(params)
    alignment = NCCL_START_ALIGNMENT_FACTOR * partition_count if stage in (1, 2) else 1
    entries, offset = [], 0
    for (name, shape, dtype), padding in zip(params, paddings, strict=True):
        entry = tensor(name, shape, dtype)
        entry.update(offset=offset, padding=padding)
        entries.append(entry)
        offset += entry["numel"] + padding
    end = offset
    padded = -(-end // alignment) * alignment
    partition = padded // partition_count
    if tail_padding_saved:
        saved = [partition] * partition_count
    else:
        saved = [min(partition, max(0, end - r * partition)) for r in range(partition_count)]
    return {
        "optimizer_group": optimizer_group,
        "partitioning": "flat",
        "partition_count": partition_count,
        "alignment": alignment,
        "padded_numel": padded,
        "partition_numel": partition,
        "saved_numels": saved,
        "params": entries,
    }


def per_param_group(optimizer_group: int, params: list[tuple[str, list[int], str]], *, world_size: int) -> dict:
    """Stage 3: each param padded to a multiple of the world size, (-numel) mod ws; a rank
    holds (numel + padding) / ws elements of each, back to back; every rank saves the same."""
    entries, offset = [], 0
    for name, shape, dtype in params:
        entry = tensor(name, shape, dtype)
        padding = (-entry["numel"]) % world_size
        entry.update(offset=offset, padding=padding)
        entries.append(entry)
        offset += (entry["numel"] + padding) // world_size
    return {
        "optimizer_group": optimizer_group,
        "partitioning": "per_param",
        "partition_count": world_size,
        "alignment": 1,
        "padded_numel": offset * world_size,
        "partition_numel": offset,
        "saved_numels": [offset] * world_size,
        "params": entries,
    }


def _align(value: int) -> int:
    return -(-value // ZIP_ALIGN) * ZIP_ALIGN


def model_file(path: str, ranks: list[int], size: int = 7357) -> dict:
    return {"path": path, "role": "model_states", "ranks": ranks, "size": size, "partitions": []}


def optimizer_files(groups: list[dict], master_dtype: str, *, step: int, ranks_per_file: int = 1,
                    prefix: str = "bf16_zero_pp", shared_member: bool = False, tight: bool = False) -> list[dict]:
    """One optimizer-states file per ``ranks_per_file`` ranks, one locator per (group, rank).

    Separate members: each partition is its own tensor (element_offset 0, member exactly
    saved_numel * itemsize bytes). ``shared_member``: one member per rank holds all its
    partitions back to back (element_offset > 0, the last one ends exactly at the member's
    end). ``tight``: the file ends exactly where its last member ends.
    """
    itemsize = ITEMSIZE[master_dtype]
    world = groups[0]["partition_count"]
    files = []
    for first in range(0, world, ranks_per_file):
        ranks = list(range(first, min(world, first + ranks_per_file)))
        stem = f"{prefix}_rank_{ranks[0]}_mp_rank_00_optim_states"
        locators, data_offset, key = [], ZIP_HEADER, 3
        for rank in ranks:
            if shared_member:
                total = sum(g["saved_numels"][rank] for g in groups)
                member, element_offset = f"{stem}/data/{key}", 0
                for g, grp in enumerate(groups):
                    numel = grp["saved_numels"][rank]
                    locators.append(_locator(g, rank, member, data_offset, total * itemsize, master_dtype,
                                             element_offset, numel))
                    element_offset += numel
                data_offset = _align(data_offset + total * itemsize)
                key += 1
            else:
                for g, grp in enumerate(groups):
                    numel = grp["saved_numels"][rank]
                    locators.append(_locator(g, rank, f"{stem}/data/{key}", data_offset, numel * itemsize,
                                             master_dtype, 0, numel))
                    data_offset = _align(data_offset + numel * itemsize)
                    key += 1
        last = locators[-1]
        end = last["data_offset"] + last["member_size"]
        files.append({
            "path": f"global_step{step}/{stem}.pt",
            "role": "optimizer_states",
            "ranks": ranks,
            "size": end if tight else end + ZIP_TRAILER,
            "partitions": locators,
        })
    return files


def _locator(group, rank, member, data_offset, member_size, dtype, element_offset, numel) -> dict:
    return {
        "group": group, "rank": rank, "member": member, "data_offset": data_offset, "member_size": member_size,
        "dtype": dtype, "element_offset": element_offset, "numel": numel,
    }


def manifest(*, layout_: dict, groups: list[dict], frozen=(), buffers=(), aliases=(), excluded=(), files=(),
             producer_: dict | None = None, version: str = "1.0.0", **unknown) -> dict:
    doc = {
        "format": "ckptspec.manifest",
        "format_version": version,
        "producer": producer_ or producer(),
        "layout": layout_,
        "groups": groups,
        "frozen": list(frozen),
        "buffers": list(buffers),
        "aliases": list(aliases),
        "excluded": list(excluded),
        "files": list(files),
    }
    doc.update(unknown)
    return doc


def frozen_param(name, shape, dtype, stored_in) -> dict:
    entry = tensor(name, shape, dtype)
    entry["stored_in"] = stored_in
    return entry


def buffer(name, shape, dtype) -> dict:
    return {"name": name, "shape": list(shape), "dtype": dtype}


def alias(name, owner, shape) -> dict:
    return {"name": name, "owner": owner, "shape": list(shape)}


# --------------------------------------------------------------------------- the valid corpus

BF16, FP16, FP32 = "bfloat16", "float16", "float32"


def stage0_single_group_ws2() -> dict:
    """Stage 0 does not partition: one flat group, partition_count 1 (even with 2 ranks), alignment 1."""
    params = [("embed.weight", [10, 8], FP16), ("fc.weight", [4, 8], FP16), ("fc.bias", [4], FP16)]
    groups = [flat_group(0, params, stage=0, partition_count=1, tail_padding_saved=False)]
    files = [model_file("global_step5/mp_rank_00_model_states.pt", [0])]
    files += optimizer_files(groups, FP32, step=5, prefix="zero_pp")
    return manifest(layout_=layout(0, 2, model_dtype=FP16, optimizer="FP16_Optimizer"), groups=groups,
                    buffers=[buffer("fc.num_batches_tracked", [], "int64")], files=files)


def stage1_fp16_ws3_tail_stripped() -> dict:
    """Stage 1, 3 ranks, three groups; tail padding stripped, so the last ranks save less
    (the one-element group: ranks 1 and 2 save nothing at all)."""
    decay = [("blocks.0.attn.weight", [20, 10], FP16), ("blocks.0.mlp.weight", [10, 7], FP16), ("head.bias", [3], FP16)]
    no_decay = [("blocks.0.ln.weight", [10], FP16), ("blocks.0.ln.bias", [7], FP16)]
    tiny = [("scale", [1], FP16)]
    groups = [
        flat_group(0, decay, stage=1, partition_count=3, tail_padding_saved=False),
        flat_group(1, no_decay, stage=1, partition_count=3, tail_padding_saved=False),
        flat_group(2, tiny, stage=1, partition_count=3, tail_padding_saved=False),
    ]
    files = [model_file("global_step30/mp_rank_00_model_states.pt", [0])]
    files += optimizer_files(groups, FP32, step=30, prefix="zero_pp")
    return manifest(layout_=layout(1, 3, model_dtype=FP16, optimizer="DeepSpeedZeroOptimizer"), groups=groups,
                    files=files)


def stage1_bf16_tail_padding_saved() -> dict:
    """DeepSpeed's BF16_Optimizer saves whole partitions, tail padding included."""
    params = [("emb.weight", [50, 16], BF16), ("l1.weight", [33, 16], BF16), ("l1.bias", [33], BF16),
              ("l2.weight", [7, 33], BF16), ("l2.bias", [7], BF16)]
    groups = [flat_group(0, params, stage=1, partition_count=2, tail_padding_saved=True)]
    files = [model_file("global_step2/mp_rank_00_model_states.pt", [0])]
    files += optimizer_files(groups, FP32, step=2)
    return manifest(layout_=layout(1, 2, tail_padding_saved=True, optimizer="BF16_Optimizer"), groups=groups,
                    aliases=[alias("head.weight", "emb.weight", [50, 16])], files=files)


def stage2_round_robin_ws4() -> dict:
    """Round-robin gradients (params listed in the optimizer's order), 4 ranks, two ranks per
    file; the second group ends early enough that rank 3 saves nothing."""
    params = [("layers.1.weight", [12, 12], BF16), ("layers.0.weight", [12, 12], BF16),
              ("layers.1.bias", [12], BF16), ("layers.0.bias", [12], BF16)]
    norms = [("norm.weight", [9], BF16), ("norm.bias", [8], BF16)]
    groups = [
        flat_group(0, params, stage=2, partition_count=4, tail_padding_saved=False),
        flat_group(1, norms, stage=2, partition_count=4, tail_padding_saved=False),
    ]
    files = [model_file("global_step40/mp_rank_00_model_states.pt", [0])]
    files += optimizer_files(groups, FP32, step=40, ranks_per_file=2)
    return manifest(layout_=layout(2, 4, round_robin=True, optimizer="DeepSpeedZeroOptimizer"), groups=groups,
                    files=files)


def stage2_parameter_alignment() -> dict:
    """With parameter_alignment each param may carry padding: here [0, 0, 7, 1, 0]."""
    params = [("a.weight", [4, 4], FP16), ("b.weight", [3, 8], FP16), ("c.weight", [9], FP16),
              ("d.weight", [7], FP16), ("e.bias", [5], FP16)]
    groups = [flat_group(0, params, stage=2, partition_count=2, tail_padding_saved=False, paddings=[0, 0, 7, 1, 0])]
    files = [model_file("global_step3/mp_rank_00_model_states.pt", [0])]
    files += optimizer_files(groups, FP32, step=3, prefix="zero_pp")
    return manifest(layout_=layout(2, 2, model_dtype=FP16, parameter_alignment=True), groups=groups, files=files)


def stage3_two_subgroups_ws3() -> dict:
    """Stage 3: per-param partitioning; optimizer group 0 is split into two sub-groups (two
    group entries with optimizer_group 0). Includes a 0-d and a zero-size param. One member
    per rank holds all its partitions (element_offset > 0)."""
    sub_a = [("encoder.weight", [10, 10], BF16), ("encoder.bias", [7], BF16)]
    sub_b = [("decoder.weight", [4, 3], BF16)]
    other = [("temperature", [], BF16), ("unused.weight", [0, 8], BF16), ("out.bias", [5], BF16)]
    groups = [
        per_param_group(0, sub_a, world_size=3),
        per_param_group(0, sub_b, world_size=3),
        per_param_group(1, other, world_size=3),
    ]
    files = [model_file(f"global_step7/zero_pp_rank_{r}_mp_rank_00_model_states.pt", [r], 5000) for r in range(3)]
    files += optimizer_files(groups, FP32, step=7, shared_member=True)
    return manifest(layout_=layout(3, 3, optimizer="DeepSpeedZeroOptimizer_Stage3", sub_group_size=100),
                    groups=groups, files=files)


def world_size_1_stage2() -> dict:
    """One rank: alignment 2, and the single rank saves fewer elements than its padded partition."""
    params = [("w", [3, 5], BF16), ("b", [3], BF16), ("g", [1], BF16)]
    groups = [flat_group(0, params, stage=2, partition_count=1, tail_padding_saved=False)]
    files = [model_file("global_step1/mp_rank_00_model_states.pt", [0])]
    files += optimizer_files(groups, FP32, step=1)
    return manifest(layout_=layout(2, 1), groups=groups, files=files)


def scalar_and_zero_size_tensors() -> dict:
    """0-d tensors (shape [], numel 1) and zero-size tensors (shape [0, 8], numel 0) everywhere."""
    params = [("scale", [], BF16), ("empty.weight", [0, 8], BF16), ("proj.weight", [6, 4], BF16),
              ("empty.bias", [0], BF16), ("shift", [], BF16)]
    groups = [flat_group(0, params, stage=2, partition_count=2, tail_padding_saved=False)]
    files = [model_file("global_step9/mp_rank_00_model_states.pt", [0])]
    files += optimizer_files(groups, FP32, step=9)
    return manifest(
        layout_=layout(2, 2), groups=groups,
        frozen=[frozen_param("frozen.scalar", [], BF16, "module"), frozen_param("frozen.empty", [3, 0, 2], BF16, "module")],
        buffers=[buffer("step", [], "int64"), buffer("mask", [0], "bool")],
        aliases=[alias("empty.weight.tied", "empty.weight", [0, 8]), alias("scale.tied", "scale", [])],
        files=files,
    )


def frozen_all_stored_in() -> dict:
    """Frozen params stored in the module state dict, in fragments, and in partitioned fragments."""
    params = [("adapter.down", [16, 4], BF16), ("adapter.up", [4, 16], BF16)]
    groups = [flat_group(0, params, stage=2, partition_count=2, tail_padding_saved=False)]
    files = [model_file("global_step11/mp_rank_00_model_states.pt", [0])]
    files += optimizer_files(groups, FP32, step=11)
    frozen = [
        frozen_param("base.embed.weight", [32, 16], BF16, "module"),
        frozen_param("base.layer.weight", [16, 16], BF16, "fragments"),
        frozen_param("base.layer.bias", [16], BF16, "partitioned_fragments"),
    ]
    return manifest(layout_=layout(2, 2, exclude_frozen_parameters=False), groups=groups, frozen=frozen,
                    aliases=[alias("base.lm_head.weight", "base.embed.weight", [32, 16])], files=files)


def aliases_buffers_excluded() -> dict:
    """Aliases (to a param and to a buffer), buffers, and params excluded from the checkpoint."""
    params = [("tok.weight", [20, 6], BF16), ("mix.weight", [6, 6], BF16), ("mix.bias", [6], BF16)]
    groups = [flat_group(0, params, stage=2, partition_count=2, tail_padding_saved=False)]
    files = [model_file("global_step12/mp_rank_00_model_states.pt", [0])]
    files += optimizer_files(groups, FP32, step=12)
    return manifest(
        layout_=layout(2, 2, exclude_frozen_parameters=True), groups=groups,
        buffers=[buffer("rope.inv_freq", [3], FP32), buffer("bn.running_mean", [6], FP32), buffer("bn.num_batches_tracked", [], "int64")],
        aliases=[alias("out.weight", "tok.weight", [20, 6]), alias("rope.inv_freq.shared", "rope.inv_freq", [3])],
        excluded=[{"name": "frozen.embed.weight", "reason": "frozen, and exclude_frozen_parameters is set"},
                  {"name": "lora.dropout_mask", "reason": "not part of the state dict"}],
        files=files,
    )


def files_with_hashes() -> dict:
    """Every file hashed (sha256 and blake2b); one member per rank; files end exactly at their last member."""
    params = [("w1", [8, 8], BF16), ("w2", [8, 3], BF16)]
    groups = [flat_group(0, params, stage=2, partition_count=2, tail_padding_saved=False),
              flat_group(1, [("b1", [8], BF16), ("b2", [3], BF16)], stage=2, partition_count=2, tail_padding_saved=False)]
    files = [model_file("global_step13/mp_rank_00_model_states.pt", [0])]
    files += optimizer_files(groups, FP32, step=13, shared_member=True, tight=True)
    for i, f in enumerate(files):
        data = f["path"].encode()
        if i % 2:
            f["hash"] = {"algorithm": "blake2b", "digest": hashlib.blake2b(data).hexdigest()}
        else:
            f["hash"] = {"algorithm": "sha256", "digest": hashlib.sha256(data).hexdigest()}
    return manifest(layout_=layout(2, 2), groups=groups, files=files)


def no_files() -> dict:
    """A manifest may describe the layout without listing any file."""
    params = [("w", [5, 5], BF16), ("b", [5], BF16)]
    groups = [flat_group(0, params, stage=2, partition_count=2, tail_padding_saved=False)]
    return manifest(layout_=layout(2, 2), groups=groups)


def newer_minor_unknown_fields() -> dict:
    """Format 1.4.0 read by a 1.0 reader: valid with warning CK004, unknown fields tolerated."""
    doc = no_files()
    doc["format_version"] = "1.4.0"
    doc["layout"]["activation_checkpointing"] = {"partitioned": True}
    doc["groups"][0]["params"][0]["quantization"] = "none"
    doc["signatures"] = [{"key": "example", "value": "0" * 16}]
    return doc


def minimal_optional_absent() -> dict:
    """No optional field anywhere: no created/metadata, no model_parallel_size, optimizer,
    sub_group_size, exclude_frozen_parameters, no file hash."""
    params = [("w", [4, 7], FP16), ("b", [7], FP16)]
    groups = [flat_group(0, params, stage=2, partition_count=2, tail_padding_saved=False)]
    files = [model_file("global_step4/mp_rank_00_model_states.pt", [0])]
    files += optimizer_files(groups, FP32, step=4, prefix="zero_pp")
    prod = {k: v for k, v in producer().items() if k != "created"}
    return manifest(layout_=layout(2, 2, model_dtype=FP16), groups=groups, files=files, producer_=prod)


def integral_floats() -> dict:
    """Counts written with a zero fraction (16.0): a writer must not, but JSON Schema counts them
    as integers, so a reader must accept them (spec.md, counts)."""
    doc = no_files()
    grp = doc["groups"][0]
    for key in ("padded_numel", "partition_numel"):
        grp[key] = float(grp[key])
    grp["params"][1]["numel"] = float(grp["params"][1]["numel"])
    grp["params"][1]["offset"] = float(grp["params"][1]["offset"])
    doc["layout"]["world_size"] = 2.0
    return doc


def deepspeed_zero2_example() -> dict:
    """The manifest ckptspec writes for a real DeepSpeed ZeRO-2 bf16 checkpoint on 2 ranks."""
    return json.loads(EXAMPLE.read_text("utf-8"))


VALID_MANIFESTS = {
    "stage0-single-group-ws2": stage0_single_group_ws2,
    "stage1-fp16-ws3-tail-stripped": stage1_fp16_ws3_tail_stripped,
    "stage1-bf16-tail-padding-saved": stage1_bf16_tail_padding_saved,
    "stage2-round-robin-ws4": stage2_round_robin_ws4,
    "stage2-parameter-alignment-paddings": stage2_parameter_alignment,
    "stage3-per-param-two-subgroups-ws3": stage3_two_subgroups_ws3,
    "world-size-1-stage2": world_size_1_stage2,
    "scalar-and-zero-size-tensors": scalar_and_zero_size_tensors,
    "frozen-all-stored-in-kinds": frozen_all_stored_in,
    "aliases-buffers-excluded": aliases_buffers_excluded,
    "files-with-hashes": files_with_hashes,
    "no-files": no_files,
    "newer-minor-1.4.0-unknown-fields": newer_minor_unknown_fields,
    "minimal-optional-fields-absent": minimal_optional_absent,
    "integral-float-counts": integral_floats,
    "deepspeed-zero2-bf16-2ranks": deepspeed_zero2_example,
}


def render(doc) -> str:
    return json.dumps(doc, indent=2, ensure_ascii=False) + "\n"


def generated() -> dict[str, str]:
    """File name -> text of every generated (valid) corpus file."""
    return {f"{name}.json": render(build()) for name, build in VALID_MANIFESTS.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare with the committed files")
    args = parser.parse_args(argv)
    stale = []
    for name, text in generated().items():
        path = VALID / name
        if path.exists() and path.read_text("utf-8") == text:
            continue
        stale.append(name)
        if not args.check:
            VALID.mkdir(parents=True, exist_ok=True)
            path.write_text(text, "utf-8")
    if args.check and stale:
        print("out of date: " + ", ".join(stale), file=sys.stderr)
        return 1
    if not args.check:
        print(f"wrote {len(stale)} file(s) in {VALID}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
